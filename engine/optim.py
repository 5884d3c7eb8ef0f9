"""Optimizer and per-iteration LR schedule from the `optim` and `sched` config sections."""
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.optim import lr_scheduler

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
            raise ValueError(f"optim.param_groups[{i}]: params {rule.params} match no parameter name "
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
                               weight_decay=cfg.weight_decay)
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=cfg.lr, momentum=cfg.momentum, alpha=cfg.alpha, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer, cfg, epochs, iters_per_epoch):
    """Stepped once per iteration; epoch-based settings are converted, so the LR at each epoch
    boundary equals what torchvision's per-epoch schedulers give, with smooth warm-up and cosine.
    As in torchvision, step sizes and milestones count from the end of the warm-up."""
    warmup = int(round(cfg.warmup_epochs * iters_per_epoch))
    total = epochs * iters_per_epoch
    if cfg.name == "constant":
        main = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    elif cfg.name == "step":
        main = lr_scheduler.StepLR(optimizer, step_size=cfg.step_size * iters_per_epoch, gamma=cfg.gamma)
    elif cfg.name == "multistep":
        main = lr_scheduler.MultiStepLR(optimizer, [m * iters_per_epoch for m in cfg.milestones],
                                        gamma=cfg.gamma)
    elif cfg.name == "poly":  # torchvision's segmentation reference: per iteration, after the warm-up
        main = lr_scheduler.PolynomialLR(optimizer, total_iters=max(1, total - warmup), power=cfg.power)
    else:
        main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup), eta_min=cfg.eta_min)
    if warmup == 0:
        return main
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=cfg.warmup_start_factor, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])

