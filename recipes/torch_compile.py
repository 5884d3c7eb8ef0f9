"""torch.compile of the (wrapped) model."""
import torch

from engine.registry import RECIPES
from engine.hooks import Recipe


@RECIPES.register("compile")
class Compile(Recipe):
    order = 90

    def __init__(self, mode=None, dynamic=None):
        self.mode, self.dynamic = mode, dynamic

    def setup(self, run):
        run.model = torch.compile(run.model, mode=self.mode, dynamic=self.dynamic)
