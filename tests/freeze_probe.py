"""A test-only recipe for tests/test_freeze.py: what train.freeze did, seen from inside the loop, saved to
<run folder>/probe<rank>.pt at the end. The processes torchrun starts register it through the config's
`imports: [freeze_probe]` (tests/ is their script's folder, on their path)."""
import os

import torch
from torch import nn

from engine import dist
from engine.hooks import Recipe
from engine.registry import RECIPES


def _clone(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


@RECIPES.register("_freeze_probe")
class FreezeProbe(Recipe):
    """At each epoch's start: the weights and buffers, each parameter's requires_grad, lr, weight decay and
    optimizer state size, and the extra models' weights (EMA); after each step: each BatchNorm layer's mode;
    `param` (a parameter name) just before and after the first step of each epoch."""
    order = 90  # after the other recipes' before_epoch

    def __init__(self, param=None, trained_statistics=False):
        self.param, self.epochs, self.steps, self.first = param, [], [], None
        self.trained_statistics = trained_statistics

    @torch.no_grad()
    def setup(self, run):
        """trained_statistics: BatchNorm statistics as a trained model's (not the fresh 0 / 1, which a reset
        would keep), before train.freeze applies."""
        if not self.trained_statistics:
            return
        generator = torch.Generator().manual_seed(0)
        for m in dist.unwrap(run.model).modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=generator) - 0.5)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=generator) + 0.5)
                m.num_batches_tracked.fill_(1000)

    def before_epoch(self, run):
        model = dist.unwrap(run.model)
        named = dict(model.named_parameters())
        group = {id(p): g for g in run.optimizer.param_groups for p in g["params"]}
        self.epochs.append({
            "epoch": run.epoch, "state": _clone(model),
            "requires_grad": {n: p.requires_grad for n, p in named.items()},
            "lr": {n: group[id(p)]["lr"] for n, p in named.items() if id(p) in group},
            "weight_decay": {n: group[id(p)]["weight_decay"] for n, p in named.items() if id(p) in group},
            "optimizer_state": {n: len(run.optimizer.state.get(p, {})) for n, p in named.items()},
            "extra": {k: _clone(m) for k, m in run.recipes.eval_models(run).items()}})
        self.first = named[self.param].detach().clone() if self.param else None

    def after_step(self, run):
        model = dist.unwrap(run.model)
        entry = {"epoch": run.epoch, "step": run.step, "bn_training": {
            n: m.training for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}}
        if self.first is not None:
            entry["param"] = (self.first, dict(model.named_parameters())[self.param].detach().clone())
            self.first = None
        self.steps.append(entry)

    def finish(self, run):
        torch.save({"epochs": self.epochs, "steps": self.steps, "final": _clone(dist.unwrap(run.model))},
                   os.path.join(run.output_dir, f"probe{dist.rank()}.pt"))
