"""One training loop for every model family: train.py calls `train(cfg, ...)`.

Models return a dict of losses in training and predictions in eval; dataset builders bring their
evaluator; recipes hook in around the step. Nothing here knows which family it is training.
Building a run: engine/build.py; one epoch: engine/epoch.py; evaluation: engine/evaluation.py.
"""
import contextlib
import logging
import os
import signal
import threading
import types
import warnings

from engine import dist
from engine.build import build_run, start_device
from engine.checkpoint import (check_free_space, hold_lock, load_checkpoint, load_model_state, prepare_run_folder,
                               release_run_folder, remove_replaced_run, restore_replaced_run, save_checkpoint,
                               set_aside_run)
from engine.config import ConfigError, to_yaml
from engine.config_changes import describe_changes, resume_policy, under
from engine.errors import Preempted
from engine.epoch import steps_per_epoch, train_one_epoch
from engine.evaluation import append_metrics, evaluate_all
from engine.files import flatten
from engine.freeze import Freezer
from engine.limits import Limits
from engine.optim import build_optimizer, fits_state, scale_lr_with_batch, state_slots
from engine.registry import closest
from engine.seeding import restore_rng, rng_state, start_epoch_data
from engine.world import configured_split, keep_global_batch

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- checkpoints

def checkpoint_state(run, epoch_complete, evaluated=True):
    """Every process's RNG state (dropout, masks differ per rank), gathered: call on every rank."""
    return {"model": dist.unwrap(run.model).state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
            "recipes": run.recipes.state_dict(), "epoch": run.epoch, "step": run.step,
            "batches_done": run.batches_done, "epoch_complete": epoch_complete, "evaluated": evaluated, "best": run.best,
            "metrics": run.metrics, "rng": dist.all_gather_object(rng_state()),
            "config": run.cfg.model_dump(mode="json"), "batch_split": run.batch_split, "limits": run.limits.state_dict(),
            "classes": list(run.data.classes) if run.data.classes else None}


def save(run, metrics, epoch_complete=True, evaluated=True):
    """last.pt every epoch (and every checkpoint.every_n_steps), best.pt on a better
    val/<best_metric>; `best` is updated first so that last.pt carries it too (a resumed run then
    compares against the true best). Called on every rank; rank 0 writes."""
    key = f"val/{run.cfg.train.best_metric}" if run.cfg.train.best_metric else next(
        (k for k in metrics if k.startswith("val/")), None)
    if key and metrics and key not in metrics:
        raise ConfigError(f"train.best_metric: '{key}' is not among the evaluation metrics {sorted(metrics)}")
    better = key in metrics and (run.best is None or (
        metrics[key] > run.best if run.cfg.train.best_mode == "max" else metrics[key] < run.best))
    if better:
        run.best = metrics[key]
    state = checkpoint_state(run, epoch_complete, evaluated)
    if not dist.is_main():
        return
    save_checkpoint(state, os.path.join(run.output_dir, "last.pt"))
    if better:
        save_checkpoint(state, os.path.join(run.output_dir, "best.pt"))
    remove_replaced_run(run.output_dir)  # --overwrite: the old run goes once the new one has a checkpoint


def checkpoint_or_stop(run):
    """Between steps: step checkpoints (checkpoint.every_n_steps) and a requested stop, at the same
    step on every process."""
    every = run.cfg.checkpoint.every_n_steps
    if run.stop or (every and run.step % every == 0):
        save(run, {}, epoch_complete=False)
    if run.stop:
        raise Preempted(f"{run.stop_signal or 'a stop request on another process'}: checkpoint written at step "
                        f"{run.step} to {os.path.join(run.output_dir, 'last.pt')}; continue with --resume")


# ---------------------------------------------------------------- resume

SCHEDULE_KEYS = ("optim.lr", "optim.name", "optim.scale_lr_with_batch", "optim.accumulate_steps", "sched",
                 "train.epochs", "train.budget", "train.max_steps_per_epoch", "optim.lr_mult", "optim.param_groups")


def resume_changes(run, state, path, force):
    """The differences from the checkpoint's config, key by key. Those that break the run (model,
    data, seed, optimizer type, recipes) are refused unless --force; the others are applied."""
    changes, refused = resume_policy(state.get("config"), run.cfg.model_dump(mode="json"))
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
    run.scheduler = run.limits.scheduler(run, steps_per_epoch(run))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for _ in range(run.step):
            run.scheduler.step()
    log.warning("lr schedule rebuilt from the new config: lr %.6g at step %d", run.optimizer.param_groups[0]["lr"],
                run.step)


def restore(run, path, force=False, state=None):
    """Continue from a checkpoint (`state`: it, already loaded). Sets run.epoch to the epoch to run
    next; returns how many of its batches were done already (a step checkpoint in the middle of an epoch)."""
    state = load_checkpoint(path) if state is None else state
    changed = resume_changes(run, state, path, force)
    run.limits.load_state_dict(state.get("limits"), run, changed)  # early stopping, the budget's plan
    load_model_state(dist.unwrap(run.model), state["model"], path, run.cfg.checkpoint.strict)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    run.epoch, run.step, run.best, run.metrics = state["epoch"], state["step"], state["best"], state["metrics"]
    regrouped = not fits_state(run.optimizer, state["optimizer"])  # lr_mult, param_groups, train.freeze changed
    if "optim.name" in changed:
        log.warning("optim.name changed: the optimizer starts from a fresh state")
    elif regrouped:
        log.warning("the optimizer's parameter groups differ from the checkpoint's (a changed optim.lr_mult, "
                    "optim.param_groups or train.freeze): the optimizer starts from a fresh state")
    else:
        run.optimizer.load_state_dict(state["optimizer"])
        if any(k.startswith("optim.") for k in changed):  # changed hyperparameters take effect
            for group, new in zip(run.optimizer.param_groups, fresh):
                group.update({k: v for k, v in new.items() if k not in ("lr", "initial_lr")})
    if regrouped or any(under(k, SCHEDULE_KEYS) for k in changed):
        replay_schedule(run, [g["initial_lr"] for g in fresh])
    else:
        try:
            run.scheduler.load_state_dict(state["scheduler"])
        except KeyError:  # a checkpoint of the older, chained schedulers: the closed form replays it
            replay_schedule(run, [g["initial_lr"] for g in fresh])
    run.scaler.load_state_dict(state["scaler"])
    run.recipes.load_state_dict(state["recipes"])
    restore_rng(state["rng"], run.cfg.seed, run.step)
    done = 0 if state.get("epoch_complete", True) else state["batches_done"]
    run.eval_pending = not state.get("evaluated", True)  # stopped during the epoch's evaluation
    run.epoch += 0 if done or run.eval_pending else 1
    log.info("resumed from %s at epoch %d (%s), step %d", path, run.epoch + 1,
             "its evaluation" if run.eval_pending else f"batch {done}", run.step)
    return done


# ---------------------------------------------------------------- the lifecycle

def check_before_training(run, config_file=None):
    """What would otherwise show only after the first epoch, or not at all."""
    cfg, where = run.cfg, f"{config_file}: " if config_file else ""
    if steps_per_epoch(run) == 0:
        b, w, a = cfg.data.batch_size, dist.world_size(), cfg.optim.accumulate_steps
        raise ConfigError(f"{where}the training split has {len(run.data.train)} samples, fewer than one step "
                          f"of data.batch_size {b} per process x {w} process(es) x optim.accumulate_steps {a} = "
                          f"{b * w * a} samples (incomplete batches are dropped): lower data.batch_size or add data")
    if len(run.data.val) == 0:
        raise ConfigError(f"{where}data ({cfg.data.name}): the validation split has no samples, so every evaluation "
                          f"would be meaningless (COCO's AP would read -1): check its annotation file / val split")
    if len(run.data.val) <= cfg.train.check_val_samples:  # a bad sample stops the run now, not after an epoch
        for _ in run.val_loader:
            pass
    names = run.data.evaluator().metric_names()
    if cfg.train.best_metric and names is not None and cfg.train.best_metric not in names:
        raise ConfigError(f"{where}train.best_metric: '{cfg.train.best_metric}' is not a metric of the "
                          f"{cfg.data.name} evaluator{closest(cfg.train.best_metric, names)} "
                          f"(valid: {', '.join(names)})")
    weights = sum(t.numel() * t.element_size() for t in dist.unwrap(run.model).state_dict().values())
    copies = 2 * (1 + state_slots(cfg.optim))  # a checkpoint and its temporary
    dist.on_main(check_free_space, run.output_dir, copies * weights)


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM (a cluster's preemption; SLURM and Kubernetes signal the whole process group) and
    SIGINT. During start-up (building, amp's timing) the run stops at once: nothing to save. Once
    `stops.run` is set the request is honoured at the next step or evaluation batch, with a
    checkpoint (Preempted). A second SIGINT stops at once."""
    stops = types.SimpleNamespace(run=None)

    def request(signum, frame):
        name, run = signal.Signals(signum).name, stops.run
        if run is None:
            raise Preempted(f"{name} during start-up: nothing was trained yet", agreed=False)
        if run.stop_signal and signum == signal.SIGINT:
            raise KeyboardInterrupt
        run.stop_signal = name
        log.warning("%s received: stopping after this step, with a checkpoint", name)

    if threading.current_thread() is not threading.main_thread():
        yield stops
        return
    previous = {s: signal.signal(s, request) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stops
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def evaluate_or_stop(run):
    """The epoch's training is in last.pt before its evaluation starts: a stop request (or a bad
    validation sample) during the evaluation loses nothing, and --resume runs the evaluation."""
    if not run.eval_pending:
        save(run, {}, evaluated=False)
    try:
        return evaluate_all(run)
    except Preempted as e:
        raise Preempted(f"{e}: the epoch's checkpoint was written before it, at step {run.step}, to "
                        f"{os.path.join(run.output_dir, 'last.pt')}; continue with --resume", agreed=False) from None


def start_run(cfg, output_dir, resume, force, config_file, overwrite=False, device=None):
    state = load_checkpoint(resume) if resume else None
    split = configured_split(cfg)
    cfg = keep_global_batch(cfg, state, resume) if state else cfg  # another number of processes: the same global batch
    # the recipes get their saved states before setup: amp keeps the checkpoint's precision, timing nothing
    run = build_run(cfg, output_dir, recipe_states=state.get("recipes") if isinstance(state, dict) else None,
                    device=device)
    run.batch_split = split
    check_before_training(run, config_file)
    if overwrite:  # the checks passed: the old run moves aside (it comes back if this one fails before a checkpoint)
        dist.on_main(set_aside_run, output_dir)
    global_batch = cfg.data.batch_size * dist.world_size() * cfg.optim.accumulate_steps
    optim_cfg, lr_text = scale_lr_with_batch(cfg.optim, global_batch)
    where = f"{config_file}: " if config_file else ""
    # the frozen parameters are in the optimizer from the start, in groups of their own, stepped once they
    # have gradients (engine.freeze)
    freezer = Freezer(cfg.train.freeze, run.model, where) if cfg.train.freeze else None
    run.optimizer = build_optimizer(run.model, optim_cfg, where, apart=freezer.params if freezer else ())
    if freezer and cfg.train.epochs and not cfg.train.budget and cfg.train.freeze.epochs >= cfg.train.epochs:
        log.warning("train.freeze.epochs %d >= train.epochs %d: %s stay frozen for the whole run",
                    cfg.train.freeze.epochs, cfg.train.epochs, ", ".join(cfg.train.freeze.modules))
    run.limits = Limits(cfg)  # epochs, early stopping, a time budget
    run.scheduler = run.limits.scheduler(run, steps_per_epoch(run))
    run.skip = restore(run, resume, force, state) if resume else 0
    run.tb.open(output_dir, purge_step=run.step + 1 if resume else None)
    if dist.is_main():
        with open(os.path.join(output_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        run.tb.text("config", "```\n" + to_yaml(cfg) + "```")
    log.info("training %s on %s (%d process%s), %d train / %d val samples, output %s", cfg.model.name,
             run.device, dist.world_size(), "es" if dist.world_size() > 1 else "", len(run.data.train),
             len(run.data.val), output_dir)
    log.info("global batch %d = %d per process x %d process(es) x %d accumulation step(s); %s", global_batch,
             cfg.data.batch_size, dist.world_size(), cfg.optim.accumulate_steps, lr_text)
    return run, freezer


def train(cfg, output_dir, resume=None, overwrite=False, force=False, config_file=None):
    """resume: a checkpoint, or "auto": <output_dir>/last.pt when it exists, else a fresh run (so
    that torchrun --max-restarts resumes by itself). A folder holding another run is refused
    unless resume or overwrite; a folder in use by a live run is refused."""
    with stop_on_signals() as stops:
        device = start_device(cfg.device)  # the process group first: the run folder is prepared on rank 0
        requested, lease = bool(resume), cfg.checkpoint.lock_lease
        # under the lock: a run that an --overwrite killed before its first checkpoint had set aside is back
        dist.on_main(prepare_run_folder, output_dir, resume=requested, overwrite=overwrite, lease=lease)
        if resume == "auto":
            last = os.path.join(output_dir, "last.pt")
            resume = last if dist.broadcast_object(os.path.isfile(last)) else None
        run = None
        try:
            with hold_lock(output_dir, lease) if dist.is_main() else contextlib.nullcontext():
                run, freezer = start_run(cfg, output_dir, resume, force, config_file, overwrite, device)
                stops.run = run
                for epoch in run.limits.epochs(run):
                    run.epoch = epoch
                    if freezer:  # train.freeze: frozen or trained in this epoch (its evaluation's precise_bn too)
                        freezer.at_epoch(run, epoch)
                    if not run.eval_pending:
                        start_epoch_data(run, epoch)
                        run.recipes.before_epoch(run)
                        train_one_epoch(run, skip=run.skip, between_steps=checkpoint_or_stop)
                    run.skip, metrics = 0, {}
                    if run.limits.last_epoch(run, epoch) or (epoch + 1) % cfg.train.eval_every == 0:
                        metrics = run.metrics = evaluate_or_stop(run)
                        dist.on_main(append_metrics, output_dir, epoch + 1, run.step, metrics)
                        run.limits.after_eval(run, metrics)  # early stopping decided, at the same step everywhere
                    run.eval_pending = False
                    save(run, metrics)
            run.recipes.finish(run)
            hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                       for k, v in flatten(cfg.model_dump(mode="json")).items()}
            run.tb.hparams(hparams, run.metrics)
            return run
        finally:
            if run is not None:
                run.tb.close()  # on a failure too: what was logged until then is kept
            if dist.is_main():
                restore_replaced_run(output_dir)  # ended before its first checkpoint: nothing is lost
                release_run_folder(output_dir)
