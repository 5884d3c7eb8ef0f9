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
from PIL import Image
from pycocotools import mask as mask_utils

from engine import dist
from engine.config import ConfigError
from engine.evaluation import Evaluator, ResultsScorer
from engine.paths import join_inside
from engine.registry import SCORERS
from engine.errors import DataError, MissingData, UserError
from engine.report import fmt, headline_markdown
from engine.report.plots import rgb
from evaluators import detection_analysis

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


def run_cocoeval(gt, detections, iou_type, backend, img_ids=None, analysis=None):
    """COCOeval on detections (COCO results dicts); returns (12 stats, per-category rows), and with
    analysis (a dict of evaluators.detection_analysis.sections options) also the analysis sections."""
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
    if analysis is None:
        return stats, rows
    return stats, rows, analysis_sections(gt, dt, E, backend, iou_type, **analysis)


def _to_rle(segm, height, width):
    if isinstance(segm, list):  # polygons
        return mask_utils.merge(mask_utils.frPyObjects(segm, height, width))
    if isinstance(segm.get("counts"), list):  # uncompressed RLE
        return mask_utils.frPyObjects(segm, height, width)
    return segm


def _evalimgs_matches(E):
    """pycocotools' own matching at IoU 0.5 (area all, the last max-detections) from its evalImgs:
    ({det id: gt id} of the true positives, {det ids it ignored: matched to a crowd region})."""
    matched, ignored = {}, set()
    p = E.params
    area = next(i for i, a in enumerate(p.areaRng) if a[0] <= 0 and a[1] >= 1e10)
    n_img, n_area = len(p.imgIds), len(p.areaRng)
    for k in range(len(p.catIds)):
        for e in E.evalImgs[k * n_area * n_img + area * n_img:k * n_area * n_img + (area + 1) * n_img]:
            if e is None:
                continue
            for d, g, ign in zip(e["dtIds"], e["dtMatches"][0], e["dtIgnore"][0]):
                if ign:
                    ignored.add(d)
                elif g > 0:
                    matched[d] = int(g)
    return matched, ignored


def greedy_matches(iou, det_class, det_score, gt_class, crowd, threshold=0.5):
    """COCOeval.evaluateImg's matching in one image at one IoU threshold (area all), for backends
    that do not expose it (faster-coco-eval reports the union over thresholds): per class, detections
    by score, each takes the unmatched box of its class with the highest IoU >= threshold, crowd
    regions last (and reusable). -> (match [D]: gt index or -1, ignored [D]: matched a crowd region).
    iou [D, G] is computed with iscrowd=crowd (a crowd region's IoU is over the detection's area)."""
    match = np.full(len(det_class), -1, np.int64)
    ignored = np.zeros(len(det_class), bool)
    for c in np.unique(det_class):
        dets = np.flatnonzero(det_class == c)
        dets = dets[np.argsort(-det_score[dets], kind="mergesort")]
        gts = np.flatnonzero(gt_class == c)
        gts = gts[np.argsort(crowd[gts], kind="mergesort")]  # crowd regions last
        if not len(gts):
            continue
        sub = iou[np.ix_(dets, gts)].tolist()
        is_crowd = crowd[gts].tolist()
        taken = [False] * len(gts)
        for row, d in zip(sub, dets):
            best, m = min(threshold, 1 - 1e-10), -1
            for g, value in enumerate(row):
                if taken[g] and not is_crowd[g]:
                    continue
                if m > -1 and not is_crowd[m] and is_crowd[g]:
                    break
                if value < best:
                    continue
                best, m = value, g
            if m > -1:
                taken[m] = True
                match[d], ignored[d] = gts[m], is_crowd[m]
    return match, ignored


def analysis_sections(gt, dt, E, backend, iou_type, score_threshold=0.3, num_worst=8):
    """The detection analysis (evaluators.detection_analysis) of one finished COCOeval: COCO's matching at IoU
    0.5 (pycocotools' evalImgs; the same rule re-run on faster-coco-eval), its accumulated precision,
    and the IoU of every detection with every box of its image (any class)."""
    p = E.params
    img_pos = {int(i): n for n, i in enumerate(p.imgIds)}
    cat_pos = {int(c): n for n, c in enumerate(p.catIds)}
    images = {im["id"]: im for im in gt.dataset["images"]}
    names = {c["id"]: c["name"] for c in gt.dataset["categories"]}
    anns = [a for a in gt.dataset["annotations"] if a["image_id"] in img_pos and a["category_id"] in cat_pos]
    dets = [d for d in (dt.dataset.get("annotations") or [])
            if d["image_id"] in img_pos and d["category_id"] in cat_pos]
    # COCO scores the best max-detections per image and category (score descending, stable)
    order = sorted(range(len(dets)), key=lambda i: (dets[i]["image_id"], dets[i]["category_id"], -dets[i]["score"]))
    kept, run, last = [], 0, None
    for i in order:
        key = (dets[i]["image_id"], dets[i]["category_id"])
        run, last = (run + 1 if key == last else 1), key
        if run <= p.maxDets[-1]:
            kept.append(i)
    dets = [dets[i] for i in sorted(kept)]
    geom = "bbox" if iou_type == "bbox" else "segmentation"

    def shape(a):
        im = images[a["image_id"]]
        return a[geom] if geom == "bbox" else _to_rle(a[geom], im["height"], im["width"])

    det_image = np.array([img_pos[d["image_id"]] for d in dets], np.int64)
    ann_image = np.array([img_pos[a["image_id"]] for a in anns], np.int64)
    det_class = np.array([cat_pos[d["category_id"]] for d in dets], np.int64)
    ann_class = np.array([cat_pos[a["category_id"]] for a in anns], np.int64)
    det_score = np.array([d["score"] for d in dets], np.float64)
    crowd = np.array([bool(a.get("iscrowd", 0)) for a in anns], bool)
    det_groups = detection_analysis.group(det_image, len(img_pos))
    ann_groups = detection_analysis.group(ann_image, len(img_pos))
    ious, match, ignored = [], np.full(len(dets), -1, np.int64), np.zeros(len(dets), bool)
    for d_idx, g_idx in zip(det_groups, ann_groups):
        iou = np.zeros((len(d_idx), len(g_idx)))
        if len(d_idx) and len(g_idx):
            d = [shape(dets[i]) for i in d_idx]
            g = [shape(anns[i]) for i in g_idx]
            if geom == "bbox":
                d, g = np.asarray(d, np.float64), np.asarray(g, np.float64)
            iou = np.asarray(mask_utils.iou(d, g, crowd[g_idx].astype(np.uint8).tolist()), np.float64)
            iou = iou.reshape(len(d_idx), len(g_idx))
            if backend != "pycocotools":
                mt, ig = greedy_matches(iou, det_class[d_idx], det_score[d_idx], ann_class[g_idx], crowd[g_idx])
                match[d_idx] = np.where(mt >= 0, g_idx[np.maximum(mt, 0)], -1)
                ignored[d_idx] = ig
        ious.append(iou)
    if backend == "pycocotools":
        by_id, ign = _evalimgs_matches(E)
        ann_pos = {a["id"]: n for n, a in enumerate(anns)}
        match = np.array([ann_pos.get(by_id.get(d["id"]), -1) for d in dets], np.int64)
        ignored = np.array([d["id"] in ign for d in dets], bool)
    # the analysed set: detections not ignored, boxes that are not crowd regions
    det_new = np.cumsum(~ignored) - 1
    gt_new = np.cumsum(~crowd) - 1
    det_keep, gt_keep = np.flatnonzero(~ignored), np.flatnonzero(~crowd)
    m = detection_analysis.Matched(
        len(img_pos), len(cat_pos), det_image[det_keep], det_class[det_keep], det_score[det_keep],
        np.array([gt_new[i] if i >= 0 else -1 for i in match[det_keep]], np.int64),
        ann_image[gt_keep], ann_class[gt_keep],
        [iou[np.ix_(~ignored[d], ~crowd[g])] for iou, d, g in zip(ious, det_groups, ann_groups)],
        [det_new[d[~ignored[d]]] for d in det_groups], [gt_new[g[~crowd[g]]] for g in ann_groups])
    return detection_analysis.sections(
        iou_type, m, [names.get(c, str(c)) for c in cat_pos], E.eval["precision"], p.iouThrs, p.recThrs,
        [int(i) for i in p.imgIds], [list(map(float, anns[i]["bbox"])) for i in gt_keep],
        [list(map(float, dets[i]["bbox"])) for i in det_keep], score_threshold, num_worst)


def evaluate_results(gt, detections, iou_types=("bbox",), backend="auto", img_ids=None, analysis=None):
    """Report dict for detections in COCO results format against a COCO object or dataset dict.
    analysis: None, or options of evaluators.detection_analysis.sections ({} for the defaults): the report gets
    "analysis", a list of sections per IoU type (TIDE errors, PR curves, confusion, calibration, worst
    images)."""
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
        stats, rows, *extra = run_cocoeval(gt, dets, iou_type, backend, img_ids, analysis)
        if extra:
            report.setdefault("analysis", []).extend(extra[0])
        report[iou_type] = stats
        report["per_category"][iou_type] = rows
        report["metrics"].update({f"{iou_type}/{k}": v for k, v in stats.items()})
    ids = set(img_ids) if img_ids is not None else set(gt.getImgIds())
    report.update(num_images=len(ids), num_detections=len(detections),
                  num_gt_instances=sum(1 for a in gt.dataset["annotations"]
                                       if a["image_id"] in ids and not a.get("iscrowd", 0)),
                  iou_types=list(iou_types), main_metric=f"{iou_types[0]}/AP")
    report["headline"] = headline(report)
    return report


def headline(report):
    """The report's first sentences: each IoU type's AP, AP50, AP75, then where AP50 is lost (the TIDE
    sections' "headline", moved here)."""
    lines = []
    for t in report["iou_types"]:
        stats = report[t]
        lines.append(f"{t}: AP {fmt(stats['AP'], 'AP')}, AP50 {fmt(stats['AP50'], 'AP50')}, "
                     f"AP75 {fmt(stats['AP75'], 'AP75')} on {report['num_images']} images with "
                     f"{report['num_gt_instances']} objects ({report['num_detections']} detections)")
        for s in report.get("analysis", []):
            if s["title"].startswith(f"{t}: ") and "headline" in s:
                lines.append(s.pop("headline"))
    return lines


def report_markdown(report):
    """The headline, then COCO's 12 numbers and the per-category AP, in per cent (n/a: undefined)."""
    lines = [headline_markdown(report),
             f"COCO evaluation ({report.get('backend')}) on {report['num_images']} images, "
             f"{report['num_gt_instances']} ground-truth instances, {report['num_detections']} detections", ""]
    iou_types = [t for t in IOU_TYPES if t in report]
    lines += ["| metric | " + " | ".join(iou_types) + " |", "|---|" + "---|" * len(iou_types)]
    for k in STAT_KEYS:
        lines.append(f"| {k} | " + " | ".join(fmt(report[t][k], k) for t in iou_types) + " |")
    lines += ["", "In per cent; n/a: undefined (no ground truth of that size).", ""]
    for t in iou_types:
        lines += [f"Per-category AP ({t}, %)", "", "| id | category | GT instances | AP | AP50 |",
                  "|---|---|---|---|---|"]
        for r in report["per_category"][t]:
            na = "n/a (no ground truth)"
            lines.append(f"| {r['id']} | {r['name']} | {r['num_gt']} | {na if r['AP'] is None else fmt(r['AP'], 'AP')} "
                         f"| {na if r['AP50'] is None else fmt(r['AP50'], 'AP50')} |")
        lines.append("")
    return "\n".join(lines)


def save_worst_images(report, img_folder, report_dir, gt, source="COCO ground truth"):
    """Draw the worst-images sections of a report (ground truth, predictions, errors labelled) into
    report_dir/analysis/; returns the paths written. source: the annotations file, named in errors."""
    names = {im["id"]: im["file_name"] for im in gt.dataset["images"]}
    return [p for s in report.get("analysis", []) if s["title"].endswith("worst images")
            for p in detection_analysis.save_worst_images(s, img_folder, report_dir, names, source)]


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


def score_results_file(gt_path, results_path, iou_types=("bbox",), backend="auto", analysis=None, images=None,
                       report_dir=None):
    """Score an existing COCO results file (any tool's) against an annotations file. analysis:
    options of the analysis sections (None: none); images (the images folder) and report_dir: draw
    the worst images into report_dir/analysis/."""
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
    if images is not None and not os.path.isdir(images):
        raise MissingData(f"images folder (--coco-images) not found: {images}")
    if analysis is not None and not images:
        analysis = {**analysis, "num_worst": 0}  # nothing to draw them on
    report = evaluate_results(gt, detections, iou_types, backend, analysis=analysis)
    report["files"] = {"coco_gt": os.path.abspath(gt_path), "coco_results": os.path.abspath(results_path)}
    if analysis is not None and images and report_dir:
        report["artifacts"] = {f"worst_{i}": p for i, p in
                               enumerate(save_worst_images(report, images, report_dir, gt, gt_path))}
    return report


@SCORERS.register("coco")
class CocoResultsScorer(ResultsScorer):
    """evaluate.py --coco-gt annotations.json --coco-results detections.json [--iou-types bbox segm]"""

    options = (("--coco-gt", {"help": "COCO annotations json: with --coco-results, score a results file "
                                      "without a model"}),
               ("--coco-results", {"help": "COCO results json (list of {image_id, category_id, bbox, score"
                                           "[, segmentation]})"}),
               ("--iou-types", {"nargs": "+", "default": ["bbox"], "choices": list(IOU_TYPES),
                                "help": "with --coco-results: IoU types to score (default: bbox)"}),
               ("--coco-images", {"help": "with --coco-results: the images folder, to draw the worst images of "
                                          "the analysis (report folder/analysis/)"}),
               ("--analysis-score", {"type": float, "default": 0.3,
                                     "help": "with --coco-results: score threshold of the analysis's confusion "
                                             "matrix and worst images (default 0.3)"}),
               ("--no-analysis", {"action": "store_true", "default": False,
                                  "help": "with --coco-results: the 12 COCO numbers only (no error analysis, "
                                          "curves, confusion matrix, calibration)"}))

    def score(self, args):
        if not (args.coco_gt and args.coco_results):
            raise UserError("--coco-gt and --coco-results go together")
        report_dir = args.report_dir or os.path.dirname(os.path.abspath(args.coco_results))
        analysis = None if args.no_analysis else {"score_threshold": args.analysis_score}
        report = score_results_file(args.coco_gt, args.coco_results, args.iou_types, analysis=analysis,
                                    images=args.coco_images, report_dir=report_dir)
        # the files scored are in the appendix (report["files"]): the headline first
        markdown = "# Evaluation report\n\n" + report_markdown(report)
        return report, markdown, os.path.dirname(os.path.abspath(args.coco_results))


# ---------------------------------------------------------------- the evaluator of the loop

def _drawable(box):
    return isinstance(box, (list, tuple)) and len(box) == 4 and _finite(box) and box[2] >= 0 and box[3] >= 0


def _rle(mask):
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    rle["counts"] = rle["counts"].decode("ascii")
    return rle


class CocoEvaluator(Evaluator):
    """update(predictions, targets): torchvision detection dicts (boxes XYXY in image pixels,
    labels 1..K, scores, optional masks) and targets with image_id. Labels map back to COCO
    category ids through label_to_cat."""

    def __init__(self, coco_gt, label_to_cat, backend="auto", img_folder=None, num_draw=4, draw_score=0.3,
                 mask_threshold=0.5, analysis=True, analysis_score=0.3, num_worst=8):
        self.coco_gt, self.label_to_cat = coco_gt, dict(label_to_cat)
        self.backend = resolve_backend(backend)
        self.img_folder, self.num_draw, self.draw_score = img_folder, num_draw, draw_score
        self.mask_threshold = mask_threshold
        # analysis: report() adds the sections of evaluators.detection_analysis (off: the 12 numbers only, e.g.
        # during training); analysis_score: the confusion matrix's and worst images' score threshold
        self.analysis, self.analysis_score, self.num_worst = analysis, analysis_score, num_worst
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
            options = ({"score_threshold": self.analysis_score, "num_worst": self.num_worst if self.img_folder else 0}
                       if self.analysis else None)
            self._cache = evaluate_results(self.coco_gt, detections, iou_types, self.backend, set(image_ids), options)
        return copy.deepcopy(self._cache)

    def compute(self):
        return self.report()["metrics"]

    def set_analysis(self, on):
        if bool(on) != self.analysis:
            self._cache = None
        self.analysis = bool(on)

    def metric_names(self):
        return [f"{iou_type}/{k}" for iou_type in IOU_TYPES for k in STAT_KEYS]  # segm when masks are predicted

    def markdown(self, report):
        return report_markdown(report)

    def save_artifacts(self, folder):
        """detections.json in COCO results format (category ids, [x, y, w, h]), for any tool."""
        detections, _ = self._gathered()
        path = os.path.join(folder, "detections.json")
        out = {"detections": path}
        if dist.is_main():
            with open(path, "w") as f:
                json.dump(detections, f)
            if self.analysis and self.img_folder:  # the worst images the report's sections refer to
                drawn = save_worst_images(self.report(), self.img_folder, folder, self.coco_gt)
                out.update({f"worst_{i}": p for i, p in enumerate(drawn)})
        return out

    def draw(self, max_images=None):
        """[(image_id, uint8 image [3,H,W])]: ground truth dashed green, labelled with its class, predictions
        >= draw_score blue with class and score, labels on a filled background where no other label is
        (detection_analysis.draw_boxes, as the report's worst images)."""
        if not self.img_folder:
            return []
        names = {c["id"]: c["name"] for c in self.coco_gt.dataset["categories"]}
        out = []
        for image_id in self.image_ids[: max_images or self.num_draw]:
            info = self.coco_gt.imgs[image_id]
            path = join_inside(self.img_folder, info["file_name"], f"COCO ground truth: image {image_id!r:.40}: "
                                                                   f"file_name", resolve=False)
            if not os.path.isfile(path):
                continue
            image = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
            gt = [a for a in self.coco_gt.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
            dets = [d for d in self.detections if d["image_id"] == image_id and d["score"] >= self.draw_score]
            # only boxes that can be drawn: finite, [x, y, w, h] with w, h >= 0 (the loader drops the others
            # from training too)
            boxes = ([{"bbox": a["bbox"], "kind": "gt", "label": f"GT {names.get(a['category_id'], a['category_id'])}"}
                      for a in gt if _drawable(a.get("bbox"))]
                     + [{"bbox": d["bbox"], "kind": "det",
                         "label": f"{names.get(d['category_id'], d['category_id'])} {d['score']:.2f}"}
                        for d in sorted(dets, key=lambda d: -d["score"]) if _drawable(d.get("bbox"))])
            out.append((image_id, detection_analysis.draw_boxes(image, boxes)))
        return out

    def log_extras(self, writer, step, prefix):
        for i, (image_id, image) in enumerate(self.draw()):
            writer.add_image(f"{prefix}/detections_{i}", image, step)  # green dashed: ground truth, blue: predicted
        if self.analysis:
            log_analysis(writer, step, prefix, self.report())


def log_analysis(writer, step, prefix, report):
    """TensorBoard: COCO's PR curves (add_pr_curve_raw; overall, and per class at IoU 0.5), the
    confusion matrix as an image, and the scores' ECE, per IoU type."""
    for s in report.get("analysis", []):
        iou_type, _, kind = s["title"].partition(": ")
        if kind == "precision-recall":
            num_gt = {row[0]: row[1] for row in s["tables"][0]["rows"]}
            for plot in s["plots"]:
                for series in plot["series"]:
                    if series["class"] != "all" and series["iou"] != 0.5:
                        continue
                    n = sum(num_gt.values()) if series["class"] == "all" else num_gt.get(series["class"], 0)
                    recall = np.asarray(series["x"], np.float64)[::-1]  # thresholds ascending: recall descending
                    precision = np.asarray(series["y"], np.float64)[::-1]
                    tp = recall * n
                    fp = np.where(precision > 0, tp * (1 - precision) / np.maximum(precision, 1e-12), 0.0)
                    writer.add_pr_curve_raw(f"{prefix}/{iou_type}_PR_IoU{int(series['iou'] * 100)}/{series['class']}",
                                            tp, fp, np.zeros_like(tp), n - tp, precision, recall, step,
                                            num_thresholds=len(tp))
        elif kind == "confusion matrix":
            writer.add_image(f"{prefix}/{iou_type}_confusion", rgb(s["plots"][0]), step, dataformats="HWC")
        elif kind.startswith("calibration"):
            writer.add_scalar(f"{prefix}/{iou_type}_ECE", s["metrics"][f"{iou_type}/calibration/ECE"], step)
