"""Resuming on another number of processes at the same global batch (torchrun --nnodes=1:4 elastic
jobs, a cluster that shrinks). The sample stream is defined by the global batch, not by the number
of processes (engine.build.GlobalStepBatches, engine.seeding.SeededSamples), so a run checkpointed
on N processes continues on M with every global step training on the same samples."""
import logging

from engine import dist
from engine.config import ConfigError

log = logging.getLogger(__name__)


def saved_world_size(state):
    """The number of processes that wrote the checkpoint: it holds one RNG state per process."""
    rng = state.get("rng")
    return len(rng) if isinstance(rng, list) else None


def per_process_split(global_batch, world, batch_size):
    """(per-process batch, accumulation steps) with world x batch x accumulation = global_batch: the
    configured per-process batch with more accumulation steps when it divides the share of a
    process, else the largest batch below it that does (memory allows no larger one). None when
    the global batch cannot be split evenly among the processes."""
    if global_batch % world:
        return None
    share = global_batch // world
    batch = batch_size if share % batch_size == 0 else max(d for d in range(1, min(batch_size, share) + 1)
                                                             if share % d == 0)
    return batch, share // batch


def configured_split(cfg):
    """[data.batch_size, optim.accumulate_steps] as the run's config gives them, before keep_global_batch
    adapts them to the number of processes: checkpoints keep it ("batch_split"), so that a resume tells a
    split it derived from one the user changed."""
    return [cfg.data.batch_size, cfg.optim.accumulate_steps]


def keep_global_batch(cfg, state, path, world=None):
    """The config to resume `state` with on this number of processes: data.batch_size and
    optim.accumulate_steps set so that the checkpoint's global batch is kept. The checkpoint's
    config and position in the epoch are expressed in the new split (in place), so that the resume
    sees no config change. A config whose batch settings differ from those the run was configured with
    (the checkpoint's "batch_split"; before it, its config's) is left as it is: the user changed them.
    A run that shrank and grows back (2 -> 1 -> 2 processes) is configured as it was, and gets its split back.
    `world`: the number of processes of this run (default: torch.distributed's)."""
    world, old_world = world or dist.world_size(), saved_world_size(state)
    saved = state.get("config") or {}
    if old_world is None or "data" not in saved:
        return cfg
    b0, a0 = saved["data"]["batch_size"], saved["optim"].get("accumulate_steps", 1)
    global_batch = b0 * old_world * a0
    ours = (cfg.data.batch_size, cfg.optim.accumulate_steps)
    if ours == (b0, a0) and world == old_world:
        return cfg
    if list(ours) != list(state.get("batch_split") or (b0, a0)):
        if ours[0] * world * ours[1] != global_batch:
            log.warning("%s was written by %d process(es) at global batch %d; the config changes data.batch_size or "
                        "optim.accumulate_steps, so the global batch becomes %d", path, old_world, global_batch,
                        ours[0] * world * ours[1])
        return cfg
    split = per_process_split(global_batch, world, ours[0])
    if split is None:
        raise ConfigError(f"--resume {path}: the run's global batch {global_batch} (data.batch_size {b0} x "
                          f"{old_world} process(es) x optim.accumulate_steps {a0}) cannot be split evenly among "
                          f"{world} process(es): resume on a number of processes that divides {global_batch}")
    batch, accumulate = split
    cfg = cfg.model_copy(deep=True)
    cfg.data.batch_size, cfg.optim.accumulate_steps = batch, accumulate
    saved["data"]["batch_size"], saved["optim"]["accumulate_steps"] = batch, accumulate
    state["batches_done"] = state.get("batches_done", 0) // a0 * accumulate  # whole steps: a step's batches
    log.warning("resuming a run of %d process(es) on %d: global batch %d kept = %d per process x %d process(es) x "
                "%d accumulation step(s) (was %d x %d x %d); every global step trains on the same samples",
                old_world, world, global_batch, batch, world, accumulate, b0, old_world, a0)
    return cfg
