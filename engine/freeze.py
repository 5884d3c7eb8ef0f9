"""train.freeze: modules frozen for the first epochs, then trained (fine-tuning's freeze-then-unfreeze).

While frozen, the matched parameters have requires_grad False, so they get no gradient and the
optimizer leaves them out of its step (no weight decay, no momentum or Adam state: torch's optimizers
step only parameters with a gradient), and their BatchNorm layers stay in eval mode whatever
model.train() says, with track_running_stats off, so that precise_bn leaves their statistics alone
too. The parameters are in the optimizer from the start, in groups of their own with the settings they
would have anyway (lr_mult, weight decay; engine.optim.build_optimizer's `apart`): at the unfreeze
they step at their group's lr of that moment, the schedule's factor times the group's base lr, their
state (momentum, Adam's moments) starting then, and the optimizer's groups never change, so a
checkpoint restores them as they are. Whether the modules are frozen is a function of the epoch alone, which the
checkpoint holds: a resume freezes or unfreezes as the uninterrupted run did at that epoch.

Under DDP a parameter that does not require a gradient when the wrapper is built is left out of its
buckets; the wrapper is built again, around the same module, at the freeze and at the unfreeze.
"""
import logging
import types

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engine.config import ConfigError
from engine.dist import unwrap
from engine.optim import check_patterns, name_matches

log = logging.getLogger(__name__)


def _stay_in_eval(self, mode=True):
    """A frozen BatchNorm's train(): eval mode whatever the mode asked."""
    return nn.Module.train(self, False)


class Freezer:
    """The parameters and BatchNorm layers train.freeze names, and whether they are frozen now."""

    def __init__(self, cfg, model, where=""):
        self.modules, self.epochs = list(cfg.modules), cfg.epochs
        model = unwrap(model)
        named = dict(model.named_parameters())
        trainable = [n for n, p in named.items() if p.requires_grad]
        check_patterns(trainable, self.modules, "train.freeze.modules", where, "trainable parameter")
        self.names = [n for n in trainable if any(name_matches(n, pat) for pat in self.modules)]
        if len(self.names) == len(trainable):
            raise ConfigError(f"{where}train.freeze.modules {self.modules}: every trainable parameter of the model "
                              f"would be frozen, nothing would train for {self.epochs} epoch(s); name fewer modules")
        self.params = [named[n] for n in self.names]
        frozen = {id(p) for p in self.params}
        # BatchNorm layers under a matched module, or whose parameters are all frozen
        self.norms = [m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and (
            any(name_matches(n, pat) for pat in self.modules)
            or (list(m.parameters()) and all(id(p) in frozen for p in m.parameters())))]
        self.tracking = [m.track_running_stats for m in self.norms]
        self.frozen = False

    def at_epoch(self, run, epoch):
        """Frozen for epochs 0 .. epochs - 1 (0-based), trained from `epochs` on: called before each epoch's
        training (and its evaluation), on a fresh run as on a resumed one."""
        frozen = epoch < self.epochs
        if frozen == self.frozen:
            return
        self.frozen = frozen
        for p in self.params:
            p.requires_grad_(not frozen)
            p.grad = None
        for m, tracking in zip(self.norms, self.tracking):
            if frozen:
                m.train = types.MethodType(_stay_in_eval, m)
                m.track_running_stats = False  # eval mode reads the running statistics still; precise_bn skips it
                nn.Module.train(m, False)
            else:  # the next model.train() (the epoch's) sets its mode
                del m.train
                m.track_running_stats = tracking
        rewrap_ddp(run)
        if frozen:
            log.info("train.freeze: %d parameter tensors (%d BatchNorm layers in eval mode) of %s frozen for the "
                     "first %d epoch(s)", len(self.params), len(self.norms), ", ".join(self.modules), self.epochs)
        else:
            ids = {id(p) for p in self.params}
            lrs = sorted({g["lr"] for g in run.optimizer.param_groups if any(id(p) in ids for p in g["params"])})
            log.info("train.freeze: %s unfrozen at epoch %d, lr %s", ", ".join(self.modules), epoch + 1,
                     ", ".join(f"{lr:.6g}" for lr in lrs))


def rewrap_ddp(run):
    """DDP built again around its module, with the same settings: it buckets the parameters that require
    a gradient now (every process does this at the same epoch; the module's state is broadcast from rank 0
    again, equal already)."""
    old = run.model
    if not isinstance(old, DistributedDataParallel):
        return
    run.model = type(old)(old.module, device_ids=old.device_ids, find_unused_parameters=old.find_unused_parameters,
                          gradient_as_bucket_view=old.gradient_as_bucket_view, static_graph=old.static_graph)
