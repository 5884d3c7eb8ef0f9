"""Automatic mixed precision, with `dtype: auto` chosen by measurement on CPU.

dtype: float16 (CUDA, with GradScaler) | bfloat16 | auto (default).
auto on CUDA: bf16 where supported, fp16 + GradScaler otherwise, and TF32 matmuls on Ampere and later.
auto on CPU: bf16 speeds some models up (AMX) and slows others down several times (depthwise
convolutions without native bf16; figures in docs/performance.md), so recipes/amp_autotune.py times
a few training steps of fp32 and bf16, each contiguous and channels-last, and bf16 with the
depthwise convolutions kept in fp32 (fp32_depthwise), at start-up on a copy of the model, and the
fastest is used. The choice is cached per machine (recipes/amp_autotune.py: model config, input
shapes, CPU, threads, torch) and stored in checkpoints: a run built for a checkpoint (resume,
evaluate.py, benchmark.py --checkpoint) applies the stored choice before setup and times nothing. A
checkpoint without one (trained without amp), evaluated with dtype auto, has inference timed (a few
eval-mode forwards), not training steps.
"""
import json
import logging

import torch

from engine import dist
from engine.config import ConfigError, duration_seconds
from engine.hooks import Recipe
from engine.registry import RECIPES
from engine.seeding import rng_state, set_rng_state
from recipes.amp_autotune import DTYPES, candidate_name, keep_depthwise_fp32, measure
from recipes.channels_last import model_to_channels_last, to_channels_last

log = logging.getLogger(__name__)
BUDGET_SHARE = 0.1  # of train.budget, at most, for dtype auto's timing (a fresh cache; a cached choice costs a step)


@RECIPES.register("amp")
class AMP(Recipe):
    order = 40

    def __init__(self, dtype="auto", steps=3, fp32_depthwise=False):
        """fp32_depthwise: run depthwise convolutions in float32 (with dtype auto it is measured)."""
        if dtype not in ("auto", "float16", "bfloat16"):
            raise ConfigError(f"recipe_args.amp.dtype: expected auto, float16 or bfloat16, got {dtype!r}")
        if not isinstance(fp32_depthwise, bool):
            raise ConfigError(f"recipe_args.amp.fp32_depthwise: expected true or false, got {fp32_depthwise!r}")
        self.requested, self.steps, self.fp32_depthwise = dtype, steps, fp32_depthwise
        self.dtype, self.channels_last, self.choice, self.stored = None, False, None, None

    def restore_before_setup(self, state):
        """A checkpoint's choice, applied by setup instead of measuring (dtype auto; an explicit dtype
        is the config's and is never measured)."""
        try:
            choice = json.loads(state.get("choice") or "null")
        except (AttributeError, TypeError, ValueError):  # not a state this recipe wrote: measure as usual
            return
        if self.requested == "auto" and isinstance(choice, dict) and choice.get("dtype") in DTYPES:
            self.stored = choice

    def setup(self, run):
        device = run.device.type
        stored = self.stored
        if self.choice is None and stored is not None:
            name = candidate_name(stored["dtype"], stored.get("channels_last", False), stored.get("fp32_depthwise", False))
            if device == "cpu" and stored["dtype"] == "float16":  # a GPU's choice: no float16 autocast on CPU
                log.warning("amp auto: the checkpoint's %s is for CUDA: choosing again on CPU", name)
            else:
                self.choice = stored
                log.info("amp auto: %s, stored in the checkpoint (nothing timed)", name)
        if self.choice is None:  # not restored from a checkpoint
            self.choice = self._choose(run)
        self.dtype = DTYPES[self.choice["dtype"]]
        self.channels_last = self.choice.get("channels_last", False)
        if device == "cpu" and self.dtype == torch.float16:
            raise ConfigError("recipe_args.amp.dtype: float16 autocast is for CUDA; use bfloat16 on CPU")
        if self.channels_last:
            run.model = model_to_channels_last(run.model)
        self.model, self.hooks = run.model, []
        self._apply_depthwise_policy(device)
        # fp16 needs loss scaling against gradient underflow; bf16 has fp32's range and does not.
        run.scaler = torch.amp.GradScaler(device, enabled=self.dtype == torch.float16)

    def _choose(self, run):
        device = run.device.type
        if self.requested != "auto":
            return {"dtype": self.requested, "fp32_depthwise": self.fp32_depthwise}
        if device == "cuda":
            if torch.cuda.get_device_capability(run.device)[0] >= 8:
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            log.info("amp auto on CUDA: %s (not timed; benchmark.py --variants fp32,fp16,bf16 measures them)", dtype)
            return {"dtype": dtype}
        if device != "cpu":
            return {"dtype": "bfloat16"}
        choice = dist.broadcast_object(self._measure(run) if dist.is_main() else None)
        log.info("amp auto: %s (%s)", candidate_name(choice["dtype"], choice["channels_last"],
                                                    choice.get("fp32_depthwise", False)),
                 ", ".join(f"{k} {v * 1000:.0f} ms/{'forward' if run.inference else 'step'}"
                           for k, v in choice["times"].items()))
        return choice

    def _measure(self, run):
        """Time the candidates on one training batch (an evaluation batch, forwards only, for a run
        that only evaluates: run.inference), or take them from the cache."""
        saved = rng_state()  # fetching a batch and running dropout must not move the run's RNG
        batch = next(iter(run.val_loader if run.inference else run.train_loader))
        forced_cl = "channels_last" in run.cfg.recipes  # the channels_last recipe already converted it
        budget = getattr(run.cfg.train, "budget", None)  # the budget counts this timing: capped at a share of it
        limit = BUDGET_SHARE * duration_seconds(budget) if budget is not None else None
        choice = measure(run.model, batch, run.device, run.cfg.model.model_dump(mode="json"), self.steps,
                         forced_cl, train=not run.inference, limit=limit)
        set_rng_state(saved)
        return choice

    def _apply_depthwise_policy(self, device):
        for h in self.hooks:
            h.remove()
        wanted = self.choice.get("fp32_depthwise") and self.dtype != torch.float32
        self.hooks = keep_depthwise_fp32(self.model, device) if wanted else []

    def forward_context(self, run):
        return torch.autocast(run.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def prepare_inputs(self, inputs):
        return to_channels_last(inputs) if self.channels_last else inputs

    def state_dict(self):
        return {"choice": json.dumps(self.choice)}

    def load_state_dict(self, state):
        """On resume: the checkpoint's precision, not a new measurement (the model's memory format
        was set at setup; it changes speed, not results)."""
        choice = json.loads(state.get("choice", "null"))
        if choice and choice != self.choice:
            if self.choice and self.choice.get("dtype") != choice.get("dtype"):
                log.warning("amp auto: this machine measured %s, the checkpoint trained with %s: keeping %s",
                            self.choice.get("dtype"), choice.get("dtype"), choice.get("dtype"))
            self.choice, self.dtype = choice, DTYPES[choice["dtype"]]
            if hasattr(self, "model"):
                self._apply_depthwise_policy(next(self.model.parameters()).device.type)
