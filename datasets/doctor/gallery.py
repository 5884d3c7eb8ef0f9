"""The doctor's report as analysis sections (engine/report/__init__.py's format) and report.html
(engine/report/html.py), with a gallery of the flagged samples: leaks side by side, likely label errors
with their given and suggested labels."""
import logging
import os

from PIL import Image, ImageDraw

from engine.report import html, section, table

log = logging.getLogger(__name__)

GALLERY = 24    # images per gallery
THUMB = 160     # pixels of a thumbnail's longer side


def _thumb(path, box=None):
    with Image.open(path) as im:
        image = im.convert("RGB")
    if box is not None:
        x, y, w, h = box
        ImageDraw.Draw(image).rectangle((x, y, x + w, y + h), outline=(255, 40, 40), width=2)
    image.thumbnail((THUMB, THUMB))
    return image


def _save(images, folder, name):
    width = sum(i.width for i in images) + 4 * (len(images) - 1)
    canvas = Image.new("RGB", (width, max(i.height for i in images)), (255, 255, 255))
    x = 0
    for image in images:
        canvas.paste(image, (x, 0))
        x += image.width + 4
    os.makedirs(folder, exist_ok=True)
    canvas.save(os.path.join(folder, name), quality=85)
    return os.path.join(os.path.basename(folder), name)


def _leak_images(report, folder):
    out = []
    for k, pair in enumerate((report.get("leaks") or {}).get("leak_pairs", [])[:GALLERY]):
        try:
            path = _save([_thumb(pair["a"]["file"]), _thumb(pair["b"]["file"])], folder, f"leak_{k:03d}.jpg")
        except (OSError, ValueError):  # not an image (text, audio) or unreadable: the table names it
            continue
        out.append({"title": f"{pair['a']['split']} / {pair['b']['split']}", "path": path,
                    "caption": f"{pair['a']['file']} and {pair['b']['file']}: {pair['how']}"})
    return out


def _label_images(report, sources, folder):
    by_split = {s.split: s for s in sources}
    out = []
    for x in ((report.get("labels") or {}).get("suspects") or [])[:GALLERY]:
        source = by_split.get(x["split"])
        if source is None or source.inputs != "image":
            continue
        box = None
        if source.kind == "coco" and "annotation " in x["record"]:
            ann = source.coco.anns.get(int(x["record"].split("annotation ")[1].split()[0]))
            box = ann and ann["bbox"]
        try:
            path = _save([_thumb(source.path(x["index"]), box)], folder, f"label_{x['rank']:03d}.jpg")
        except (OSError, ValueError):
            continue
        out.append({"title": f"#{x['rank']}: given {x['given']}, likely {x['suggested']}", "path": path,
                    "caption": f"{x['record']} (p {x['given_probability']:.2f} vs {x['suggested_probability']:.2f})"})
    return out


def sections(report, sources, report_dir):
    folder = os.path.join(report_dir, "gallery")
    summary = report["summary"]
    metrics = {"integrity errors": summary["integrity_errors"], "seconds": summary["seconds"]}
    if report.get("speed"):
        metrics["samples"] = report["speed"]["samples"]
        metrics["samples/s"] = report["speed"]["samples_per_second"]
    if report.get("leaks"):
        metrics["leaks"], metrics["duplicates"] = report["leaks"]["leaks"], report["leaks"]["duplicates"]
    out = [section("Summary", metrics, [table("findings by kind", ["severity:kind", "count"],
                                               sorted(summary["by_kind"].items()))])]
    flagged = [f for f in report["findings"] if f["check"] == "integrity"]
    if flagged:
        out.append(section("Integrity", tables=[table("findings", ["severity", "kind", "split", "message"], [
            [f["severity"], f["kind"], f.get("split", ""), f["message"]] for f in flagged])]))
    if report.get("stats"):
        tables = [table(f"{split}: samples per class", ["class", "samples"], s["samples_per_class"].items())
                  for split, s in report["stats"].items()]
        images = [{"title": p["title"], "path": p["path"], "caption": ""} for p in report.get("plots", [])]
        stat_findings = [f["message"] for f in report["findings"] if f["check"] == "stats"]
        if stat_findings:
            tables.append(table("balance", ["finding"], [[m] for m in stat_findings]))
        out.append(section("Statistics", tables=tables, images=images))
    if report.get("leaks"):
        pairs = report["leaks"]["leak_pairs"] + report["leaks"]["duplicate_pairs"]
        out.append(section("Leaks and duplicates", tables=[table("pairs", ["split a", "file a", "split b", "file b",
                                                                           "how"], [
            [p["a"]["split"], p["a"]["file"] or p["a"]["record"], p["b"]["split"], p["b"]["file"] or p["b"]["record"],
             p["how"]] for p in pairs])], images=_leak_images(report, folder)))
    if report.get("labels"):
        suspects = report["labels"].get("suspects") or []
        info = {k: v for k, v in report["labels"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        tables = [table("likely label errors, most likely first", ["rank", "record", "given", "suggested",
                                                                   "p(given)", "p(suggested)"], [
            [x["rank"], x["record"], x["given"], x["suggested"], x["given_probability"], x["suggested_probability"]]
            for x in suspects])]
        if report["labels"].get("skipped"):
            tables = [table("skipped", ["why"], [[report["labels"]["skipped"]]])]
        out.append(section("Label errors", info, tables, images=_label_images(report, sources, folder)))
    return out


def write_html(report, sources, report_dir):
    """report.html through engine/report/html.py."""
    page = dict(report, analysis=sections(report, sources, report_dir))
    return html.write_html(os.path.join(report_dir, "report.html"), page,
                           title=f"Data doctor: {report['config']['data']}")
