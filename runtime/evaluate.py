"""An exported ONNX artifact scored on ground truth in standard files, without torch: numpy, PIL,
ONNX Runtime, and pycocotools for box AP (evaluate_onnx.py's body, commands/evaluate_onnx.py).

Detection: COCO instances (box AP). Panoptic: COCO panoptic PNG + JSON (PQ). Semantic segmentation:
COCO panoptic files read as classes, or label PNGs named as the images (mIoU).

What it reads of the artifact is its description (`<artifact>.json`: the task, the pre-processing,
label -> category id, the fusion settings); runtime.model opens it after the safety checks. For a
segmenter on COCO panoptic ground truth, a pixel's class is its segment's category through the
description's `label_of_category` (void and crowd ignored), resized as the evaluation transform
resizes masks. The report: the metrics, the latency per image at batch 1, the torch modules
imported (none), and for a detector its detections in the COCO results format ("results").
"""
import contextlib
import io
import json
import os
import sys
import time

import numpy as np
from PIL import Image

from engine.errors import ArtifactError, DataError, MissingData, UserError
from engine.paths import join_inside
from runtime.model import OnnxArtifact, nearest
from runtime.panoptic import fuse, pq_image, pq_summary, read_ids, summary_metrics
from runtime.segmentation import IGNORE_INDEX, confusion_counts, segmentation_metrics

COCO_STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def read_json(path, what):
    if not os.path.isfile(path):
        raise MissingData(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


class Timed:
    """The artifact's run() with the seconds of each call kept (latency at batch 1)."""

    def __init__(self, artifact):
        self.artifact, self.seconds = artifact, []

    def __call__(self, *arrays):
        tick = time.perf_counter()
        out = self.artifact.run(*arrays)
        self.seconds.append(time.perf_counter() - tick)
        return out


def detection(artifact, run, images, coco_gt, limit=None):
    """COCO box AP of a detector: SSD's padded batch outputs or a two-stage detector's one image."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    if not os.path.isfile(coco_gt):
        raise MissingData(f"COCO instances (--coco-gt) not found: {coco_gt}")
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(coco_gt)
    to_cat = {int(k): v for k, v in artifact.spec.get("label_to_category_id", {}).items()}
    results, ids = [], sorted(gt.getImgIds())[:limit]
    for image_id in ids:
        name = gt.imgs[image_id]["file_name"]
        x, _ = artifact.image(join_inside(images, name, f"{coco_gt}: image {image_id}: file_name", resolve=False))
        boxes, scores, labels = run(x)[:3]
        if boxes.ndim == 3:  # a batch of one, padded with label 0
            boxes, scores, labels = boxes[0], scores[0], labels[0]
        for (x0, y0, x1, y1), s, k in zip(boxes.tolist(), scores.tolist(), labels.tolist()):
            if k > 0:
                results.append({"image_id": image_id, "category_id": to_cat.get(int(k), int(k)),
                                "bbox": [x0, y0, x1 - x0, y1 - y0], "score": s})
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator = COCOeval(gt, gt.loadRes(results) if results else COCO(), "bbox")
        evaluator.params.imgIds = ids
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {"images": len(ids), "detections": len(results),
            "metrics": {f"bbox/{k}": float(v) for k, v in zip(COCO_STATS, evaluator.stats)}, "results": results}


def panoptic_ground_truth(gt_json, limit=None):
    """(annotations, file name by image id, categories) of a COCO panoptic file."""
    gt = read_json(gt_json, "panoptic ground truth")
    if not isinstance(gt, dict) or any(k not in gt for k in ("annotations", "categories", "images")):
        raise DataError(f"{gt_json}: not a COCO panoptic file (needs images, annotations, categories)")
    files = {im["id"]: im["file_name"] for im in gt["images"]}
    annotations = sorted(gt["annotations"], key=lambda a: a["image_id"])[:limit]
    return annotations, files, gt["categories"]


def panoptic(artifact, run, images, gt_json, gt_folder, limit=None):
    """PQ of a Panoptic FPN artifact: its graph, then runtime.panoptic.fuse, against COCO panoptic files."""
    annotations, files, categories = panoptic_ground_truth(gt_json, limit)
    cat_index = {c["id"]: i for i, c in enumerate(categories)}
    stats = np.zeros((len(categories), 4))
    for ann in annotations:
        where = f"{gt_json}: image {ann['image_id']}"
        x, _ = artifact.image(join_inside(images, files[ann["image_id"]], f"{where}: file_name", resolve=False))
        ids, segments = fuse(run(x), artifact.spec, artifact.path)
        gt_ids = read_ids(join_inside(gt_folder, ann["file_name"], f"{where}: PNG file_name", resolve=False))
        stats += pq_image(gt_ids, ann["segments_info"], ids, segments, cat_index, ann["image_id"])
    summary = pq_summary(stats, categories)
    return {"images": len(annotations), "metrics": {f"panoptic/{k}": v for k, v in summary_metrics(summary).items()},
            "panoptic": summary}


def segmentation(artifact, run, images, gt_json=None, gt_folder=None, masks=None, limit=None):
    """mIoU of a segmenter at the size its graph sees, the ground truth resized as a mask ("nearest")."""
    classes = artifact.spec.get("classes") or []
    num_classes = len(classes)
    if gt_json:
        annotations, files, _ = panoptic_ground_truth(gt_json, limit)
        of_category = artifact.spec.get("preprocessing", {}).get("label_of_category") or \
            artifact.spec.get("postprocessing", {}).get("label_of_category")
        if not of_category:
            raise ArtifactError(f"{artifact.path}: its description has no label_of_category, so COCO panoptic ground "
                                f"truth cannot be read as its classes; give --masks")
        lut = {int(k): int(v) for k, v in of_category.items()}
        items = [(files[a["image_id"]], a) for a in annotations]
    else:
        items = sorted((f, None) for f in os.listdir(masks) if f.endswith(".png"))[:limit]
    counts = np.zeros((num_classes, num_classes), np.int64)
    for name, ann in items:
        if ann is not None:
            where = f"{gt_json}: image {ann['image_id']}"
            ids = read_ids(join_inside(gt_folder, ann["file_name"], f"{where}: PNG file_name", resolve=False))
            target = np.full(ids.shape, IGNORE_INDEX, np.int64)
            for s in ann["segments_info"]:
                if not s.get("iscrowd", 0):
                    target[ids == s["id"]] = lut[s["category_id"]]
            image = join_inside(images, name, f"{where}: file_name", resolve=False)
        else:
            with Image.open(os.path.join(masks, name)) as f:
                target = np.asarray(f, dtype=np.int64)
            stem = os.path.splitext(name)[0]
            found = [f for f in os.listdir(images) if os.path.splitext(f)[0] == stem]
            if not found:
                raise MissingData(f"{os.path.join(masks, name)}: no image named {stem}.* in {images}")
            image = os.path.join(images, found[0])
        x, (height, width) = artifact.image(image)
        logits = run(x)[0]
        pred = logits[0].argmax(0) if logits.ndim == 4 else logits.argmax(0)
        counts += confusion_counts(pred, nearest(target, height, width), num_classes)
    metrics, iou = segmentation_metrics(counts)
    return {"images": len(items), "metrics": metrics,
            "per_class_iou": dict(zip(map(str, classes), iou))}


def evaluate(args):
    """The report of args (evaluate_onnx.py's parsed arguments)."""
    artifact = OnnxArtifact(args.artifact, args.trust_artifact, args.threads)
    run = Timed(artifact)
    task = artifact.task
    if task == "detection":
        if not args.coco_gt:
            raise UserError("a detector is scored on COCO instances: give --coco-gt")
        result = detection(artifact, run, args.images, args.coco_gt, args.limit)
    elif task == "panoptic":
        if not (args.panoptic_gt_json and args.panoptic_gt_folder):
            raise UserError("a panoptic model is scored on COCO panoptic files: give --panoptic-gt-json and "
                            "--panoptic-gt-folder")
        result = panoptic(artifact, run, args.images, args.panoptic_gt_json, args.panoptic_gt_folder, args.limit)
    elif task == "semantic_segmentation":
        if not (args.masks or (args.panoptic_gt_json and args.panoptic_gt_folder)):
            raise UserError("a segmenter is scored on label PNGs (--masks) or COCO panoptic files "
                            "(--panoptic-gt-json, --panoptic-gt-folder)")
        result = segmentation(artifact, run, args.images, args.panoptic_gt_json, args.panoptic_gt_folder,
                              args.masks, args.limit)
    else:
        raise ArtifactError(f"{args.artifact}: task {task!r}: this evaluation scores detection, "
                            f"semantic_segmentation and panoptic artifacts; use evaluate.py --artifact")
    latency = sorted(run.seconds[1:] or run.seconds)  # the first call includes ONNX Runtime's warm-up
    imported = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in ("torch", "torchvision"))
    return {"artifact": os.path.abspath(args.artifact), "task": task, "model": artifact.spec.get("model"), **result,
            "latency_ms_batch1": {"median": 1000 * latency[len(latency) // 2] if latency else None},
            "imported_torch": imported}
