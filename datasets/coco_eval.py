"""COCO evaluation: bbox (and segm when masks are predicted), results files, reports.

pycocotools is the reference; `faster-coco-eval` is used as the fast backend when installed
(backend="auto"), and both give the same 12 numbers (tests/test_coco_eval.py). The 12 stats are
reported as fractions (0-1) under the keys of STAT_KEYS, per IoU type:
{"bbox": {"AP": 0.251, ...}, "segm": {...}}.
"""
import contextlib
import copy
import io
import json
import math
import os

import numpy as np
import torch

from datasets.base import DataError, MissingData
from engine import dist
from engine.config import ConfigError
from engine.evaluation import Evaluator, ResultsScorer
from engine.registry import SCORERS
from engine.errors import UserError

STAT_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
IOU_TYPES = ("bbox", "segm")


class ResultsError(UserError, ValueError):
    """A results file that does not fit the annotations it is scored against."""


def resolve_backend(backend="auto"):
    if backend not in ("auto", "pycocotools", "faster_coco_eval"):
        raise ConfigError(f"COCO eval backend: expected auto, pycocotools or faster_coco_eval, got {backend!r}")
    if backend == "auto":
        try:
            import faster_coco_eval  # noqa: F401
            return "faster_coco_eval"
        except ImportError:
            return "pycocotools"
    return backend


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def load_gt(path_or_dataset, backend="pycocotools"):
    """A COCO ground-truth object of the backend from a json path or an already-loaded dict."""
    if backend == "faster_coco_eval":
        from faster_coco_eval import COCO
    else:
        from pycocotools.coco import COCO
    with _quiet():
        if isinstance(path_or_dataset, dict):
            gt = COCO()
            gt.dataset = path_or_dataset
            gt.createIndex()
            return gt
        return COCO(path_or_dataset)


def _load_res(gt, detections, backend):
    """Detections as pycocotools' loadRes makes them, whichever backend scores them: the reference
    takes a detection's area from its bbox when it has one, also for segm (faster-coco-eval's
    loadRes takes it from the mask, which moves APs/APm)."""
    if not detections:  # an empty results set, scored as AP 0 (not a crash)
        return load_gt({"images": list(gt.dataset["images"]), "categories": copy.deepcopy(gt.dataset["categories"]),
                        "annotations": []}, backend)
    images = load_gt({"images": gt.dataset["images"], "categories": gt.dataset["categories"], "annotations": []})
    with _quiet():
        res = images.loadRes(copy.deepcopy(detections))
    return res if backend == "pycocotools" else load_gt(res.dataset, backend)


def run_cocoeval(gt, detections, iou_type, backend, img_ids=None):
    """COCOeval on detections (COCO results dicts); returns (12 stats, per-category rows)."""
    if backend == "faster_coco_eval":
        from faster_coco_eval import COCOeval_faster as COCOeval
    else:
        from pycocotools.cocoeval import COCOeval
    dt = _load_res(gt, detections, backend)
    kwargs = {"print_function": lambda *a, **k: None} if backend == "faster_coco_eval" else {}
    with _quiet():
        E = COCOeval(gt, dt, iou_type, **kwargs)
        if img_ids is not None:
            E.params.imgIds = sorted(img_ids)
        E.evaluate()
        E.accumulate()
        E.summarize()
    stats = {k: float(v) for k, v in zip(STAT_KEYS, E.stats)}
    precision = np.asarray(E.eval["precision"])  # [iou thresholds, recall, category, area, max dets]
    cats = {c["id"]: c["name"] for c in gt.dataset["categories"]}
    img_set = set(E.params.imgIds)
    rows = []
    for k, cat_id in enumerate(E.params.catIds):
        p = precision[:, :, k, 0, -1]
        p50 = precision[0, :, k, 0, -1]
        num_gt = sum(1 for a in gt.dataset["annotations"] if a["category_id"] == cat_id
                     and a["image_id"] in img_set and not a.get("iscrowd", 0))
        cat_id = int(cat_id)
        rows.append({"id": cat_id, "name": cats.get(cat_id, str(cat_id)), "num_gt": num_gt,
                     "AP": float(p[p > -1].mean()) if (p > -1).any() else None,
                     "AP50": float(p50[p50 > -1].mean()) if (p50 > -1).any() else None})
    return stats, rows


def evaluate_results(gt, detections, iou_types=("bbox",), backend="auto", img_ids=None):
    """Report dict for detections in COCO results format against a COCO object or dataset dict."""
    backend = resolve_backend(backend)
    if isinstance(gt, (str, dict)):
        gt = load_gt(gt, backend)
    elif backend == "faster_coco_eval" and not type(gt).__module__.startswith("faster_coco_eval"):
        gt = load_gt(gt.dataset, backend)
    report = {"metrics": {}, "per_category": {}, "backend": backend}
    for iou_type in iou_types:
        if iou_type not in IOU_TYPES:
            raise ConfigError(f"iou type must be one of {IOU_TYPES}, got {iou_type!r}")
        keys = ("image_id", "category_id", "score", "bbox") + (("segmentation",) if iou_type == "segm" else ())
        dets = [{k: v for k, v in d.items() if k in keys} for d in detections]
        stats, rows = run_cocoeval(gt, dets, iou_type, backend, img_ids)
        report[iou_type] = stats
        report["per_category"][iou_type] = rows
        report["metrics"].update({f"{iou_type}/{k}": v for k, v in stats.items()})
    ids = set(img_ids) if img_ids is not None else set(gt.getImgIds())
    report.update(num_images=len(ids), num_detections=len(detections),
                  num_gt_instances=sum(1 for a in gt.dataset["annotations"]
                                       if a["image_id"] in ids and not a.get("iscrowd", 0)),
                  iou_types=list(iou_types))
    return report


def report_markdown(report):
    lines = [f"COCO evaluation ({report.get('backend')}) on {report['num_images']} images, "
             f"{report['num_gt_instances']} ground-truth instances, {report['num_detections']} detections", ""]
    iou_types = [t for t in IOU_TYPES if t in report]
    lines += ["| metric | " + " | ".join(iou_types) + " |", "|---|" + "---|" * len(iou_types)]
    for k in STAT_KEYS:
        lines.append(f"| {k} | " + " | ".join(f"{100 * report[t][k]:.1f}" for t in iou_types) + " |")
    lines += ["", "Numbers in %; -100.0 means undefined (no ground truth in that range).", ""]
    for t in iou_types:
        lines += [f"Per-category AP ({t}, %)", "", "| id | category | GT instances | AP | AP50 |",
                  "|---|---|---|---|---|"]
        for r in report["per_category"][t]:
            fmt = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
            lines.append(f"| {r['id']} | {r['name']} | {r['num_gt']} | {fmt(r['AP'])} | {fmt(r['AP50'])} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- results files

def _finite(values):
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def validate_results(detections, gt, iou_types, source="results"):
    """Raise ResultsError with a clear message when detections do not fit the annotations."""
    if not isinstance(detections, list):
        raise ResultsError(f"{source}: expected a JSON list of detections "
                           f"({{image_id, category_id, bbox: [x, y, w, h], score}}), got {type(detections).__name__}")
    images = {img["id"]: img for img in gt.dataset["images"]}
    cats = {c["id"] for c in gt.dataset["categories"]}
    bad_images, bad_cats = {}, {}  # unknown id -> index of the first detection with it
    for i, d in enumerate(detections):
        where = f"{source}: detection {i}"
        if not isinstance(d, dict):
            raise ResultsError(f"{where}: expected an object, got {d!r:.80}")
        for key in ("image_id", "category_id", "score"):
            if key not in d:
                raise ResultsError(f"{where}: missing '{key}' ({json.dumps(d)[:120]})")
        if not _finite([d["score"]]):
            raise ResultsError(f"{where}: score must be a finite number, got {d['score']!r}")
        for key in ("image_id", "category_id"):
            if not isinstance(d[key], (int, str)) or isinstance(d[key], bool):
                raise ResultsError(f"{where}: '{key}' must be an id (an integer), got {d[key]!r:.80}")
        if d["image_id"] not in images:
            bad_images.setdefault(d["image_id"], i)
            continue
        if d["category_id"] not in cats:
            bad_cats.setdefault(d["category_id"], i)
        if "bbox" in iou_types:
            b = d.get("bbox")
            if not (isinstance(b, list) and len(b) == 4 and _finite(b)):
                raise ResultsError(f"{where}: 'bbox' must be [x, y, width, height] (4 finite numbers), got {b!r:.80}")
            if b[2] < 0 or b[3] < 0:
                raise ResultsError(f"{where}: malformed bbox {b}: negative width or height "
                                   f"(COCO boxes are [x, y, width, height], not [x1, y1, x2, y2])")
        if "segm" in iou_types:
            s = d.get("segmentation")
            img = images[d["image_id"]]
            if isinstance(s, dict):
                if list(s.get("size", [])) != [img["height"], img["width"]] or "counts" not in s:
                    raise ResultsError(f"{where}: RLE segmentation size {s.get('size')} does not match image "
                                       f"{d['image_id']} ({img['height']}x{img['width']}), or no 'counts'")
            elif not (isinstance(s, list) and s and all(isinstance(p, list) and len(p) >= 6 and _finite(p)
                                                        for p in s)):
                raise ResultsError(f"{where}: 'segmentation' must be an RLE {{size, counts}} or a list of "
                                   f"polygons for iou type segm, got {str(s)[:80]}")
    if bad_images:
        first = min(bad_images.values())
        raise ResultsError(f"{source}: detections refer to {len(bad_images)} image id(s) that are not in the "
                           f"annotations, e.g. {sorted(bad_images, key=str)[:5]} (first: detection {first}, image_id "
                           f"{detections[first]['image_id']}; annotations have "
                           f"{len(images)} images, ids like {sorted(images)[:3]}): is this the results file of "
                           f"another split or data set?")
    if bad_cats:
        first = min(bad_cats.values())
        raise ResultsError(f"{source}: detections use category id(s) {sorted(bad_cats, key=str)[:10]} that are "
                           f"not in the annotations (first: detection {first}, category_id "
                           f"{detections[first]['category_id']}; known: {sorted(cats)[:10]}{'...' if len(cats) > 10 else ''}); "
                           f"were contiguous labels written instead of COCO category ids?")


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: not valid JSON: {e}") from None


def score_results_file(gt_path, results_path, iou_types=("bbox",), backend="auto"):
    """Score an existing COCO results file (any tool's) against an annotations file."""
    for path, what in ((gt_path, "annotations (--coco-gt)"), (results_path, "results (--coco-results)")):
        if not os.path.isfile(path):
            raise MissingData(f"{what} file not found: {path}")
    gt_data = _read_json(gt_path)
    if not isinstance(gt_data, dict) or not all(k in gt_data for k in ("images", "annotations", "categories")):
        raise ResultsError(f"{gt_path}: not a COCO annotations file (needs images, annotations, categories)")
    detections = _read_json(results_path)
    backend = resolve_backend(backend)
    try:
        gt = load_gt(gt_data, backend)
    except (KeyError, TypeError, ValueError) as e:  # a record without id / image_id / category_id
        raise ResultsError(f"{gt_path}: malformed COCO annotations ({type(e).__name__}: {e})") from None
    validate_results(detections, gt, iou_types, results_path)
    report = evaluate_results(gt, detections, iou_types, backend)
    report["files"] = {"coco_gt": os.path.abspath(gt_path), "coco_results": os.path.abspath(results_path)}
    return report


@SCORERS.register("coco")
class CocoResultsScorer(ResultsScorer):
    """evaluate.py --coco-gt annotations.json --coco-results detections.json [--iou-types bbox segm]"""

    options = (("--coco-gt", {"help": "COCO annotations json: with --coco-results, score a results file "
                                      "without a model"}),
               ("--coco-results", {"help": "COCO results json (list of {image_id, category_id, bbox, score"
                                           "[, segmentation]})"}),
               ("--iou-types", {"nargs": "+", "default": ["bbox"], "choices": list(IOU_TYPES),
                                "help": "with --coco-results: IoU types to score (default: bbox)"}))

    def score(self, args):
        if not (args.coco_gt and args.coco_results):
            raise UserError("--coco-gt and --coco-results go together")
        report = score_results_file(args.coco_gt, args.coco_results, args.iou_types)
        markdown = (f"# Evaluation report\n\n- annotations: `{args.coco_gt}`\n- results: `{args.coco_results}`"
                    f"\n\n" + report_markdown(report))
        return report, markdown, os.path.dirname(os.path.abspath(args.coco_results))


# ---------------------------------------------------------------- the evaluator of the loop

def _drawable(box):
    return isinstance(box, (list, tuple)) and len(box) == 4 and _finite(box) and box[2] >= 0 and box[3] >= 0


def _rle(mask):
    from pycocotools import mask as mask_utils
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    rle["counts"] = rle["counts"].decode("ascii")
    return rle


class CocoEvaluator(Evaluator):
    """update(predictions, targets): torchvision detection dicts (boxes XYXY in image pixels,
    labels 1..K, scores, optional masks) and targets with image_id. Labels map back to COCO
    category ids through label_to_cat."""

    def __init__(self, coco_gt, label_to_cat, backend="auto", img_folder=None, num_draw=4, draw_score=0.3,
                 mask_threshold=0.5):
        self.coco_gt, self.label_to_cat = coco_gt, dict(label_to_cat)
        self.backend = resolve_backend(backend)
        self.img_folder, self.num_draw, self.draw_score = img_folder, num_draw, draw_score
        self.mask_threshold = mask_threshold
        self.detections, self.image_ids, self.has_masks = [], [], False
        self._cache = self._all = None

    def update(self, predictions, targets):
        self._cache = self._all = None
        for pred, target in zip(predictions, targets):
            image_id = int(target["image_id"])
            self.image_ids.append(image_id)
            boxes = pred["boxes"].detach().float().cpu()
            scores = pred["scores"].detach().float().cpu().tolist()
            labels = pred["labels"].detach().cpu().tolist()
            masks = pred.get("masks")
            if masks is not None:
                self.has_masks = True
                masks = masks.detach().cpu()
                masks = masks[:, 0] if masks.dim() == 4 else masks
                masks = (masks > self.mask_threshold if masks.is_floating_point() else masks.bool()).numpy()
            xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist()
            for i, (box, score, label) in enumerate(zip(xywh, scores, labels)):
                if label not in self.label_to_cat:
                    raise ConfigError(f"the model predicted label {label}, which maps to no category "
                                      f"(labels {min(self.label_to_cat)}..{max(self.label_to_cat)}): "
                                      f"does model.num_classes fit the data set?")
                det = {"image_id": image_id, "category_id": self.label_to_cat[label], "bbox": box,
                       "score": score}
                if masks is not None:
                    det["segmentation"] = _rle(masks[i])
                self.detections.append(det)

    def _gathered(self):
        # gathered from every process once: later calls (report, save_artifacts) may run on rank 0 only
        if self._all is None:
            self._all = (dist.all_gather_list(self.detections), dist.all_gather_list(self.image_ids))
        return self._all

    def report(self):
        if self._cache is None:
            detections, image_ids = self._gathered()
            if not image_ids:
                raise DataError("evaluation saw no images: is the validation split empty?")
            iou_types = ("bbox", "segm") if self.has_masks else ("bbox",)
            self._cache = evaluate_results(self.coco_gt, detections, iou_types, self.backend, set(image_ids))
        return copy.deepcopy(self._cache)

    def compute(self):
        return self.report()["metrics"]

    def metric_names(self):
        return [f"{iou_type}/{k}" for iou_type in IOU_TYPES for k in STAT_KEYS]  # segm when masks are predicted

    def markdown(self, report):
        return report_markdown(report)

    def save_artifacts(self, folder):
        """detections.json in COCO results format (category ids, [x, y, w, h]), for any tool."""
        detections, _ = self._gathered()
        path = os.path.join(folder, "detections.json")
        if dist.is_main():
            with open(path, "w") as f:
                json.dump(detections, f)
        return {"detections": path}

    def draw(self, max_images=None):
        """[(image_id, uint8 image [3,H,W] with GT boxes in green and predictions in red)]."""
        from PIL import Image
        from torchvision.utils import draw_bounding_boxes
        if not self.img_folder:
            return []
        names = {c["id"]: c["name"] for c in self.coco_gt.dataset["categories"]}
        out = []
        for image_id in self.image_ids[: max_images or self.num_draw]:
            info = self.coco_gt.imgs[image_id]
            path = os.path.join(self.img_folder, info["file_name"])
            if not os.path.isfile(path):
                continue
            image = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
            gt = [a for a in self.coco_gt.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
            dets = [d for d in self.detections if d["image_id"] == image_id and d["score"] >= self.draw_score]
            for items, colour, fmt in ((gt, "lime", "{name}"), (dets, "red", "{name} {score:.2f}")):
                # only boxes that can be drawn: finite, [x, y, w, h] with w, h >= 0 (the loader drops
                # the others from training too)
                items = [a for a in items if _drawable(a.get("bbox"))]
                if not items:
                    continue
                b = torch.tensor([a["bbox"] for a in items], dtype=torch.float)
                b[:, 2:] += b[:, :2]
                labels = [fmt.format(name=names.get(a["category_id"], a["category_id"]), score=a.get("score", 0))
                          for a in items]
                image = draw_bounding_boxes(image, b, labels, colors=colour, width=2)
            out.append((image_id, image))
        return out

    def log_extras(self, writer, step, prefix):
        for i, (image_id, image) in enumerate(self.draw()):
            writer.add_image(f"{prefix}/detections_{i}", image, step)  # green: ground truth, red: predicted
