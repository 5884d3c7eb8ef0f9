"""Automatic mixed precision, with `dtype: auto` chosen by measurement on CPU.

dtype: float16 (CUDA, with GradScaler) | bfloat16 | auto (default).
auto on CUDA: bf16 where supported, fp16 + GradScaler otherwise, and TF32 matmuls on Ampere and later.
auto on CPU: bf16 helps some models 2-4x (AMX) and slows others 5-14x (depthwise convolutions
without native bf16), so a few training steps of fp32 and bf16, each contiguous and channels-last,
are timed at start-up on a copy of the model and the fastest is used. Like cudnn.benchmark, the
choice is cached per model, input shape and machine (~/.cache/zoo/amp_auto.json, or
$ZOO_CACHE_DIR) and stored in checkpoints, so a resumed run keeps it.
"""
import copy
import hashlib
import json
import logging
import os
import platform
import time

import torch

from engine import dist
from engine.checkpoint import rng_state, set_rng_state
from engine.hooks import Recipe
from engine.registry import RECIPES

log = logging.getLogger(__name__)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _cache_path():
    return os.path.join(os.environ.get("ZOO_CACHE_DIR") or os.path.expanduser("~/.cache/zoo"), "amp_auto.json")


def _shape(inputs):
    if isinstance(inputs, torch.Tensor):
        return list(inputs.shape)
    return [list(x.shape) for x in inputs] if isinstance(inputs, (list, tuple)) else str(type(inputs))


def _to_memory_format(inputs, channels_last):
    if channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs


def time_candidates(model, batch, device, candidates, steps=3):
    """Seconds per training step (forward + backward, after one warm-up step) of each
    (dtype name, channels_last) candidate, on a copy of the model: weights and BN stats untouched."""
    inputs, targets = batch
    times = {}
    for dtype, channels_last in candidates:
        m = copy.deepcopy(model).train()
        if channels_last:
            m = m.to(memory_format=torch.channels_last)
        x = _to_memory_format(inputs, channels_last)
        elapsed = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=_DTYPES[dtype], enabled=dtype != "float32"):
                loss = sum(m(x, targets).values())
            loss.backward()
            elapsed.append(time.perf_counter() - start)
        times[f"{dtype}{'+channels_last' if channels_last else ''}"] = min(elapsed[1:])
        del m
    return times


@RECIPES.register("amp")
class AMP(Recipe):
    order = 40

    def __init__(self, dtype="auto", steps=3):
        if dtype not in ("auto", "float16", "bfloat16"):
            raise ValueError(f"recipe_args.amp.dtype: expected auto, float16 or bfloat16, got {dtype!r}")
        self.requested, self.steps = dtype, steps
        self.dtype, self.channels_last, self.choice = None, False, None

    def setup(self, run):
        device = run.device.type
        if self.choice is None:  # not restored from a checkpoint
            self.choice = self._choose(run)
        self.dtype = _DTYPES[self.choice["dtype"]]
        self.channels_last = self.choice.get("channels_last", False)
        if device == "cpu" and self.dtype == torch.float16:
            raise ValueError("recipe_args.amp.dtype: float16 autocast is for CUDA; use bfloat16 on CPU")
        if self.channels_last:
            run.model = run.model.to(memory_format=torch.channels_last)
        # fp16 needs loss scaling against gradient underflow; bf16 has fp32's range and does not.
        run.scaler = torch.amp.GradScaler(device, enabled=self.dtype == torch.float16)

    def _choose(self, run):
        device = run.device.type
        if self.requested != "auto":
            return {"dtype": self.requested}
        if device == "cuda":
            if torch.cuda.get_device_capability(run.device)[0] >= 8:
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            return {"dtype": "bfloat16" if torch.cuda.is_bf16_supported() else "float16"}
        if device != "cpu":
            return {"dtype": "bfloat16"}
        choice = dist.broadcast_object(self._measure(run) if dist.is_main() else None)
        log.info("amp auto: %s%s (%s)", choice["dtype"], " + channels_last" if choice["channels_last"] else "",
                 ", ".join(f"{k} {v * 1000:.0f} ms/step" for k, v in choice["times"].items()))
        return choice

    def _measure(self, run):
        """Time the candidates on one training batch, or take them from the cache."""
        forced_cl = "channels_last" in run.cfg.recipes  # the channels_last recipe already converted it
        saved = rng_state()  # fetching a batch and running dropout must not move the run's RNG
        batch = next(iter(run.train_loader))
        model = run.model
        key = "|".join(str(k) for k in (
            run.cfg.model.name, hashlib.sha256(repr([(n, tuple(p.shape)) for n, p in model.state_dict().items()])
                                               .encode()).hexdigest()[:12],
            _shape(batch[0]), cpu_name(), torch.get_num_threads(), torch.__version__, forced_cl))
        cache = _read_cache()
        if key in cache:
            set_rng_state(saved)
            return {**cache[key], "cached": True}
        candidates = [(d, cl) for d in ("float32", "bfloat16") for cl in (False, True) if cl or not forced_cl]
        times = time_candidates(model, batch, run.device, candidates, self.steps)
        set_rng_state(saved)
        best = min(times, key=times.get)
        choice = {"dtype": best.split("+")[0], "channels_last": best.endswith("+channels_last"), "times": times}
        cache[key] = choice
        _write_cache(cache)
        return choice

    def forward_context(self, run):
        return torch.autocast(run.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def prepare_inputs(self, inputs):
        return _to_memory_format(inputs, self.channels_last)

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
            self.choice, self.dtype = choice, _DTYPES[choice["dtype"]]


def _read_cache():
    try:
        with open(_cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(cache):
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home only costs the measurement next time
        log.warning("amp auto: could not write the cache %s (%s)", path, e)
