"""Detection and instance-segmentation analysis from one COCO evaluation (evaluators/coco.py):
TIDE error decomposition, precision-recall curves, a confusion matrix with a background row and
column, per-class P/R/F1 at the F1-maximising score threshold, calibration of the scores, and the
worst images with each error labelled.

Everything starts from COCO's own matching at IoU 0.5 (area all, 100 detections per image and
class): which detection is a true positive is what COCOeval decided for AP50, so the baseline of the
decomposition is the reported AP50 and the curves are COCOeval's accumulated precision.

TIDE (Bolya et al., ECCV 2020; the `tidecv` package): each false positive gets one error type, in
this order, from its IoU with the ground truth of its image (foreground 0.5, background 0.1):
  loc   the best IoU with a box of its own class is in [0.1, 0.5];
  cls   IoU >= 0.5 with a box of another class;
  dupe  IoU >= 0.5 with a box of its class that a higher-scoring detection already matched;
  bkg   IoU <= 0.1 with every box;
  both  none of these (a wrong class and a poor box).
A ground truth no detection matched and no loc/cls error points at is missed. Each type's dAP is the
AP50 gained when an oracle fixes only the errors of that type: a loc/cls error becomes the true
positive of its box (only the highest-scoring one per box; the others are removed), dupe, bkg and
both errors are removed, missed boxes are taken out of the ground truth. FP: every false positive
scored below every true positive; FN: every unmatched box removed. As in tidecv, dAP of the six
types is clipped at 0. Differences from tidecv: detections COCO ignores (matched to a crowd region,
or past the 100 per image and class) are left out, and a class counts in the mean AP when it has
ground truth (COCO's rule; tidecv also counts classes that only have detections, with AP 0).
"""
import importlib.util
import math
import os

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as TF

from engine.report import section, table
from engine.paths import join_inside
from evaluators.calibration import binary_calibration

FG_IOU, BG_IOU = 0.5, 0.1
ERRORS = ("cls", "loc", "both", "dupe", "bkg", "miss")
SPECIAL = ("FP", "FN")
TP, CLS, LOC, BOTH, DUPE, BKG = 0, 1, 2, 3, 4, 5  # codes of det_error; MISS is a ground truth's
ERROR_NAMES = {CLS: "cls", LOC: "loc", BOTH: "both", DUPE: "dupe", BKG: "bkg"}
RECALL_POINTS = np.linspace(0.0, 1.0, 101)
# the colour of each kind of box in the drawn images (labels: black or white text on a fill of that colour,
# chosen by its brightness); ground truth dashed, detections solid
COLOURS = {"gt": "#00c853", "miss": "#ff4081", "ok": "#2979ff", "det": "#2979ff", "cls": "#ff1744",
           "loc": "#ff9100", "both": "#aa00ff", "dupe": "#ffea00", "bkg": "#ffffff"}
GROUND_TRUTH = ("gt", "miss")
LEGEND = (("gt", "ground truth a detection found (GT <class>)"), ("miss", "missed ground truth (miss: <class>)"),
          ("ok", "correct detection (<class> <score>)"), ("cls", "cls: right box, wrong class"),
          ("loc", "loc: right class, box IoU 0.1-0.5"), ("both", "both: wrong class and poor box"),
          ("dupe", "dupe: second detection of a found object"), ("bkg", "bkg: detection on no object"))
ERROR_WORDS = {"cls": "classification confusion", "loc": "poor localisation",
               "both": "wrong class and poor box", "dupe": "duplicate detections",
               "bkg": "background false positives", "miss": "missed objects"}


class Matched:
    """The evaluated detections and ground truth of one IoU type, as arrays.

    det_*: one entry per detection COCO evaluated and did not ignore: image index, class index,
    score, matched ground-truth index (-1: a false positive at IoU 0.5). gt_*: one entry per
    non-crowd ground truth: image index, class index. ious[i]: [dets of image i, gts of image i]
    IoU (any class), with det_index[i] / gt_index[i] their global indices.
    """

    def __init__(self, num_images, num_classes, det_image, det_class, det_score, det_match, gt_image, gt_class,
                 ious, det_index, gt_index):
        self.num_images, self.num_classes = num_images, num_classes
        self.det_image, self.det_class = np.asarray(det_image, np.int64), np.asarray(det_class, np.int64)
        self.det_score, self.det_match = np.asarray(det_score, np.float64), np.asarray(det_match, np.int64)
        self.gt_image, self.gt_class = np.asarray(gt_image, np.int64), np.asarray(gt_class, np.int64)
        self.ious, self.det_index, self.gt_index = ious, det_index, gt_index
        self.det_tp = self.det_match >= 0
        self.gt_used = np.zeros(len(self.gt_class), bool)
        self.gt_used[self.det_match[self.det_tp]] = True
        self.num_gt = np.bincount(self.gt_class, minlength=num_classes)


def group(image_of, num_images):
    """Per image, the indices of the items of that image (in their order)."""
    order = np.argsort(image_of, kind="stable")
    bounds = np.searchsorted(image_of[order], np.arange(num_images + 1))
    return [order[bounds[i]:bounds[i + 1]] for i in range(num_images)]


# ---------------------------------------------------------------- TIDE

def classify_errors(m):
    """(det_error [D] with TP for true positives, det_target [D] the ground truth a loc/cls error
    points at or -1, gt_missed [G]) under TIDE's rules."""
    err = np.full(len(m.det_class), TP, np.int64)
    target = np.full(len(m.det_class), -1, np.int64)
    for iou, dets, gts in zip(m.ious, m.det_index, m.gt_index):
        if not len(dets):
            continue
        fp = ~m.det_tp[dets]
        if not len(gts):
            err[dets[fp]] = BKG
            continue
        same = m.det_class[dets][:, None] == m.gt_class[gts][None, :]
        iou_same = iou * same
        best_same = iou_same.max(1)
        loc = (best_same >= BG_IOU) & (best_same <= FG_IOU)
        iou_other = iou * ~same
        cls = ~loc & (iou_other.max(1) >= FG_IOU)
        dupe = ~loc & ~cls & ((iou_same * m.gt_used[gts][None, :]).max(1) >= FG_IOU)
        bkg = ~loc & ~cls & ~dupe & (iou.max(1) <= BG_IOU)
        kind = np.select([loc, cls, dupe, bkg], [LOC, CLS, DUPE, BKG], BOTH)
        err[dets[fp]] = kind[fp]
        tgt = np.where(loc, gts[iou_same.argmax(1)], np.where(cls, gts[iou_other.argmax(1)], -1))
        target[dets[fp]] = tgt[fp]
    usable = np.zeros(len(m.gt_class), bool)
    pointed = target[target >= 0]
    usable[pointed[~m.gt_used[pointed]]] = True
    return err, target, ~m.gt_used & ~usable


def _fixable(m, err, target):
    """Boolean [D]: the loc/cls errors an oracle turns into true positives: per unmatched ground
    truth, the highest-scoring error that points at it (tidecv's BestGTMatch)."""
    cand = np.flatnonzero(((err == LOC) | (err == CLS)) & (target >= 0))
    cand = cand[~m.gt_used[target[cand]]]
    order = cand[np.lexsort((cand, -m.det_score[cand]))]  # score descending, then first come
    _, first = np.unique(target[order], return_index=True)
    out = np.zeros(len(err), bool)
    out[order[first]] = True
    return out


def average_precisions(classes, scores, tp, num_gt, counted):
    """Per class AP (101 recall points, COCO's interpolation) of scored detections; NaN for the
    classes not counted: those without ground truth in the original (COCO's rule) and, as in
    tidecv, those left with neither ground truth nor detections."""
    num_classes = len(num_gt)
    aps = np.full(num_classes, np.nan)
    order = np.lexsort((-scores, classes))  # by class, then score descending (stable)
    classes, tp = classes[order], tp[order]
    bounds = np.searchsorted(classes, np.arange(num_classes + 1))
    for k in np.flatnonzero(counted):
        hits = tp[bounds[k]:bounds[k + 1]]
        if num_gt[k] <= 0:
            aps[k] = 0.0 if len(hits) else np.nan
            continue
        if not len(hits):
            aps[k] = 0.0
            continue
        ctp = np.cumsum(hits)
        recall = ctp / num_gt[k]
        precision = ctp / np.arange(1, len(hits) + 1)
        precision = np.maximum.accumulate(precision[::-1])[::-1]
        idx = np.searchsorted(recall, RECALL_POINTS, side="left")
        aps[k] = np.where(idx < len(precision), precision[np.minimum(idx, len(precision) - 1)], 0.0).mean()
    return aps


def _map(aps):
    return float(np.nanmean(aps)) if np.isfinite(aps).any() else 0.0


def tide(m, err=None, target=None, missed=None):
    """{"AP50": baseline, "dAP_cls" ... "dAP_miss", "dAP_FP", "dAP_FN"} (fractions) and the error
    counts {"cls": n, ...}."""
    if err is None:
        err, target, missed = classify_errors(m)
    counted = m.num_gt > 0
    base = _map(average_precisions(m.det_class, m.det_score, m.det_tp, m.num_gt, counted))
    fixable = _fixable(m, err, target)
    out = {"AP50": base}
    for code, name in ((CLS, "cls"), (LOC, "loc"), (BOTH, "both"), (DUPE, "dupe"), (BKG, "bkg")):
        this = err == code
        keep = ~this | fixable
        classes = m.det_class.copy()
        classes[this & fixable] = m.gt_class[target[this & fixable]]
        tp = m.det_tp | (this & fixable)
        aps = average_precisions(classes[keep], m.det_score[keep], tp[keep], m.num_gt, counted)
        out[f"dAP_{name}"] = max(_map(aps) - base, 0.0)
    num_gt = m.num_gt - np.bincount(m.gt_class[missed], minlength=m.num_classes)
    out["dAP_miss"] = max(_map(average_precisions(m.det_class, m.det_score, m.det_tp, num_gt, counted)) - base, 0.0)
    out["dAP_FP"] = _map(average_precisions(m.det_class, m.det_tp.astype(float), m.det_tp, m.num_gt, counted)) - base
    matched = np.bincount(m.det_class[m.det_tp], minlength=m.num_classes)
    out["dAP_FN"] = _map(average_precisions(m.det_class, m.det_score, m.det_tp, matched, counted)) - base
    counts = {name: int((err == code).sum()) for code, name in ERROR_NAMES.items()}
    counts["miss"] = int(missed.sum())
    return out, counts


# ---------------------------------------------------------------- curves, F1, confusion

def pr_curves(precision, iou_thrs, rec_thrs, class_names):
    """{iou: {"all": [101 precisions], name: [...]}} at IoU 0.5 and 0.75 from COCOeval's
    eval["precision"] [T, R, K, A, M] (area all, the last max-detections): the curves whose mean
    is the reported AP50 / AP75 (per class: its AP; "all": the mean over classes with ground truth)."""
    out = {}
    for iou in (0.5, 0.75):
        t = np.flatnonzero(np.isclose(iou_thrs, iou))
        if not len(t):
            continue
        p = np.asarray(precision)[t[0], :, :, 0, -1]  # [R, K]
        valid = (p > -1).all(0)
        curves = {"all": (p[:, valid].mean(1) if valid.any() else np.zeros(len(rec_thrs))).tolist()}
        for k, name in enumerate(class_names):
            if valid[k]:
                curves[name] = p[:, k].tolist()
        out[iou] = curves
    return out


def f1_threshold(m, max_candidates=2000):
    """The score threshold maximising the macro F1 (mean over classes with ground truth) and the
    per class (P, R, F1) there, plus each class's own best threshold and F1."""
    classes = np.flatnonzero(m.num_gt > 0)
    if not len(m.det_score) or not len(classes):
        return None
    cand = np.unique(m.det_score)
    if len(cand) > max_candidates:
        cand = np.unique(np.quantile(m.det_score, np.linspace(0, 1, max_candidates)))
    p = np.zeros((len(classes), len(cand)))
    r = np.zeros_like(p)
    for row, k in enumerate(classes):
        sel = m.det_class == k
        s = m.det_score[sel]
        order = np.argsort(-s, kind="stable")
        s, ctp = s[order], np.concatenate([[0], np.cumsum(m.det_tp[sel][order])])
        n = np.searchsorted(-s, -cand, side="right")  # detections with score >= each candidate
        tp = ctp[n]
        p[row] = np.where(n > 0, tp / np.maximum(n, 1), 0.0)
        r[row] = tp / m.num_gt[k]
    f1 = np.where(p + r > 0, 2 * p * r / np.maximum(p + r, 1e-12), 0.0)
    best = int(np.argmax(f1.mean(0)))
    own = f1.argmax(1)
    return {"threshold": float(cand[best]), "F1": float(f1[:, best].mean()), "P": float(p[:, best].mean()),
            "R": float(r[:, best].mean()),
            "per_class": {int(k): {"P": float(p[i, best]), "R": float(r[i, best]), "F1": float(f1[i, best]),
                                   "best_threshold": float(cand[own[i]]), "best_F1": float(f1[i, own[i]])}
                          for i, k in enumerate(classes)}}


def confusion(m, score_threshold, iou=FG_IOU):
    """[K+1, K+1] counts, rows ground truth, columns predicted, index K = background: detections
    with score >= score_threshold matched one to one with ground truth at IoU >= iou, same-class pairs
    first, then the rest by IoU (a detection on a box of another class lands off the diagonal).
    Unmatched ground truth: the background column; unmatched detections: the background row."""
    k = m.num_classes
    out = np.zeros((k + 1, k + 1), np.int64)
    for image, (ious, dets, gts) in enumerate(zip(m.ious, m.det_index, m.gt_index)):
        keep = m.det_score[dets] >= score_threshold
        dets, ious = dets[keep], ious[keep]
        det_used, gt_used = np.zeros(len(dets), bool), np.zeros(len(gts), bool)
        if len(dets) and len(gts):
            same = m.det_class[dets][:, None] == m.gt_class[gts][None, :]
            for pass_same in (True, False):
                cand = np.argwhere((ious >= iou) & (same if pass_same else ~same))
                if not len(cand):
                    continue
                cand = cand[np.argsort(-ious[cand[:, 0], cand[:, 1]], kind="stable")]
                for d, g in cand:
                    if not det_used[d] and not gt_used[g]:
                        det_used[d] = gt_used[g] = True
                        out[m.gt_class[gts[g]], m.det_class[dets[d]]] += 1
        np.add.at(out, (m.gt_class[gts[~gt_used]], k), 1)
        np.add.at(out, (k, m.det_class[dets[~det_used]]), 1)
    return out


# ---------------------------------------------------------------- worst images

def worst_images(m, err, target, image_ids, class_names, gt_boxes, det_boxes, score_threshold, num):
    """The `num` images with the most errors among detections scored >= score_threshold (plus their
    ground truth no such detection matched, labelled miss), each with the boxes to draw:
    [{"image_id", "errors", "boxes": [{"bbox" [x, y, w, h], "label", "kind"}]}]."""
    if num <= 0:
        return []
    shown = m.det_score >= score_threshold
    det_err = np.where(shown & (err != TP), 1, 0)
    covered = np.zeros(len(m.gt_class), bool)
    covered[m.det_match[shown & m.det_tp]] = True
    per_image = (np.bincount(m.det_image, det_err, minlength=m.num_images)
                 + np.bincount(m.gt_image, (~covered).astype(float), minlength=m.num_images)).astype(np.int64)
    order = np.argsort(-per_image, kind="stable")
    out = []
    for i in order[:num]:
        if per_image[i] <= 0:
            break
        boxes = []
        for g in m.gt_index[i]:
            kind = "gt" if covered[g] else "miss"
            boxes.append({"bbox": gt_boxes[g], "kind": kind,
                          "label": f"{'GT' if kind == 'gt' else 'miss:'} {class_names[m.gt_class[g]]}"})
        for d in m.det_index[i]:
            if not shown[d]:
                continue
            kind = "ok" if err[d] == TP else ERROR_NAMES[int(err[d])]
            name = class_names[m.det_class[d]]
            boxes.append({"bbox": det_boxes[d], "kind": kind,
                          "label": f"{name} {m.det_score[d]:.2f}" if kind == "ok" else
                          f"{kind}: {name} {m.det_score[d]:.2f}"})
        out.append({"image_id": image_ids[i], "errors": int(per_image[i]), "boxes": boxes})
    return out


def _font(size):
    """matplotlib's DejaVu Sans Bold (readable labels), found without importing matplotlib; else PIL's default."""
    spec = importlib.util.find_spec("matplotlib")
    path = spec and os.path.join(os.path.dirname(spec.origin), "mpl-data", "fonts", "ttf", "DejaVuSans-Bold.ttf")
    if path and os.path.isfile(path):
        return ImageFont.truetype(path, size)
    return ImageFont.load_default(size)


def _overlaps(a, b):
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def place_labels(boxes, sizes, width, height, gap=1):
    """Where each box's label goes: [(x, y, w, h)] rectangles that do not overlap one another.

    boxes: [[x0, y0, x1, y1]] in pixels, in the order of importance (the first get the best places);
    sizes: [(w, h)] of their labels. Each label takes the first free place of: above the box's top-left
    corner, inside it, below the box, above its top-right corner, beside it; else the free place
    nearest that corner inside the image; else a new row under the image (y >= height: the caller
    extends its canvas). Returns (rectangles, the canvas height needed)."""
    placed, bottom = [], height

    def free(r):
        return all(not _overlaps(r, q) for q in placed)

    def inside(r):
        return r[0] >= 0 and r[1] >= 0 and r[0] + r[2] <= width and r[1] + r[3] <= height

    for (x0, y0, x1, y1), (w, h) in zip(boxes, sizes):
        w, h = w + gap, h + gap
        near = [(x0, y0 - h), (x0, y0), (x0, y1), (x0, y1 - h), (x1 - w, y0 - h), (x1 - w, y1), (x0 - w, y0), (x1, y0)]
        rect = None
        for x, y in near:
            r = (round(min(max(x, 0), max(width - w, 0))), round(min(max(y, 0), max(height - h, 0))), w, h)
            if inside(r) and free(r):
                rect = r
                break
        if rect is None:  # the nearest free place: a grid of positions by distance from the corner
            step_x, step_y = max(4, w // 4), max(2, h // 2)
            grid = [(x, y) for x in range(0, max(width - w, 0) + 1, step_x)
                    for y in range(0, max(height - h, 0) + 1, step_y)]
            grid.sort(key=lambda p: (p[0] - x0) ** 2 + (p[1] - y0 + h) ** 2)
            rect = next(((x, y, w, h) for x, y in grid if free((x, y, w, h))), None)
        if rect is None:  # no room left in the image: a row under it
            row = [q for q in placed if q[1] >= height and q[1] + q[3] == bottom]
            x = max((q[0] + q[2] for q in row), default=None)
            if x is None or x + w > width:
                x, bottom = 0, bottom + h
            rect = (x, bottom - h, w, h)
        placed.append(rect)
    return [(x, y, w - gap, h - gap) for x, y, w, h in placed], max(bottom, height)


def _rgb(colour):
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def _text_colour(fill):
    r, g, b = _rgb(fill)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"


def _dashed_rectangle(draw, box, colour, width, dash=7):
    x0, y0, x1, y1 = box
    for (a, b), fixed, horizontal in (((x0, x1), y0, True), ((x0, x1), y1, True), ((y0, y1), x0, False),
                                      ((y0, y1), x1, False)):
        for start in np.arange(a, b, 2 * dash):
            end = min(start + dash, b)
            draw.line([(start, fixed), (end, fixed)] if horizontal else [(fixed, start), (fixed, end)],
                      fill=colour, width=width)


ORDER = {"cls": 0, "loc": 0, "both": 0, "dupe": 0, "bkg": 0, "miss": 1, "ok": 2, "det": 2, "gt": 3}
LABEL_PAD = 3


def label_layout(boxes, scale, height, width, font_size=None):
    """Where draw_boxes puts the boxes and labels on an image of height x width (already scaled by `scale`):
    (the boxes by importance, their [x0, y0, x1, y1] in pixels, the indices of those with a label, each
    label's rectangle (place_labels), the canvas height, the font)."""
    font = _font(font_size or max(13, round(max(height, width) / 32)))
    boxes = sorted(boxes, key=lambda b: ORDER.get(b["kind"], 0))  # errors get the best places, plain GT the last
    xyxy = [[v * scale for v in (x, y, x + w, y + h)] for x, y, w, h in (b["bbox"] for b in boxes)]
    labelled = [i for i, b in enumerate(boxes) if b.get("label")]
    sizes = []
    for i in labelled:
        left, top, right, bottom = font.getbbox(boxes[i]["label"])
        sizes.append((right - left + 2 * LABEL_PAD, bottom - top + 2 * LABEL_PAD))
    rects, canvas_h = place_labels([xyxy[i] for i in labelled], sizes, width, height)
    return boxes, xyxy, labelled, rects, canvas_h, font


def draw_boxes(image, boxes, width=2, min_side=480, font_size=None):
    """uint8 [3, H, W] with each {"bbox" [x, y, w, h], "label", "kind"} drawn in its kind's colour (ground
    truth dashed), each label on a filled background in the box's colour, placed where no other label is
    (place_labels; a label with no room in the image goes to a white strip under it, H grows, linked by a
    line). Small images are first enlarged to min_side so that the labels stay readable."""
    scale = max(1.0, min_side / max(image.shape[-2:]))
    if scale > 1:
        image = TF.resize(image, [round(image.shape[-2] * scale), round(image.shape[-1] * scale)], antialias=True)
    boxes = [b for b in boxes if len(b["bbox"]) == 4 and all(math.isfinite(v) for v in b["bbox"])
             and b["bbox"][2] >= 0 and b["bbox"][3] >= 0]
    if not boxes:
        return image
    height, width_px = image.shape[-2:]
    boxes, xyxy, labelled, rects, canvas_h, font = label_layout(boxes, scale, height, width_px, font_size)
    pad = LABEL_PAD
    canvas = Image.new("RGB", (width_px, canvas_h), "white")
    canvas.paste(Image.fromarray(image.permute(1, 2, 0).numpy()), (0, 0))
    draw = ImageDraw.Draw(canvas)
    for b, box in reversed(list(zip(boxes, xyxy))):  # the important ones drawn last, on top
        colour = COLOURS.get(b["kind"], "#ff1744")
        if b["kind"] in GROUND_TRUTH:
            _dashed_rectangle(draw, box, "black", width + 2)
            _dashed_rectangle(draw, box, colour, width)
        else:
            draw.rectangle(box, outline="black", width=width + 2)  # a dark rim: visible on any background
            draw.rectangle([box[0] + 1, box[1] + 1, max(box[0] + 1, box[2] - 1), max(box[1] + 1, box[3] - 1)],
                           outline=colour, width=width)
    for i, (x, y, w, h) in zip(labelled, rects):  # the lines first: no line crosses a label
        box = xyxy[i]
        if not _overlaps((x, y, w, h), (box[0] - 3, box[1] - 3, box[2] - box[0] + 6, box[3] - box[1] + 6)):
            cx, cy = x + w / 2, y + h / 2  # a label away from its box: a line to it
            end = (min(max(cx, box[0]), box[2]), min(max(cy, box[1]), box[3]))
            draw.line([(cx, cy), end], fill="black", width=3)
            draw.line([(cx, cy), end], fill=COLOURS.get(boxes[i]["kind"], "#ff1744"), width=1)
    for i, (x, y, w, h) in zip(labelled, rects):
        b = boxes[i]
        colour = COLOURS.get(b["kind"], "#ff1744")
        draw.rectangle([x, y, x + w - 1, y + h - 1], fill=colour, outline="black", width=1)
        left, top, _, _ = font.getbbox(b["label"])
        draw.text((x + pad - left, y + pad - top), b["label"], fill=_text_colour(colour), font=font)
    return torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1)


def legend(kinds=None):
    """The colour key of a worst-images section (engine.report's "legend")."""
    return [{"colour": COLOURS[k], "label": text, "dashed": k in GROUND_TRUTH} for k, text in LEGEND
            if kinds is None or k in kinds]


def save_worst_images(section_, img_folder, report_dir, file_names, source="the annotations"):
    """Draw a worst-images section's entries into report_dir/<entry path>; returns the paths written.
    file_names: image id -> file name under img_folder (entries whose file is missing are skipped; a
    name that leads out of img_folder is an OutsideFolder naming `source` and the image)."""
    written = []
    for entry in section_.get("images", []):
        name = file_names.get(entry["image_id"])
        path = name and join_inside(img_folder, name, f"{source}: image {entry['image_id']!r:.40}: file_name",
                                   resolve=False)
        if not path or not os.path.isfile(path):
            continue
        image = decode_image(path, mode=ImageReadMode.RGB)
        image = draw_boxes(image, entry["boxes"])
        out = os.path.join(report_dir, entry["path"])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(out, compress_level=1)  # fast zlib: a third of the time
        written.append(out)
    return written


# ---------------------------------------------------------------- the sections

def _r(values, digits=4):
    return [round(float(v), digits) for v in values]


def _scores(values):
    """The middle half of some scores: "0.31-0.45" (or one score: "0.31")."""
    lo, hi = np.quantile(values, [0.25, 0.75]) if len(values) > 1 else (values[0], values[0])
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def error_details(m, err, target, missed, class_names):
    """Where each TIDE error type's errors are: {type: {"count", "mostly", "share", "scores"}}; "mostly" is
    the most frequent (ground-truth class, detected class) pair of the cls errors, the class missed of the
    misses, the detected class of the others; "scores": the middle half of their scores (None for misses)."""
    out = {}
    for code, name in list(ERROR_NAMES.items()) + [(None, "miss")]:
        if code is None:
            idx = np.flatnonzero(missed)
            keys = [class_names[c] for c in m.gt_class[idx]]
            scores = None
        else:
            idx = np.flatnonzero(err == code)
            if code == CLS:
                keys = [f"{class_names[m.gt_class[g]]} taken for {class_names[c]}"
                        for g, c in zip(target[idx], m.det_class[idx])]
            else:
                keys = [class_names[c] for c in m.det_class[idx]]
            scores = _scores(m.det_score[idx]) if len(idx) else None
        if not len(idx):
            continue
        values, counts = np.unique(keys, return_counts=True)
        top = int(np.argmax(counts))
        out[name] = {"count": int(len(idx)), "mostly": str(values[top]), "share": int(counts[top]), "scores": scores}
    return out


def tide_headline(t, deltas, details):
    """One sentence: the error type that loses the most AP50, where its errors are, and the next one."""
    ranked = sorted(((deltas[f"dAP_{e}"], e) for e in ERRORS), reverse=True)
    (top, e), (second, e2) = ranked[0], ranked[1]
    if top < 0.0005:
        return f"{t}: no error type costs a tenth of an AP50 point (AP50 {100 * deltas['AP50']:.1f})"
    d = details.get(e, {})
    line = f"{t}: most AP50 is lost to {ERROR_WORDS[e]} ({100 * top:.1f} points)"
    if d:
        what = {"cls": "{m}", "miss": "{m} objects", "loc": "{m} boxes"}.get(e, "{m} detections")
        line += (f": {d['count']} {'objects' if e == 'miss' else 'errors'}, mostly {what.format(m=d['mostly'])} "
                 f"({d['share']})" + (f" at score{'s' if '-' in d['scores'] else ''} {d['scores']}"
                                      if d.get("scores") else ""))
    if second >= 0.0005:
        line += f"; then to {ERROR_WORDS[e2]} ({100 * second:.1f} points)"
    return line


def sections(iou_type, m, class_names, precision, iou_thrs, rec_thrs, image_ids, gt_boxes, det_boxes,
             score_threshold=0.3, num_worst=8, max_curves=10):
    """The analysis sections of one IoU type (plain JSON, analysis's section format). The TIDE section
    carries "headline": its sentence for the report's headline (evaluators.coco moves it there)."""
    t = iou_type
    err, target, missed = classify_errors(m)
    deltas, counts = tide(m, err, target, missed)
    details = error_details(m, err, target, missed, class_names)
    out = []
    names = list(ERRORS) + list(SPECIAL)
    what = {"cls": "right box, wrong class", "loc": "right class, box IoU 0.1-0.5", "both": "wrong class and poor box",
            "dupe": "a second detection of a found object", "bkg": "a detection on no object (IoU <= 0.1)",
            "miss": "an object nothing detected", "FP": "every false positive ranked last",
            "FN": "every missed object removed"}
    rows = []
    for n in names:
        d = details.get(n, {})
        rows.append([n, what[n], round(deltas[f"dAP_{n}"], 6), counts.get(n, "-"),
                     f"{d['mostly']} ({d['share']})" if d else "-", d.get("scores") or "-"])
    out.append(section(
        f"{t}: error analysis (TIDE)",
        metrics={f"{t}/tide/{k}": round(v, 6) for k, v in deltas.items()}, show_metrics=False,
        headline=tide_headline(t, deltas, details),
        tables=[table(f"AP50 {100 * deltas['AP50']:.1f}: the AP50 points (dAP50) an oracle gains by fixing each "
                      "error type alone (they overlap: they do not add up), the errors' count, their most frequent "
                      "class and the middle half of their scores",
                      ["error", "what", "dAP50", "count", "mostly", "scores"], rows)],
        plots=[{"kind": "bars", "title": f"{t}: AP50 points lost to each error type (TIDE dAP50)", "labels": names,
                "series": [{"values": [round(deltas[f"dAP_{n}"], 6) for n in names],
                            "colours": [COLOURS.get(n, "#9e9e9e") for n in names]}],
                "y_label": "dAP50 (AP50 points)", "percent": "y", "value_labels": True}]))

    curves = pr_curves(precision, iou_thrs, rec_thrs, class_names)
    f1 = f1_threshold(m)
    ranked = sorted((k for k in range(m.num_classes) if m.num_gt[k] > 0), key=lambda k: -m.num_gt[k])
    shown = ["all"] + [class_names[k] for k in ranked[:max_curves]]
    gt_of = {class_names[k]: int(m.num_gt[k]) for k in ranked}
    # small multiples: one panel per class ("all" first, in black), IoU 0.5 solid and 0.75 dashed, AP in the legend
    series = [{"label": f"IoU {iou}: AP {100 * float(np.mean(by_class[name])):.1f}", "class": name, "iou": iou,
               "panel": name, "emphasis": name == "all", "style": "-" if iou == 0.5 else "--",
               "x": _r(rec_thrs, 2), "y": _r(by_class[name])}
              for name in shown for iou, by_class in curves.items() if name in by_class]
    plots = [{"kind": "curves", "title": f"{t}: precision-recall at IoU 0.5 and 0.75, per class"
              + (f" (the {max_curves} classes with most ground truth)" if len(ranked) > max_curves else ""),
              "x_label": "recall (%)", "y_label": "precision (%)", "x_range": [0, 1], "y_range": [0, 1.02],
              "percent": "xy", "legend": "best", "series": series,
              "panel_titles": {"all": "all classes (mean)", **{n: f"{n} ({g} objects)" for n, g in gt_of.items()}}}
             ] if series else []
    rows = []
    for k in ranked:
        name = class_names[k]
        pc = (f1 or {}).get("per_class", {}).get(k, {})
        ap = [round(float(np.mean(curves[i][name])), 4) if name in curves.get(i, {}) else None for i in (0.5, 0.75)]
        rows.append([name, int(m.num_gt[k]), *ap] + [round(pc[x], 4) if x in pc else None
                                                     for x in ("P", "R", "F1", "best_threshold", "best_F1")])
    metrics = {}
    if f1:
        metrics = {f"{t}/f1/threshold": round(f1["threshold"], 4), f"{t}/f1/F1": round(f1["F1"], 4),
                   f"{t}/f1/P": round(f1["P"], 4), f"{t}/f1/R": round(f1["R"], 4)}
    out.append(section(
        f"{t}: precision-recall", metrics=metrics,
        tables=[table("per class (P, R, F1 at the score threshold that maximises the mean F1; each class's own "
                      "best threshold and F1)",
                      ["class", "GT", "AP50", "AP75", "P", "R", "F1", "best threshold", "best F1"], rows)],
        plots=plots))

    cm = confusion(m, score_threshold)
    k = m.num_classes
    with_gt = [i for i in range(k) if m.num_gt[i] > 0 or cm[:, i].any()]
    idx = with_gt + [k]
    labels = [class_names[i] for i in with_gt] + ["background"]
    out.append(section(
        f"{t}: confusion matrix",
        metrics={f"{t}/confusion/score_threshold": score_threshold, f"{t}/confusion/matched": int(cm[:k, :k].sum()),
                 f"{t}/confusion/correct": int(np.trace(cm[:k, :k])), f"{t}/confusion/missed": int(cm[:k, k].sum()),
                 f"{t}/confusion/false_positives": int(cm[k, :k].sum())},
        plots=[{"kind": "matrix", "title": f"{t}: confusion (IoU >= {FG_IOU}, score >= {score_threshold})",
                "labels": labels, "values": cm[np.ix_(idx, idx)].tolist(), "normalise": False,
                "x_label": "predicted", "y_label": "ground truth"}]))

    if len(m.det_score):
        cal = binary_calibration(np.clip(m.det_score, 0.0, 1.0), m.det_tp.astype(float),
                                 title=f"{t}: calibration (score vs matched at IoU 0.5)")
        cal["metrics"] = {f"{t}/calibration/{key}": v for key, v in cal.get("metrics", {}).items()}
        out.append(cal)

    worst = worst_images(m, err, target, image_ids, class_names, gt_boxes, det_boxes, score_threshold, num_worst)
    if worst:
        images = []
        for i, w in enumerate(worst):
            kinds = [b["kind"] for b in w["boxes"] if b["kind"] not in ("gt", "ok")]
            by_kind = ", ".join(f"{kinds.count(x)} {x}" for x in ERRORS if x in kinds)
            images.append({"title": f"image {w['image_id']}: {w['errors']} error{'s' if w['errors'] != 1 else ''}", "path": f"analysis/{t}_worst_{i}.png",
                           "caption": f"({by_kind})" if by_kind else "", **w})
        present = {b["kind"] for w in worst for b in w["boxes"]}
        out.append(section(f"{t}: worst images", images=images, legend=legend(present), tables=[table(
            f"the images with the most errors at score >= {score_threshold}", ["image", "errors"],
            [[w["image_id"], w["errors"]] for w in worst])]))
    return out
