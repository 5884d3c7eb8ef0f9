"""Panoptic quality (PQ, SQ, RQ) exactly as COCO's panopticapi defines it, files in COCO panoptic
format, the evaluator of the loop and evaluate.py's --panoptic-* scoring mode. The arithmetic
(`pq_image`, `pq_summary`, `summary_metrics`) lives torch-free in runtime/panoptic.py, imported here.

The definitions (matching, crowd and void, the All / Things / Stuff means) are in its docstring.
Reported as fractions (0-1).

The evaluator of the loop also scores the semantic branch (the model's `sem_seg` map) against the
data's semantic target with the segmentation family's confusion matrix and metrics (mIoU, pixel
accuracy, summed across processes), over the stuff classes plus one "things" class, as detectron2
scores Panoptic FPN's semantic head: a "stuff" head (which predicts "things", label 0) and an "all"
head (whose thing classes merge into "things") give comparable figures, and they measure what the
panoptic fusion takes from the semantic map.

The analysis (evaluators/segmentation_analysis.py): PQ, SQ and RQ per class as a chart, each class's FP and FN
segment counts, the worst images (lowest per-image PQ) drawn image | ground truth | prediction, and
the semantic branch's IoU bars and confusion matrix.
"""
import io
import json
import os

import numpy as np
import torch
from PIL import Image

from evaluators.segmentation import (IGNORE_INDEX, ConfusionMatrix, report_markdown, segmentation_report,
                                        target_and_prediction)
from evaluators.panoptic_ids import png_bytes, read_ids, rgb_to_id
from engine import dist
from engine.config import ConfigError
from engine.evaluation import Evaluator, ResultsScorer
from engine.paths import OutsideFolder, join_inside
from engine.registry import SCORERS
from engine.report import headline_markdown
from engine.errors import DataError, MissingData, UserError
from evaluators.segmentation_analysis import (Worst, image_pq, iou_section, panoptic_class_section,
                                             panoptic_headline, worst_images_section, worst_of)
# the PQ arithmetic lives torch-free in runtime/panoptic.py (a consumer of an ONNX artifact scores with it)
from runtime.panoptic import OFFSET, PanopticFormatError, pq_image, pq_summary, summary_metrics  # noqa: F401

STAT_NAMES = ("tp", "fp", "fn", "iou")


def summary_markdown(summary, num_images):
    lines = [f"Panoptic quality on {num_images} images (%, COCO panopticapi definition)", "",
             "| | PQ | SQ | RQ | categories |", "|---|---|---|---|---|"]
    for group in ("All", "Things", "Stuff"):
        s = summary[group]
        lines.append(f"| {group} | {100 * s['pq']:.1f} | {100 * s['sq']:.1f} | {100 * s['rq']:.1f} | {s['n']} |")
    lines += ["", "| id | category | thing | PQ | SQ | RQ | TP | FP | FN |", "|---|---|---|---|---|---|---|---|---|"]
    for cat_id, r in summary["per_class"].items():
        lines.append(f"| {cat_id} | {r['name']} | {'yes' if r['isthing'] else 'no'} | {100 * r['pq']:.1f} | "
                     f"{100 * r['sq']:.1f} | {100 * r['rq']:.1f} | {r['tp']} | {r['fp']} | {r['fn']} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- scoring files (no model)

def _read_json(path, what):
    if not os.path.isfile(path):
        raise MissingData(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PanopticFormatError(f"{path}: not valid JSON: {e}") from None


def score_panoptic_files(gt_json, gt_folder, pred_json, pred_folder):
    """panopticapi's pq_compute: every ground-truth image must have a prediction."""
    gt = _read_json(gt_json, "panoptic ground truth (--panoptic-gt-json)")
    pred = _read_json(pred_json, "panoptic predictions (--panoptic-pred-json)")
    for path, data, keys in ((gt_json, gt, ("annotations", "categories")), (pred_json, pred, ("annotations",))):
        if not isinstance(data, dict) or any(k not in data for k in keys):
            raise PanopticFormatError(f"{path}: not a COCO panoptic file (needs {', '.join(keys)})")
    categories = gt["categories"]
    cat_index = {c["id"]: i for i, c in enumerate(categories)}
    predictions = {a["image_id"]: a for a in pred["annotations"]}
    stats = np.zeros((len(categories), 4))
    for ann in gt["annotations"]:
        image_id = ann["image_id"]
        if image_id not in predictions:
            raise PanopticFormatError(f"{pred_json}: ground-truth image {image_id} has no prediction")
        p = predictions[image_id]
        gt_png, pred_png = (join_inside(folder, a.get("file_name"), f"{path}: annotation of image {image_id!r:.40}: "
                                                                    f"file_name", resolve=False)
                            for folder, a, path in ((gt_folder, ann, gt_json), (pred_folder, p, pred_json)))
        stats += pq_image(read_ids(gt_png), ann["segments_info"], read_ids(pred_png), p["segments_info"], cat_index,
                          image_id)
    summary = pq_summary(stats, categories)
    return {"metrics": summary_metrics(summary), "panoptic": summary, "num_images": len(gt["annotations"]),
            "main_metric": "PQ", "headline": panoptic_headline(summary, len(gt["annotations"])),
            "files": {k: os.path.abspath(v) for k, v in (("gt_json", gt_json), ("gt_folder", gt_folder),
                                                          ("pred_json", pred_json), ("pred_folder", pred_folder))}}


@SCORERS.register("panoptic")
class PanopticResultsScorer(ResultsScorer):
    """evaluate.py --panoptic-gt-json G.json --panoptic-gt-folder GDIR --panoptic-pred-json P.json
    --panoptic-pred-folder PDIR: PQ of any tool's COCO panoptic predictions."""

    options = (("--panoptic-gt-json", {"help": "COCO panoptic ground truth json (panoptic_val2017.json)"}),
               ("--panoptic-gt-folder", {"help": "its PNG folder (annotations/panoptic_val2017/)"}),
               ("--panoptic-pred-json", {"help": "predictions json in COCO panoptic format ({annotations: "
                                                 "[{image_id, file_name, segments_info}]})"}),
               ("--panoptic-pred-folder", {"help": "the predictions' PNG folder"}))

    def score(self, args):
        paths = [args.panoptic_gt_json, args.panoptic_gt_folder, args.panoptic_pred_json, args.panoptic_pred_folder]
        if not all(paths):
            raise UserError("--panoptic-gt-json, --panoptic-gt-folder, --panoptic-pred-json and "
                             "--panoptic-pred-folder go together")
        report = score_panoptic_files(*paths)
        # the files scored are in the appendix (report["files"]): the headline first
        markdown = ("# Evaluation report\n\n" + headline_markdown(report)
                    + summary_markdown(report["panoptic"], report["num_images"]))
        return report, markdown, os.path.dirname(os.path.abspath(args.panoptic_pred_json))


# ---------------------------------------------------------------- the evaluator of the loop

def colorize(ids, segments, colours, void=(0, 0, 0)):
    """uint8 [3, H, W]: each segment in its category's colour, things varied per instance."""
    ids = np.asarray(ids)
    uniq, inverse = np.unique(ids, return_inverse=True)
    by_id = {int(s["id"]): s for s in segments}
    palette = np.zeros((len(uniq), 3), np.int64)
    for k, i in enumerate(uniq.tolist()):
        s = by_id.get(i)
        if s is None or s.get("iscrowd", 0):
            palette[k] = void
            continue
        colour = np.array(colours.get(s["category_id"], (128, 128, 128)))
        if s.get("isthing", False):
            colour = colour + np.random.default_rng(i).integers(-50, 51, size=3)
        palette[k] = np.clip(colour, 0, 255)
    image = palette[inverse.reshape(ids.shape)].astype(np.uint8)
    return torch.from_numpy(image).permute(2, 0, 1)


class PanopticEvaluator(Evaluator):
    """PQ of the model's `panoptic` + `segments_info` outputs (contiguous labels, mapped back to
    category ids by label_to_cat) against COCO panoptic ground truth (its JSON and PNG folder)."""

    def __init__(self, gt, gt_folder, label_to_cat, img_folder=None, num_draw=4, num_worst=6,
                 gt_json="panoptic ground truth"):
        self.gt_json = gt_json  # names the records in errors
        self.worst, self.num_worst = Worst(num_worst), num_worst
        self.categories = gt["categories"]
        self.cat_index = {c["id"]: i for i, c in enumerate(self.categories)}
        self.gt = {a["image_id"]: a for a in gt["annotations"]}
        self.images = {img["id"]: img for img in gt.get("images", [])}
        self.gt_folder, self.img_folder, self.num_draw = gt_folder, img_folder, num_draw
        self.label_to_cat = dict(label_to_cat)
        self.colours = {c["id"]: tuple(c.get("color") or np.random.default_rng(c["id"]).integers(0, 256, 3))
                        for c in self.categories}
        self.stats = np.zeros((len(self.categories), 4))
        self.predictions, self.drawn = [], []  # (image_id, png bytes, segments_info); (image_id, ids, segments)
        self._all = None
        # semantic branch: label (0: the "stuff" head's "things" class) -> "things" (0) or 1 + stuff index
        isthing = {c["id"]: bool(c.get("isthing", 0)) for c in self.categories}
        stuff = [label for label in sorted(self.label_to_cat) if not isthing[self.label_to_cat[label]]]
        self.semantic_of_label = torch.zeros(max(self.label_to_cat, default=0) + 1, dtype=torch.long)
        for k, label in enumerate(stuff):
            self.semantic_of_label[label] = k + 1
        names = {c["id"]: c.get("name", str(c["id"])) for c in self.categories}
        self.semantic_classes = ["things"] + [names[self.label_to_cat[label]] for label in stuff]
        self.semantic_cm = ConfusionMatrix(len(self.semantic_classes))
        self.drawn_semantic = []  # (target, prediction) in semantic classes

    def update(self, predictions, targets):
        self._all = None
        for pred, target in zip(predictions, targets):
            image_id = int(target["image_id"])
            if image_id not in self.gt:
                raise DataError(f"panoptic evaluation: image {image_id} has no ground truth in the panoptic JSON")
            ann = self.gt[image_id]
            ids = pred["panoptic"].detach().cpu().numpy().astype(np.int32)
            segments = [{"id": int(s["id"]), "category_id": self.label_to_cat[int(s["category_id"])],
                         "isthing": int(bool(s["isthing"])), "score": float(s["score"]), "area": int(s["area"])}
                        for s in pred["segments_info"]]
            gt_ids = read_ids(self.gt_png(ann))
            stats = pq_image(gt_ids, ann["segments_info"], ids, segments, self.cat_index, image_id)
            self.stats += stats
            if self.analysis:
                self.worst.add(image_pq(stats), lambda: image_id)
            name = os.path.splitext(ann["file_name"])[0] + ".png"
            self.predictions.append({"image_id": image_id, "file_name": name, "segments_info": segments,
                                     "png": png_bytes(ids)})
            if len(self.drawn) < self.num_draw:
                self.drawn.append((image_id, ids, segments))
            if "sem_seg" in pred and "sem_seg" in target:
                self._update_semantic(pred["sem_seg"], target["sem_seg"], image_id)

    def gt_png(self, ann):
        """The ground-truth PNG of an annotation, inside gt_folder (else OutsideFolder naming the record)."""
        return join_inside(self.gt_folder, ann["file_name"], f"{self.gt_json}: annotation of image "
                                                             f"{ann['image_id']!r:.40}: file_name", resolve=False)

    def output_folder(self, folder):
        """`folder`, refused (OutsideFolder) when it is or lies in the data set's PNG or image folder:
        evaluation never writes into the data set's folders."""
        for data in (self.gt_folder, self.img_folder):
            real = data and os.path.realpath(data)
            if real and os.path.commonpath([os.path.realpath(folder), real]) == real:
                raise OutsideFolder(f"panoptic evaluation: the output folder {folder} is inside the data set's folder "
                                    f"{data}; evaluation never writes into the data set: choose another report folder")
        return folder

    def semantic(self, labels):
        """Category labels (0 = "things") -> semantic classes; IGNORE_INDEX stays."""
        labels = torch.as_tensor(labels).long().cpu()
        ignored = labels == IGNORE_INDEX
        bad = ~ignored & ((labels < 0) | (labels >= len(self.semantic_of_label)))
        if bad.any():
            raise ConfigError(f"panoptic evaluation: semantic labels {labels[bad].unique()[:5].tolist()} are outside "
                              f"0..{len(self.semantic_of_label) - 1}")
        return torch.where(ignored, IGNORE_INDEX, self.semantic_of_label[labels.masked_fill(ignored, 0)])

    def _update_semantic(self, pred, target, image_id):
        """pred: the model's sem_seg (category labels); target: the data's (label - 1, 255 void)."""
        target = torch.as_tensor(target).long().cpu()
        if pred.shape != target.shape:
            raise ValueError(f"panoptic evaluation: image {image_id}: sem_seg prediction {tuple(pred.shape)} and "
                             f"target {tuple(target.shape)} differ in size")
        pred, target = self.semantic(pred), self.semantic(torch.where(target == IGNORE_INDEX, target, target + 1))
        self.semantic_cm.update(pred, target)
        if len(self.drawn_semantic) < self.num_draw:
            self.drawn_semantic.append((target, pred))

    def _gathered(self):
        # gathered from every process once: later calls (report, save_artifacts) may run on rank 0 only
        if self._all is None:
            stats = np.sum(dist.all_gather_list([self.stats]), axis=0)
            worst = worst_of(dist.all_gather_list([self.worst.items()]), self.num_worst) if self.analysis else []
            self._all = stats, dist.all_gather_list(self.predictions), self.semantic_cm.total(), worst
        return self._all

    def report(self):
        stats, predictions, semantic_cm, worst = self._gathered()
        if not predictions:
            raise DataError("panoptic evaluation saw no images: is the validation split empty?")
        summary = pq_summary(stats, self.categories)
        report = {"metrics": summary_metrics(summary), "panoptic": summary, "num_images": len(predictions),
                  "main_metric": "PQ", "headline": panoptic_headline(summary, len(predictions))}
        if semantic_cm.sum() > 0:  # the model predicts a semantic map: its branch's figures too
            report["semantic"] = segmentation_report(semantic_cm, self.semantic_classes)
            report["metrics"].update({f"semantic_{k}": v for k, v in report["semantic"]["metrics"].items()})
        if self.analysis:
            images = [{"path": f"analysis/panoptic/worst_{k + 1}.png", "title": f"image {image_id}",
                       "caption": f"PQ {100 * score:.1f}", "score": round(score, 4)}
                      for k, (score, image_id) in enumerate(worst)]
            report["analysis"] = [panoptic_class_section(summary["per_class"]),
                                  worst_images_section("worst images (lowest per-image PQ)", images, "PQ",
                                                       "each image: the image | ground truth | prediction, one colour "
                                                       "per class (things varied per instance)")]
            if "semantic" in report:
                s = report["semantic"]
                report["analysis"].append(iou_section(np.asarray(s["confusion_matrix"]), s["classes"],
                                                      [s["per_class_iou"][c] for c in s["classes"]],
                                                      "semantic branch: per-class IoU and confusion matrix"))
        return report

    def compute(self):
        return self.report()["metrics"]

    def markdown(self, report):
        text = headline_markdown(report) + summary_markdown(report["panoptic"], report["num_images"])
        if "semantic" in report:
            text += ("\nSemantic branch (stuff classes and one \"things\" class)\n\n"
                     + report_markdown(report["semantic"], headline=False))
        return text

    def save_artifacts(self, folder):
        """panoptic_predictions.json + panoptic_predictions/*.png in COCO panoptic format; with the
        analysis, the worst images (analysis/panoptic/worst_K.png)."""
        _, predictions, _, worst = self._gathered()
        png_folder = self.output_folder(os.path.join(folder, "panoptic_predictions"))
        json_path = png_folder + ".json"
        if dist.is_main() and worst:
            by_id = {p["image_id"]: p for p in predictions}
            os.makedirs(self.output_folder(os.path.join(folder, "analysis", "panoptic")), exist_ok=True)
            for k, (_, image_id) in enumerate(worst):
                p = by_id[image_id]
                ids = rgb_to_id(np.array(Image.open(io.BytesIO(p["png"])).convert("RGB")))
                panels = self._panels(image_id, ids, p["segments_info"], gap=4)
                Image.fromarray(panels.permute(1, 2, 0).numpy()).save(
                    os.path.join(folder, "analysis", "panoptic", f"worst_{k + 1}.png"))
        if dist.is_main():
            os.makedirs(png_folder, exist_ok=True)
            for p in predictions:  # names from the data set: checked again where they are written
                path = join_inside(png_folder, p["file_name"], f"{self.gt_json}: prediction of image "
                                                                f"{p['image_id']!r:.40}: file_name")
                with open(path, "wb") as f:
                    f.write(p["png"])
            with open(json_path, "w") as f:
                json.dump({"annotations": [{k: v for k, v in p.items() if k != "png"} for p in predictions],
                           "categories": self.categories}, f)
        return {"panoptic_json": json_path, "panoptic_folder": png_folder}

    def draw(self):
        """[(image_id, uint8 [3, H, 3W]: the image, ground truth, prediction side by side)]."""
        return [(image_id, self._panels(image_id, ids, segments)) for image_id, ids, segments in self.drawn]

    def _panels(self, image_id, ids, segments, gap=0):
        """uint8 [3, H, W']: the image (when its folder is known), ground truth and prediction side by side."""
        ann = self.gt[image_id]
        gt_ids = read_ids(self.gt_png(ann))
        panels = [colorize(gt_ids, ann["segments_info"], self.colours), colorize(ids, segments, self.colours)]
        name = self.images.get(image_id, {}).get("file_name", os.path.splitext(ann["file_name"])[0] + ".jpg")
        image_path = self.img_folder and join_inside(self.img_folder, name, f"{self.gt_json}: image "
                                                                              f"{image_id!r:.40}: file_name", resolve=False)
        if image_path and os.path.isfile(image_path):
            panels.insert(0, torch.from_numpy(np.array(Image.open(image_path).convert("RGB"))).permute(2, 0, 1))
        if gap:
            white = torch.full((3, panels[0].shape[1], gap), 255, dtype=torch.uint8)
            panels = [x for panel in panels for x in (panel, white)][:-1]
        return torch.cat(panels, dim=2)

    def log_extras(self, writer, step, prefix):
        for i, (image_id, image) in enumerate(self.draw()):
            writer.add_image(f"{prefix}/panoptic_{i}", image, step)  # image | ground truth | prediction
        for i, (target, pred) in enumerate(self.drawn_semantic):  # as the segmentation evaluator draws
            writer.add_image(f"{prefix}/semantic_{i}", target_and_prediction(target, pred, len(self.semantic_classes)),
                             step)
