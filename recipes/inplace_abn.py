"""Recipes inplace_abn and inplace_abn_sync: a model's BatchNorm + activation pairs as InPlace-ABN
(models/inplace_abn.py), as Mapillary's Seamless Scene Segmentation trains (leaky ReLU 0.01,
synchronized BatchNorm); GroupNorm + activation pairs likewise, as InPlace-AGN.

A pair converts only where rewriting the BN's input in place is safe and the activation inverts:
  - inside an nn.Sequential (or torchvision's IntermediateLayerGetter, which runs its children in
    order): Conv -> BatchNorm2d -> activation, three consecutive children, so the BN input is the
    convolution's fresh output and the BN output reaches only the activation;
  - torchvision's ResNet Bottleneck / BasicBlock: bn1 -> relu, bn2 -> relu, and the last BN with
    the shortcut inside the op: act(BN(conv3) + shortcut) (the shortcut is kept for backward by the
    block's first convolution anyway).
  - a BatchNorm without an activation whose output is kept for backward anyway, as InPlace-ABN with
    the identity: the ResNet block's shortcut BN (downsample.1, kept by the block's last InPlace-ABN)
    and torchvision's FeaturePyramidNetwork output blocks (layer_blocks.N.1, kept by the heads that
    read the features). Its input, which a BatchNorm keeps, is no longer kept.
  - Conv -> GroupNorm -> activation in an nn.Sequential (Panoptic FPN's semantic head) as InPlace-AGN:
    the same inversion with GroupNorm's per-sample statistics (recipe_args group_norm: false keeps them).
The activation: ReLU becomes leaky ReLU 0.01 (a model change, logged per pair), LeakyReLU with a
positive slope and ELU keep theirs; anything else (Hardswish, SiLU, GELU, ReLU6, none) is not
invertible here and the pair stays as it is. FrozenBatchNorm2d (pretrained backbones), a BN with a
negative weight (InPlace-ABN's scale is |w| + eps) and any other layout stay too. Every decision
is logged. The converted modules keep their names, so state dicts load both ways.
"""
import logging

import torch
from torch import nn
from torchvision.ops import FrozenBatchNorm2d
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork
from torchvision.models.resnet import BasicBlock, Bottleneck
from torchvision.models._utils import IntermediateLayerGetter

from engine import dist
from engine.config import ConfigError
from engine.hooks import Recipe
from engine.registry import RECIPES
from models.inplace_abn import InPlaceABN, InPlaceABNSync, InPlaceAGN, from_batchnorm, from_groupnorm

log = logging.getLogger(__name__)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def invertible(act, slope):
    """(activation, parameter, note) for InPlaceABN, or None with the reason."""
    if type(act) is nn.ReLU:
        return ("leaky_relu", slope, f"ReLU became leaky ReLU {slope}"), None
    if type(act) is nn.LeakyReLU:
        if act.negative_slope > 0:
            return ("leaky_relu", act.negative_slope, ""), None
        return None, f"LeakyReLU slope {act.negative_slope} is not invertible"
    if type(act) is nn.ELU:
        return ("elu", act.alpha, ""), None
    return None, f"{type(act).__name__} is not invertible"


class ABNBottleneck(Bottleneck):
    """bn1, bn2 and bn3 as InPlace-ABN; bn3 takes the shortcut inside: act(BN(conv3) + shortcut)."""

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.bn3(self.conv3(out), identity)


class ABNBasicBlock(BasicBlock):
    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return self.bn2(self.conv2(self.bn1(self.conv1(x))), identity)


def convert_inplace_abn(model, sync=False, slope=0.01, group_norm=True):
    """Convert `model`'s safe BatchNorm (and, with group_norm, GroupNorm) + activation pairs in place.
    Returns (converted, kept): lists of (norm layer name, what) for the log."""
    c = _Conversion(InPlaceABNSync if sync else InPlaceABN, slope, group_norm)
    for prefix, module in list(model.named_modules()):
        full = (prefix + ".") if prefix else ""
        if type(module) in (Bottleneck, BasicBlock):
            c.resnet_block(module, full)
        elif type(module) is FeaturePyramidNetwork:
            for i, block in enumerate(module.layer_blocks):
                c.conv_bn_kept(block, f"{full}layer_blocks.{i}", "an FPN output, kept by the heads that read it")
        elif isinstance(module, (nn.Sequential, IntermediateLayerGetter)):
            c.sequential(module, full)
    c.untouched(model)
    return c.converted, c.kept


class _Conversion:
    """convert_inplace_abn's walk, a layout at a time; converted / kept: (norm layer name, what)."""

    def __init__(self, cls, slope, group_norm):
        self.cls, self.slope, self.group_norm = cls, slope, group_norm
        self.norms = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm) if group_norm else nn.modules.batchnorm._BatchNorm
        self.converted, self.kept = [], []

    def pair(self, norm, name, act, kept_output=None):
        """The in-place layer for norm + act, or None (kept, with why). kept_output: no activation; why
        the norm's output is kept for backward anyway."""
        group = type(norm) is nn.GroupNorm
        if group and not self.group_norm:
            self.kept.append((name, "GroupNorm, kept (recipe_args group_norm: false)"))
            return None
        if not group and type(norm) is not nn.BatchNorm2d:
            self.kept.append((name, f"{type(norm).__name__}, not a trainable BatchNorm2d"))
            return None
        choice, why = (("identity", 0.0, ""), None) if kept_output else invertible(act, self.slope)
        if choice is None:
            self.kept.append((name, why))
            return None
        if norm.affine and (norm.weight < 0).any():
            self.kept.append((name, f"negative {'GroupNorm' if group else 'BN'} weight: the in-place op's scale "
                                    "|w| + eps would change its output"))
            return None
        activation, param, note = choice
        kind = "InPlaceAGN" if group else "InPlaceABN"
        what = f"{kind}(identity): {kept_output}" if kept_output else \
            f"{type(act).__name__} -> {kind}({activation} {param})" + (f": {note}" if note else "")
        self.converted.append((name, what))
        if group:
            return from_groupnorm(norm, activation=activation, activation_param=param)
        return from_batchnorm(norm, self.cls, activation=activation, activation_param=param)

    def conv_bn_kept(self, seq, name, why):
        """Sequential(conv, BN) whose output is kept for backward anyway (`why`): the BN as identity InPlace-ABN."""
        if isinstance(seq, nn.Sequential) and len(seq) == 2 and isinstance(seq[0], CONVS):
            new = self.pair(seq[1], name + ".1", None, kept_output=why)
            if new is not None:
                seq[1] = new

    def resnet_block(self, module, full):
        """A torchvision Bottleneck / BasicBlock: all its BNs at once, as an ABN block, or none."""
        bottleneck = type(module) is Bottleneck
        stages = ["bn1", "bn2", "bn3"] if bottleneck else ["bn1", "bn2"]
        if not all(type(getattr(module, bn)) is nn.BatchNorm2d for bn in stages):
            self.kept += [(full + bn, "a ResNet block with another norm layer") for bn in stages]
        elif any((getattr(module, bn).weight < 0).any() for bn in stages):
            self.kept += [(full + bn, "negative BN weight: InPlace-ABN's scale |w| + eps would change its output")
                          for bn in stages]
        else:
            new = [self.pair(getattr(module, bn), full + bn, module.relu) for bn in stages]
            if all(m is not None for m in new):
                for bn, m in zip(stages, new):
                    setattr(module, bn, m)
                module.__class__ = ABNBottleneck if bottleneck else ABNBasicBlock
                self.conv_bn_kept(module.downsample, full + "downsample",
                                  "the shortcut, kept by the block's last InPlace-ABN")

    def sequential(self, module, full):
        """conv, norm, activation in a Sequential (or a feature extractor): the norm and activation as one."""
        names = list(module._modules)
        for i, key in enumerate(names):
            child = module._modules[key]
            if not isinstance(child, self.norms) or isinstance(child, (InPlaceABN, InPlaceAGN)):
                continue
            before = module._modules[names[i - 1]] if i > 0 else None
            after = module._modules[names[i + 1]] if i + 1 < len(names) else None
            if not isinstance(before, CONVS):
                self.kept.append((full + key, "its input is not a convolution's output in the same Sequential"))
            elif after is None:
                self.kept.append((full + key, "no activation follows it"))
            elif isinstance(module, IntermediateLayerGetter) and key in module.return_layers:
                self.kept.append((full + key, "its output is returned by the feature extractor"))
            else:
                new = self.pair(child, full + key, after)
                if new is not None:
                    module._modules[key] = new
                    module._modules[names[i + 1]] = nn.Identity()

    def untouched(self, model):
        """Norm layers the walk left untouched (e.g. in a custom forward) are kept as they are."""
        done = {n for n, _ in self.converted} | {n for n, _ in self.kept}
        for name, m in model.named_modules():
            if name not in done and not isinstance(m, (InPlaceABN, InPlaceAGN)) and \
                    isinstance(m, (self.norms, FrozenBatchNorm2d)):
                self.kept.append((name, "not in a layout this recipe knows to be safe"))


@RECIPES.register("inplace_abn")
class InPlaceABNRecipe(Recipe):
    """BatchNorm + activation pairs as InPlace-ABN (per-process statistics). `slope`: the leaky ReLU
    slope that replaces ReLU (the paper's 0.01). `group_norm`: GroupNorm + activation pairs too, as
    InPlace-AGN (false: GroupNorm stays as it is)."""
    order = 15  # after qat is refused, before syncbn, channels_last, amp, ema, compile, ddp
    sync = False

    def __init__(self, slope=0.01, group_norm=True):
        if not slope > 0:
            raise ConfigError(f"recipe_args.{self.name()}.slope must be > 0 (leaky ReLU must invert), got {slope}")
        if not isinstance(group_norm, bool):
            raise ConfigError(f"recipe_args.{self.name()}.group_norm must be true or false, got {group_norm!r}")
        self.slope, self.group_norm = slope, group_norm

    def name(self):
        return "inplace_abn_sync" if self.sync else "inplace_abn"

    def setup(self, run):
        names = set(run.recipes.names.values()) if getattr(run, "recipes", None) is not None else set()
        if "qat" in names:
            raise ConfigError(f"recipes: {self.name()} and qat cannot be combined (qat fuses Conv+BN+ReLU)")
        if "syncbn" in names:
            raise ConfigError(f"recipes: {self.name()} replaces BatchNorm itself; use inplace_abn_sync instead of "
                              f"{self.name()} + syncbn")
        model = dist.unwrap(run.model)
        converted, kept = convert_inplace_abn(model, sync=self.sync, slope=self.slope, group_norm=self.group_norm)
        if not converted:
            reasons = sorted({why for _, why in kept}) or ["the model has no BatchNorm" + (" or GroupNorm" if self.group_norm else "")]
            raise ConfigError(f"recipes: {self.name()} found no norm layer + activation pair to convert in "
                              f"model {run.cfg.model.name}: {'; '.join(reasons)}")
        for name, what in converted:
            log.info("%s: %s: %s", self.name(), name, what)
        for name, why in kept:
            log.info("%s: %s kept as it is: %s", self.name(), name, why)
        log.info("%s: %d norm layer + activation pairs converted, %d norm layers kept%s", self.name(), len(converted),
                 len(kept), " (statistics over all processes)" if self.sync and dist.is_distributed() else "")

    def as_trained(self, model):
        """The same conversion as setup, so a checkpoint's weights load into the model they were trained
        in (leaky ReLU, scale |w| + eps), not the unconverted one."""
        convert_inplace_abn(model, slope=self.slope, group_norm=self.group_norm)

    def for_inference(self, model):
        inference_form(model)


@RECIPES.register("inplace_abn_sync")
class InPlaceABNSyncRecipe(InPlaceABNRecipe):
    """inplace_abn with the batch statistics of every process of a torchrun job (gloo or nccl), correct
    with unequal per-process batches; in one process the same as inplace_abn."""
    sync = True


# ---------------------------------------------------------------- loading a converted model's checkpoint

def _activation_module(activation, param):
    return {"leaky_relu": lambda: nn.LeakyReLU(param, inplace=True), "elu": lambda: nn.ELU(param, inplace=True),
            "identity": lambda: None}[activation]()


def _plain_norm(m):
    """The ordinary norm layer that computes m's normalisation with its scale |w| + eps."""
    like = m.weight if m.weight is not None else getattr(m, "running_mean", None)
    factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
    if isinstance(m, InPlaceAGN):
        plain = nn.GroupNorm(m.num_groups, m.num_channels, m.eps, **factory)
    else:
        plain = nn.BatchNorm2d(m.num_features, m.eps, m.momentum, True, m.track_running_stats, **factory)
        if m.track_running_stats:
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                getattr(plain, key).copy_(getattr(m, key))
    with torch.no_grad():
        plain.weight.copy_(m.weight.abs() + m.eps if m.weight is not None else torch.full_like(plain.weight, 1 + m.eps))
        plain.bias.copy_(m.bias if m.bias is not None else torch.zeros_like(plain.bias))
    return plain.train(m.training)


def inference_form(model):
    """`model` with every InPlace-ABN / InPlace-AGN replaced by the ordinary modules that compute the
    same in eval (BatchNorm2d / GroupNorm with weight |w| + eps, then LeakyReLU / ELU), so evaluation,
    export and quantization see standard layers. For inference only: training needs the in-place op.
    Returns the number of layers replaced."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, (ABNBottleneck, ABNBasicBlock)):
            stages = ["bn1", "bn2", "bn3"] if isinstance(module, ABNBottleneck) else ["bn1", "bn2"]
            module.relu = _activation_module(module.bn1.activation, module.bn1.activation_param)
            for bn in stages:
                setattr(module, bn, _plain_norm(getattr(module, bn)))
            module.__class__ = Bottleneck if isinstance(module, ABNBottleneck) else BasicBlock
            count += len(stages)
        for key, child in list(module._modules.items()):
            if isinstance(child, (InPlaceABN, InPlaceAGN)):
                act = _activation_module(child.activation, child.activation_param)
                plain = _plain_norm(child)
                module._modules[key] = plain if act is None else nn.Sequential(plain, act)
                count += 1
    return count
