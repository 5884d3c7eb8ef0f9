"""Optimizer and per-iteration LR schedule from the `optim` and `sched` config sections."""
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


def build_optimizer(model, cfg):
    params = param_groups(model, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
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
    else:
        main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup), eta_min=cfg.eta_min)
    if warmup == 0:
        return main
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=cfg.warmup_start_factor, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])



def scale_lr_with_batch(cfg, global_batch):
    """The linear scaling rule (Goyal et al., 2017): lr grows with the global batch. Returns the
    optim config to build from (lr scaled when optim.scale_lr_with_batch is set) and a log line."""
    if cfg.scale_lr_with_batch is None:
        return cfg, f"lr {cfg.lr:g}"
    base = cfg.scale_lr_with_batch.base_batch
    lr = cfg.lr * global_batch / base
    return (cfg.model_copy(update={"lr": lr}),
            f"lr {lr:g} = optim.lr {cfg.lr:g} x global batch {global_batch} / base_batch {base} (linear scaling)")
