"""The amp recipe's `dtype: auto` on CPU: time a few training steps (or, for a run that only
evaluates, eval-mode forwards) of each precision candidate on a copy of the model, keep the fastest,
and cache the choice per model config, input shapes, CPU, thread count and torch version
(~/.cache/zoo/amp_auto.json, or $ZOO_CACHE_DIR), like cudnn.benchmark. Measured figures:
docs/performance.md ("amp: dtype auto")."""
import contextlib
import copy
import functools
import hashlib
import json
import logging
import numbers
import os
import time

import torch

from engine.build import cpu_name
from engine.files import write_json
from recipes.channels_last import model_to_channels_last, to_channels_last

log = logging.getLogger(__name__)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# ---------------------------------------------------------------- candidates

def candidate_name(dtype, channels_last=False, fp32_depthwise=False):
    return dtype + ("+channels_last" if channels_last else "") + ("+fp32_depthwise" if fp32_depthwise else "")


def depthwise_convolutions(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.groups > 1]


def _autocast_off(device, module, args):
    module._autocast_was = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, False)
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _autocast_back(device, module, args, output):
    torch.set_autocast_enabled(device, module._autocast_was)


def keep_depthwise_fp32(model, device):
    """Run the grouped (depthwise) convolutions in float32 under autocast. Without native bf16 they
    fall to a per-channel slow path (docs/performance.md, "Why bf16 is slow for SSDlite").
    Returns the hook handles; the hooks survive deepcopy (EMA)."""
    handles = []
    for m in depthwise_convolutions(model):
        handles += [m.register_forward_pre_hook(functools.partial(_autocast_off, device)),
                    m.register_forward_hook(functools.partial(_autocast_back, device))]
    return handles


def time_candidates(model, batch, device, candidates, steps=3, train=True, limit=None):
    """Seconds per training step (forward + backward, after one warm-up step) of each
    (dtype name, channels_last, fp32_depthwise) candidate, on a copy of the model: weights and BN
    stats untouched. train=False: seconds per eval-mode forward (no gradients, no backward).
    A candidate is dropped as soon as it cannot win: a timed step over 1.5x the best so far, or a
    warm-up step over 10x (bf16 without native support can take minutes per step). limit: seconds for
    all of it (a budget run's cap): the candidates not reached by then are left out of the result."""
    inputs, targets = batch
    times, began = {}, time.perf_counter()
    for dtype, channels_last, fp32_depthwise in candidates:
        if times and limit is not None and time.perf_counter() - began > limit:
            break
        name = candidate_name(dtype, channels_last, fp32_depthwise)
        m = copy.deepcopy(model).train(train)
        if channels_last:
            m = model_to_channels_last(m)
        if fp32_depthwise:
            keep_depthwise_fp32(m, device.type)
        x = to_channels_last(inputs) if channels_last else inputs
        best = min(times.values(), default=float("inf"))
        elapsed = []
        for i in range(steps + 1):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != "float32"), \
                    (contextlib.nullcontext() if train else torch.inference_mode()):
                out = m(x, targets) if train else m(x)
            if train:
                sum(out.values()).backward()
            elapsed.append(time.perf_counter() - start)
            if elapsed[-1] > best * (10 if i == 0 else 1.5) or (
                    limit is not None and time.perf_counter() - began > limit and (times or len(elapsed) > 1)):
                break
        times[name] = min(elapsed[1:] or elapsed)
        del m
    return times


def still_holds(cached, model, batch, device, train=True):
    """A cached choice is re-timed (two steps): measured on a busy machine it would be wrong for
    good, so a time off by more than 2x from the cached one means measuring again."""
    best = (cached["dtype"], cached.get("channels_last", False), cached.get("fp32_depthwise", False))
    name = candidate_name(*best)
    then = cached.get("times", {}).get(name)
    log.info("amp auto: timing the cached choice %s again (%s)", name, "training steps" if train else "inference")
    now = time_candidates(model, batch, device, [best], steps=1, train=train)[name]
    if then and 0.5 <= now / then <= 2:
        return True
    log.warning("amp auto: the cached choice %s takes %.0f ms/step now, %s when it was cached: measuring again",
                name, now * 1000, f"{then * 1000:.0f} ms/step" if then else "no time")
    return False


def measure(model, batch, device, model_config, steps=3, forced_channels_last=False, train=True, limit=None):
    """The fastest candidate {dtype, channels_last, fp32_depthwise, times}: from the cache when its
    time still holds ("cached": True), else timed and cached. model_config: the config's model
    section (a dict: name, size, ...; or a name). forced_channels_last: the model is already
    channels-last (the channels_last recipe), so only that layout is timed. train=False: eval-mode
    forwards are timed (a run that only evaluates), cached apart from training steps. limit: seconds the
    timing may take (train.budget's share); a capped timing chooses among what it timed and is not cached."""
    key = cache_key(model_config, model, batch[0], forced_channels_last, train)
    cache = read_cache()
    if key in cache and still_holds(cache[key], model, batch, device, train):
        return {**cache[key], "cached": True}
    layouts = [cl for cl in (False, True) if cl or not forced_channels_last]
    candidates = [(d, cl, False) for d in ("float32", "bfloat16") for cl in layouts]
    if depthwise_convolutions(model):
        candidates += [("bfloat16", cl, True) for cl in layouts]
    log.info("amp auto: timing %s of %s", "training steps" if train else "inference",
             ", ".join(candidate_name(*c) for c in candidates))
    times = time_candidates(model, batch, device, candidates, steps, train, limit=limit)
    timed = [c for c in candidates if candidate_name(*c) in times]
    best = min(timed, key=lambda c: times[candidate_name(*c)])
    choice = {"dtype": best[0], "channels_last": best[1], "fp32_depthwise": best[2], "times": times}
    if len(timed) < len(candidates):
        log.warning("amp auto: timing capped at %.0f s (the run's budget pays for no more): %s not timed and "
                    "the choice not cached; a run without train.budget times them all", limit,
                    ", ".join(candidate_name(*c) for c in candidates if c not in timed))
        return {**choice, "capped": True}
    cache[key] = choice
    write_cache(cache)
    return choice


# ---------------------------------------------------------------- the per-machine cache

def cache_path():
    return os.path.join(os.environ.get("ZOO_CACHE_DIR") or os.path.expanduser("~/.cache/zoo"), "amp_auto.json")


def _shape(inputs):
    """The example batch's shapes (its batch size included): a tensor's, each tensor's of a list, a dict's."""
    if isinstance(inputs, torch.Tensor):
        return list(inputs.shape)
    if isinstance(inputs, dict):
        return {k: _shape(v) for k, v in sorted(inputs.items())}
    return [_shape(x) for x in inputs] if isinstance(inputs, (list, tuple)) else type(inputs).__name__


def cache_key(model_config, model, inputs, forced_channels_last, train=True):
    """What the choice depends on: the model's config (name and arguments: a detector's `size` is the
    resolution it resizes to, whatever the images' size), its parameter shapes, the example batch's
    shapes, CPU, threads, torch version, the forced layout, and training steps vs inference."""
    if not isinstance(model_config, dict):
        model_config = {"name": str(model_config)}
    config = json.dumps(model_config, sort_keys=True, default=str)
    shapes = repr([(n, tuple(p.shape)) for n, p in model.state_dict().items()])
    return "|".join(str(k) for k in (
        "v3", config, hashlib.sha256(shapes.encode()).hexdigest()[:12], json.dumps(_shape(inputs)), cpu_name(),
        torch.get_num_threads(), torch.__version__, forced_channels_last, "train" if train else "infer"))


def _entry_problem(entry):
    """Why a cache entry is not a choice this module wrote, or None."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        return "an entry has no known dtype"
    if any(not isinstance(entry.get(k, False), bool) for k in ("channels_last", "fp32_depthwise")):
        return "channels_last / fp32_depthwise are not true or false"
    times = entry.get("times", {})
    if not isinstance(times, dict) or any(
            not isinstance(t, numbers.Real) or isinstance(t, bool) for t in times.values()):
        return "times are not numbers"
    return None


def read_cache():
    """{key: choice}; {} when there is no cache yet. A file that is not valid JSON or not of this
    shape is ignored with a warning (it is rewritten at the next measurement)."""
    path = cache_path()
    try:
        with open(path) as f:
            cache = json.load(f)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("amp auto: ignoring the cache %s: %s", path, e)
        return {}
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        log.warning("amp auto: ignoring the cache %s: not valid JSON (%s)", path, e)
        return {}
    problem = "not a JSON object" if not isinstance(cache, dict) else next(
        filter(None, map(_entry_problem, cache.values())), None)
    if problem:
        log.warning("amp auto: ignoring the cache %s: %s", path, problem)
        return {}
    return cache


def write_cache(cache):
    path = cache_path()
    try:
        write_json(path, cache, indent=1)
    except OSError as e:  # a read-only home only costs the measurement next time
        log.warning("amp auto: could not write the cache %s (%s)", path, e)
