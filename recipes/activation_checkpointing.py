"""Recipe activation_checkpointing: chosen submodules run under torch.utils.checkpoint
(use_reentrant=False) in training, so only their inputs are kept for backward and their inside is
recomputed then: less activation memory for one more forward of those modules.

    recipes: [activation_checkpointing]
    recipe_args: {activation_checkpointing: {modules: [backbone.body.layer1, InvertedResidual]}}

`modules`: dotted module names (`model.get_submodule`) or class names (every module of that class).
Without it, the family's backbone stages: the children with parameters of the first of
backbone.body (detection, panoptic), backbone (segmentation), net.features (classification),
encoder.layers (sequence) that the model has. A module inside another chosen one is not wrapped
twice. The modules keep their names (state dicts load both ways); eval runs them as they are.

BatchNorm inside a checkpointed module would update its running statistics twice (forward and
recomputation): they are put back after the recomputation, so they match a run without the recipe.
"""
import contextlib
import logging

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from engine import dist
from engine.config import ConfigError
from engine.hooks import Recipe
from engine.registry import RECIPES

log = logging.getLogger(__name__)
DEFAULT_ROOTS = ("backbone.body", "backbone", "net.features", "encoder.layers")
_CLASSES = {}
_HELD = []  # lists that record the inputs each checkpointed forward keeps (benchmark's saved bytes)


@contextlib.contextmanager
def record_kept_inputs(sink):
    """Append to `sink` the tensors a checkpointed module keeps for its recomputation (its inputs): what
    torch.autograd.graph.saved_tensors_hooks does not see, as checkpoint keeps them itself."""
    _HELD.append(sink)
    try:
        yield sink
    finally:
        _HELD.remove(sink)


@contextlib.contextmanager
def running_stats_kept(module):
    """The BatchNorm running statistics of `module` as they were before the block (the recomputation
    must not count a batch twice)."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
             and m.track_running_stats]
    saved = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, bufs in zip(norms, saved):
                for buf, old in zip((m.running_mean, m.running_var, m.num_batches_tracked), bufs):
                    buf.copy_(old)


def checkpointed_class(base):
    """A subclass of `base` whose training forward runs under checkpoint (cached per class)."""
    if base not in _CLASSES:
        def forward(self, *args, **kwargs):
            if not (self.training and torch.is_grad_enabled()):
                return base.forward(self, *args, **kwargs)
            calls = []
            for sink in _HELD:
                sink += [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]  # dicts too (FPN)

            def run(*a, **k):
                calls.append(1)
                if len(calls) == 1:
                    return base.forward(self, *a, **k)
                with running_stats_kept(self):  # the recomputation in backward
                    return base.forward(self, *a, **k)
            return checkpoint(run, *args, use_reentrant=False, **kwargs)
        _CLASSES[base] = type(f"Checkpointed{base.__name__}", (base,), {"forward": forward, "_checkpointed": True})
    return _CLASSES[base]


def default_modules(model):
    for root in DEFAULT_ROOTS:
        try:
            parent = model.get_submodule(root)
        except AttributeError:
            continue
        names = [f"{root}.{n}" for n, child in parent.named_children()
                 if any(True for _ in child.parameters()) and any(True for _ in child.children())]
        if names:
            return names
    return []


def resolve(model, specs):
    """Module names for `specs` (names or class names), outermost only."""
    found = []
    by_class = {}
    for name, m in model.named_modules():
        for cls in type(m).__mro__:  # a converted block (ABNBottleneck) is still a Bottleneck
            if cls not in (nn.Module, object):
                by_class.setdefault(cls.__name__, []).append(name)
    for spec in specs:
        try:
            model.get_submodule(spec)
            found.append(spec)
        except AttributeError:
            if spec not in by_class:
                raise ConfigError(f"recipe_args.activation_checkpointing.modules: {spec!r} is neither a module name "
                                  f"nor a module class of this model (e.g. {', '.join(list(by_class)[:8])})") from None
            found += by_class[spec]
    found = sorted(set(found))
    return [n for n in found if n and not any(n.startswith(o + ".") for o in found if o != n)]


def apply_checkpointing(model, specs=None):
    names = resolve(model, specs) if specs else default_modules(model)
    for name in names:
        m = model.get_submodule(name)
        if not getattr(m, "_checkpointed", False):
            m.__class__ = checkpointed_class(type(m))
    return names


@RECIPES.register("activation_checkpointing")
class ActivationCheckpointing(Recipe):
    order = 25  # after inplace_abn / syncbn swap modules, before channels_last, amp, ema, compile, ddp

    def __init__(self, modules=None):
        if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) for m in modules)):
            raise ConfigError(f"recipe_args.activation_checkpointing.modules must be a list of module names or "
                              f"class names, got {modules!r}")
        self.modules = list(modules) if modules else None

    def setup(self, run):
        model = dist.unwrap(run.model)
        names = apply_checkpointing(model, self.modules)
        if not names:
            raise ConfigError(f"recipes: activation_checkpointing has no default modules for model "
                              f"{run.cfg.model.name}: name them in recipe_args.activation_checkpointing.modules")
        log.info("activation_checkpointing: %d module(s) recomputed in backward: %s", len(names),
                 ", ".join(names) if len(names) <= 12 else ", ".join(names[:12]) + ", ...")
