"""Exponential moving average of the weights (torch.optim.swa_utils), evaluated and checkpointed."""
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from engine.config import ConfigError
from engine.dist import unwrap
from engine.registry import RECIPES
from engine.hooks import Recipe


@RECIPES.register("ema")
class EMA(Recipe):
    order = 60

    def __init__(self, decay=0.999, every_n_steps=1):
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"recipe_args.ema.decay: expected 0 < decay < 1, got {decay}")
        self.decay, self.every = decay, every_n_steps
        self.ema = None

    def setup(self, run):
        # use_buffers: BatchNorm running statistics are averaged too, so the EMA model evaluates as is
        self.ema = AveragedModel(unwrap(run.model), multi_avg_fn=get_ema_multi_avg_fn(self.decay),
                                 use_buffers=True)

    def after_step(self, run):
        if run.step % self.every == 0:
            self.ema.update_parameters(unwrap(run.model))

    def eval_models(self, run):
        return {"ema": self.ema.module}

    def state_dict(self):
        return self.ema.state_dict()

    def load_state_dict(self, state):
        self.ema.load_state_dict(state)

    @torch.no_grad()
    def copy_to(self, model):
        model.load_state_dict(self.ema.module.state_dict())
