"""Detectors: torchvision SSD models (SSD300, SSDlite: the detection models that declare exports)
exported with static-shape post-processing, compared box by box, presented as drawn images, a
COCO-style detections.json and the same detections in COCO's results format (results.json).
Faster R-CNN's adapter (exporters/rcnn.py) shares the presentation and the spec's class names."""
import logging
import os

import torch
from torch import nn
from torchvision.io import write_png
from torchvision.models import get_weight
from torchvision.transforms.v2 import functional as TF
from torchvision.utils import draw_bounding_boxes

from engine.files import write_json
from exporters.base import EXPORTERS, Adapter, ExportError
from exporters.inputs import read_image
from exporters.ssd_static import SSDExport, detections, match_detections

log = logging.getLogger(__name__)

KEYS = ("boxes", "scores", "labels")


@EXPORTERS.register(task="detection", inputs="image")
class Detector(Adapter):
    """images [B, 3, H, W] (RGB in [0, 1], any size: resized inside) -> boxes [B, D, 4] in the input's
    pixels, scores [B, D], labels [B, D] (0 = padding)."""
    task = "detection"
    output_names = ("boxes", "scores", "labels")

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        # a torchvision SSD: the detection models that declare exports (@MODELS.register(exports=...))
        classes, label_to_cat = detection_classes(cfg, data, model.head.classification_head.num_columns)
        width, height = model.transform.fixed_size
        return {"classes": classes, "label_to_category_id": label_to_cat,
                "preprocessing": {"image_mode": "RGB", "scale": 1 / 255, "layout": "NCHW float32",
                                  "in_model": {"resize": [int(height), int(width)], "interpolation": "bilinear",
                                               "mean": list(model.transform.image_mean),
                                               "std": list(model.transform.image_std)}},
                "postprocessing": {"in_model": {"score_thresh": model.score_thresh, "nms_thresh": model.nms_thresh,
                                                "topk_candidates": model.topk_candidates,
                                                "detections_per_img": model.detections_per_img},
                                   "boxes": "xyxy in the input image's pixels", "padding": "label 0, score 0"}}

    def module(self, model):
        return SSDExport(model).eval()

    def dynamic_shapes(self, dynamic_batch):
        dim = torch.export.Dim
        return ({0: dim.DYNAMIC if dynamic_batch else dim.STATIC, 2: dim.DYNAMIC, 3: dim.DYNAMIC},)

    def compare(self, ref, got, atol=None):
        return match_detections(detections(ref), detections(got), capacity=ref[1].shape[1])

    def eval_model(self, runner, where):
        return RunnerAsDetector(runner, where, batched=not self.one_image)

    def load(self, item):
        return TF.to_dtype(TF.pil_to_tensor(read_image(item)), torch.float32, scale=True)

    def batch_key(self, sample):
        return super().batch_key(sample) if self.one_image else tuple(sample.shape)

    def category_id(self, label):
        return self.spec.get("label_to_category_id", {}).get(str(label), label)

    def present(self, outputs, items, samples, out_dir, args):
        results = []
        for path, image, det in zip(items, samples, detections(outputs, args.score_thresh)):
            names = [f"{self.class_name(int(c))} {s:.2f}" for c, s in zip(det["labels"], det["scores"].tolist())]
            drawn = draw_bounding_boxes((image * 255).round().to(torch.uint8), det["boxes"], names, width=2,
                                        colors="red")
            out = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + "_boxes.png")
            write_png(drawn, out)
            found = [{"label": self.class_name(int(c)), "category_id": self.category_id(int(c)),
                      "score": round(s, 4), "bbox_xyxy": [round(v, 2) for v in b]}
                     for c, s, b in zip(det["labels"].tolist(), det["scores"].tolist(), det["boxes"].tolist())]
            results.append({"input": path, "drawn": out, "height": image.shape[1], "width": image.shape[2],
                            "detections": found})
        return results

    def summary(self, result):
        found = result["detections"]
        return (f"{result['input']}: {len(found)} detections" + (": " if found else "")
                + ", ".join(f"{d['label']} {d['score']:.2f}" for d in found[:8]) + (" ..." if len(found) > 8 else ""))

    def after_predictions(self, results, out_dir, args):
        """detections.json: COCO style (images, categories, annotations with scores); results.json: the
        same detections in COCO's results format (COCO("detections.json").loadRes("results.json"))."""
        images, annotations = [], []
        for i, r in enumerate(results, 1):
            images.append({"id": i, "file_name": r["input"], "height": r["height"], "width": r["width"]})
            for d in r["detections"]:
                x0, y0, x1, y1 = d["bbox_xyxy"]
                annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": d["category_id"],
                                    "bbox": [x0, y0, round(x1 - x0, 2), round(y1 - y0, 2)],
                                    "area": round((x1 - x0) * (y1 - y0), 2), "score": d["score"]})
        categories = [{"id": self.category_id(k), "name": name} for k, name in enumerate(self.classes or [])
                      if k > 0 and not name.startswith(("unused_", "N/A"))]
        write_json(os.path.join(out_dir, "detections.json"),
                   {"images": images, "categories": categories, "annotations": annotations})
        write_json(os.path.join(out_dir, "results.json"),
                   [{k: a[k] for k in ("image_id", "category_id", "bbox", "score")} for a in annotations])


def detection_classes(cfg, data, num_classes):
    """(class names, {str(label): COCO category id}) for a detector's spec: the data's, else (no data
    at hand) the names stored with torchvision weights, else numbers."""
    if data is not None:
        classes, label_to_cat = list(data.classes), dict(getattr(data.val, "label_to_cat", {}))
    else:
        classes, label_to_cat = _weights_categories(cfg["model"].get("weights")), {}
    classes = classes or ["__background__"] + [str(i) for i in range(1, num_classes)]
    return classes, {str(k): v for k, v in label_to_cat.items()}


def _weights_categories(weights):
    """Category names stored with torchvision weights (e.g. SSDLite320_..._Weights.COCO_V1), else None."""
    if not weights or os.path.exists(str(weights)):
        return None
    try:
        return list(get_weight(weights).meta["categories"])
    except (ValueError, KeyError, AttributeError):
        return None


class RunnerAsDetector(nn.Module):
    """A detector's runner where the engine expects the eager model: the detection val loader's images
    (a tuple of [3, H, W] tensors of any sizes) in, one {boxes, scores, labels} dict per image out.
    Each image runs alone (batched: as a batch of one, its padding rows dropped); runners are safe to
    call from several threads (ONNX Runtime sessions are)."""

    def __init__(self, runner, where, batched):
        super().__init__()
        self.runner, self.where, self.batched = runner, where, batched

    def forward(self, images):
        if not isinstance(images, (list, tuple)):
            raise ExportError(f"{self.where}: a detector is evaluated on detection batches (a list of images), "
                              f"this data set gives {type(images).__name__}: evaluate the checkpoint")
        if not self.batched:
            return [dict(zip(KEYS, self.runner(image.cpu()))) for image in images]
        return detections([torch.cat(o) for o in zip(*(self.runner(image.cpu()[None]) for image in images))])
