"""The report format every evaluation writes: analysis sections, their Markdown, report.html.

An evaluator's report() may carry "analysis": a list of sections, plain JSON, so that report.json
keeps every number behind every plot (docs/evaluation.md):

    {"title": str, "metrics": {name: float}, "tables": [{"title", "columns", "rows"}],
     "plots": [PLOT, ...], "images": [{"title", "path" (relative to the report folder), "caption"}]}

plots.py draws the PLOT kinds (matplotlib, imported when a plot is drawn); html.py writes report.html
from a report. Generic: what a task's sections hold is built in evaluators/ (one module per task).
"""


def section(title, metrics=None, tables=None, plots=None, images=None):
    """One analysis section, leaving out what is empty."""
    out = {"title": title}
    for key, value in (("metrics", metrics), ("tables", tables), ("plots", plots), ("images", images)):
        if value:
            out[key] = value
    return out


def table(title, columns, rows):
    return {"title": title, "columns": list(columns), "rows": [list(r) for r in rows]}


def sections_of(report):
    """[(part name or None, section)] of a report: its own "analysis" and every part's."""
    out = [(None, s) for s in report.get("analysis", [])]
    for name, part in (report.get("parts") or {}).items():
        if isinstance(part, dict):
            out += [(name, s) for s in part.get("analysis", [])]
    return out


def _cell(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value).replace("|", "\\|")


def sections_markdown(report, max_rows=50):
    """The sections' metrics and tables as Markdown (the plots and images are in report.html)."""
    lines = []
    for part, s in sections_of(report):
        lines += ["", f"### {part + ': ' if part else ''}{s['title']}", ""]
        if s.get("metrics"):
            lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in s["metrics"].items()] + [""]
        for t in s.get("tables", []):
            lines += [f"{t['title']}", "", "| " + " | ".join(map(str, t["columns"])) + " |",
                      "|" + "---|" * len(t["columns"])]
            lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in t["rows"][:max_rows]]
            if len(t["rows"]) > max_rows:
                lines.append(f"\n({len(t['rows']) - max_rows} more rows in report.json)")
            lines.append("")
        for image in s.get("images", []):
            lines.append(f"- {image.get('title', '')}: `{image['path']}` {image.get('caption', '')}")
    return ("\n## Analysis\n" + "\n".join(lines) + "\n") if lines else ""
