"""Panoptic FPN's outputs without torch: the panoptic fusion in numpy, an exported graph's outputs
turned into a COCO panoptic result (`fuse`), the COCO panoptic id codec and PNGs, and panoptic
quality exactly as COCO's panopticapi defines it (`pq_image`, `pq_summary`). evaluators/panoptic.py
and exporters/panoptic.py import these; a consumer of the ONNX artifact needs numpy and PIL only.

The exported graph (exporters/panoptic.py) gives, for one image: boxes, scores, labels (thing
labels 1..T), masks [N, 1, H, W] (probabilities pasted into the image), sem_prob and sem_label
[H, W] (the semantic head's softmax maximum and its category label, 0 = "things" for a "stuff"
head). Its description (`<artifact>.json`) holds under "postprocessing" the fusion settings
("fusion"), the stuff labels ("stuff_labels") and the COCO categories ("categories"), and at the
top "label_to_category_id".

PQ per image (`pq_image`, vectorised over pixels with one np.unique of combined gt/pred ids):
  - a prediction matches a ground-truth segment of the same category when IoU > 0.5, where the
    union leaves out the prediction's overlap with ground-truth void (id 0);
  - crowd ground truth is never matched (and is no false negative);
  - an unmatched prediction is no false positive when more than half of it lies on void, or on
    the crowd region of its own category;
  - ground-truth areas come from the JSON, predicted areas from the PNG.
PQ = sum(IoU of TPs) / (TP + FP/2 + FN/2), SQ = sum(IoU) / TP, RQ = TP / (TP + FP/2 + FN/2); the
All / Things / Stuff figures are unweighted means over the categories with any TP, FP or FN.
"""
import io
import os
from collections.abc import Mapping

import numpy as np
from PIL import Image

from engine.errors import ArtifactError, BadSample, MissingData, UserError

OFFSET = 256 ** 3  # ids are below 256^3 (RGB)
OUTPUTS = ("boxes", "scores", "labels", "masks", "sem_prob", "sem_label")  # the exported graph's, in order


class PanopticFormatError(UserError, ValueError):
    """A panoptic prediction that does not fit its JSON or the categories."""


# ---------------------------------------------------------------- ids and PNGs

def id_to_rgb(ids):
    """COCO panoptic ids (id = R + 256 G + 256^2 B, 0 = void) -> uint8 RGB [..., 3]."""
    ids = ids.astype(np.uint32)
    return np.stack([ids % 256, ids // 256 % 256, ids // 65536 % 256], -1).astype(np.uint8)


def rgb_to_id(rgb):
    rgb = np.asarray(rgb, dtype=np.uint32)
    return rgb[..., 0] + 256 * rgb[..., 1] + 65536 * rgb[..., 2]


def read_ids(path):
    """Segment ids of a COCO panoptic PNG; a PNG that cannot be decoded (truncated, corrupt) is a
    BadSample naming it."""
    if not os.path.isfile(path):
        raise MissingData(f"panoptic PNG not found: {path}")
    try:
        with open(path, "rb") as f:
            rgb = np.array(Image.open(f).convert("RGB"))
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ...
        raise BadSample(path, f"cannot read panoptic PNG ({type(e).__name__}: {e})") from None
    return rgb_to_id(rgb)


def png_bytes(ids):
    """A segment id map as COCO panoptic PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(id_to_rgb(np.asarray(ids))).save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------- fusion

def _at(value, dtype):
    """A threshold in the array's precision (torch compares a float32 tensor with a Python float in float32)."""
    return np.asarray(value, dtype=dtype) if np.issubdtype(dtype, np.floating) else value


def panoptic_fusion(masks, scores, labels, semantic, stuff_labels, semantic_scores=None, score_thresh=0.5,
                    mask_thresh=0.5, overlap_thresh=0.5, stuff_area_thresh=4096):
    """One image's panoptic map from numpy arrays (models.panoptic.panoptic_fusion runs this on tensors).

    masks [N, H, W] or [N, 1, H, W] probabilities, scores [N], labels [N] thing labels; semantic
    [H, W] category labels; stuff_labels: the labels of `semantic` that are stuff.
    1. instances with score >= score_thresh, masks binarised at >= mask_thresh, in descending score
       order (ties: the first first): dropped if more than overlap_thresh of the mask is already
       taken, else they get their free pixels;
    2. stuff: on the remaining free pixels, each stuff label with at least stuff_area_thresh pixels
       becomes one segment;
    3. the rest is void (0).
    Returns (panoptic [H, W] int32 with ids 1..n, segments_info [{id, category_id (label), isthing,
    score, area}])."""
    masks, scores, labels, semantic = (np.asarray(a) for a in (masks, scores, labels, semantic))
    if masks.ndim == 4:
        masks = masks[:, 0]
    panoptic = np.zeros(semantic.shape, dtype=np.int32)
    segments = []
    keep = np.flatnonzero(scores >= _at(score_thresh, scores.dtype))
    keep = keep[np.argsort(-scores[keep], kind="stable")]
    for i in keep.tolist():
        mask = masks[i] >= _at(mask_thresh, masks.dtype)
        area = int(mask.sum())
        if area == 0:
            continue
        free = mask & (panoptic == 0)
        free_area = int(free.sum())
        if (area - free_area) / area > overlap_thresh or free_area == 0:
            continue
        segment_id = len(segments) + 1
        panoptic[free] = segment_id
        segments.append({"id": segment_id, "category_id": int(labels[i]), "isthing": True,
                         "score": float(scores[i]), "area": free_area})
    free = panoptic == 0
    stuff_labels = sorted(int(c) for c in stuff_labels)
    counts = np.bincount(semantic[free].astype(np.int64).ravel(), minlength=max(stuff_labels, default=0) + 1)
    for label in stuff_labels:
        if int(counts[label]) < max(stuff_area_thresh, 1):
            continue
        region = free & (semantic == label)
        segment_id = len(segments) + 1
        panoptic[region] = segment_id
        score = float(np.asarray(semantic_scores)[region].astype(np.float64).mean()) \
            if semantic_scores is not None else 1.0
        segments.append({"id": segment_id, "category_id": label, "isthing": False, "score": score,
                         "area": int(counts[label])})
    return panoptic, segments


def fusion_settings(spec, where="the artifact's description"):
    """(stuff labels, fusion keywords, label -> COCO category id) from an export description."""
    post = spec.get("postprocessing") or {}
    missing = [k for k in ("stuff_labels", "fusion") if k not in post] + \
        ([] if "label_to_category_id" in spec else ["label_to_category_id"])
    if missing:
        raise ArtifactError(f"{where}: a panoptic description needs postprocessing.stuff_labels, "
                            f"postprocessing.fusion and label_to_category_id; missing {', '.join(missing)}")
    to_cat = {int(k): int(v) for k, v in spec["label_to_category_id"].items()}
    return [int(c) for c in post["stuff_labels"]], dict(post["fusion"]), to_cat


def named_outputs(outputs, spec=None, where="the exported graph"):
    """The graph's outputs by name: a mapping as it is, a sequence in the description's output order."""
    if isinstance(outputs, Mapping):
        named = dict(outputs)
    else:
        names = (spec or {}).get("outputs") or OUTPUTS
        if len(outputs) != len(names):
            raise ArtifactError(f"{where}: {len(outputs)} outputs, the description names {len(names)} "
                                f"({', '.join(names)})")
        named = dict(zip(names, outputs))
    missing = [k for k in OUTPUTS if k not in named]
    if missing:
        raise ArtifactError(f"{where}: not a panoptic graph's outputs: {', '.join(missing)} missing "
                            f"(expected {', '.join(OUTPUTS)})")
    return {k: np.asarray(v) for k, v in named.items()}


def fuse(outputs, spec, where="the artifact's description"):
    """The exported graph's outputs of one image (numpy arrays, a sequence in spec["outputs"] order or a
    mapping by name) and its description -> (panoptic ids [H, W] int32, segments_info [{id,
    category_id (COCO), isthing (0/1), area, score}]): a COCO panoptic PNG's ids and its JSON record."""
    stuff, fusion, to_cat = fusion_settings(spec, where)
    out = named_outputs(outputs, spec)
    ids, segments = panoptic_fusion(out["masks"], out["scores"], out["labels"], out["sem_label"], stuff,
                                    out["sem_prob"], **fusion)
    unknown = sorted({s["category_id"] for s in segments} - set(to_cat))
    if unknown:
        raise ArtifactError(f"{where}: label(s) {unknown} have no category id in label_to_category_id")
    return ids, [{"id": s["id"], "category_id": to_cat[s["category_id"]], "isthing": int(s["isthing"]),
                  "area": s["area"], "score": s["score"]} for s in segments]


def image_input(image):
    """A PIL image -> the graph's input: float32 [3, H, W], RGB scaled to [0, 1]."""
    return np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255)


# ---------------------------------------------------------------- panoptic quality

def pq_image(gt_ids, gt_segments, pred_ids, pred_segments, cat_index, image_id=None):
    """Per-category [tp, fp, fn, iou sum] of one image: array [len(cat_index), 4].

    gt_ids / pred_ids: [H, W] segment ids (0 = void); *_segments: COCO segments_info lists
    (gt with area and iscrowd); cat_index: {category_id: row}. Raises PanopticFormatError
    naming the image and the id when the prediction's PNG and JSON disagree."""
    where = f"image {image_id}"
    if gt_ids.shape != pred_ids.shape:
        raise PanopticFormatError(f"{where}: prediction is {pred_ids.shape[1]}x{pred_ids.shape[0]}, ground truth "
                                  f"{gt_ids.shape[1]}x{gt_ids.shape[0]}")
    stats = np.zeros((len(cat_index), 4))
    pred_segs = {int(s["id"]): s for s in pred_segments}
    for s in pred_segments:
        if s["category_id"] not in cat_index:
            raise PanopticFormatError(f"{where}: segment {s['id']} has unknown category_id {s['category_id']}")
    ids, areas = np.unique(pred_ids, return_counts=True)
    pred_area = dict(zip(ids.tolist(), areas.tolist()))
    extra = sorted(set(pred_area) - set(pred_segs) - {0})
    if extra:
        raise PanopticFormatError(f"{where}: segment id(s) {extra} are in the PNG but not in the JSON")
    absent = sorted(set(pred_segs) - set(pred_area))
    if absent:
        raise PanopticFormatError(f"{where}: segment id(s) {absent} are in the JSON but not in the PNG")

    # intersections of every (gt id, pred id) pair present in the image
    pairs, inter = np.unique(gt_ids.astype(np.int64) * OFFSET + pred_ids.astype(np.int64), return_counts=True)
    pair_g, pair_p = pairs // OFFSET, pairs % OFFSET
    intersection = dict(zip(zip(pair_g.tolist(), pair_p.tolist()), inter.tolist()))
    on_void = {p: n for (g, p), n in intersection.items() if g == 0}

    gt_segs = {int(s["id"]): s for s in gt_segments}
    gt_matched, pred_matched = set(), set()
    for (g, p), n in intersection.items():
        gs, ps = gt_segs.get(g), pred_segs.get(p)
        if gs is None or ps is None or gs.get("iscrowd", 0) == 1 or gs["category_id"] != ps["category_id"]:
            continue
        union = pred_area[p] + gs["area"] - n - on_void.get(p, 0)
        iou = n / union
        if iou > 0.5:
            row = cat_index[gs["category_id"]]
            stats[row, 0] += 1
            stats[row, 3] += iou
            gt_matched.add(g)
            pred_matched.add(p)
    crowd_of_cat = {}
    for g, gs in gt_segs.items():
        if g in gt_matched:
            continue
        if gs.get("iscrowd", 0) == 1:
            crowd_of_cat[gs["category_id"]] = g
            continue
        if gs["category_id"] not in cat_index:
            raise PanopticFormatError(f"{where}: ground-truth segment {g} has unknown category_id {gs['category_id']}")
        stats[cat_index[gs["category_id"]], 2] += 1
    for p, ps in pred_segs.items():
        if p in pred_matched:
            continue
        ignored = on_void.get(p, 0)
        if ps["category_id"] in crowd_of_cat:
            ignored += intersection.get((crowd_of_cat[ps["category_id"]], p), 0)
        if ignored / pred_area[p] > 0.5:
            continue
        stats[cat_index[ps["category_id"]], 1] += 1
    return stats


def pq_summary(stats, categories):
    """{"All", "Things", "Stuff": {pq, sq, rq, n}, "per_class": {id: {...}}} from summed stats
    (rows in the order of `categories`, COCO category dicts with isthing)."""
    per_class, groups = {}, {"All": [], "Things": [], "Stuff": []}
    for (tp, fp, fn, iou), cat in zip(stats, categories):
        row = {"name": cat.get("name", str(cat["id"])), "isthing": int(cat.get("isthing", 0)),
               "tp": int(tp), "fp": int(fp), "fn": int(fn), "pq": 0.0, "sq": 0.0, "rq": 0.0}
        if tp + fp + fn > 0:
            denominator = tp + 0.5 * fp + 0.5 * fn
            row.update(pq=iou / denominator, sq=iou / tp if tp else 0.0, rq=tp / denominator)
            for group in ("All", "Things" if row["isthing"] else "Stuff"):
                groups[group].append(row)
        per_class[str(cat["id"])] = row
    out = {name: {k: float(np.mean([r[k] for r in rows])) if rows else 0.0 for k in ("pq", "sq", "rq")}
           for name, rows in groups.items()}
    for name, rows in groups.items():
        out[name]["n"] = len(rows)
    out["per_class"] = per_class
    return out


def summary_metrics(summary):
    """PQ, SQ, RQ and their _th / _st (things / stuff) figures of a pq_summary, as fractions."""
    out = {}
    for group, suffix in (("All", ""), ("Things", "_th"), ("Stuff", "_st")):
        for k in ("pq", "sq", "rq"):
            out[k.upper() + suffix] = summary[group][k]
    return out
