"""Statistics of a data set per split: samples per class, image sizes and aspect ratios, text lengths,
audio durations, what the annotation file adds (instances, object sizes); classes absent from a
split and imbalance beyond doctor.imbalance_ratio; plots as PNG files."""
import logging
import os

import numpy as np

from datasets.doctor.findings import WARNING, Finding
from datasets.doctor.sources import _summary

log = logging.getLogger(__name__)


def split_stats(source, results):
    """The numbers of one split from its per-sample results."""
    classes = source.classes or []
    per_class = np.zeros(len(classes), dtype=np.int64)
    for r in results:
        for label in set(r["labels"]):
            if 0 <= label < len(classes):
                per_class[label] += 1
    out = {"samples": len(results), "classes": len(classes),
           "samples_per_class": dict(zip(classes, per_class.tolist()))}
    widths = [r["width"] for r in results if "width" in r]
    if widths:
        heights = [r["height"] for r in results if "height" in r]
        out["image_width"], out["image_height"] = _summary(widths), _summary(heights)
        out["aspect_ratio"] = _summary(np.array(widths) / np.array(heights))
    lengths = [r["length"] for r in results if "length" in r]
    if lengths:
        out["text_words"] = _summary(lengths)
    durations = [r["duration"] for r in results if "duration" in r]
    if durations:
        out["audio_seconds"] = _summary(durations)
    out.update(source.annotation_stats())
    return out


def count_key(stats):
    """What the classes are counted by: instances (detection) or samples."""
    first = next(iter(stats.values()), {})
    return "instances_per_class" if "instances_per_class" in first else "samples_per_class"


def class_counts(stats):
    """(key, [(class, count per split...)] of the classes present in some split, most first,
    [the classes absent from every split])."""
    key = count_key(stats)
    splits = list(stats)
    classes = list(stats[splits[0]][key]) if splits else []
    rows = [(c, *[int(stats[s][key].get(c, 0)) for s in splits]) for c in classes]
    present = sorted((r for r in rows if any(r[1:])), key=lambda r: (-sum(r[1:]), str(r[0])))
    return key, present, [r[0] for r in rows if not any(r[1:])]


def _num(v):
    return f"{int(v)}" if float(v).is_integer() else f"{v:.3g}"


def _range(x):
    """One cell of a _summary: 'min-max (mean m, median d)', or 'v (all)' when they are equal."""
    if not isinstance(x, dict):
        return "-" if x is None else x
    if not x.get("count"):
        return "-"
    if x["min"] == x["max"]:
        return f"{_num(x['min'])} (all)"
    return f"{_num(x['min'])}-{_num(x['max'])} (mean {_num(x['mean'])}, median {_num(x['median'])})"


SUMMARY = (("image_width", "image width (px)"), ("image_height", "image height (px)"),
           ("aspect_ratio", "aspect ratio (w / h)"), ("text_words", "text length (words)"),
           ("audio_seconds", "audio duration (s)"), ("instances", "instances"),
           ("instances_per_image", "instances per image"), ("images_without_annotations", "images without annotations"))


def summary_rows(stats):
    """Rows [name, value per split...] of the statistics that are not per class (Markdown and HTML tables)."""
    splits = list(stats)
    key = count_key(stats)
    rows = [["samples", *[stats[s]["samples"] for s in splits]],
            [f"classes with {'an instance' if key == 'instances_per_class' else 'a sample'}",
             *[f"{sum(1 for c in stats[s][key].values() if c)} of {stats[s]['classes']}" for s in splits]]]
    rows += [[label, *[_range(stats[s].get(name)) for s in splits]] for name, label in SUMMARY
             if any(name in stats[s] for s in splits)]
    if any("object_sizes" in stats[s] for s in splits):
        rows.append(["objects small / medium / large",
                     *[" / ".join(str(v) for v in stats[s].get("object_sizes", {}).values()) or "-" for s in splits]])
    return rows


def balance_findings(stats, ratio):
    """Classes absent from a split, and splits whose largest class outnumbers the smallest by more
    than `ratio`."""
    out = []
    for split, s in stats.items():
        what = "instances" if s.get("instances_per_class") else "samples"
        counts = s.get("instances_per_class") or s["samples_per_class"]
        absent = [c for c, n in counts.items() if n == 0]
        if absent:
            out.append(Finding("stats", WARNING, "absent_class", f"{split}: {len(absent)} of {len(counts)} classes "
                               f"with no {what[:-1]}: {absent[:20]}{' ...' if len(absent) > 20 else ''}", split=split))
        present = {c: n for c, n in counts.items() if n > 0}
        if len(present) > 1:
            most, fewest = max(present, key=present.get), min(present, key=present.get)
            if present[most] > ratio * present[fewest]:
                out.append(Finding("stats", WARNING, "imbalance", f"{split}: class {most!r} has {present[most]} "
                                   f"{what}, class {fewest!r} {present[fewest]}: more than doctor.imbalance_ratio="
                                   f"{ratio:g} times as many", split=split))
    return out


CLASSES_PER_CHART = 16  # rows of one per-class chart (report.html shows an image at most 640 px a side)


def plots(stats, per_split_values, folder):
    """PNG plots of the per-class counts (horizontal bars, most first, the absent classes folded into
    the title; CLASSES_PER_CHART a chart) and of the size / length / duration distributions;
    -> [(title, relative path)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    out = []

    def save(fig, name, title):
        path = os.path.join(folder, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append((title, os.path.join(os.path.basename(folder), name)))

    splits = list(stats)
    key, present, absent = class_counts(stats)
    what = key.replace("_per_class", "")
    chunks = [present[k:k + CLASSES_PER_CHART] for k in range(0, len(present), CLASSES_PER_CHART)]
    for n, rows in enumerate(chunks):
        height = 0.9 + len(rows) * (0.14 + 0.12 * len(splits))
        fig, ax = plt.subplots(figsize=(6.2, height))
        bar = 0.8 / len(splits)
        y = np.arange(len(rows))
        top = max(max(r[1:]) for r in present)
        for k, split in enumerate(splits):
            counts = [r[1 + k] for r in rows]
            bars = ax.barh(y + k * bar, counts, bar, label=split)
            ax.bar_label(bars, fontsize=8, padding=2)
        ax.set_yticks(y + bar * (len(splits) - 1) / 2)
        ax.set_yticklabels([str(r[0]) for r in rows], fontsize=9)
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.15)
        ax.set_xlabel(f"{what} per class")
        first = n * CLASSES_PER_CHART
        part = f" ({first + 1}-{first + len(rows)} of {len(present)})" if len(chunks) > 1 else ""
        folded = f"; {len(absent)} classes with none not shown" if absent else ""
        ax.set_title(f"{what} per class, most first{part}{folded}", fontsize=9, loc="left",
                     pad=18 if len(splits) > 1 else 6)
        if len(splits) > 1:  # above the bars, under the title: never over a bar
            ax.legend(fontsize=8, ncol=len(splits), loc="lower left", bbox_to_anchor=(0, 1), frameon=False,
                      borderaxespad=0.1)
        save(fig, f"per_class{'_' + str(n + 1) if n else ''}.png", f"{what} per class{part}")
    for name, label in (("aspect_ratio", "image aspect ratio (width / height)"), ("length", "text length (words)"),
                        ("duration", "audio duration (s)"), ("area", "object area (px, log10)")):
        series = {s: v[name] for s, v in per_split_values.items() if len(v.get(name, []))}
        if not series or np.ptp(np.concatenate([np.asarray(v, dtype=float) for v in series.values()])) == 0:
            continue  # nothing, or one value (the table says it): no histogram
        fig, ax = plt.subplots(figsize=(5, 3))
        for split, values in series.items():
            ax.hist(values, bins=40, alpha=0.6, label=split)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.legend()
        save(fig, f"{name}.png", label)
    return out
