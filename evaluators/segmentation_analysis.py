"""The analysis sections of semantic segmentation (per-class IoU bars, the normalised confusion matrix,
the worst images) and of panoptic segmentation (PQ / SQ / RQ per class, FP and FN segment counts, the
worst images), and the bookkeeping of "the N worst images" they share."""
import heapq
import itertools

import numpy as np

from engine.report import fmt, section, table

MAX_MATRIX_CLASSES = 60


class Worst:
    """The n items with the lowest score seen so far (ties: the first seen), with their payloads."""

    def __init__(self, n):
        self.n, self._heap, self._count = n, [], itertools.count()

    def add(self, score, payload_fn):
        """payload_fn() is called only when the item enters the n worst (drawing inputs stay cheap)."""
        key = (-score, -next(self._count))  # max-heap on score through negation; the newest leaves first on ties
        if len(self._heap) < self.n:
            heapq.heappush(self._heap, (key, payload_fn()))
        elif key > self._heap[0][0]:
            heapq.heapreplace(self._heap, (key, payload_fn()))

    def items(self):
        """[(score, payload)] worst first."""
        return [(-k[0], p) for k, p in sorted(self._heap, key=lambda e: (-e[0][0], -e[0][1]))]


def worst_of(gathered, n):
    """The n lowest of [(score, payload)] lists gathered from every process."""
    return sorted((x for part in gathered for x in part), key=lambda x: x[0])[:n]


def image_miou(cm):
    """Mean IoU of one image's confusion matrix over the classes in its ground truth or prediction."""
    cm = np.asarray(cm, dtype=np.float64)
    tp, union = np.diag(cm), cm.sum(0) + cm.sum(1) - np.diag(cm)
    present = union > 0
    return float((tp[present] / union[present]).mean()) if present.any() else 1.0


def iou_section(cm, classes, iou, title="per-class IoU and confusion matrix"):
    plots = [{"kind": "bars", "title": "IoU per class", "labels": list(classes), "y_label": "IoU (%)", "y_range": [0, 1],
              "percent": "y", "series": [{"label": "IoU", "values": list(iou)}]}]
    if len(classes) <= MAX_MATRIX_CLASSES:
        plots.append({"kind": "matrix", "title": "confusion matrix (pixels, rows normalised)", "labels": list(classes),
                      "values": np.asarray(cm).tolist(), "normalise": True, "x_label": "predicted",
                      "y_label": "ground truth"})
    cm = np.asarray(cm, dtype=np.float64)
    off = cm.copy()
    np.fill_diagonal(off, 0)
    rows = []
    for flat in np.argsort(off, axis=None)[::-1][:10]:
        i, j = divmod(int(flat), cm.shape[1])
        if off[i, j] > 0:
            rows.append((classes[i], classes[j], int(off[i, j]), round(100 * off[i, j] / max(cm[i].sum(), 1), 2)))
    ranked = sorted(((c, None if v is None else round(v, 4)) for c, v in zip(classes, iou)),
                    key=lambda r: (r[1] is None, r[1] if r[1] is not None else 0))
    return section(title, plots=plots,
                   tables=[table("IoU per class (worst first; - : class absent)", ["class", "IoU"], ranked),
                           table("pixels most often confused", ["true", "predicted", "pixels", "% of true class"],
                                 rows)])


def worst_images_section(title, images, what, layout=None):
    """images: [{"path", "title", "caption", "score"}] already written; what: the score's name (mIoU, PQ), the
    table's column; layout: what the panels of each image are, said once (the section's legend)."""
    return section(title, images=images, legend=[{"label": layout}] if layout else None,
                   tables=[table(f"the {len(images)} worst images by {what}", ["image", what],
                                 [(i["title"], i["score"]) for i in images])])


def panoptic_class_section(per_class):
    """PQ / SQ / RQ per class as bars and each class's TP / FP / FN segment counts (pq_summary's
    per_class: {id: {name, isthing, pq, sq, rq, tp, fp, fn}})."""
    rows = list(per_class.values())
    labels = [r["name"] for r in rows]
    plots = [{"kind": "bars", "title": "PQ, SQ and RQ per class", "labels": labels, "y_label": "per cent",
              "y_range": [0, 1], "percent": "y", "series": [{"label": k.upper(), "values": [r[k] for r in rows]} for k in ("pq", "sq", "rq")]},
             {"kind": "bars", "title": "false-positive and false-negative segments per class", "labels": labels,
              "y_label": "segments", "series": [{"label": "FP", "values": [r["fp"] for r in rows]},
                                                {"label": "FN", "values": [r["fn"] for r in rows]}]}]
    ranked = sorted(rows, key=lambda r: r["pq"])
    return section("PQ, SQ, RQ and segment errors per class", plots=plots,
                   tables=[table("per class (worst PQ first)", ["class", "thing", "PQ", "SQ", "RQ", "TP", "FP", "FN"],
                                 [(r["name"], "yes" if r["isthing"] else "no", round(r["pq"], 4), round(r["sq"], 4),
                                   round(r["rq"], 4), r["tp"], r["fp"], r["fn"]) for r in ranked])])


def segmentation_headline(report):
    """The first sentences of a segmentation report: mIoU and pixel accuracy, the class with the lowest IoU
    and what its pixels are taken for."""
    m = report["metrics"]
    lines = [f"mIoU {fmt(m['mIoU'], 'mIoU')}, pixel accuracy {fmt(m['pixel_accuracy'], 'pixel_accuracy')} "
             f"on {report['num_pixels']:,} pixels"]
    iou = {c: v for c, v in report["per_class_iou"].items() if v is not None}
    if len(iou) > 1:
        worst = min(iou, key=iou.get)
        k = report["classes"].index(worst)
        row = np.asarray(report["confusion_matrix"][k], dtype=np.float64)
        other = row.copy()
        other[k] = 0
        line = f"lowest IoU: {worst} ({fmt(iou[worst], 'IoU')})"
        if other.sum() > 0 and row.sum() > 0:
            j = int(other.argmax())
            line += f", its pixels most often taken for {report['classes'][j]} ({100 * other[j] / row.sum():.1f}%)"
        lines.append(line)
    return lines


def panoptic_headline(summary, num_images):
    """The first sentences of a panoptic report: PQ (things, stuff) and the class with the lowest PQ, with
    whether its segments are missed (FN) or spurious (FP)."""
    a, th, st = summary["All"], summary["Things"], summary["Stuff"]
    lines = [f"PQ {fmt(a['pq'], 'PQ')} (things {fmt(th['pq'], 'PQ')}, stuff {fmt(st['pq'], 'PQ')}), SQ "
             f"{fmt(a['sq'], 'SQ')}, RQ {fmt(a['rq'], 'RQ')} on {num_images} images"]
    rows = [r for r in summary["per_class"].values() if r["tp"] + r["fp"] + r["fn"] > 0]
    if len(rows) > 1:
        r = min(rows, key=lambda r: r["pq"])
        lines.append(f"lowest PQ: {r['name']} ({fmt(r['pq'], 'PQ')}; {r['tp']} segments found, {r['fn']} missed, "
                     f"{r['fp']} spurious)")
    return lines


def image_pq(stats):
    """PQ of one image from pq_image's per-category [tp, fp, fn, iou] rows: the mean over the
    categories with any segment (1.0 when there is none)."""
    stats = np.asarray(stats, dtype=np.float64)
    tp, fp, fn, iou = stats.T
    present = tp + fp + fn > 0
    if not present.any():
        return 1.0
    return float((iou[present] / (tp[present] + 0.5 * fp[present] + 0.5 * fn[present])).mean())
