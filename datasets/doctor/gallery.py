"""The doctor's report as analysis sections (engine/report/__init__.py's format) and report.html
(engine/report/html.py), with a gallery of the flagged samples: leaks side by side, likely label errors
with their given and suggested labels."""
import logging
import os

from PIL import Image, ImageDraw

from datasets.doctor.stats import class_counts, summary_rows
from engine.report import html, section, table

log = logging.getLogger(__name__)

GALLERY = 24    # images per gallery
THUMB = 160     # pixels of a thumbnail's longer side
READABLE = 96   # smaller images (8x8 digits, 28 px MNIST) are enlarged, nearest-neighbour, to at least this


def _thumb(path, box=None):
    """(thumbnail, how it was scaled: '' or e.g. '8x8 px shown x12')."""
    with Image.open(path) as im:
        image = im.convert("RGB")
    if box is not None:
        x, y, w, h = box
        ImageDraw.Draw(image).rectangle((x, y, x + w, y + h), outline=(255, 40, 40), width=2)
    size = image.size
    if max(size) < READABLE:  # whole pixels, each a visible square: no blur to judge a label by
        k = -(-READABLE // max(size))
        return image.resize((size[0] * k, size[1] * k), Image.NEAREST), f"{size[0]}x{size[1]} px shown x{k}"
    image.thumbnail((THUMB, THUMB))
    return image, ""


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
            (a, how_a), (b, how_b) = _thumb(pair["a"]["file"]), _thumb(pair["b"]["file"])
            path = _save([a, b], folder, f"leak_{k:03d}.png")
        except (OSError, ValueError):  # not an image (text, audio) or unreadable: the table names it
            continue
        scaled = f" (left {how_a}, right {how_b})" if how_a or how_b else ""
        out.append({"title": f"{pair['a']['split']} / {pair['b']['split']}", "path": path,
                    "caption": f"{pair['a']['file']} and {pair['b']['file']}: {pair['how']}{scaled}"})
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
            image, how = _thumb(source.path(x["index"]), box)
            path = _save([image], folder, f"label_{x['rank']:03d}.png")
        except (OSError, ValueError):
            continue
        out.append({"title": f"#{x['rank']}: given {x['given']}, likely {x['suggested']}", "path": path,
                    "caption": f"{x['record']} (p {x['given_probability']:.2f} vs {x['suggested_probability']:.2f})"
                               + (f"; {how}" if how else "")})
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
    kinds = sorted(summary["by_kind"].items())
    out = [section("Summary", metrics, [table("findings by kind", ["severity:kind", "count"], kinds)] if kinds else [])]
    flagged = [f for f in report["findings"] if f["check"] == "integrity"]
    if flagged:
        out.append(section("Integrity", tables=[table("findings", ["severity", "kind", "split", "message"], [
            [f["severity"], f["kind"], f.get("split", ""), f["message"]] for f in flagged])]))
    stats = report.get("stats")
    if stats:  # the plots first, with the short table beside them; the per-class numbers after
        images = [{"title": p["title"], "path": p["path"], "caption": ""} for p in report.get("plots", [])]
        out.append(section("Statistics", tables=[table("per split", ["", *stats], summary_rows(stats))],
                           images=images))
        key, present, absent = class_counts(stats)
        tables = [table(f"{key.replace('_', ' ')}, most first", ["class", *stats], present)]
        if absent:
            tables.append(table(f"{len(absent)} classes with none in any split", ["classes"],
                                [[", ".join(map(str, absent))]]))
        stat_findings = [f["message"] for f in report["findings"] if f["check"] == "stats"]
        if stat_findings:
            tables.append(table("balance", ["finding"], [[m] for m in stat_findings]))
        out.append(section("Classes", tables=tables))
    leaks = report.get("leaks")
    if leaks:
        pairs = leaks["leak_pairs"] + leaks["duplicate_pairs"]
        counts = {"leaks": leaks["leaks"], "duplicates": leaks["duplicates"]}
        if leaks.get("small_images"):
            counts["small images compared resized"] = leaks["small_images"]
        out.append(section("Leaks and duplicates", counts, [table("pairs", ["split a", "file a", "split b", "file b",
                                                                          "how"], [
            [p["a"]["split"], p["a"]["file"] or p["a"]["record"], p["b"]["split"], p["b"]["file"] or p["b"]["record"],
             p["how"]] for p in pairs])] if pairs else [], images=_leak_images(report, folder)))
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
    """report.html through engine/report/html.py (report["headline"] first)."""
    page = dict(report, analysis=sections(report, sources, report_dir))
    return html.write_html(os.path.join(report_dir, "report.html"), page,
                           title=f"Data doctor: {report['config']['data']}")
