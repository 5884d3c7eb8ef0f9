"""Two-stage detectors: torchvision's Faster R-CNN exported whole (resize, normalisation, RPN, RoI
heads, NMS) as one graph of ONE image of any size, through the TorchScript-based ONNX exporter
(torchvision's way: the number of proposals and detections depends on the data, which torch.export
cannot trace). Compared box by box with the eager model; evaluated and presented one image at a time."""
import logging

from torch import nn

from exporters.base import EXPORTERS
from exporters.detection import KEYS, Detector, detection_classes
from exporters.ssd_static import match_detections

log = logging.getLogger(__name__)

@EXPORTERS.register(task="detection", inputs="image", by_name=True)
class RCNNDetector(Detector):
    """image [3, H, W] (RGB in [0, 1], any size) -> boxes [D, 4] xyxy in the input's pixels, scores [D],
    labels [D] (1..K), D varying with the image: the eager model's detections for that image."""
    input_names = ("image",)
    onnx_exporter = "torchscript"
    one_image = True

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        classes, label_to_cat = detection_classes(cfg, data, model.roi_heads.box_predictor.cls_score.out_features)
        return {"classes": classes, "label_to_category_id": label_to_cat, "preprocessing": rcnn_preprocessing(model),
                "postprocessing": {"in_model": rcnn_postprocessing(model), "boxes": "xyxy in the input image's pixels"}}

    def module(self, model):
        return OneImage(model).eval()

    def dynamic_shapes(self, dynamic_batch):
        return None  # torch.export is not declared (models/faster_rcnn.py's not_exported)

    def dynamic_axes(self, dynamic_batch):
        return {"image": {1: "height", 2: "width"}, **{name: {0: "detections"} for name in self.output_names}}

    def compare(self, ref, got, atol=None):
        as_dicts = [[dict(zip(KEYS, outputs)) for outputs in side] for side in (ref, got)]
        return match_detections(*as_dicts, capacity=self.spec["postprocessing"]["in_model"]["box_detections_per_img"])

    def present(self, outputs, items, samples, out_dir, args):
        return super().present(tuple(o.unsqueeze(0) for o in outputs), items, samples, out_dir, args)


class OneImage(nn.Module):
    """A torchvision detector on one image: (boxes, scores, labels) = model([image])[0]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, image):
        found = self.model([image])[0]
        return tuple(found[k] for k in KEYS)


def rcnn_preprocessing(model):
    """A torchvision two-stage model's one-image input and what its graph does to it (GeneralizedRCNNTransform)."""
    t = model.transform
    return {"image_mode": "RGB", "scale": 1 / 255, "layout": "CHW float32, one image",
            "in_model": {"min_size": list(t.min_size), "max_size": t.max_size, "mean": list(t.image_mean),
                         "std": list(t.image_std), "size_divisible": t.size_divisible}}


def rcnn_postprocessing(model):
    """The RPN's and RoI heads' test-time settings, inside the graph."""
    heads, rpn = model.roi_heads, model.rpn
    return {"box_score_thresh": heads.score_thresh, "box_nms_thresh": heads.nms_thresh,
            "box_detections_per_img": heads.detections_per_img,
            "rpn_pre_nms_top_n_test": rpn._pre_nms_top_n["testing"],
            "rpn_post_nms_top_n_test": rpn._post_nms_top_n["testing"], "rpn_score_thresh": rpn.score_thresh}
