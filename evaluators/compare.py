"""evaluate.py --compare A/report.json B/report.json [...]: what changed between evaluations of the
same data: every metric's change, for detection which TIDE error type moved and by how much, the
per-class changes sorted; written as compare.md, compare.html and compare.json.

Reports of different data sets (report["dataset"]: name, classes, samples, the settings that define
the data) or of different IoU types are refused; configs that differ in more than the weights compared
are listed as warnings.
"""
import json
import logging
import os

from engine.report import section, sections_markdown, sections_of, table
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
            out[prefix + "accuracy"] = rep["per_class_accuracy"]
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


def tide(report):
    """{section title: {metric: value}} of the TIDE sections (detection) of a report, the metric names
    without their "<iou type>/tide/" prefix (AP50, dAP_cls, ..., dAP_FP, dAP_FN)."""
    return {(f"{part}: " if part else "") + s["title"]: {k.split("/")[-1]: v for k, v in s.get("metrics", {}).items()}
            for part, s in sections_of(report) if "TIDE" in s.get("title", "")}


def _delta(a, b):
    return None if a is None or b is None else b - a


def compare(reports, names):
    """A report-like dict (metrics of the last, "analysis" sections of the changes) and its Markdown."""
    base = reports[0]
    sections, md = [], [f"# Comparison of {len(reports)} evaluation reports", ""]
    md += [f"- {chr(65 + i) if i < 26 else i}: `{n}`" for i, n in enumerate(names)]
    letters = [chr(65 + i) if i < 26 else str(i) for i in range(len(reports))]

    keys = list(dict.fromkeys(k for r in reports for k in r["metrics"]))
    columns = ["metric"] + letters + [f"{x} - A" for x in letters[1:]]
    rows = []
    for k in keys:
        values = [r["metrics"].get(k) for r in reports]
        rows.append([k] + values + [_delta(values[0], v) for v in values[1:]])
    sections.append(section("every metric", tables=[table("metrics (changes against A)", columns, rows)]))

    headline = []
    base_tide = tide(base)
    for title, errors in base_tide.items():
        later = [tide(r).get(title) for r in reports[1:]]
        if not any(later):
            continue
        t_rows = []
        for err, value in errors.items():
            if isinstance(value, (int, float)):
                t_rows.append([err, value] + [(l or {}).get(err) for l in later]
                              + [_delta(value, (l or {}).get(err)) for l in later])
        last = later[-1] or {}
        moved = [(err, last[err] - v) for err, v in errors.items()
                 if isinstance(v, (int, float)) and isinstance(last.get(err), (int, float))
                 and err.lower().removeprefix("dap_") in MAIN_ERRORS]
        if moved:
            err, change = min(moved, key=lambda x: x[1])  # the error whose cost (dAP) dropped most
            worst, worse = max(moved, key=lambda x: x[1])
            line = (f"{title}: the error type that improved most from A to {letters[-1]} is **{err}** "
                    f"(its dAP {errors[err]:.4g} -> {last[err]:.4g}, {change:+.4g})")
            if worse > 0:
                line += f"; the one that grew most is {worst} ({worse:+.4g})"
            headline.append(line)
        sections.append(section(f"{title}: change of each error type's dAP",
                                tables=[table("dAP per error type (lower is better)",
                                              ["error type"] + letters + [f"{x} - A" for x in letters[1:]], t_rows)],
                                plots=[{"kind": "bars", "title": f"{title}: dAP per error type",
                                        "labels": [r[0] for r in t_rows], "y_label": "dAP",
                                        "series": [{"label": letters[i], "values": [r[1 + i] for r in t_rows]}
                                                   for i in range(len(reports))]}]))

    base_classes = per_class(base)
    last_classes = per_class(reports[-1])
    for measure, values in base_classes.items():
        other = last_classes.get(measure)
        if not other:
            continue
        changes = [(c, v, other.get(c), _delta(v, other.get(c))) for c, v in values.items()]
        ranked = sorted(changes, key=lambda r: (r[3] is None, -(r[3] or 0)))
        plotted = [r for r in ranked if r[3] is not None]
        sections.append(section(f"per-class change of {measure} (A -> {letters[-1]}), sorted",
                                tables=[table(f"{measure} per class, best gain first",
                                              ["class", "A", letters[-1], "change"], ranked)],
                                plots=[{"kind": "bars", "title": f"change of {measure} per class",
                                        "labels": [r[0] for r in plotted], "y_label": f"{measure} change",
                                        "series": [{"label": f"{letters[-1]} - A", "values": [r[3] for r in plotted]}]}]
                                if plotted else None))

    report = {"compared": list(names), "analysis": sections, "headline": headline}
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
