"""Automatic mixed precision, with `dtype: auto` chosen by measurement on CPU.

dtype: float16 (CUDA, with GradScaler) | bfloat16 | auto (default).
auto on CUDA: bf16 where supported, fp16 + GradScaler otherwise, and TF32 matmuls on Ampere and later.
auto on CPU: bf16 helps some models 2-4x (AMX) and slows others 5-14x (depthwise convolutions
without native bf16), so a few training steps of fp32 and bf16, each contiguous and channels-last,
and bf16 with the depthwise convolutions kept in fp32 (fp32_depthwise), are timed at start-up on a
copy of the model and the fastest is used. Like cudnn.benchmark, the
choice is cached per model, input shape and machine (~/.cache/zoo/amp_auto.json, or
$ZOO_CACHE_DIR) and stored in checkpoints, so a resumed run keeps it.
"""
import copy
import functools
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


def _autocast_off(device, module, args):
    module._autocast_was = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, False)
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _autocast_back(device, module, args, output):
    torch.set_autocast_enabled(device, module._autocast_was)


def keep_depthwise_fp32(model, device):
    """Run the grouped (depthwise) convolutions in float32 under autocast. Without native bf16 they
    fall to a per-channel slow path: SSDlite's bf16 step spent 80% of its time there (9307 calls of
    _slow_conv2d on EPYC). Returns the hook handles; the hooks survive deepcopy (EMA)."""
    handles = []
    for m in depthwise_convolutions(model):
        handles += [m.register_forward_pre_hook(functools.partial(_autocast_off, device)),
                    m.register_forward_hook(functools.partial(_autocast_back, device))]
    return handles


def depthwise_convolutions(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.groups > 1]


def candidate_name(dtype, channels_last=False, fp32_depthwise=False):
    return dtype + ("+channels_last" if channels_last else "") + ("+fp32_depthwise" if fp32_depthwise else "")


def time_candidates(model, batch, device, candidates, steps=3):
    """Seconds per training step (forward + backward, after one warm-up step) of each
    (dtype name, channels_last, fp32_depthwise) candidate, on a copy of the model: weights and BN
    stats untouched.
    A candidate is dropped as soon as it cannot win: a timed step over 1.5x the best so far, or a
    warm-up step over 10x (bf16 without native support can take minutes per step)."""
    inputs, targets = batch
    times = {}
    for dtype, channels_last, fp32_depthwise in candidates:
        name = candidate_name(dtype, channels_last, fp32_depthwise)
        m = copy.deepcopy(model).train()
        if channels_last:
            m = m.to(memory_format=torch.channels_last)
        if fp32_depthwise:
            keep_depthwise_fp32(m, device.type)
        x = _to_memory_format(inputs, channels_last)
        best = min(times.values(), default=float("inf"))
        elapsed = []
        for i in range(steps + 1):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=_DTYPES[dtype], enabled=dtype != "float32"):
                loss = sum(m(x, targets).values())
            loss.backward()
            elapsed.append(time.perf_counter() - start)
            if elapsed[-1] > best * (10 if i == 0 else 1.5):
                break
        times[name] = min(elapsed[1:] or elapsed)
        del m
    return times


@RECIPES.register("amp")
class AMP(Recipe):
    order = 40

    def __init__(self, dtype="auto", steps=3, fp32_depthwise=False):
        """fp32_depthwise: run depthwise convolutions in float32 (with dtype auto it is measured)."""
        if dtype not in ("auto", "float16", "bfloat16"):
            raise ValueError(f"recipe_args.amp.dtype: expected auto, float16 or bfloat16, got {dtype!r}")
        if not isinstance(fp32_depthwise, bool):
            raise ValueError(f"recipe_args.amp.fp32_depthwise: expected true or false, got {fp32_depthwise!r}")
        self.requested, self.steps, self.fp32_depthwise = dtype, steps, fp32_depthwise
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
            return {"dtype": "bfloat16" if torch.cuda.is_bf16_supported() else "float16"}
        if device != "cpu":
            return {"dtype": "bfloat16"}
        choice = dist.broadcast_object(self._measure(run) if dist.is_main() else None)
        log.info("amp auto: %s (%s)", candidate_name(choice["dtype"], choice["channels_last"],
                                                    choice.get("fp32_depthwise", False)),
                 ", ".join(f"{k} {v * 1000:.0f} ms/step" for k, v in choice["times"].items()))
        return choice

    def _measure(self, run):
        """Time the candidates on one training batch, or take them from the cache."""
        forced_cl = "channels_last" in run.cfg.recipes  # the channels_last recipe already converted it
        saved = rng_state()  # fetching a batch and running dropout must not move the run's RNG
        batch = next(iter(run.train_loader))
        model = run.model
        key = "|".join(str(k) for k in (
            "v2", run.cfg.model.name, hashlib.sha256(repr([(n, tuple(p.shape)) for n, p in model.state_dict().items()])
                                               .encode()).hexdigest()[:12],
            _shape(batch[0]), cpu_name(), torch.get_num_threads(), torch.__version__, forced_cl))
        cache = _read_cache()
        if key in cache and self._still_holds(cache[key], model, batch, run.device):
            set_rng_state(saved)
            return {**cache[key], "cached": True}
        layouts = [cl for cl in (False, True) if cl or not forced_cl]
        candidates = [(d, cl, False) for d in ("float32", "bfloat16") for cl in layouts]
        if depthwise_convolutions(model):
            candidates += [("bfloat16", cl, True) for cl in layouts]
        times = time_candidates(model, batch, run.device, candidates, self.steps)
        set_rng_state(saved)
        best = min(candidates, key=lambda c: times[candidate_name(*c)])
        choice = {"dtype": best[0], "channels_last": best[1], "fp32_depthwise": best[2], "times": times}
        cache[key] = choice
        _write_cache(cache)
        return choice

    def _apply_depthwise_policy(self, device):
        for h in self.hooks:
            h.remove()
        wanted = self.choice.get("fp32_depthwise") and self.dtype != torch.float32
        self.hooks = keep_depthwise_fp32(self.model, device) if wanted else []

    def _still_holds(self, cached, model, batch, device):
        """A cached choice is re-timed (two steps): measured on a busy machine it would be wrong for
        good, so a time off by more than 2x from the cached one means measuring again."""
        best = (cached["dtype"], cached.get("channels_last", False), cached.get("fp32_depthwise", False))
        name = candidate_name(*best)
        then = cached.get("times", {}).get(name)
        now = time_candidates(model, batch, device, [best], steps=1)[name]
        if then and 0.5 <= now / then <= 2:
            return True
        log.warning("amp auto: the cached choice %s takes %.0f ms/step now, %s when it was cached: measuring again",
                    name, now * 1000, f"{then * 1000:.0f} ms/step" if then else "no time")
        return False

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
            if hasattr(self, "model"):
                self._apply_depthwise_policy(next(self.model.parameters()).device.type)


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
