"""DistributedDataParallel; added automatically when launched with torchrun on several processes."""
from torch.nn.parallel import DistributedDataParallel

from engine import dist
from engine.registry import RECIPES
from engine.hooks import Recipe


@RECIPES.register("ddp")
class DDP(Recipe):
    order = 80

    def __init__(self, find_unused_parameters=False):
        # True for models with branches that get no gradient in some steps (e.g. a panoptic head)
        self.find_unused_parameters = find_unused_parameters

    def setup(self, run):
        if dist.is_distributed():
            ids = [run.device.index] if run.device.type == "cuda" else None
            run.model = DistributedDataParallel(run.model, device_ids=ids,
                                                find_unused_parameters=self.find_unused_parameters)
