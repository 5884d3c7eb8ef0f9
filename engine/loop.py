"""One training loop for every model family: train.py calls `train(cfg, ...)`.

Models return a dict of losses in training and predictions in eval; dataset builders bring their
evaluator; recipes hook in around the step. Nothing here knows which family it is training.
"""
import collections
import contextlib
import itertools
import logging
import os
import signal
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler

from engine import dist
from engine.checkpoint import (RESUME_BREAKING, RESUME_IGNORED, _under, check_free_space, config_changes,
                               describe_changes, load_checkpoint, load_weights, prepare_run_folder,
                               release_run_folder, rng_state, save_checkpoint, seed_everything, set_rng_state)
from engine.config import ConfigError, to_yaml
from engine.evaluation import fold_batch_norms
from engine.logger import TensorBoard, progress, setup_console
from engine.optim import build_optimizer, build_scheduler, scale_lr_with_batch
from engine.registry import DATASETS, MODELS, closest
from engine.hooks import RecipeStack

log = logging.getLogger("train")


# ---------------------------------------------------------------- building blocks

def pick_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def to_device(obj, device):
    if hasattr(obj, "to") and isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def build_data(cfg, output_dir):
    kwargs = dict(cfg.data.model_extra)
    if "output_dir" in (DATASETS.arguments(cfg.data.name) or []):
        kwargs["output_dir"] = output_dir  # e.g. a tokenizer saved next to the checkpoints
    return DATASETS.build(cfg.data.name, **kwargs)


def build_model(cfg, data):
    kwargs = dict(cfg.model.model_extra)
    accepted = MODELS.arguments(cfg.model.name) or []
    for key, value in data.model_defaults.items():
        if key in accepted and key not in kwargs:
            kwargs[key] = value
    need, given = data.model_defaults.get("num_classes"), kwargs.get("num_classes")
    if need is not None and isinstance(given, int) and given < need:  # labels would index past the outputs
        raise ConfigError(f"model.num_classes is {given} but data set '{cfg.data.name}' needs {need} "
                          f"(its labels); leave model.num_classes unset to take it from the data")
    return MODELS.build(cfg.model.name, **kwargs)


class ShardSampler(Sampler):
    """Evaluation sharding without the padding DistributedSampler adds: every sample counted once."""

    def __init__(self, n):
        self.indices = range(dist.rank(), n, dist.world_size())

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class ResumableBatches(Sampler):
    """The epoch's batches, as (epoch seed, index) keys for SeededSamples. On a resume in the middle
    of an epoch the first `skip` are passed over (indices only, no data loaded), so the run sees
    exactly the samples it had not seen yet. `skip` holds until reset: DataLoader may call iter()
    more than once per epoch (with workers, it does)."""

    def __init__(self, batches, sampler):
        self.batches, self.sampler, self.skip, self.epoch_seed = batches, sampler, 0, 0

    def __iter__(self):
        seed = self.epoch_seed
        return ([(seed, i) for i in batch] for batch in itertools.islice(iter(self.batches), self.skip, None))

    def __len__(self):
        return len(self.batches)


class SeededSamples(Dataset):
    """The training set read by (epoch seed, index) keys: each sample draws its augmentation from its
    own seed, whichever process or worker loads it. So augmentations do not depend on data.workers,
    workers can persist across epochs, and a resume (mid-epoch too) sees the same samples.
    A dataset with `seeded_items(indices, seeds)` is handed a batch's seeds at once (so it can draw
    and crop a whole batch in a few calls: SyntheticShapes), one marked `deterministic` is read
    as it is (TokenizedText), any other with torch's CPU generator seeded for each sample."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys):  # DataLoader fetches a batch's keys in one call
        indices = [index for _, index in keys]
        if getattr(self.dataset, "deterministic", False):  # draws nothing random: no seeds to set
            return [self.dataset[i] for i in indices]
        seeds = [int(np.random.SeedSequence(key).generate_state(1)[0]) for key in keys]  # 32 bits
        if hasattr(self.dataset, "seeded_items"):
            return self.dataset.seeded_items(indices, seeds)
        return [torch_seeded(seed, self.dataset.__getitem__, index) for index, seed in zip(indices, seeds)]


def torch_seeded(seed, fn, *args):
    """fn(*args) with torch's CPU generator seeded (torch.manual_seed would also queue CUDA seeding,
    with a formatted stack trace each time), its state restored afterwards."""
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        return fn(*args)
    finally:
        torch.set_rng_state(state)


def loader_workers(setting, device):
    """data.workers: a number, or auto. On CPU the intra-op threads spin on every core and a worker
    process preempts them (2 cores, SSDlite: the loop ran at 0.55 of the bare loop with 1 worker,
    0.77 with none), so small CPUs load in the main process; GPUs get a worker per spare core."""
    if setting != "auto":
        return setting
    cores = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device.type == "cuda":
        return min(8, max(1, cores - 1))
    return 0 if cores <= 4 else min(4, cores // 8)


def build_loaders(cfg, data, seed, device=torch.device("cpu")):
    if dist.is_distributed():
        sampler = DistributedSampler(data.train, shuffle=True, seed=seed, drop_last=True)
    else:  # its generator is reseeded every epoch: the shuffle survives resume
        sampler = RandomSampler(data.train, generator=torch.Generator())
    if data.train_batch_sampler:
        batches = data.train_batch_sampler(data.train, sampler, cfg.data.batch_size)
    else:
        batches = BatchSampler(sampler, cfg.data.batch_size, drop_last=True)
    workers = loader_workers(cfg.data.workers, device)
    # each loader draws its workers' base seed from its own generator, not from the global RNG
    # (dropout's), so that the training's random draws do not depend on data.workers
    common = dict(num_workers=workers, collate_fn=data.collate_fn, pin_memory=device.type == "cuda",
                  persistent_workers=workers > 0)
    train = DataLoader(SeededSamples(data.train), batch_sampler=ResumableBatches(batches, sampler),
                       generator=torch.Generator().manual_seed(seed), **common)
    val = DataLoader(data.val, batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                     sampler=ShardSampler(len(data.val)), generator=torch.Generator().manual_seed(seed), **common)
    return train, val


def start_epoch_data(run, epoch):
    # The shuffle's generator and the samples' augmentation seeds, both a function of (seed, epoch).
    # Ranks load other samples (DistributedSampler), so they draw other augmentations.
    batches = run.train_loader.batch_sampler
    batches.epoch_seed = (run.cfg.seed or 0) * 1000 + epoch
    if isinstance(batches.sampler, DistributedSampler):
        batches.sampler.set_epoch(epoch)
    else:
        batches.sampler.generator.manual_seed((run.cfg.seed or 0) * 1000 + epoch)


# ---------------------------------------------------------------- evaluation

def eval_streams(model, device, recipes=None, run=None):
    """How many batches evaluate() runs at once: on CPU, one per intra-op thread (each then runs on
    one thread), unless the model is compiled or a recipe's forward context changes the model
    rather than the thread's state (autocast is per thread; pausing QAT observers is not), or DDP's
    forward would run collectives (its buffer broadcast) from several threads at once. A model's
    eval forward must therefore be safe in threads: process-wide switches it flips need a lock and a
    count (models.transformer's fast-path switch)."""
    if (device.type != "cpu" or torch.get_num_threads() < 2 or hasattr(model, "_orig_mod")
            or isinstance(model, torch.nn.parallel.DistributedDataParallel)):
        return 1
    contexts = [r.forward_context(run) for r in (recipes or ())]
    return torch.get_num_threads() if all(isinstance(c, (contextlib.nullcontext, torch.autocast))
                                          for c in contexts) else 1


def evaluate(model, loader, evaluator, device, recipes=None, run=None, show_progress=True, streams=None):
    """Predictions for every batch of the loader, fed to the evaluator in the loader's order. On CPU
    with several threads, `streams` batches run at once on one thread each (the reference evaluation
    runs one thread): one batch's Python (post-processing, the evaluator) overlaps the others'
    kernels, and no team of OpenMP threads spin-waits on a busy machine."""
    model.eval()
    model = fold_batch_norms(model)  # a folded copy: the trained model stays as it is
    streams = streams or eval_streams(model, device, recipes, run)

    def predict(inputs):
        with torch.no_grad():  # per thread, as autocast is
            inputs = to_device(inputs, device)
            if not recipes:
                return model(inputs)
            inputs = recipes.prepare_inputs(inputs)
            with recipes.forward_context(run):
                return model(inputs)

    batches = progress(loader, desc="eval", leave=False, disable=not show_progress, tty_only=True)
    if streams == 1:
        for inputs, targets in batches:
            evaluator.update(predict(inputs), targets)
        return evaluator
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the pool's threads take it up on their first kernel
    try:
        with ThreadPoolExecutor(streams) as pool:
            pending = collections.deque()
            for inputs, targets in batches:
                pending.append((pool.submit(predict, inputs), targets))
                if len(pending) > streams:  # one more queued than running: no thread waits for the loader
                    future, done = pending.popleft()
                    evaluator.update(future.result(), done)
            for future, done in pending:
                evaluator.update(future.result(), done)
    finally:
        torch.set_num_threads(threads)
    return evaluator


def evaluate_all(run):
    """Evaluate the trained model and every extra model recipes offer (EMA, int8, ...)."""
    run.recipes.before_eval(run)
    results = {}
    for suffix, model in {"": run.model, **run.recipes.eval_models(run)}.items():
        prefix = "val" if not suffix else f"val_{suffix}"
        evaluator = evaluate(model, run.val_loader, run.data.evaluator(), run.device, run.recipes, run)
        metrics = evaluator.compute()
        run.tb.scalars(metrics, run.step, prefix)
        run.tb.evaluator_extras(evaluator, run.step, prefix)
        results.update({f"{prefix}/{k}": v for k, v in metrics.items()})
    log.info("epoch %d: %s", run.epoch, "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
    return results


# ---------------------------------------------------------------- checkpoints and resume

class Preempted(Exception):
    """SIGTERM / SIGINT: a checkpoint was written at the current step; --resume continues."""
    exit_code = 75  # EX_TEMPFAIL: distinct from failures (1) and from being killed (128 + signal)


def checkpoint_state(run, epoch_complete):
    """Every process's RNG state (dropout, masks differ per rank), gathered: call on every rank."""
    return {"model": dist.unwrap(run.model).state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
            "recipes": run.recipes.state_dict(), "epoch": run.epoch, "step": run.step,
            "batches_done": run.batches_done, "epoch_complete": epoch_complete, "best": run.best,
            "metrics": run.metrics, "rng": dist.all_gather_object(rng_state()),
            "config": run.cfg.model_dump(mode="json")}


def save(run, metrics, epoch_complete=True):
    """last.pt every epoch (and every checkpoint.every_n_steps), best.pt on a better
    val/<best_metric>; `best` is updated first so that last.pt carries it too (a resumed run then
    compares against the true best). Called on every rank; rank 0 writes."""
    key = f"val/{run.cfg.train.best_metric}" if run.cfg.train.best_metric else next(
        (k for k in metrics if k.startswith("val/")), None)
    if key and metrics and key not in metrics:
        raise KeyError(f"train.best_metric: '{key}' is not among the evaluation metrics {sorted(metrics)}")
    better = key in metrics and (run.best is None or (
        metrics[key] > run.best if run.cfg.train.best_mode == "max" else metrics[key] < run.best))
    if better:
        run.best = metrics[key]
    state = checkpoint_state(run, epoch_complete)
    if not dist.is_main():
        return
    save_checkpoint(state, os.path.join(run.output_dir, "last.pt"))
    if better:
        save_checkpoint(state, os.path.join(run.output_dir, "best.pt"))


SCHEDULE_KEYS = ("optim.lr", "optim.name", "optim.scale_lr_with_batch", "optim.accumulate_steps", "sched",
                 "train.epochs", "train.max_steps_per_epoch")


def resume_changes(run, state, path, force):
    """The differences from the checkpoint's config, key by key. Those that break the run (model,
    data, seed, optimizer type, recipes) are refused unless --force; the others are applied."""
    changes = [c for c in config_changes(state.get("config"), run.cfg.model_dump(mode="json"))
               if not _under(c[0], RESUME_IGNORED)]
    refused = {k for k, _, _ in changes if _under(k, RESUME_BREAKING)}
    if refused and not force:
        raise ConfigError(f"--resume {path}: the config differs from the checkpoint's:\n"
                          f"{describe_changes(changes, refused)}\nchanges to the model, data, seed, optimizer "
                          f"type or recipes break the run: pass --force to resume anyway, or start a new run "
                          f"in another --output-dir")
    if changes:
        log.warning("resuming %s with a changed config, applied%s:\n%s", path, " (--force)" if refused else "",
                    describe_changes(changes, set()))
    return {k for k, _, _ in changes}


def replay_schedule(run, base_lrs):
    """The lr schedule of the changed config, advanced to the current step."""
    for group, lr in zip(run.optimizer.param_groups, base_lrs):
        group["lr"] = lr
        group.pop("initial_lr", None)
    run.scheduler = build_scheduler(run.optimizer, run.cfg.sched, run.cfg.train.epochs, steps_per_epoch(run))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for _ in range(run.step):
            run.scheduler.step()
    log.warning("lr schedule rebuilt from the new config: lr %.6g at step %d", run.optimizer.param_groups[0]["lr"],
                run.step)


def restore_rng(run, saved):
    states = saved if isinstance(saved, list) else [saved]  # older checkpoints: rank 0's only
    if len(states) == dist.world_size():
        set_rng_state(states[dist.rank()])
    else:
        seed_everything((run.cfg.seed or 0) * 1_000_003 + run.step, dist.rank())
        log.warning("the checkpoint holds the random states of %d process(es), this run has %d: re-seeded "
                    "from seed, step and rank", len(states), dist.world_size())


def restore(run, path, force=False):
    """Continue from a checkpoint. Sets run.epoch to the epoch to run next; returns how many of its
    batches were done already (a step checkpoint in the middle of an epoch)."""
    state = load_checkpoint(path)
    changed = resume_changes(run, state, path, force)
    load_weights(dist.unwrap(run.model), state["model"], path, run.cfg.checkpoint.strict)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    run.epoch, run.step, run.best, run.metrics = state["epoch"], state["step"], state["best"], state["metrics"]
    if "optim.name" in changed:
        log.warning("optim.name changed: the optimizer starts from a fresh state")
    else:
        run.optimizer.load_state_dict(state["optimizer"])
        if any(k.startswith("optim.") for k in changed):  # changed hyperparameters take effect
            for group, new in zip(run.optimizer.param_groups, fresh):
                group.update({k: v for k, v in new.items() if k not in ("lr", "initial_lr")})
    if any(_under(k, SCHEDULE_KEYS) for k in changed):
        replay_schedule(run, [g["initial_lr"] for g in fresh])
    else:
        try:
            run.scheduler.load_state_dict(state["scheduler"])
        except KeyError:  # a checkpoint of the older, chained schedulers: the closed form replays it
            replay_schedule(run, [g["initial_lr"] for g in fresh])
    run.scaler.load_state_dict(state["scaler"])
    run.recipes.load_state_dict(state["recipes"])
    restore_rng(run, state["rng"])
    done = 0 if state.get("epoch_complete", True) else state["batches_done"]
    run.epoch += 0 if done else 1
    log.info("resumed from %s at epoch %d (batch %d), step %d", path, run.epoch + 1, done, run.step)
    return done


# ---------------------------------------------------------------- the loop

def training_forward(model, batch, run):
    inputs, targets = to_device(batch, run.device)
    with run.recipes.forward_context(run):
        return model(run.recipes.prepare_inputs(inputs), targets)


def steps_per_epoch(run):
    """Optimizer steps per epoch: whole steps of optim.accumulate_steps batches, at most max_steps_per_epoch."""
    steps = len(run.train_loader) // run.cfg.optim.accumulate_steps
    limit = run.cfg.train.max_steps_per_epoch
    return steps if limit is None else min(steps, limit)


class LossMeter:
    """Loss terms summed on the device, averaged over steps and processes only when logged: no
    per-step host sync."""

    def __init__(self):
        self.sums, self.count = None, 0

    def add(self, losses):
        values = torch.stack([v.detach().float() for v in losses.values()])
        self.sums = values if self.sums is None else self.sums + values
        self.names, self.count = list(losses), self.count + 1

    def mean(self):
        means = dist.reduce_mean(self.sums / self.count).tolist()
        self.sums, self.count = None, 0
        return {**dict(zip(self.names, means)), "loss": sum(means)}


def check_step(run, losses):
    """Non-finite loss terms and stop requests (signals), decided across processes in one small
    all-reduce, so that all stop at the same step. With fp16 AMP the GradScaler skips the step."""
    flags = [~torch.isfinite(v.detach()).all() for v in losses.values()]
    flags = torch.stack(flags + [torch.tensor(run.stop_signal is not None, device=flags[0].device)]).float()
    *bad, stop = dist.reduce_max(flags).tolist()
    if any(bad) and not run.scaler.is_enabled():
        names = [k for k, b in zip(losses, bad) if b]
        here = ", ".join(f"{k}={v.item():.4g}" for k, v in losses.items())
        raise FloatingPointError(
            f"non-finite loss at step {run.step + 1} (epoch {run.epoch + 1}): {', '.join(names)} not finite "
            f"(this process: {here}); last.pt and best.pt hold the last good state. Lower optim.lr, set "
            f"optim.clip_grad_norm or check the data")
    run.stop = run.stop or bool(stop)


def optimizer_step(run):
    if run.cfg.optim.clip_grad_norm:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.optim.clip_grad_norm)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.scheduler.step()
    run.step += 1
    run.recipes.after_step(run)


def after_step(run):
    """Step checkpoints (checkpoint.every_n_steps) and a requested stop, at the same step everywhere."""
    every = run.cfg.checkpoint.every_n_steps
    if run.stop or (every and run.step % every == 0):
        save(run, {}, epoch_complete=False)
    if run.stop:
        raise Preempted(f"{run.stop_signal or 'a stop request on another process'}: checkpoint written at step "
                        f"{run.step} to {os.path.join(run.output_dir, 'last.pt')}; continue with --resume")


def train_one_epoch(run, skip=0):
    cfg, accum = run.cfg, run.cfg.optim.accumulate_steps
    run.model.train()
    total = steps_per_epoch(run) * accum  # batches
    bar = progress(total=total, initial=skip, desc=f"epoch {run.epoch + 1}/{cfg.train.epochs}")
    meter, data_time = LossMeter(), 0.0
    skipped = []  # unreadable samples left out of their batch (data.skip_bad_samples)
    run.train_loader.batch_sampler.skip = skip
    step_start = tick = time.perf_counter()
    for i, batch in enumerate(run.train_loader, start=skip):
        if i == total:
            break
        data_time += time.perf_counter() - tick
        skipped += getattr(batch, "skipped", [])
        boundary = (i + 1) % accum == 0  # this batch completes an optimizer step
        if i % accum == 0:
            run.optimizer.zero_grad(set_to_none=True)
        sync = boundary or not hasattr(run.model, "no_sync")  # DDP: all-reduce on the step's last batch only
        with contextlib.nullcontext() if sync else run.model.no_sync():
            losses = training_forward(run.model, batch, run)
            check_step(run, losses)
            loss = sum(losses.values())
            run.scaler.scale(loss / accum if accum > 1 else loss).backward()
        meter.add(losses)
        run.batches_done = i + 1
        bar.update()
        tick = time.perf_counter()
        if not boundary:
            continue
        optimizer_step(run)
        step_time = time.perf_counter() - step_start
        if run.step % cfg.train.log_every == 0 or i + 1 == total:
            values = meter.mean()
            values.update(lr=run.optimizer.param_groups[0]["lr"], data_time=data_time, step_time=step_time,
                          samples_per_s=len(batch[1]) * accum * dist.world_size() / step_time)
            run.tb.scalars(values, run.step, "train")
            bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
        after_step(run)
        step_start = tick = time.perf_counter()
        data_time = 0.0
    run.train_loader.batch_sampler.skip = 0
    bar.close()
    if skipped:
        log.warning("epoch %d: %d unreadable training samples skipped (data.skip_bad_samples): %s", run.epoch + 1,
                    len(skipped), "; ".join(f"{s.where} ({s.reason})" for s in skipped))


def build_run(cfg, output_dir, data=None):
    """Everything train.py and evaluate.py share: device, data, model, recipes, loaders.
    `data`: DataSplits already built from the same config (benchmark.py reuses them)."""
    device = pick_device(cfg.device)
    rank, local_rank, world = dist.init_distributed(device.type)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    setup_console()
    if cfg.seed is not None:
        seed_everything(cfg.seed, rank)
        torch.backends.cudnn.benchmark = False
    data = data or build_data(cfg, output_dir)
    recipe_names = cfg.recipes + (["ddp"] if world > 1 and "ddp" not in cfg.recipes else [])
    run = SimpleNamespace(cfg=cfg, device=device, data=data, output_dir=output_dir, epoch=0, step=0,
                          batches_done=0, best=None, metrics={}, stop=False, stop_signal=None,
                          recipes=RecipeStack(recipe_names, cfg.recipe_args),
                          model=build_model(cfg, data).to(device), tb=TensorBoard(None),
                          scaler=torch.amp.GradScaler(device.type, enabled=False))
    run.training_forward = lambda model, batch: training_forward(model, batch, run)
    run.train_loader, run.val_loader = build_loaders(cfg, data, cfg.seed or 0, device)
    run.recipes.setup(run)
    return run


def check_before_training(run, config_file=None):
    """What would otherwise show only after the first epoch, or not at all."""
    cfg, where = run.cfg, f"{config_file}: " if config_file else ""
    if steps_per_epoch(run) == 0:
        b, w, a = cfg.data.batch_size, dist.world_size(), cfg.optim.accumulate_steps
        raise ConfigError(f"{where}the training split has {len(run.data.train)} samples, fewer than one step "
                          f"of data.batch_size {b} per process x {w} process(es) x optim.accumulate_steps {a} = "
                          f"{b * w * a} samples (incomplete batches are dropped): lower data.batch_size or add data")
    names = run.data.evaluator().metric_names()
    if cfg.train.best_metric and names is not None and cfg.train.best_metric not in names:
        raise ConfigError(f"{where}train.best_metric: '{cfg.train.best_metric}' is not a metric of the "
                          f"{cfg.data.name} evaluator{closest(cfg.train.best_metric, names)} "
                          f"(valid: {', '.join(names)})")
    slots = {"sgd": 1, "rmsprop": 2, "adamw": 2}[cfg.optim.name]
    weights = sum(t.numel() * t.element_size() for t in dist.unwrap(run.model).state_dict().values())
    dist.on_main(check_free_space, run.output_dir, 2 * weights * (1 + slots))  # a checkpoint and its temporary


@contextlib.contextmanager
def stop_on_signals(run):
    """SIGTERM (a cluster's preemption) and SIGINT: finish the step, write a checkpoint, exit
    (Preempted). A second SIGINT stops at once."""
    def request(signum, frame):
        if run.stop_signal and signum == signal.SIGINT:
            raise KeyboardInterrupt
        run.stop_signal = signal.Signals(signum).name
        log.warning("%s received: stopping after this step, with a checkpoint", run.stop_signal)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, request) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def start_run(cfg, output_dir, resume, force, config_file):
    run = build_run(cfg, output_dir)
    check_before_training(run, config_file)
    global_batch = cfg.data.batch_size * dist.world_size() * cfg.optim.accumulate_steps
    optim_cfg, lr_text = scale_lr_with_batch(cfg.optim, global_batch)
    run.optimizer = build_optimizer(run.model, optim_cfg)
    run.scheduler = build_scheduler(run.optimizer, cfg.sched, cfg.train.epochs, steps_per_epoch(run))
    run.skip = restore(run, resume, force) if resume else 0
    run.tb = TensorBoard(output_dir, purge_step=run.step + 1 if resume else None)
    if dist.is_main():
        with open(os.path.join(output_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        run.tb.text("config", "```\n" + to_yaml(cfg) + "```")
    log.info("training %s on %s (%d process%s), %d train / %d val samples, output %s", cfg.model.name,
             run.device, dist.world_size(), "es" if dist.world_size() > 1 else "", len(run.data.train),
             len(run.data.val), output_dir)
    log.info("global batch %d = %d per process x %d process(es) x %d accumulation step(s); %s", global_batch,
             cfg.data.batch_size, dist.world_size(), cfg.optim.accumulate_steps, lr_text)
    return run


def train(cfg, output_dir, resume=None, overwrite=False, force=False, config_file=None):
    """resume: a checkpoint, or "auto": <output_dir>/last.pt when it exists, else a fresh run (so
    that torchrun --max-restarts resumes by itself). A folder holding another run is refused
    unless resume or overwrite; a folder in use by a live run is refused."""
    dist.init_distributed(pick_device(cfg.device).type)
    requested = bool(resume)
    if resume == "auto":
        last = os.path.join(output_dir, "last.pt")
        resume = last if dist.broadcast_object(os.path.isfile(last)) else None
    dist.on_main(prepare_run_folder, output_dir, resume=requested, overwrite=overwrite)
    run = None
    try:
        run = start_run(cfg, output_dir, resume, force, config_file)
        with stop_on_signals(run):
            for epoch in range(run.epoch, cfg.train.epochs):
                run.epoch = epoch
                start_epoch_data(run, epoch)
                run.recipes.before_epoch(run)
                train_one_epoch(run, skip=run.skip)
                run.skip, metrics = 0, {}
                if (epoch + 1) % cfg.train.eval_every == 0 or epoch + 1 == cfg.train.epochs:
                    metrics = run.metrics = evaluate_all(run)
                save(run, metrics)
        run.recipes.finish(run)
        run.tb.hparams(_flat_hparams(cfg.model_dump(mode="json")), run.metrics)
        return run
    finally:
        if run is not None:
            run.tb.close()  # on a failure too: what was logged until then is kept
        if dist.is_main():
            release_run_folder(output_dir)


def _flat_hparams(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_hparams(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
