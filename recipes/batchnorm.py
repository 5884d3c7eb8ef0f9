"""BatchNorm recipes: precise_bn (recompute running statistics) and syncbn (statistics across GPUs)."""
import itertools
import logging

import torch
from torch import nn

from engine import dist
from engine.registry import RECIPES
from engine.hooks import Recipe


@torch.no_grad()
def recompute_bn_stats(model, batches, forward):
    """Replace BatchNorm running statistics by their plain average over `batches` (detectron2's
    PreciseBN). `forward(model, batch)` runs one training-mode forward. Returns batches used."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return 0
    momenta = [m.momentum for m in norms]
    was_training = model.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    model.train()
    n = 0
    for batch in batches:
        forward(model, batch)
        n += 1
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
        if dist.is_distributed():
            for buf in (m.running_mean, m.running_var):
                torch.distributed.all_reduce(buf)
                buf /= dist.world_size()
    model.train(was_training)
    return n


@RECIPES.register("precise_bn")
class PreciseBN(Recipe):
    """torchvision's MobileNetV3 uses BatchNorm momentum 0.01: after a short run the running
    statistics lag far behind the weights and eval-mode accuracy can sit at chance. Recompute them
    on `num_batches` training batches before every evaluation."""
    order = 70

    def __init__(self, num_batches=50):
        self.num_batches = num_batches

    def before_eval(self, run):
        batches = itertools.islice(run.train_loader, self.num_batches)
        model = dist.unwrap(run.model)
        recompute_bn_stats(model, batches, run.training_forward)
        for extra in run.recipes.eval_models(run).values():  # e.g. the EMA copy
            recompute_bn_stats(extra, itertools.islice(run.train_loader, self.num_batches), run.training_forward)


def convert_to_syncbn(model):
    """Every BatchNorm layer as a SyncBatchNorm (same parameters and statistics)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


@RECIPES.register("syncbn")
class SyncBN(Recipe):
    order = 20

    def setup(self, run):
        if not dist.is_distributed():
            return
        if run.device.type == "cpu":  # torch's SyncBatchNorm trains on GPUs only
            logging.getLogger(__name__).warning(
                "syncbn: SyncBatchNorm needs CUDA, so these CPU processes keep per-process BatchNorm: "
                "batch statistics come from each process's %d samples, not the global batch of %d, and the "
                "running statistics differ between processes (rank 0's are saved). Results match per-process "
                "BatchNorm, not SyncBN.", run.cfg.data.batch_size, run.cfg.data.batch_size * dist.world_size())
            return
        run.model = convert_to_syncbn(run.model)
