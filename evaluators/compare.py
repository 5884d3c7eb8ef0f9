"""evaluate.py --compare A/report.json B/report.json [...]: what changed between evaluations of the
same data: every metric's change, for detection which TIDE error type improved and which worsened
most (a dAP is AP lost: lower is better), the per-class changes sorted; written as compare.md,
compare.html and compare.json. Each report is named by what it evaluated (checkpoint, epoch, step).

One unit: AP, AR, PQ, IoU, F1 and dAP in points (0-100, one decimal; classification's per cent as it
is), changes signed, undefined values (None, COCO's -1) "n/a". The tables hold those strings;
compare.json's "figures" keeps the unrounded values of the reports behind them.

Reports of different data sets (report["dataset"]: name, classes, samples, the settings that define
the data) or of different IoU types are refused; configs that differ in more than the weights compared
are listed as warnings.
"""
import json
import logging
import os

from engine.report import main_metric, section, sections_markdown, sections_of, table, unit
from engine.errors import UserError
from engine.files import flatten, write_together
from engine.report.html import report_html

log = logging.getLogger(__name__)

# config keys that never make two evaluations incomparable nor deserve a warning
QUIET_KEYS = ("output_dir", "resume", "data.workers", "data.eval_batch_size", "data.batch_size")


class CompareError(UserError):
    """Reports that cannot be compared (missing, not a report, another data set or IoU type)."""


def read_report(path):
    if os.path.isdir(path):
        path = os.path.join(path, "report.json")
    if not os.path.isfile(path):
        raise CompareError(f"--compare: report not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CompareError(f"--compare: {path} is not valid JSON: {e}") from None
    if not isinstance(report, dict) or not isinstance(report.get("metrics"), dict):
        raise CompareError(f"--compare: {path} is not an evaluate.py report (no \"metrics\")")
    return report


def iou_types(report):
    """The COCO IoU types a report scored (bbox, segm), from its keys or its metric names."""
    found = set(report.get("iou_types") or [])
    found |= {k.split("/")[0] for k in report["metrics"] if k.split("/")[0] in ("bbox", "segm")}
    return sorted(found)


def check_comparable(reports, paths):
    """CompareError for another data set or IoU type; warnings for other config differences."""
    first, warnings = reports[0], []
    for report, path in zip(reports[1:], paths[1:]):
        a, b = first.get("dataset"), report.get("dataset")
        if a is None or b is None:
            warnings.append(f"{paths[0] if a is None else path} does not record its data set (an older report): "
                            "it is assumed to be the same")
        else:
            differ = [k for k in sorted(set(a) | set(b)) if k != "id" and a.get(k) != b.get(k)]
            if differ or a.get("id") != b.get("id"):
                detail = "; ".join(f"{k}: {_short(a.get(k))} vs {_short(b.get(k))}" for k in differ[:6])
                raise CompareError(f"--compare: {paths[0]} and {path} evaluate different data sets "
                                   f"({detail or 'another identity'}); compare reports of the same data")
        if iou_types(first) != iou_types(report):
            raise CompareError(f"--compare: {paths[0]} scores IoU types {iou_types(first) or 'none'}, {path} "
                               f"{iou_types(report) or 'none'}; compare reports of the same IoU types")
        ca = flatten((first.get("config") or {}).get("resolved") or {})
        cb = flatten((report.get("config") or {}).get("resolved") or {})
        changed = [k for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)
                   and not any(k == q or k.startswith(q + ".") for q in QUIET_KEYS)]
        if changed:
            warnings.append(f"the configs of {paths[0]} and {path} differ in more than the weights: "
                            + ", ".join(f"{k} ({_short(ca.get(k))} -> {_short(cb.get(k))})" for k in changed[:12])
                            + (f" and {len(changed) - 12} more" if len(changed) > 12 else ""))
    return warnings


def _short(value):
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def per_class(report):
    """{measure: {class: value}} of the per-class figures a report holds (any family)."""
    out = {}

    def visit(rep, prefix):
        if isinstance(rep.get("per_class_accuracy"), dict):
            out[prefix + "top1"] = rep["per_class_accuracy"]  # a per cent, like top1
        if isinstance(rep.get("per_class_iou"), dict):
            out[prefix + "IoU"] = rep["per_class_iou"]
        pan = rep.get("panoptic")
        if isinstance(pan, dict) and isinstance(pan.get("per_class"), dict):
            out[prefix + "PQ"] = {r["name"]: r["pq"] for r in pan["per_class"].values()}
        categories = rep.get("per_category") if isinstance(rep.get("per_category"), dict) else {}
        for t in ("bbox", "segm"):  # detection: COCO's per-category AP (evaluators.coco.evaluate_results)
            if isinstance(categories.get(t), list):
                for key in ("AP", "AP50"):
                    out[f"{prefix}{t}/{key}"] = {r["name"]: r.get(key) for r in categories[t]}
        for part, s in sections_of({"analysis": rep.get("analysis", [])}):  # and the PR section's per-class table
            if s.get("title", "").endswith(": precision-recall"):
                for t in s.get("tables", []):
                    cols = t.get("columns", [])
                    if t.get("title", "").startswith("per class") and "class" in cols:
                        for key in ("AP50", "AP75", "F1"):  # AP50 only where per_category has none
                            if key in cols:
                                out.setdefault(f"{prefix}{s['title'].split(':')[0]}/{key}", {
                                    row[cols.index("class")]: row[cols.index(key)] for row in t["rows"]})
        if isinstance(rep.get("semantic"), dict):
            visit(rep["semantic"], prefix + "semantic ")
        for name, part in (rep.get("parts") or {}).items():
            if isinstance(part, dict):
                visit(part, f"{prefix}{name}/" if name else prefix)

    visit(report, "")
    return out


MAIN_ERRORS = ("cls", "loc", "both", "dupe", "bkg", "miss")  # TIDE's six; FP / FN are their groupings
ERROR_NAMES = {"cls": "classification", "loc": "localisation", "both": "class and box", "dupe": "duplicate",
               "bkg": "background", "miss": "missed", "FP": "all false positives", "FN": "all false negatives"}
NA = "n/a"


def letter(i):
    return chr(65 + i) if i < 26 else str(i)


# ---------------------------------------------------------------- one unit: points
def scale(name):
    """100 for a fraction shown in points, 1 for a per cent already, None for a figure in its own unit:
    engine.report.unit's rule, the report pages' own."""
    return {"fraction": 100, "percent": 1}.get(unit(name.split("/")[-1].split(" ")[-1]))


def shown(name, value):
    """The value as shown (points with one decimal where scale() has one, so that a change is the
    difference of the values on the page); None where undefined (COCO's -1 too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    k = scale(name)
    if k == 100 and value == -1:  # COCO: no object of that size
        return None
    return round(value * k, 1) if k else value


def fmt(name, value):
    """A shown value: points with one decimal, "n/a" where undefined."""
    if value is None:
        return NA
    return f"{value:.1f}" if scale(name) else f"{value:.4g}"


def signed(name, change):
    """A change with its sign: +1.2 / -0.3 points, "0.0" when nothing changed, "n/a" when undefined."""
    if change is None:
        return NA
    if change == 0:
        return "0.0" if scale(name) else "0"
    return f"{change:+.1f}" if scale(name) else f"{change:+.4g}"


def _delta(a, b):
    return None if a is None or b is None else b - a


def _rel(path):
    """A path relative to the working folder where it lies under it, else absolute."""
    rel = os.path.relpath(os.path.abspath(path))
    return rel if not rel.startswith("..") else os.path.abspath(path)


def describe(report, path):
    """What a report evaluated, from what evaluate.py records: 'runs/x/epoch_004.pt (epoch 4, step 200)'
    (a checkpoint), the artifact and its format, or the scored results file; then the report's path."""
    ck, art = report.get("checkpoint"), report.get("artifact")
    if isinstance(ck, dict) and ck.get("path"):
        name, detail = ck["path"], [f"epoch {ck['epoch']}" if ck.get("epoch") is not None else None,
                                    f"step {ck['step']}" if ck.get("step") is not None else None,
                                    "EMA weights" if ck.get("weights") == "ema" else None]
    elif isinstance(art, dict) and art.get("path"):
        name, detail = art["path"], [art.get("artifact_format"),
                                     f"epoch {art['epoch']}" if art.get("epoch") is not None else None]
    else:
        scored = [v for k, v in (report.get("files") or {}).items() if "gt" not in k and isinstance(v, str)]
        name, detail = (scored[0], ["scored file"]) if scored else (None, [])
    detail = ", ".join(d for d in detail if d)
    report_path = os.path.join(path, "report.json") if os.path.isdir(path) else path
    if name is None:
        return f"report {_rel(report_path)}"
    return f"{_rel(name)}{f' ({detail})' if detail else ''}, report {_rel(report_path)}"


def _named(letter, report):
    """'A (epoch 4)': a report's letter with the epoch it evaluated, where it records one."""
    epoch = next((r.get("epoch") for r in (report.get("checkpoint"), report.get("artifact"))
                  if isinstance(r, dict) and r.get("epoch") is not None), None)
    return f"{letter} (epoch {epoch})" if epoch is not None else letter


def tide(report):
    """{section title: {metric: value}} of the TIDE sections (detection) of a report, the metric names
    without their "<iou type>/tide/" prefix (AP50, dAP_cls, ..., dAP_FP, dAP_FN)."""
    return {(f"{part}: " if part else "") + s["title"]: {k.split("/")[-1]: v for k, v in s.get("metrics", {}).items()}
            for part, s in sections_of(report) if "TIDE" in s.get("title", "")}


# ---------------------------------------------------------------- the comparison
def _rows(names, columns_of):
    """Table rows [name, shown A, shown B..., signed B - A ...] and the shown values of each name."""
    rows, values = [], {}
    for name in names:
        v = [shown(name, x) for x in columns_of(name)]
        values[name] = v
        rows.append([name] + [fmt(name, x) for x in v] + [signed(name, _delta(v[0], x)) for x in v[1:]])
    return rows, values


def _tide_headline(title, a, b, last):
    """The error type that improved most (its dAP50 fell: a dAP is AP lost) if one did, and the one
    that worsened most if one did; a change that rounds to 0.0 points is no change. a, b: {type: points}."""
    moved = [(e, b[e] - a[e]) for e in MAIN_ERRORS if a.get(e) is not None and b.get(e) is not None
             and round(b[e] - a[e], 1) != 0]
    improved, worsened = [m for m in moved if m[1] < 0], [m for m in moved if m[1] > 0]

    def named(e, change):
        return f"**{e}** ({ERROR_NAMES[e]}), dAP50 {a[e]:.1f} → {b[e]:.1f} ({change:+.1f} points)"
    return (f"{title}, A → {last}: "
            + (f"the error type that improved most is {named(*min(improved, key=lambda m: m[1]))}" if improved
               else "no error type improved")
            + "; " + (f"the one that worsened most is {named(*max(worsened, key=lambda m: m[1]))}" if worsened
                      else "none worsened"))


def compare(reports, paths):
    """A report-like dict (the labels of the reports, a headline, "analysis" sections of the changes, the
    raw "figures" behind them) and its Markdown. Tables show points (one decimal) and signed changes."""
    letters = [letter(i) for i in range(len(reports))]
    last = letters[-1]
    labels = [describe(r, p) for r, p in zip(reports, paths)]
    changes = [f"{x} - A" for x in letters[1:]]
    sections, headline, figures = [], [], {"metrics": {}, "tide": {}, "per_class": {}}

    keys = list(dict.fromkeys(k for r in reports for k in r["metrics"]))
    figures["metrics"] = {k: [r["metrics"].get(k) for r in reports] for k in keys}
    rows, values = _rows(keys, figures["metrics"].get)
    in_points = [k for k in keys if scale(k) and any(v is not None for v in values[k])]
    prefix = os.path.commonprefix(in_points).rpartition("/")[0]  # "bbox/" said once, in the title
    prefix = prefix + "/" if prefix else ""
    sections.append(section(
        "every metric", tables=[table("AP, AR, PQ, IoU... in points (0-100)" + (
            "; n/a: undefined (COCO's -1)" if any(NA in r for r in rows) else ""),
            ["metric"] + letters + changes, rows)],
        plots=[{"kind": "bars", "title": f"{prefix.replace('/', ' ')}metrics (points)", "labels": [k.removeprefix(prefix) for k in in_points],
                "series": [{"label": x, "values": [values[k][i] for k in in_points]} for i, x in enumerate(letters)]}]
        if in_points else None))
    main = main_metric(reports[0])
    if main is not None:
        a, b = values[main][0], values[main][-1]
        suffix = " points" if scale(main) else ""
        headline.append(f"{main} from {_named(letters[0], reports[0])} to {_named(last, reports[-1])}: "
                        f"{fmt(main, a)} → {fmt(main, b)} "
                        f"({signed(main, _delta(a, b))}{suffix if _delta(a, b) is not None else ''})")

    for title, errors in tide(reports[0]).items():
        later = [tide(r).get(title) or {} for r in reports[1:]]
        if not any(later):
            continue
        names = [e for e, v in errors.items() if isinstance(v, (int, float))]
        figures["tide"][title] = {e: [errors[e]] + [x.get(e) for x in later] for e in names}
        rows, values = _rows(names, figures["tide"][title].get)
        short = {n: n.removeprefix("dAP_") for n in names}
        headline.append(_tide_headline(title, {short[n]: values[n][0] for n in names},
                                       {short[n]: values[n][-1] for n in names}, last))
        six = [n for n in names if short[n] in MAIN_ERRORS]
        groups = [n for n in names if short[n] in ("FP", "FN")]
        # no y label: a long one is cut at the figure's edge beside wide ticks; the titles give the unit
        plots = [{"kind": "bars", "title": f"{title.removesuffix(': error analysis (TIDE)')}: {what} (points lost, lower is better)",
                  "labels": [short[n] for n in shown_names],
                  "series": [{"label": x, "values": [values[n][i] for n in shown_names]} for i, x in enumerate(letters)]}
                 for what, shown_names in (("dAP50 per error type", six), ("dAP50 of FP and FN", groups))
                 if shown_names]
        for row in rows:  # a dAP is AP lost: say which way it moved
            d = _delta(values[row[0]][0], values[row[0]][-1])
            better = (d or 0) > 0 if row[0] == "AP50" else (d or 0) < 0
            row.append(NA if d is None else "same" if round(d, 1) == 0 else "better" if better else "worse")
        sections.append(section(f"{title}: change of each error type's dAP",
                                tables=[table("AP50 and each error type's dAP50 (AP50 lost to it: lower is "
                                              "better), in points",
                                              ["error type"] + letters + changes + [f"{last} against A"], rows)],
                                plots=plots))

    base_classes = per_class(reports[0])
    last_classes = per_class(reports[-1])
    for measure, base in base_classes.items():
        other = last_classes.get(measure)
        if not other:
            continue
        figures["per_class"][measure] = {c: [v, other.get(c)] for c, v in base.items()}
        ranked = []
        for c, (x, y) in figures["per_class"][measure].items():
            x, y = shown(measure, x), shown(measure, y)
            ranked.append((c, x, y, _delta(x, y)))
        ranked.sort(key=lambda r: (r[3] is None, -(r[3] or 0)))
        plotted = [r for r in ranked if r[3] is not None]
        if not any(r[3] for r in plotted):
            plotted = []  # nothing changed: no empty chart
        suffix = " (points)" if scale(measure) else ""
        sections.append(section(
            f"per-class change of {measure} (A -> {last}), sorted",
            tables=[table(f"{measure} per class{suffix}, best gain first",
                          ["class", "A", last, f"{last} - A"],
                          [[c, fmt(measure, x), fmt(measure, y), signed(measure, d)] for c, x, y, d in ranked])],
            plots=[{"kind": "bars", "title": f"change of {measure} per class, {last} - A{unit}",
                    "labels": [r[0] for r in plotted], "series": [{"values": [r[3] for r in plotted]}]}]
            if plotted else None))

    report = {"compared": labels, "reports": [os.path.abspath(p) for p in paths], "headline": headline,
              "analysis": sections, "figures": figures}
    md = [f"# Comparison of {len(reports)} evaluation reports", ""]
    md += [f"- {x}: {label}" for x, label in zip(letters, labels)]
    if headline:
        md += ["", *[f"- {h}" for h in headline]]
    return report, "\n".join(md) + "\n"


def compare_reports(paths, report_dir):
    """Read, check, compare; write compare.json / compare.md / compare.html into report_dir."""
    if len(paths) < 2:
        raise CompareError("--compare needs at least two reports")
    reports = [read_report(p) for p in paths]
    warnings = check_comparable(reports, paths)
    for w in warnings:
        log.warning("%s", w)
    report, md = compare(reports, paths)
    report["warnings"] = warnings
    if warnings:
        md += "\n" + "\n".join(f"> warning: {w}" for w in warnings) + "\n"
    md += sections_markdown(report, max_rows=100)
    html = report_html(report, os.path.abspath(report_dir), "Comparison of evaluation reports").encode("utf-8")
    write_together({os.path.join(report_dir, "compare.json"): json.dumps(report, indent=2),
                    os.path.join(report_dir, "compare.md"): md, os.path.join(report_dir, "compare.html"): html})
    return report, md
