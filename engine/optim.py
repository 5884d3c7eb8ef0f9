"""Optimizer and per-iteration LR schedule from the `optim` and `sched` config sections."""
import bisect
import math
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.optim import lr_scheduler

from engine.config import ConfigError

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
          nn.LocalResponseNorm)


def param_groups(model, weight_decay, norm_weight_decay=None, bias_weight_decay=None):
    """Split parameters so norm layers and biases can get their own weight decay (torchvision's rule)."""
    groups = {"other": [], "norm": [], "bias": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if norm_weight_decay is not None and isinstance(module, _NORMS):
                groups["norm"].append(p)
            elif bias_weight_decay is not None and name == "bias":
                groups["bias"].append(p)
            else:
                groups["other"].append(p)
    decay = {"other": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    return [{"params": ps, "weight_decay": decay[k]} for k, ps in groups.items() if ps]


def apply_param_group_rules(model, groups, rules, lr):
    """Split each group by the first rule (optim.param_groups) whose fnmatch patterns match a
    parameter's name: its lr becomes lr * lr_mult, its weight decay the rule's when set."""
    if not rules:
        return groups
    names = {id(p): n for n, p in model.named_parameters()}
    for i, rule in enumerate(rules):
        if not any(fnmatchcase(n, pat) for n in names.values() for pat in rule.params):
            raise ConfigError(f"optim.param_groups[{i}]: params {rule.params} match no parameter name "
                             f"(names look like {', '.join(list(names.values())[:3])}, ...)")
    out = []
    for group in groups:
        split = {}
        for p in group["params"]:
            rule = next((r for r in rules if any(fnmatchcase(names[id(p)], pat) for pat in r.params)), None)
            split.setdefault(id(rule), (rule, []))[1].append(p)
        for rule, params in split.values():
            new = dict(group, params=params)
            if rule is not None:
                new["lr"] = lr * rule.lr_mult
                if rule.weight_decay is not None:
                    new["weight_decay"] = rule.weight_decay
            out.append(new)
    return out


def build_optimizer(model, cfg):
    params = param_groups(model, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    params = apply_param_group_rules(model, params, cfg.param_groups, cfg.lr)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, **fused_kernel(params, cfg.fused))
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=cfg.lr, momentum=cfg.momentum, alpha=cfg.alpha, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **fused_kernel(params, cfg.fused))


def state_slots(cfg):
    """How many tensors the size of the weights the optimizer keeps (checkpoint size estimates):
    SGD's momentum buffer; RMSprop's square average and momentum buffer; AdamW's two moments."""
    return {"sgd": 1, "rmsprop": 2, "adamw": 2}[cfg.name]


def fused_kernel(groups, wanted):
    """fused=True where torch has the kernel (float parameters on CPU or CUDA): the same update in one
    call. On CPU torch defaults to a loop over tensors; MobileNetV3-Small's AdamW step took 12.5 ms
    that way and 2.8 ms fused (docs/performance.md), equal to 1e-6."""
    params = [p for g in groups for p in g["params"]]
    ok = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return {"fused": True} if wanted and ok else {}


def build_scheduler(optimizer, cfg, epochs, iters_per_epoch):
    """Stepped once per iteration; epoch-based settings are converted, so the LR at each epoch
    boundary equals what torchvision's per-epoch schedulers give, with smooth warm-up and cosine.
    The warm-up is linear from `warmup_start_factor`, over `warmup_iters` iterations or
    `warmup_epochs` epochs, combined with the main schedule as `warmup_mode` says:

    - chain (torchvision's references/classification): warm-up, then the main schedule, whose
      step sizes, milestones and cosine count from the end of the warm-up (as SequentialLR).
    - overlay (torchvision's references/detection, engine.train_one_epoch): the warm-up factor
      multiplies the first iterations of epoch 0, at most len(loader) - 1 of them, and the main
      schedule counts from iteration 0.
    One LambdaLR in closed form: the lr is a function of the iteration alone.
    """
    return lr_scheduler.LambdaLR(optimizer, schedule_factor(cfg, epochs, iters_per_epoch, optimizer.defaults["lr"]))


def schedule_factor(cfg, epochs, iters_per_epoch, lr):
    """The lr factor of build_scheduler as a function of the iteration (`epochs` may be fractional:
    a time budget builds it for its planned iterations, engine.budget)."""
    if cfg.warmup_iters is not None and cfg.warmup_epochs:
        raise ConfigError("sched: set warmup_iters or warmup_epochs, not both")
    warmup = cfg.warmup_iters if cfg.warmup_iters is not None else int(round(cfg.warmup_epochs * iters_per_epoch))
    if cfg.warmup_mode == "overlay":
        warmup, offset = min(warmup, iters_per_epoch - 1), 0
    else:
        offset = warmup
    main = _main_factor(cfg, epochs * iters_per_epoch - offset, iters_per_epoch, lr)

    def factor(it):
        ramp = cfg.warmup_start_factor + (1 - cfg.warmup_start_factor) * it / warmup if it < warmup else 1.0
        if cfg.warmup_mode == "chain":
            return ramp if it < warmup else main(it - warmup)
        return ramp * main(it)

    return factor


def _main_factor(cfg, total, iters_per_epoch, lr):
    """Factor of the main schedule at iteration t (counted from its start), in closed form."""
    if cfg.name == "constant":
        return lambda t: 1.0
    if cfg.name == "step":
        return lambda t: cfg.gamma ** (t // (cfg.step_size * iters_per_epoch))
    if cfg.name == "multistep":
        milestones = sorted(m * iters_per_epoch for m in cfg.milestones)
        return lambda t: cfg.gamma ** bisect.bisect_right(milestones, t)
    if cfg.name == "poly":  # torchvision's segmentation reference: (1 - iter / max_iter) ** 0.9
        return lambda t: (1 - min(t, total) / max(1, total)) ** cfg.power
    floor = cfg.eta_min / lr if lr else 0.0
    if cfg.name == "linear":  # to eta_min at the last iteration (budgeted training, Li et al., ICLR 2020)
        return lambda t: floor + (1 - floor) * (1 - min(t, total) / max(1, total))
    return lambda t: floor + (1 - floor) * (1 + math.cos(math.pi * min(t, total) / max(1, total))) / 2


def scale_lr_with_batch(cfg, global_batch):
    """The linear scaling rule (Goyal et al., 2017): lr grows with the global batch. Returns the
    optim config to build from (lr scaled when optim.scale_lr_with_batch is set) and a log line."""
    if cfg.scale_lr_with_batch is None:
        return cfg, f"lr {cfg.lr:g}"
    base = cfg.scale_lr_with_batch.base_batch
    lr = cfg.lr * global_batch / base
    return (cfg.model_copy(update={"lr": lr}),
            f"lr {lr:g} = optim.lr {cfg.lr:g} x global batch {global_batch} / base_batch {base} (linear scaling)")
