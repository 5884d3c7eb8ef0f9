"""Optimizer and per-iteration LR schedule from the `optim` and `sched` config sections."""
import bisect
import math
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.optim import lr_scheduler

from engine.config import ConfigError
from engine.dist import unwrap
from engine.registry import closest

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

    def change(group, rule):
        group["lr"] = lr * rule.lr_mult
        if rule.weight_decay is not None:
            group["weight_decay"] = rule.weight_decay
    return split_groups(groups, lambda p: next((r for r in rules if any(fnmatchcase(names[id(p)], pat)
                                                                         for pat in r.params)), None), change)


def split_groups(groups, rule_of, change):
    """Each group split by the rule each parameter falls under (rule_of(p), None for none), in order;
    change(new_group, rule) sets what a rule changes in its part."""
    out = []
    for group in groups:
        split = {}
        for p in group["params"]:
            rule = rule_of(p)
            split.setdefault(id(rule), (rule, []))[1].append(p)
        for rule, params in split.values():
            new = dict(group, params=params)
            if rule is not None:
                change(new, rule)
            out.append(new)
    return out


def name_matches(name, pattern):
    """Does a parameter or module name fall under a pattern: the name itself, a module prefix on a
    dot boundary ('backbone' matches 'backbone.body.0.weight', not 'backbone2.x'), or an fnmatch
    pattern ('*.bn*')? The rule of optim.lr_mult and train.freeze.modules."""
    return name == pattern or name.startswith(pattern + ".") or fnmatchcase(name, pattern)


def check_patterns(names, patterns, key, where="", what="parameter"):
    """A ConfigError naming the first pattern that matches none of `names`."""
    for pattern in patterns:
        if not any(name_matches(n, pattern) for n in names):
            tops = sorted({n.split(".")[0] for n in names})
            parts = [n.split(".") for n in names]
            hint = closest(pattern, sorted({".".join(p[:i]) for p in parts for i in range(1, len(p))}))
            raise ConfigError(f"{where}{key}: '{pattern}' matches no {what} of the model{hint} (a module-name "
                              f"prefix or an fnmatch pattern; its top-level modules: {', '.join(tops[:12])})")


def apply_lr_mult(model, groups, lr_mult, lr, where=""):
    """optim.lr_mult: each group split by the longest pattern its parameters fall under (mmdetection's
    custom_keys rule), whose multiplier scales the group's lr."""
    if not lr_mult:
        return groups
    names = {id(p): n for n, p in model.named_parameters()}
    check_patterns([names[id(p)] for g in groups for p in g["params"]], lr_mult, "optim.lr_mult", where,
                   "trainable parameter")
    by_length = sorted(lr_mult, key=len, reverse=True)

    def change(group, pattern):
        group["lr"] = group.get("lr", lr) * lr_mult[pattern]
    return split_groups(groups, lambda p: next((pat for pat in by_length if name_matches(names[id(p)], pat)), None),
                        change)


def set_apart(groups, apart):
    """Each group split in two, the parameters in `apart` (train.freeze's) in a group of their own with the
    same settings: they start stepping later, all at once (fused SGD creates the momentum buffers of a group
    together, at its first step)."""
    out = []
    for group in groups:
        for params in ([p for p in group["params"] if id(p) not in apart],
                       [p for p in group["params"] if id(p) in apart]):
            if params:
                out.append(dict(group, params=params))
    return out


def build_optimizer(model, cfg, where="", apart=()):
    """`where`: the config file, named in errors. Parameter names are the model's own (under DDP and
    torch.compile wrappers). `apart`: parameters given groups of their own (train.freeze's)."""
    model = unwrap(model)
    params = param_groups(model, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    params = apply_param_group_rules(model, params, cfg.param_groups, cfg.lr)
    params = apply_lr_mult(model, params, cfg.lr_mult, cfg.lr, where)
    params = set_apart(params, {id(p) for p in apart})
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, **fused_kernel(params, cfg.fused))
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=cfg.lr, momentum=cfg.momentum, alpha=cfg.alpha, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **fused_kernel(params, cfg.fused))


def fits_state(optimizer, saved):
    """Does a saved optimizer state (state_dict()) fit this optimizer: the same groups, of the same sizes,
    whose per-weight tensors have the weights' shapes? Not when optim.lr_mult or optim.param_groups
    changed the grouping (torch's load_state_dict checks only the sizes, and only some)."""
    groups, saved_groups = optimizer.param_groups, saved.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
        return False
    ids, state = [i for g in saved_groups for i in g["params"]], saved.get("state", {})
    for p, i in zip((p for g in groups for p in g["params"]), ids):
        if any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in state.get(i, {}).values()):
            return False
    return True


def schedule_lr(optimizer):
    """The schedule's lr now, for optim.lr: the first group's lr without its multiplier (optim.lr_mult,
    optim.param_groups), as logged."""
    group, lr = optimizer.param_groups[0], optimizer.defaults["lr"]
    base = group.get("initial_lr", lr)
    return group["lr"] if base == lr else group["lr"] * lr / base


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
