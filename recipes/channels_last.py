"""NHWC memory format for the model and 4-D inputs (faster convolutions with AMX / tensor cores)."""
import torch

from engine.registry import RECIPES
from engine.hooks import Recipe


def model_to_channels_last(model):
    return model.to(memory_format=torch.channels_last)


def to_channels_last(inputs):
    """A 4-D tensor (an image batch) in NHWC; other inputs as they are."""
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs


@RECIPES.register("channels_last")
class ChannelsLast(Recipe):
    order = 30

    def setup(self, run):
        run.model = model_to_channels_last(run.model)

    def prepare_inputs(self, inputs):
        return to_channels_last(inputs)
