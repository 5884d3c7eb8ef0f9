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


def balance_findings(stats, ratio):
    """Classes absent from a split, and splits whose largest class outnumbers the smallest by more
    than `ratio`."""
    out = []
    for split, s in stats.items():
        counts = s.get("instances_per_class") or s["samples_per_class"]
        absent = [c for c, n in counts.items() if n == 0]
        if absent:
            out.append(Finding("stats", WARNING, "absent_class", f"{split}: classes with no sample: "
                               f"{absent[:20]}{' ...' if len(absent) > 20 else ''}", split=split))
        present = {c: n for c, n in counts.items() if n > 0}
        if len(present) > 1:
            most, fewest = max(present, key=present.get), min(present, key=present.get)
            if present[most] > ratio * present[fewest]:
                out.append(Finding("stats", WARNING, "imbalance", f"{split}: class {most!r} has {present[most]} "
                                   f"samples, class {fewest!r} {present[fewest]}: more than doctor.imbalance_ratio="
                                   f"{ratio:g} times as many", split=split))
    return out


def plots(stats, per_split_values, folder):
    """PNG plots of the per-class counts and the size / length / duration distributions;
    -> [(title, relative path)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    out = []

    def save(fig, name, title):
        path = os.path.join(folder, name)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        out.append((title, os.path.join(os.path.basename(folder), name)))

    splits = list(stats)
    if splits:
        key = "instances_per_class" if "instances_per_class" in stats[splits[0]] else "samples_per_class"
        classes = list(stats[splits[0]][key])
        if classes:
            fig, ax = plt.subplots(figsize=(max(5, 0.3 * len(classes) + 2), 3.5))
            width = 0.8 / len(splits)
            for k, split in enumerate(splits):
                counts = [stats[split][key].get(c, 0) for c in classes]
                ax.bar(np.arange(len(classes)) + k * width, counts, width, label=split)
            ax.set_xticks(np.arange(len(classes)) + 0.4 - width / 2)
            ax.set_xticklabels(classes, rotation=90 if len(classes) > 8 else 0, fontsize=7)
            ax.set_ylabel(key.replace("_", " "))
            ax.legend()
            save(fig, "per_class.png", key.replace("_", " "))
    for name, label in (("aspect_ratio", "image aspect ratio (width / height)"), ("length", "text length (words)"),
                        ("duration", "audio duration (s)"), ("area", "object area (px, log10)")):
        series = {s: v[name] for s, v in per_split_values.items() if len(v.get(name, []))}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5, 3))
        for split, values in series.items():
            ax.hist(values, bins=40, alpha=0.6, label=split)
        ax.set_xlabel(label)
        ax.legend()
        save(fig, f"{name}.png", label)
    return out
