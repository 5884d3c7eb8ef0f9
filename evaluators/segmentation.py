"""Semantic-segmentation evaluation: mIoU, pixel accuracy and per-class IoU from a confusion matrix.

The confusion matrix (rows: true class, columns: predicted) is accumulated per process and summed
across processes before any metric is computed, so a sharded evaluation gives exactly the
single-process numbers. Pixels labelled `ignore_index` (255: VOC borders, crop padding) are not
counted. A class that appears neither in the ground truth nor in the predictions has no IoU and is
left out of the mean (reported as null).

The analysis (evaluators/segmentation_analysis.py): IoU per class as bars, the normalised confusion matrix, the
pixels most often confused, and the worst images (lowest per-image mIoU) drawn ground truth | prediction.
"""
import os

import numpy as np
import torch
from PIL import Image

from engine.errors import DataError
from engine import dist
from engine.evaluation import Evaluator
from engine.report import headline_markdown, plots
from runtime.segmentation import IGNORE_INDEX, confusion_counts, segmentation_metrics  # torch-free: runtime/ scores with them too
from evaluators.segmentation_analysis import (Worst, image_miou, iou_section, segmentation_headline,
                                             worst_images_section, worst_of)



def confusion_matrix(pred, target, num_classes, ignore_index=IGNORE_INDEX):
    """[num_classes, num_classes] int64 counts of (true, predicted) over the pixels not ignored
    (runtime.segmentation.confusion_counts, as a tensor)."""
    return torch.from_numpy(confusion_counts(pred.detach().cpu().numpy(), target.detach().cpu().numpy(),
                                             num_classes, ignore_index))


class ConfusionMatrix:
    """confusion_matrix counts accumulated per process; total() is their sum over every process,
    gathered once (every process must call it; later calls may run on rank 0 only)."""

    def __init__(self, num_classes, ignore_index=IGNORE_INDEX):
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.counts = torch.zeros(num_classes, num_classes, dtype=torch.long)
        self._total = None

    def update(self, pred, target):
        self._total = None
        self.counts += confusion_matrix(pred, target, self.num_classes, self.ignore_index)

    def total(self):
        if self._total is None:
            self._total = sum(dist.all_gather_list([self.counts]), torch.zeros_like(self.counts))
        return self._total


def segmentation_report(cm, classes, ignore_index=IGNORE_INDEX):
    """The JSON report of a (summed) confusion matrix: metrics, per-class IoU, the matrix itself."""
    metrics, iou = segmentation_metrics(cm)
    report = {"metrics": metrics, "per_class_iou": dict(zip(classes, iou)), "classes": list(classes),
              "num_pixels": int(cm.sum()), "ignore_index": ignore_index, "confusion_matrix": cm.tolist(),
              "main_metric": "mIoU"}
    report["headline"] = segmentation_headline(report)
    return report


def report_markdown(report, headline=True):
    """The markdown of segmentation_report: the headline, the means, then a per-class IoU table."""
    m = report["metrics"]
    lines = [headline_markdown(report) if headline else "", f"**mIoU** {100 * m['mIoU']:.1f}%  **pixel accuracy** {100 * m['pixel_accuracy']:.1f}%  "
             f"**mean class accuracy** {100 * m['mean_accuracy']:.1f}%  on {report['num_pixels']} pixels "
             f"(ignore index {report['ignore_index']} not counted)", "", "| class | IoU (%) |", "|---|---|"]
    lines += [f"| {c} | {'-' if v is None else f'{100 * v:.1f}'} |" for c, v in report["per_class_iou"].items()]
    return "\n".join(lines) + "\n"


def palette(num_classes):
    """A fixed colour per class (uint8 [num_classes + 1, 3]); the last row (ignore) is white."""
    g = torch.Generator().manual_seed(0)
    colours = torch.randint(40, 256, (num_classes, 3), generator=g, dtype=torch.uint8)
    return torch.cat([colours, torch.full((1, 3), 255, dtype=torch.uint8)])


def colourise(labels, num_classes, ignore_index=IGNORE_INDEX):
    """[H, W] labels -> uint8 [3, H, W] image."""
    labels = labels.long().clone()
    labels[(labels == ignore_index) | (labels < 0) | (labels >= num_classes)] = num_classes
    return palette(num_classes)[labels].permute(2, 0, 1)


def target_and_prediction(target, pred, num_classes, ignore_index=IGNORE_INDEX):
    """uint8 [3, H, 2W]: the coloured ground truth (left) and prediction (right), for TensorBoard."""
    return torch.cat([colourise(target, num_classes, ignore_index), colourise(pred, num_classes, ignore_index)], 2)


def save_side_by_side(path, target, pred, num_classes, ignore_index=IGNORE_INDEX):
    """A PNG of the coloured ground truth (left) and prediction (right), a white gap between."""
    gt, p = colourise(target, num_classes, ignore_index), colourise(pred, num_classes, ignore_index)
    gap = torch.full((3, gt.shape[1], 4), 255, dtype=torch.uint8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(torch.cat([gt, gap, p], 2).permute(1, 2, 0).numpy()).save(path)


class SegmentationEvaluator(Evaluator):
    """update(logits [N, C, H, W], targets [N, H, W]); metrics as fractions (0-1)."""

    def __init__(self, classes, ignore_index=IGNORE_INDEX, num_draw=4, num_worst=6):
        self.classes, self.ignore_index, self.num_draw = list(classes), ignore_index, num_draw
        self.num_classes = len(self.classes)
        self.cm = ConfusionMatrix(self.num_classes, ignore_index)
        self.drawn = []  # (target, prediction) of the first images, for TensorBoard
        self.worst, self.num_worst, self._seen = Worst(num_worst), num_worst, 0
        self._indices, self._worst_all = None, None

    def attach_dataset(self, dataset, indices):
        self._indices = indices

    def update(self, predictions, targets):
        pred = predictions.argmax(1).cpu()
        targets = torch.as_tensor(targets).cpu()
        if pred.shape != targets.shape:
            raise ValueError(f"predictions {tuple(pred.shape)} and targets {tuple(targets.shape)} differ in size")
        self.cm.update(pred, targets)
        for t, p in zip(targets, pred):
            if len(self.drawn) < self.num_draw:
                self.drawn.append((t, p))
            if self.analysis:  # the image's mIoU: keep the worst images to draw them
                position = self._seen
                self.worst.add(image_miou(confusion_matrix(p, t, self.num_classes, self.ignore_index)),
                               lambda: (position, t.to(torch.uint8 if self.num_classes < 255 else torch.int16).clone(),
                                        p.to(torch.uint8 if self.num_classes < 255 else torch.int16).clone()))
            self._seen += 1

    def confusion_matrix(self):
        return self.cm.total()

    def compute(self):
        cm = self.confusion_matrix()
        if cm.sum() == 0:
            raise DataError("evaluation saw no labelled pixels: is the validation split empty?")
        return segmentation_metrics(cm)[0]

    def _worst_images(self):
        """[(mIoU, sample index or position, rank, target, prediction)] of the worst images of every process."""
        if self._worst_all is None:
            indices = self._indices if self._indices is not None and len(self._indices) == self._seen else None
            mine = [(score, indices[pos] if indices is not None else pos, dist.rank(), t, p)
                    for score, (pos, t, p) in self.worst.items()]
            self._worst_all = worst_of(dist.all_gather_list([mine]), self.num_worst)
        return self._worst_all

    def report(self):
        report = segmentation_report(self.confusion_matrix(), self.classes, self.ignore_index)
        if self.analysis:
            iou = [report["per_class_iou"][c] for c in self.classes]
            images = [{"path": f"analysis/segmentation/worst_{k + 1}.png", "title": f"val image {index}",
                       "caption": f"mIoU {100 * score:.1f}", "score": round(score, 4)}
                      for k, (score, index, rank, _, _) in enumerate(self._worst_images())]
            report["analysis"] = [iou_section(self.confusion_matrix().numpy(), self.classes, iou),
                                  worst_images_section("worst images (lowest per-image mIoU)", images, "mIoU",
                                                       "each image: ground truth (left) | prediction (right), "
                                                       "one colour per class")]
        return report

    def save_artifacts(self, folder):
        """The worst images (analysis/segmentation/worst_K.png) that the report's section shows."""
        if not self.analysis:
            return {}
        worst = self._worst_images()
        if dist.is_main():
            for k, (_, _, _, target, pred) in enumerate(worst):
                save_side_by_side(os.path.join(folder, "analysis", "segmentation", f"worst_{k + 1}.png"), target.long(),
                                  pred.long(), self.num_classes, self.ignore_index)
        return {"segmentation_worst_images": os.path.join(folder, "analysis", "segmentation")} if worst else {}

    def markdown(self, report):
        return report_markdown(report)

    def log_extras(self, writer, step, prefix):
        for i, (target, pred) in enumerate(self.drawn):  # left: ground truth, right: prediction
            writer.add_image(f"{prefix}/segmentation_{i}",
                             target_and_prediction(target, pred, self.num_classes, self.ignore_index), step)
        if self.analysis and self.num_classes <= 60:
            cm = self.confusion_matrix().numpy()
            matrix = iou_section(cm, self.classes, segmentation_metrics(self.confusion_matrix())[1])["plots"][1]
            writer.add_image(f"{prefix}/confusion_matrix", plots.rgb(matrix), step, dataformats="HWC")
