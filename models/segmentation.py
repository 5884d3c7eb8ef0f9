"""Semantic segmentation: torchvision's LR-ASPP and DeepLabV3 behind the zoo's model contract.

The networks come from torchvision's own model-assembly functions (`_lraspp_mobilenetv3`,
`_deeplabv3_mobilenetv3`, `_deeplabv3_resnet`) on a dilated backbone, as its builders do, with
backbone weights loaded offline through models/weights.py (a whole model's, model.weights, by the model
registry: engine.transfer, the classifiers' last convolutions declared class-dependent). `SegmentationModel` adds what torchvision's
reference training script does outside the model: cross-entropy with ignore index 255 on the
"out" logits plus aux_weight (0.5) x the same loss on the "aux" logits. Inputs are a batch
[N, 3, H, W]; targets a batch of masks [N, H, W] (long, 255 = ignore). In eval the model returns
the logits [N, C, H, W] at the input's size.
"""
import torch.nn.functional as F
from torch import nn
from torchvision.models import mobilenetv3, resnet
from torchvision.models.segmentation.deeplabv3 import _deeplabv3_mobilenetv3, _deeplabv3_resnet
from torchvision.models.segmentation.lraspp import _lraspp_mobilenetv3

from engine.registry import MODELS, Range
from engine.transfer import Rows
from models.weights import load_pretrained, resolve_pretrained

IGNORE_INDEX = 255


class SegmentationModel(nn.Module):
    """{'loss_seg', 'loss_aux'?} in training (loss_aux already weighted), logits in eval.
    The torchvision network is `net` (published weights load through engine.transfer, which maps
    torchvision's keys onto `net.`)."""

    def __init__(self, net, aux_weight=0.5, ignore_index=IGNORE_INDEX):
        super().__init__()
        self.net, self.aux_weight, self.ignore_index = net, aux_weight, ignore_index

    def forward(self, images, targets=None):
        outputs = self.net(images)
        if not (self.training and targets is not None):
            return outputs["out"]
        losses = {"loss_seg": F.cross_entropy(outputs["out"], targets, ignore_index=self.ignore_index)}
        if "aux" in outputs:
            losses["loss_aux"] = self.aux_weight * F.cross_entropy(outputs["aux"], targets,
                                                                   ignore_index=self.ignore_index)
        return losses


def _backbone(build, weights, weights_backbone):
    weights_backbone = resolve_pretrained(weights, weights_backbone)  # the model's weights win
    backbone = build()
    if weights_backbone:
        load_pretrained(backbone, weights_backbone, strict_shapes=True)
    return backbone


# the last convolutions of the classifiers (and of DeepLabV3's auxiliary FCN head): a channel per class
LRASPP_CLASS_PARAMS = {"net.classifier.low_classifier": Rows(), "net.classifier.high_classifier": Rows()}
DEEPLAB_CLASS_PARAMS = {"net.classifier.4": Rows(), "net.aux_classifier.4": Rows()}


@MODELS.register(task="semantic_segmentation", quantizable=False, exports=("onnx", "torch_export"),
                 ranges={"num_classes": Range(ge=1)}, class_params=LRASPP_CLASS_PARAMS)
def lraspp_mobilenet_v3_large(num_classes=21, weights=None, weights_backbone=None):
    """LR-ASPP (Howard et al. 2019) on a dilated MobileNetV3-Large; no auxiliary head.
    weights: e.g. LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1 or a local file;
    weights_backbone: e.g. MobileNet_V3_Large_Weights.IMAGENET1K_V1."""
    backbone = _backbone(lambda: mobilenetv3.mobilenet_v3_large(dilated=True), weights, weights_backbone)
    return SegmentationModel(_lraspp_mobilenetv3(backbone, num_classes), 0.0)


@MODELS.register(task="semantic_segmentation", quantizable=False, exports=("onnx", "torch_export"),
                  ranges={"num_classes": Range(ge=1), "aux_weight": Range(ge=0)}, class_params=DEEPLAB_CLASS_PARAMS)
def deeplabv3_mobilenet_v3_large(num_classes=21, aux_loss=True, aux_weight=0.5, weights=None,
                                 weights_backbone=None):
    """DeepLabV3 (Chen et al. 2017) on a dilated MobileNetV3-Large, with torchvision's FCN
    auxiliary head on C2 when aux_loss."""
    backbone = _backbone(lambda: mobilenetv3.mobilenet_v3_large(dilated=True), weights, weights_backbone)
    return SegmentationModel(_deeplabv3_mobilenetv3(backbone, num_classes, aux_loss), aux_weight)


@MODELS.register(task="semantic_segmentation", quantizable=False, exports=("onnx", "torch_export"),
                  ranges={"num_classes": Range(ge=1), "aux_weight": Range(ge=0)}, class_params=DEEPLAB_CLASS_PARAMS)
def deeplabv3_resnet50(num_classes=21, aux_loss=True, aux_weight=0.5, weights=None, weights_backbone=None):
    """DeepLabV3 on ResNet-50 with dilated layer3/layer4 (output stride 8), FCN auxiliary head on
    layer3 when aux_loss. weights_backbone: e.g. ResNet50_Weights.IMAGENET1K_V1."""
    backbone = _backbone(lambda: resnet.resnet50(replace_stride_with_dilation=[False, True, True]), weights,
                         weights_backbone)
    return SegmentationModel(_deeplabv3_resnet(backbone, num_classes, aux_loss), aux_weight)
