"""Image classifiers: torchvision's MobileNetV3 behind the loss-dict / predictions interface."""
import torch.nn.functional as F
from torch import nn
from torchvision.models import mobilenetv3
from torchvision.models.quantization.mobilenetv3 import QuantizableInvertedResidual, QuantizableMobileNetV3
from torchvision.models.quantization.utils import _replace_relu

from engine.registry import MODELS, Range
from engine.transfer import Rows


class Classifier(nn.Module):
    """Wraps a logits network: {'loss_cls': ...} in training, logits in eval (or without targets)."""

    def __init__(self, net, label_smoothing=0.0):
        super().__init__()
        self.net = net
        self.label_smoothing = label_smoothing

    def forward(self, inputs, targets=None):
        logits = self.net(inputs)
        if self.training and targets is not None:
            return {"loss_cls": F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)}
        return logits


def _mobilenet_v3(arch, num_classes, width_mult, reduced_tail, dilated, dropout, label_smoothing, quantize=False):
    if quantize:  # torchvision's quantizable variant (QuantStub/DeQuantStub, fuse_model): recipes qat/ptq
        block, cls = QuantizableInvertedResidual, QuantizableMobileNetV3
    else:
        block, cls = mobilenetv3.InvertedResidual, mobilenetv3.MobileNetV3
    settings, last_channel = mobilenetv3._mobilenet_v3_conf(
        arch, width_mult=width_mult, reduced_tail=reduced_tail, dilated=dilated)
    net = cls(settings, last_channel, num_classes=num_classes, dropout=dropout, block=block)
    if quantize:
        _replace_relu(net)  # as torchvision's quantized builder: no in-place ReLU in fused modules
    return Classifier(net, label_smoothing)


MOBILENET_RANGES = {"num_classes": Range(ge=1), "width_mult": Range(gt=0), "dropout": Range(ge=0, lt=1),
                    "label_smoothing": Range(ge=0, lt=1)}
# the last layer; model.weights (a state dict, a checkpoint, or e.g. MobileNet_V3_Large_Weights.IMAGENET1K_V1)
# load through the model registry (engine.transfer)
MOBILENET_CLASS_PARAMS = {"net.classifier.3": Rows()}


@MODELS.register(task="classification", quantizable=True, exports=("onnx", "torch_export", "torchscript"),
                  ranges=MOBILENET_RANGES, class_params=MOBILENET_CLASS_PARAMS)
def mobilenet_v3_large(num_classes=1000, width_mult=1.0, reduced_tail=False, dilated=False,
                       dropout=0.2, label_smoothing=0.0, quantize=False):
    """quantize: build torchvision's quantizable variant (same weights; for recipes qat / ptq)."""
    return _mobilenet_v3("mobilenet_v3_large", num_classes, width_mult, reduced_tail, dilated,
                         dropout, label_smoothing, quantize)


@MODELS.register(task="classification", quantizable=True, exports=("onnx", "torch_export", "torchscript"),
                  ranges=MOBILENET_RANGES, class_params=MOBILENET_CLASS_PARAMS)
def mobilenet_v3_small(num_classes=1000, width_mult=1.0, reduced_tail=False, dilated=False,
                       dropout=0.2, label_smoothing=0.0, quantize=False):
    """quantize: build torchvision's quantizable variant (same weights; for recipes qat / ptq)."""
    return _mobilenet_v3("mobilenet_v3_small", num_classes, width_mult, reduced_tail, dilated,
                         dropout, label_smoothing, quantize)
