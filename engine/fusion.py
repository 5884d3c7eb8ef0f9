"""Model surgery for inference that holds for any nn.Module, whatever its family: each Conv2d ->
BatchNorm2d pair folded into one Conv2d. The eval runner (engine.evaluation.evaluate) applies it to
every model it runs (training's evaluations, the budget's timing, evaluate.py, quantize.py), so it
lives in engine/, which imports no family package."""
import copy

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval


def _conv_bn_pairs(model):
    """(sequential, conv name, bn name) for each Conv2d directly followed by a BatchNorm2d inside an
    nn.Sequential (only there does the order of the children say that one feeds the other); exact
    types only, so quantization-aware and frozen variants stay as they are, and none with hooks."""
    pairs = []
    for seq in model.modules():
        if not isinstance(seq, nn.Sequential):
            continue
        names = list(seq._modules)
        for a, b in zip(names, names[1:]):
            conv, bn = seq._modules[a], seq._modules[b]
            if (type(conv) is nn.Conv2d and type(bn) is nn.BatchNorm2d and bn.running_mean is not None
                    and conv.out_channels == bn.num_features and not (conv._forward_hooks or bn._forward_hooks
                                                                      or bn._forward_pre_hooks)):
                pairs.append((seq, a, b))
    return pairs


def fold_batch_norms(model):
    """For evaluation: a copy of an eval-mode model with each Conv2d -> BatchNorm2d pair folded
    into one Conv2d (torch's fuse_conv_bn_eval): the same function up to float rounding, without
    a pass of the normalisation over every activation (about a sixth of SSDlite's CPU time). The
    model itself comes back when there is nothing to fold, when it trains, or when it is compiled
    or scripted (a copy would not be what runs)."""
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if (plain.training or hasattr(plain, "_orig_mod") or isinstance(plain, torch.jit.ScriptModule)
            or not _conv_bn_pairs(plain)):
        return model
    folded = copy.deepcopy(plain)
    for seq, conv, bn in _conv_bn_pairs(folded):
        seq._modules[conv] = fuse_conv_bn_eval(seq._modules[conv], seq._modules[bn])
        seq._modules[bn] = nn.Identity()
    return folded
