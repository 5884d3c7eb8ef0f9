"""Automatic mixed precision: fp16 + GradScaler or bf16 on CUDA, bf16 on CPU (fast with AMX)."""
import torch

from engine.registry import RECIPES
from engine.hooks import Recipe

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@RECIPES.register("amp")
class AMP(Recipe):
    order = 40

    def __init__(self, dtype="auto"):
        if dtype not in ("auto", *_DTYPES):
            raise ValueError(f"recipe_args.amp.dtype: expected auto, float16 or bfloat16, got {dtype!r}")
        self.requested = dtype
        self.dtype = None

    def setup(self, run):
        device = run.device.type
        self.dtype = _DTYPES[self.requested] if self.requested != "auto" else (
            torch.float16 if device == "cuda" else torch.bfloat16)
        if device == "cpu" and self.dtype == torch.float16:
            raise ValueError("recipe_args.amp.dtype: float16 autocast is for CUDA; use bfloat16 on CPU")
        # fp16 needs loss scaling against gradient underflow; bf16 has fp32's range and does not.
        run.scaler = torch.amp.GradScaler(device, enabled=self.dtype == torch.float16)

    def forward_context(self, run):
        return torch.autocast(run.device.type, dtype=self.dtype)
