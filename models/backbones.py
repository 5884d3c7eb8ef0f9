"""The backbone prologue of torchvision's detectors, written once: pretrained weights -> trainable
layers -> frozen BatchNorm -> the backbone with its weights (Faster R-CNN, Panoptic FPN)."""
import warnings

from torch import nn
from torchvision.ops import misc as misc_nn_ops

from engine.config import ConfigError
from models.weights import load_pretrained, resolve_pretrained


def check_trainable_layers(value, pretrained, maximum, default):
    """torchvision's _validate_trainable_layers: without pretrained weights every layer trains."""
    if value is not None and not 0 <= value <= maximum:
        raise ConfigError(f"model.trainable_backbone_layers must be 0..{maximum}, got {value}")
    if not pretrained:
        if value is not None and value != maximum:
            warnings.warn(f"model.trainable_backbone_layers={value} has no effect without model.weights or "
                          f"model.weights_backbone: all {maximum} layers are trained (as torchvision does)")
        return maximum
    return default if value is None else value


def pretrained_body(build, weights, weights_backbone, trainable_layers, maximum, default,
                    scratch_norm=nn.BatchNorm2d, pretrained_norm=misc_nn_ops.FrozenBatchNorm2d):
    """A detector's backbone body, as torchvision's builders make it:
    1. the detector's `weights` win over `weights_backbone`; both files are found first;
    2. with either, `default` of the `maximum` backbone layers train (or `trainable_layers`); from scratch all;
    3. BatchNorm is `pretrained_norm` (FrozenBatchNorm2d; torchvision's v2 detectors: BatchNorm2d) when
       pretrained, `scratch_norm` otherwise;
    4. build(norm_layer=...) gets the backbone weights.
    Returns (body, number of trainable layers) for torchvision's feature extractor."""
    weights_backbone = resolve_pretrained(weights, weights_backbone)
    pretrained = bool(weights or weights_backbone)
    trainable = check_trainable_layers(trainable_layers, pretrained, maximum, default)
    body = build(norm_layer=pretrained_norm if pretrained else scratch_norm)
    if weights_backbone:
        load_pretrained(body, weights_backbone, strict_shapes=True)
    return body, trainable
