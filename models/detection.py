"""SSD detectors from torchvision's building blocks: SSD300-VGG16 and SSDlite320-MobileNetV3-Large.

The builders follow torchvision's `ssd300_vgg16` / `ssdlite320_mobilenet_v3_large` line by line
(same modules, same state-dict keys, same initialisation: Xavier with zero bias for SSD300's
new convolutions, N(0, 0.03) for SSDlite's), but backbone weights are loaded offline through
models/weights.py: a local file or a torchvision weights name found in the torch hub cache. A whole
detector's weights (model.weights) are loaded by the model registry (engine.transfer): the
classification head, declared class-dependent, starts anew for other classes.

torchvision's SSD already follows the zoo's model contract: model(images, targets) returns
{'bbox_regression', 'classification'} losses in training and a list of {boxes, scores, labels}
in eval. The head's outputs are cast to float32, so under bf16 autocast the losses, scores and
decoded boxes keep full precision while the convolutions run in bf16.
"""
from functools import partial

from torch import nn
from torchvision.models import mobilenetv3, vgg
from torchvision.models.detection import _utils as det_utils
from torchvision.models.detection.anchor_utils import DefaultBoxGenerator
from torchvision.models.detection.ssd import SSD, _vgg_extractor
from torchvision.models.detection.ssdlite import SSDLiteHead, _mobilenet_extractor, _normal_init

from engine.registry import MODELS, Range
from engine.transfer import Interleaved
from models.backbones import check_trainable_layers
from models.weights import load_pretrained, resolve_pretrained


def _float_head_outputs(module, inputs, outputs):
    return {k: v.float() for k, v in outputs.items()}


def _finish(model):
    model.head.register_forward_hook(_float_head_outputs)
    return model


# the classification head's convolutions: channel = anchor * num_classes + class (torchvision's
# SSDScoringHead), class 0 the background
SSD_CLASS_PARAMS = {"head.classification_head.module_list.*": Interleaved(background=True)}
SSDLITE_CLASS_PARAMS = {"head.classification_head.module_list.*.1": Interleaved(background=True)}


SSD_RANGES = {"num_classes": Range(ge=1), "score_thresh": Range(ge=0, le=1), "nms_thresh": Range(ge=0, le=1),
              "iou_thresh": Range(ge=0, le=1), "detections_per_img": Range(ge=1), "topk_candidates": Range(ge=1)}


@MODELS.register(task="detection", quantizable=False, exports=("onnx", "torch_export"),
                  ranges={**SSD_RANGES, "trainable_backbone_layers": Range(ge=0, le=5)}, class_params=SSD_CLASS_PARAMS)
def ssd300_vgg16(num_classes=91, weights=None, weights_backbone=None,
                 trainable_backbone_layers: int | None = None, score_thresh=0.01, nms_thresh=0.45,
                 detections_per_img=200, topk_candidates=400, iou_thresh=0.5):
    """SSD300 with a VGG16 backbone (Liu et al. 2016), torchvision's builder.

    weights: a full detector (local file, a project checkpoint, or e.g. SSD300_VGG16_Weights.COCO_V1,
    whose head is for COCO's 91 category ids); a head for other classes starts anew (model.new_classes,
    model.class_map: engine.transfer). weights_backbone: VGG16 features,
    e.g. VGG16_Weights.IMAGENET1K_FEATURES (torchvision's recipe) or a local file.
    """
    weights_backbone = resolve_pretrained(weights, weights_backbone)  # the detector's weights win
    trainable = check_trainable_layers(trainable_backbone_layers, bool(weights or weights_backbone), 5, 4)
    backbone = vgg.vgg16()  # torchvision's init (Kaiming) for the VGG layers when not pretrained
    if weights_backbone:
        load_pretrained(backbone, weights_backbone, strict_shapes=True)
    backbone = _vgg_extractor(backbone, False, trainable)  # new convolutions: Xavier, zero bias
    anchors = DefaultBoxGenerator([[2], [2, 3], [2, 3], [2, 3], [2], [2]],
                                  scales=[0.07, 0.15, 0.33, 0.51, 0.69, 0.87, 1.05], steps=[8, 16, 32, 64, 100, 300])
    model = SSD(backbone, anchors, (300, 300), num_classes,
                image_mean=[0.48235, 0.45882, 0.40784], image_std=[1.0 / 255.0] * 3,
                score_thresh=score_thresh, nms_thresh=nms_thresh, detections_per_img=detections_per_img,
                topk_candidates=topk_candidates, iou_thresh=iou_thresh)
    return _finish(model)


@MODELS.register(task="detection", quantizable=False, exports=("onnx", "torch_export"),
                  ranges={**SSD_RANGES, "trainable_backbone_layers": Range(ge=0, le=6),
                          "size": Range(ge=1, le=8192), "width_mult": Range(gt=0)},
                  class_params=SSDLITE_CLASS_PARAMS)
def ssdlite320_mobilenet_v3_large(num_classes=91, weights=None, weights_backbone=None,
                                  trainable_backbone_layers: int | None = None, score_thresh=0.001, nms_thresh=0.55,
                                  detections_per_img=300, topk_candidates=300, iou_thresh=0.5, size=320,
                                  width_mult=1.0):
    """SSDlite with a MobileNetV3-Large backbone (Howard et al. 2019), torchvision's builder.

    `size` (input resolution, square) and `width_mult` default to torchvision's 320 and 1.0; other
    values give lighter variants (e.g. the CPU demo), which no published weights fit.
    """
    weights_backbone = resolve_pretrained(weights, weights_backbone)  # the detector's weights win
    trainable = check_trainable_layers(trainable_backbone_layers, bool(weights or weights_backbone), 6, 6)
    norm_layer = partial(nn.BatchNorm2d, eps=0.001, momentum=0.03)
    reduce_tail = not weights_backbone  # the paper's reduced tail when the backbone is not pretrained
    settings, last_channel = mobilenetv3._mobilenet_v3_conf("mobilenet_v3_large", width_mult=width_mult,
                                                            reduced_tail=reduce_tail)
    backbone = mobilenetv3.MobileNetV3(settings, last_channel, norm_layer=norm_layer)
    if weights_backbone:
        load_pretrained(backbone, weights_backbone, strict_shapes=True)
    else:
        _normal_init(backbone)
    backbone = _mobilenet_extractor(backbone, trainable, norm_layer)
    size = (int(size), int(size))
    anchors = DefaultBoxGenerator([[2, 3] for _ in range(6)], min_ratio=0.2, max_ratio=0.95)
    out_channels = det_utils.retrieve_out_channels(backbone, size)
    head = SSDLiteHead(out_channels, anchors.num_anchors_per_location(), num_classes, norm_layer)
    model = SSD(backbone, anchors, size, num_classes, head=head, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                score_thresh=score_thresh, nms_thresh=nms_thresh, detections_per_img=detections_per_img,
                topk_candidates=topk_candidates, iou_thresh=iou_thresh)
    return _finish(model)
