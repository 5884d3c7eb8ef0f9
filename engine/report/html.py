"""report.html: one self-contained page of a report (its metrics, every part's analysis sections with
their tables, plots and images), with the plots and images embedded as data URIs: no network, no
script, no CDN; it opens offline and travels by e-mail. Images are downscaled (JPEG) so that the page
stays light."""
import base64
import html
import io
import logging
import os
import re

from PIL import Image

from engine.files import atomic_write
from engine.paths import inside
from engine.report import UNITS_NOTE, fmt, headline, plots, provenance, sections_of, shown_metrics, table_units

log = logging.getLogger(__name__)
_NUMBER = re.compile(r"^[+\-\u2212]?\d[\d.,]*( ?%| points)?$|^n/a\b")  # written as text, read as a number

MAX_IMAGE_SIDE = 640      # pixels of an embedded image's longer side
MAX_TABLE_ROWS = 300      # more are in report.json

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1180px;padding:12px 20px;
color:#1d2330;background:#fff;font-size:14px}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;border-bottom:2px solid #dde3ee;padding-bottom:3px;margin-top:28px}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}td,th{border:1px solid #d5dae3;padding:3px 8px;
text-align:right}th{background:#f1f4f9}td:first-child,th:first-child,td.t{text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:10px}.plots img{max-width:100%;height:auto;border:1px solid #e4e8ef}
.images{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:14px;width:100%}
figure{margin:0;max-width:100%}figure img{max-width:100%;max-height:620px;height:auto;border:1px solid #e4e8ef}
figcaption{font-size:13px;color:#333;margin-top:2px}.meta td{text-align:left}.note{color:#666;font-size:12px}
.warn{color:#9a4a00}.row{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}h4{margin:6px 0 2px;font-size:13px}
.row>div{max-width:100%;overflow-x:auto}
.headline{background:#f4f7fc;border:1px solid #d5deee;border-radius:6px;padding:10px 16px;margin:10px 0 18px}
.headline .main{font-size:20px;margin:2px 0 6px}.headline ul{margin:4px 0;padding-left:20px;font-size:15px}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;margin:4px 0 10px;font-size:13px;width:100%}
.legend span.key{display:inline-block;width:22px;height:12px;margin-right:5px;vertical-align:-1px;
border:2px solid #222;box-sizing:border-box}.legend span.dashed{border-style:dashed}
"""


def _esc(value):
    return html.escape(str(value))


def _cell(value, kind=None):
    """A table cell: numbers right-aligned (the default; a number already written as text too: "+1.2",
    "n/a"), text left."""
    text = "-" if value is None and not kind else _esc(fmt(value, kind=kind))
    return f"<td class=t>{text}</td>" if isinstance(value, str) and not _NUMBER.match(value) else f"<td>{text}</td>"


def _data_uri(data, mime):
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def image_uri(path, max_side=MAX_IMAGE_SIDE):
    """A data URI of an image file downscaled to max_side (JPEG), or None when it cannot be read."""
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            im.thumbnail((max_side, max_side))
            buffer = io.BytesIO()
            im.save(buffer, format="JPEG", quality=90)  # sharp label text
    except OSError as e:
        log.warning("report.html: image %s left out: %s", path, e)
        return None
    return _data_uri(buffer.getvalue(), "image/jpeg")


def metrics_table(metrics):
    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(fmt(v, k))}</td></tr>" for k, v in metrics.items())
    return f"<table><tr><th>metric</th><th>value</th></tr>{rows}</table>"


def table_html(t):
    kinds = table_units(t) if "columns" in t else []
    head = "".join(f"<th>{_esc(c)}</th>" for c in t["columns"])
    rows = "".join("<tr>" + "".join(_cell(v, k) for v, k in zip(row, kinds + [None] * len(row)))
                   + "</tr>" for row in t["rows"][:MAX_TABLE_ROWS])
    more = (f"<p class=note>{len(t['rows']) - MAX_TABLE_ROWS} more rows in report.json</p>"
            if len(t["rows"]) > MAX_TABLE_ROWS else "")
    return f"<h4>{_esc(t.get('title', ''))}</h4><table><tr>{head}</tr>{rows}</table>{more}"


def legend_html(legend):
    """One key for a section's images: [{"colour" (none: a plain note), "label", "dashed"}]."""
    keys = "".join((f'<span><span class="key{" dashed" if x.get("dashed") else ""}" '
                    f'style="background:{_esc(x["colour"])}"></span>' if x.get("colour") else "<span>")
                   + f'{_esc(x["label"])}</span>' for x in legend)
    return f"<div class=legend>{keys}</div>"


def section_html(s, report_dir, part=None):
    out = [f"<section><h3>{_esc(part + ': ' if part else '')}{_esc(s.get('title', ''))}</h3><div class=row>"]
    metrics = shown_metrics(s)
    if metrics or s.get("tables"):
        out.append("<div>")
        if metrics:
            out.append(metrics_table(metrics))
        for t in s.get("tables", []):
            out.append(table_html(t))
        out.append("</div>")
    if s.get("plots"):
        out.append("<div class=plots>")
        for p in s["plots"]:
            try:
                out.append(f'<img class=plot alt="{_esc(p.get("title", ""))}" '
                           f'src="{_data_uri(plots.png(p), "image/png")}">')
            except (plots.PlotError, KeyError, TypeError, ValueError) as e:
                log.warning("report.html: plot '%s' left out: %s", p.get("title"), e)
                out.append(f"<p class=warn>plot {_esc(p.get('title', ''))} could not be drawn: {_esc(e)}</p>")
        out.append("</div>")
    if s.get("legend"):
        out.append(legend_html(s["legend"]))
    if s.get("images"):
        out.append("<div class=images>")
        for image in s["images"]:
            # the report names its images: only those inside its folder are embedded
            path = report_dir and inside(report_dir, image["path"]) and os.path.join(report_dir, image["path"])
            uri = image_uri(path) if path else None
            body = (f'<img alt="{_esc(image.get("title", ""))}" src="{uri}">' if uri
                    else f"<p class=warn>missing image {_esc(image['path'])}</p>")
            out.append(f"<figure>{body}<figcaption><b>{_esc(image.get('title', ''))}</b> "
                       f"{_esc(image.get('caption', ''))}</figcaption></figure>")
        out.append("</div>")
    out.append("</div></section>")
    return "\n".join(out)


def headline_html(report):
    """The answer first: the main metric and the sentences that say where it is lost."""
    name, value, lines = headline(report)
    if name is None and not lines:
        return ""
    main = (f"<p class=main>{_esc(name)}: <b>{_esc(value)}</b></p>" if name is not None else "")
    items = "".join(f"<li>{_esc(line.replace('**', ''))}</li>" for line in lines)
    return f"<section class=headline id=headline>{main}{f'<ul>{items}</ul>' if items else ''}</section>"


def _about(report):
    """Where the numbers come from (the appendix): checkpoint / artifact / files / config / data set / speed."""
    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in provenance(report))
    return f"<table class=meta>{rows}</table>" if rows else ""


def report_html(report, report_dir, title="Evaluation report"):
    """The page of a report dict; report_dir: where the sections' image paths are relative to. The headline
    first, then the metrics, the analysis sections, and the provenance last (an appendix)."""
    body = [f"<h1>{_esc(title)}</h1>", headline_html(report)]
    if report.get("compared"):
        body.append("<ul>" + "".join(f"<li>{chr(65 + i) if i < 26 else i}: {_esc(n)}</li>"
                                     for i, n in enumerate(report["compared"])) + "</ul>")
    if report.get("warnings"):
        body += [f"<p class=warn>{_esc(w)}</p>" for w in report["warnings"]]
    if report.get("metrics"):
        body += ["<h2>Metrics</h2>", f"<p class=note>{_esc(UNITS_NOTE)}</p>", metrics_table(report["metrics"])]
    current = object()
    for part, s in sections_of(report):
        if part != current:
            current = part
            body.append(f"<h2>{_esc(part) if part else 'Analysis'}</h2>")
        body.append(section_html(s, report_dir))
    if not sections_of(report):
        body.append("<p class=note>No analysis sections in this report (analysis turned off, or an evaluator "
                    "without any).</p>")
    about = _about(report)
    if about:
        body += ["<h2 id=provenance>Appendix: provenance</h2>", about]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            "<meta name=viewport content=\"width=device-width, initial-scale=1\">"
            f"<title>{_esc(title)}</title><style>{STYLE}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write_html(path, report, title="Evaluation report"):
    """report.html at path, images resolved relative to its folder; returns the path."""
    text = report_html(report, os.path.dirname(os.path.abspath(path)), title)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), binary=True)
    return path
