"""BatchNorm recipes: precise_bn (recompute running statistics) and syncbn (statistics across processes:
torch's SyncBatchNorm on CUDA, models.inplace_abn.SyncBatchNormCPU under gloo on CPU)."""
import itertools
import logging

import torch
from torch import nn

from engine import dist
from engine.registry import RECIPES
from engine.config import ConfigError
from engine.hooks import Recipe
from models.inplace_abn import InPlaceABN, SyncBatchNormCPU, from_batchnorm


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


def convert_to_syncbn_cpu(model):
    """Every BatchNorm layer as a SyncBatchNormCPU: torch's SyncBatchNorm maths over gloo (same parameters,
    statistics and outputs; the activations around it untouched). Returns (model, number converted)."""
    count = 0
    for parent in list(model.modules()):
        for key, child in list(parent._modules.items()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, InPlaceABN):
                parent._modules[key] = from_batchnorm(child, SyncBatchNormCPU)
                count += 1
    return model, count


@RECIPES.register("syncbn")
class SyncBN(Recipe):
    """BatchNorm statistics over the global batch of a torchrun job: torch's SyncBatchNorm on CUDA,
    SyncBatchNormCPU (the same maths on gloo, unequal per-process batches allowed) on CPU."""
    order = 20

    def setup(self, run):
        if not dist.is_distributed():
            return
        model = dist.unwrap(run.model)
        if any(isinstance(m, InPlaceABN) for m in model.modules()):
            raise ConfigError("recipes: syncbn would turn InPlace-ABN layers back into BatchNorm; "
                              "use inplace_abn_sync instead of inplace_abn + syncbn")
        if run.device.type == "cpu":  # torch's SyncBatchNorm runs on CUDA only
            run.model, count = convert_to_syncbn_cpu(run.model)
            logging.getLogger(__name__).info(
                "syncbn: %d BatchNorm layers compute their statistics over the %d processes' global batch "
                "(SyncBatchNormCPU over gloo)", count, dist.world_size())
            return
        run.model = convert_to_syncbn(run.model)
