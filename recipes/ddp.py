"""DistributedDataParallel; added automatically when launched with torchrun on several processes."""
from torch.nn.parallel import DistributedDataParallel

from engine import dist
from engine.registry import RECIPES
from engine.hooks import Recipe


class _DDP(DistributedDataParallel):
    """DDP whose unused-parameter error names the config key that fixes it."""

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            if "find_unused_parameters" not in str(e) or self.find_unused_parameters:
                raise
            raise RuntimeError("DDP: some parameters got no gradient in the last step (a branch the "
                               "loss did not use): set recipe_args.ddp.find_unused_parameters=true, or make "
                               f"the model use them.\nDDP said: {e}") from None


@RECIPES.register("ddp")
class DDP(Recipe):
    order = 80

    def __init__(self, find_unused_parameters=False, static_graph=False, gradient_as_bucket_view=False):
        # find_unused_parameters: for models with branches that get no gradient in some steps (a
        # panoptic head); static_graph: the same graph every step (faster with checkpointing);
        # gradient_as_bucket_view: gradients share DDP's buckets (saves memory)
        self.kwargs = dict(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                           gradient_as_bucket_view=gradient_as_bucket_view)

    def setup(self, run):
        if dist.is_distributed():
            ids = [run.device.index] if run.device.type == "cuda" else None
            run.model = _DDP(run.model, device_ids=ids, **self.kwargs)
