"""The report format every evaluation writes: analysis sections, their Markdown, report.html.

An evaluator's report() may carry "analysis": a list of sections, plain JSON, so that report.json
keeps every number behind every plot (docs/evaluation.md):

    {"title": str, "metrics": {name: float}, "tables": [{"title", "columns", "rows"}],
     "plots": [PLOT, ...], "images": [{"title", "path" (relative to the report folder), "caption"}],
     "legend": [{"colour", "label"}] (one key for the section's images), "show_metrics": false (the
     metrics are kept for readers of report.json; a table of the section shows them)}

and "headline": sentences that say what the result is and where it is lost, shown first.

One unit per page: every figure that is a share (AP, AR, precision, recall, F1, IoU, PQ, accuracies,
ECE) is shown in per cent, 0-100 with one decimal, whether report.json keeps it as a fraction (most)
or in per cent (classification's top1); undefined ones (COCO's -1, None) read "n/a (why)"; no
scientific notation. unit() tells which from a figure's name, fmt() writes it.

plots.py draws the PLOT kinds (matplotlib, imported when a plot is drawn); html.py writes report.html
from a report. Generic: what a task's sections hold is built in evaluators/ (one module per task).
"""
import math
import re

UNITS_NOTE = ("AP, AR, precision, recall, F1, IoU, PQ, accuracies, ECE and confidences are in per cent "
              "(0-100, one decimal); n/a: undefined.")
# COCO's -1: no ground truth of that size
UNDEFINED = {"s": "n/a (no small objects)", "m": "n/a (no medium objects)", "l": "n/a (no large objects)"}


def section(title, metrics=None, tables=None, plots=None, images=None, **extra):
    """One analysis section, leaving out what is empty (extra: "legend", "show_metrics")."""
    out = {"title": title}
    for key, value in (("metrics", metrics), ("tables", tables), ("plots", plots), ("images", images)):
        if value:
            out[key] = value
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def table(title, columns, rows, units=None):
    """units: {column: "fraction" | "percent" | None} where a column's name does not tell (unit())."""
    out = {"title": title, "columns": list(columns), "rows": [list(r) for r in rows]}
    if units:
        out["units"] = dict(units)
    return out


def sections_of(report):
    """[(part name or None, section)] of a report: its own "analysis" and every part's."""
    out = [(None, s) for s in report.get("analysis", [])]
    for name, part in (report.get("parts") or {}).items():
        if isinstance(part, dict):
            out += [(name, s) for s in part.get("analysis", [])]
    return out


# ---------------------------------------------------------------- units

_FRACTION = re.compile(r"^(d?AP|AR)\w*$|^(PQ|SQ|RQ)(_th|_st)?$|^(pq|sq|rq)$|(^|_)(mIoU|IoU)$|^(P|R|F1|precision|recall)$"
                       r"|^(macro|best)[ _](F1|precision|recall)$|accuracy$|^mean_confidence$")


def unit(name):
    """How a figure named `name` (a metric key like "bbox/APl", a column) is stored: "fraction" (0-1, shown
    x100), "percent" (0-100 already: classification's top1 / top5, a "%" column) or None (its own unit:
    counts, score thresholds, a temperature, a loss)."""
    leaf = str(name).split("/")[-1].strip()
    if leaf in ("top1", "top5") or "%" in leaf:
        return "percent"
    if leaf.startswith("ECE"):
        return "fraction"
    if "threshold" in leaf or "temperature" in leaf or "NLL" in leaf:
        return None
    return "fraction" if _FRACTION.search(leaf) else None


def undefined(name):
    """What an undefined figure reads: "n/a (no large objects)" for COCO's APl / ARl, ..."""
    leaf = str(name).split("/")[-1]
    m = re.match(r"^A[PR]([sml])$", leaf)
    return UNDEFINED[m.group(1)] if m else "n/a"


def number(value):
    """A plain float without scientific notation, 3 significant digits: 0.161, 1.32, 0.000072."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    if abs(value) >= 100:
        return f"{value:.0f}" if abs(value) >= 10000 else f"{value:.1f}"
    decimals = min(15, max(0, 2 - int(math.floor(math.log10(abs(value))))))
    text = f"{value:.{decimals}f}"
    text = text.rstrip("0").rstrip(".") if "." in text else text
    return "0" if text in ("-0", "0") else text


def fmt(value, name=None, kind="auto"):
    """A figure as the page shows it: shares in per cent with one decimal, undefined ones "n/a (why)",
    counts as integers, other numbers plainly. kind: "auto" (unit(name)), "fraction", "percent" or None."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    kind = unit(name) if kind == "auto" else kind
    if value is None:
        return undefined(name) if kind else "n/a"
    if not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    if kind and value == -1:  # COCO's "no ground truth in that range"
        return undefined(name)
    if kind:
        text = f"{(100 if kind == 'fraction' else 1) * value:.1f}"
        return "0.0" if text == "-0.0" else text
    return str(value) if isinstance(value, int) else number(value)


def table_units(t):
    """The kind of each column of a table: its "units" where given, else unit() of its name."""
    given = t.get("units") or {}
    return [given[c] if c in given else unit(c) for c in t["columns"]]


def shown_metrics(s):
    """The section's metrics a page shows (none where "show_metrics" is false)."""
    return s.get("metrics") if s.get("show_metrics", True) else None


# ---------------------------------------------------------------- headline and provenance

def main_metric(report):
    """The metric a report leads with: the run's train.best_metric, else the evaluator's "main_metric",
    else the first metric."""
    metrics = report.get("metrics") or {}
    best = (((report.get("config") or {}).get("resolved") or {}).get("train") or {}).get("best_metric")
    if best in metrics:
        return best
    for name, part in [(None, report)] + list((report.get("parts") or {}).items()):
        key = isinstance(part, dict) and part.get("main_metric")
        if key:
            full = f"{name}/{key}" if name else key
            if full in metrics:
                return full
    return next(iter(metrics), None)


def headline(report):
    """(main metric name, its value shown, [sentences]): the report's own headline and every part's."""
    name = main_metric(report)
    value = fmt(report["metrics"][name], name) if name else None
    lines = list(report.get("headline") or [])
    for part_name, part in (report.get("parts") or {}).items():
        if isinstance(part, dict):
            lines += [f"{part_name}: {line}" if part_name else line for line in part.get("headline") or []]
    return name, value, lines


def provenance(report):
    """[(key, value)] of where the numbers come from: checkpoint / artifact / files / config / data set / speed
    (the appendix of a page)."""
    rows = []
    for key in ("checkpoint", "artifact", "files", "config", "dataset", "speed"):
        value = report.get(key)
        if isinstance(value, dict):
            for k, v in value.items():
                if k == "resolved" or isinstance(v, (dict, list)) and len(str(v)) > 200:
                    continue
                rows.append((f"{key}.{k}", v if isinstance(v, str) else fmt(v, k, None)))
    return rows


def headline_markdown(report):
    """The first lines of report.md: the main metric and the headline's sentences."""
    name, value, lines = headline(report)
    if name is None and not lines:
        return ""
    out = ["## Headline", ""]
    if name is not None:
        out.append(f"**{name}: {value}**" + (" (per cent)" if unit(name) else ""))
        out.append("")
    out += [f"- {line}" for line in lines]
    return "\n".join(out) + "\n\n"


def _cell(value, kind=None):
    return fmt(value, kind=kind).replace("|", "\\|") if value is not None or kind else "-"


def sections_markdown(report, max_rows=50):
    """The sections' metrics and tables as Markdown (the plots and images are in report.html), then
    the provenance appendix."""
    lines = []
    for part, s in sections_of(report):
        lines += ["", f"### {part + ': ' if part else ''}{s['title']}", ""]
        metrics = shown_metrics(s)
        if metrics:
            lines += ["| | |", "|---|---|"] + [f"| {k} | {fmt(v, k)} |" for k, v in metrics.items()] + [""]
        for t in s.get("tables", []):
            kinds = table_units(t)
            lines += [f"{t['title']}", "", "| " + " | ".join(map(str, t["columns"])) + " |",
                      "|" + "---|" * len(t["columns"])]
            lines += ["| " + " | ".join(_cell(v, k) for v, k in zip(row, kinds)) + " |" for row in t["rows"][:max_rows]]
            if len(t["rows"]) > max_rows:
                lines.append(f"\n({len(t['rows']) - max_rows} more rows in report.json)")
            lines.append("")
        if s.get("legend"):
            lines += ["Key: " + "; ".join(x["label"] for x in s["legend"]), ""]
        for image in s.get("images", []):
            lines.append(f"- {image.get('title', '')}: `{image['path']}` {image.get('caption', '')}")
    out = ("\n## Analysis\n\n" + UNITS_NOTE + "\n" + "\n".join(lines) + "\n") if lines else ""
    rows = provenance(report)
    if rows:
        out += "\n## Appendix: provenance\n\n| | |\n|---|---|\n" + "\n".join(
            f"| {k} | {str(v).replace('|', chr(92) + '|')} |" for k, v in rows) + "\n"
    return out
