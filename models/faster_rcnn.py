"""Faster R-CNN with a MobileNetV3-Large FPN backbone: torchvision's two builders.

`fasterrcnn_mobilenet_v3_large_fpn` (800 px) and `fasterrcnn_mobilenet_v3_large_320_fpn`
(320 px, fewer RPN proposals at test time) follow torchvision's `_fasterrcnn_mobilenet_v3_large_fpn`:
same modules and state-dict keys (so published weights load), FrozenBatchNorm2d in a pretrained
backbone and BatchNorm2d from scratch, 3 trainable backbone stages by default when pretrained, all 6
from scratch. Backbone weights load offline through models/weights.py, a whole detector's through the
model registry (engine.transfer: `roi_heads.box_predictor`, declared class-dependent, starts anew for
other classes). torchvision's FasterRCNN already
follows the zoo's model contract (losses in training, detection dicts in eval), so the COCO loader
and evaluator serve it as they serve SSD. Both export to ONNX whole, one image per graph
(exporters/rcnn.py); torch.export cannot trace them (NOT_EXPORTED).
"""
from torchvision.models import mobilenetv3
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import _mobilenet_extractor
from torchvision.models.detection.faster_rcnn import FasterRCNN

from engine.registry import MODELS, Range
from engine.transfer import Rows
from models.backbones import pretrained_body


def _fasterrcnn_mobilenet_v3_large_fpn(num_classes, weights, weights_backbone, trainable_backbone_layers,
                                       **kwargs):
    body, trainable = pretrained_body(mobilenetv3.mobilenet_v3_large, weights, weights_backbone,
                                      trainable_backbone_layers, 6, 3)
    backbone = _mobilenet_extractor(body, True, trainable)
    anchor_sizes = ((32, 64, 128, 256, 512),) * 3
    anchors = AnchorGenerator(anchor_sizes, ((0.5, 1.0, 2.0),) * len(anchor_sizes))
    return FasterRCNN(backbone, num_classes, rpn_anchor_generator=anchors, **kwargs)


# torchvision's FastRCNNPredictor: a score per class, 4 box deltas per class (row = class * 4 + j);
# class 0 the background
FASTER_RCNN_CLASS_PARAMS = {"roi_heads.box_predictor.cls_score": Rows(background=True),
                            "roi_heads.box_predictor.bbox_pred": Rows(per=4, background=True)}


# exported whole (one image in, its detections out) by the TorchScript-based ONNX exporter: exporters/rcnn.py
NOT_EXPORTED = {"torch_export": "torch.export cannot trace a two-stage detector: its numbers of proposals and "
                                "detections depend on the data (the RPN's box filtering)"}


FASTER_RCNN_RANGES = {
    "num_classes": Range(ge=1), "trainable_backbone_layers": Range(ge=0, le=6), "min_size": Range(ge=1, le=8192),
    "max_size": Range(ge=1, le=8192), "rpn_score_thresh": Range(ge=0, le=1), "box_score_thresh": Range(ge=0, le=1),
    "box_detections_per_img": Range(ge=1), "rpn_pre_nms_top_n_test": Range(ge=1),
    "rpn_post_nms_top_n_test": Range(ge=1), "rpn_pre_nms_top_n_train": Range(ge=1),
    "rpn_post_nms_top_n_train": Range(ge=1), "box_batch_size_per_image": Range(ge=1)}


@MODELS.register(task="detection", quantizable=False, exports=("onnx",), not_exported=NOT_EXPORTED,
                 export_adapter="RCNNDetector", ranges=FASTER_RCNN_RANGES, class_params=FASTER_RCNN_CLASS_PARAMS)
def fasterrcnn_mobilenet_v3_large_fpn(num_classes=91, weights=None, weights_backbone=None,
                                      trainable_backbone_layers: int | None = None, min_size=800, max_size=1333,
                                      rpn_score_thresh=0.05, box_score_thresh=0.05, box_detections_per_img=100,
                                      rpn_pre_nms_top_n_test=1000, rpn_post_nms_top_n_test=1000,
                                      rpn_pre_nms_top_n_train=2000, rpn_post_nms_top_n_train=2000,
                                      box_batch_size_per_image=512):
    """torchvision's defaults (FasterRCNN's, with rpn_score_thresh 0.05). weights: a whole detector
    (a local file, a project checkpoint, or FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1);
    weights_backbone: e.g. MobileNet_V3_Large_Weights.IMAGENET1K_V1 (torchvision's recipe)."""
    return _fasterrcnn_mobilenet_v3_large_fpn(**locals())  # the signature above, passed on whole


@MODELS.register(task="detection", quantizable=False, exports=("onnx",), not_exported=NOT_EXPORTED,
                 export_adapter="RCNNDetector", ranges=FASTER_RCNN_RANGES, class_params=FASTER_RCNN_CLASS_PARAMS)
def fasterrcnn_mobilenet_v3_large_320_fpn(num_classes=91, weights=None, weights_backbone=None,
                                          trainable_backbone_layers: int | None = None, min_size=320, max_size=640,
                                          rpn_score_thresh=0.05, box_score_thresh=0.05, box_detections_per_img=100,
                                          rpn_pre_nms_top_n_test=150, rpn_post_nms_top_n_test=150,
                                          rpn_pre_nms_top_n_train=2000, rpn_post_nms_top_n_train=2000,
                                          box_batch_size_per_image=512):
    """The low-resolution variant: torchvision's defaults min_size 320, max_size 640, 150 RPN
    proposals before and after NMS at test time, rpn_score_thresh 0.05.
    weights: e.g. FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1 or a local file."""
    return _fasterrcnn_mobilenet_v3_large_fpn(**locals())  # the signature above, passed on whole
