"""One training loop for every model family: train.py calls `train(cfg, ...)`.

Models return a dict of losses in training and predictions in eval; dataset builders bring their
evaluator; recipes hook in around the step. Nothing here knows which family it is training.
"""
import logging
import os
import time
from types import SimpleNamespace

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler

from engine import dist
from engine.checkpoint import load_checkpoint, rng_state, save_checkpoint, seed_everything, set_rng_state
from engine.config import ConfigError, to_yaml
from engine.logger import TensorBoard, progress, setup_console
from engine.optim import build_optimizer, build_scheduler
from engine.registry import DATASETS, MODELS
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


def build_loaders(cfg, data, seed):
    generator = torch.Generator()  # reseeded every epoch: shuffling and worker seeds survive resume
    if dist.is_distributed():
        sampler = DistributedSampler(data.train, shuffle=True, seed=seed, drop_last=True)
    else:
        sampler = RandomSampler(data.train, generator=generator)
    if data.train_batch_sampler:
        batches = data.train_batch_sampler(data.train, sampler, cfg.data.batch_size)
    else:
        batches = BatchSampler(sampler, cfg.data.batch_size, drop_last=True)
    common = dict(num_workers=cfg.data.workers, collate_fn=data.collate_fn,
                  pin_memory=torch.cuda.is_available())
    train = DataLoader(data.train, batch_sampler=batches, generator=generator, **common)
    val = DataLoader(data.val, batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                     sampler=ShardSampler(len(data.val)), **common)
    return train, val


def start_epoch_data(run, epoch):
    run.train_loader.generator.manual_seed((run.cfg.seed or 0) * 1000 + epoch)
    sampler = run.train_loader.batch_sampler.sampler
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, loader, evaluator, device, recipes=None, run=None, show_progress=True):
    model.eval()
    for inputs, targets in progress(loader, desc="eval", leave=False, disable=not show_progress,
                                      tty_only=True):
        inputs = to_device(inputs, device)
        if recipes:
            inputs = recipes.prepare_inputs(inputs)
            with recipes.forward_context(run):
                predictions = model(inputs)
        else:
            predictions = model(inputs)
        evaluator.update(predictions, targets)
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


# ---------------------------------------------------------------- checkpoints

def checkpoint_state(run):
    return {"model": dist.unwrap(run.model).state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
            "recipes": run.recipes.state_dict(), "epoch": run.epoch, "step": run.step,
            "best": run.best, "metrics": run.metrics, "rng": rng_state(),
            "config": run.cfg.model_dump(mode="json")}


def restore(run, path):
    state = load_checkpoint(path)
    dist.unwrap(run.model).load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.recipes.load_state_dict(state["recipes"])
    run.epoch, run.step, run.best, run.metrics = state["epoch"], state["step"], state["best"], state["metrics"]
    set_rng_state(state["rng"])
    log.info("resumed from %s at epoch %d, step %d", path, run.epoch + 1, run.step)


def save(run, metrics):
    """last.pt every epoch, best.pt on a better val/<best_metric>; `best` is updated first so that
    last.pt carries it too (a resumed run then compares against the true best)."""
    if not dist.is_main():
        return
    key = f"val/{run.cfg.train.best_metric}" if run.cfg.train.best_metric else next(
        (k for k in metrics if k.startswith("val/")), None)
    if key and metrics and key not in metrics:
        raise KeyError(f"train.best_metric: '{key}' is not among the evaluation metrics {sorted(metrics)}")
    better = key in metrics and (run.best is None or (
        metrics[key] > run.best if run.cfg.train.best_mode == "max" else metrics[key] < run.best))
    if better:
        run.best = metrics[key]
    state = checkpoint_state(run)
    save_checkpoint(state, os.path.join(run.output_dir, "last.pt"))
    if better:
        save_checkpoint(state, os.path.join(run.output_dir, "best.pt"))


# ---------------------------------------------------------------- the loop

def training_forward(model, batch, run):
    inputs, targets = to_device(batch, run.device)
    with run.recipes.forward_context(run):
        return model(run.recipes.prepare_inputs(inputs), targets)


def steps_per_epoch(run):
    limit = run.cfg.train.max_steps_per_epoch
    return len(run.train_loader) if limit is None else min(len(run.train_loader), limit)


def train_one_epoch(run):
    cfg = run.cfg
    run.model.train()
    steps = steps_per_epoch(run)
    bar = progress(total=steps, desc=f"epoch {run.epoch + 1}/{cfg.train.epochs}")
    tick = time.perf_counter()
    skipped = []  # unreadable samples left out of their batch (data.skip_bad_samples)
    for i, batch in enumerate(run.train_loader):
        if i == steps:
            break
        skipped += getattr(batch, "skipped", [])
        data_time = time.perf_counter() - tick
        losses = training_forward(run.model, batch, run)
        loss = sum(losses.values())
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {run.step}: {losses}")
        run.optimizer.zero_grad(set_to_none=True)
        run.scaler.scale(loss).backward()
        if cfg.optim.clip_grad_norm:
            run.scaler.unscale_(run.optimizer)
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.optim.clip_grad_norm)
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.scheduler.step()
        run.step += 1
        run.recipes.after_step(run)
        step_time = time.perf_counter() - tick
        tick = time.perf_counter()
        if run.step % cfg.train.log_every == 0 or i == steps - 1:
            batch_size = len(batch[1]) * dist.world_size()
            values = {k: v.item() for k, v in losses.items()}
            values.update(loss=loss.item(), lr=run.optimizer.param_groups[0]["lr"],
                          samples_per_s=batch_size / step_time, data_time=data_time, step_time=step_time)
            run.tb.scalars(values, run.step, "train")
            bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
        bar.update()
    bar.close()
    if skipped:
        log.warning("epoch %d: %d unreadable training samples skipped (data.skip_bad_samples): %s", run.epoch + 1,
                    len(skipped), "; ".join(f"{s.where} ({s.reason})" for s in skipped))


def build_run(cfg, output_dir):
    """Everything train.py and evaluate.py share: device, data, model, recipes, loaders."""
    device = pick_device(cfg.device)
    rank, local_rank, world = dist.init_distributed(device.type)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    setup_console()
    if cfg.seed is not None:
        seed_everything(cfg.seed, rank)
        torch.backends.cudnn.benchmark = False
    data = build_data(cfg, output_dir)
    recipe_names = cfg.recipes + (["ddp"] if world > 1 and "ddp" not in cfg.recipes else [])
    run = SimpleNamespace(cfg=cfg, device=device, data=data, output_dir=output_dir, epoch=0, step=0,
                          best=None, metrics={}, recipes=RecipeStack(recipe_names, cfg.recipe_args),
                          model=build_model(cfg, data).to(device), tb=TensorBoard(None),
                          scaler=torch.amp.GradScaler(device.type, enabled=False))
    run.training_forward = lambda model, batch: training_forward(model, batch, run)
    run.train_loader, run.val_loader = build_loaders(cfg, data, cfg.seed or 0)
    run.recipes.setup(run)
    return run


def train(cfg, output_dir, resume=None):
    os.makedirs(output_dir, exist_ok=True)
    run = build_run(cfg, output_dir)
    run.optimizer = build_optimizer(run.model, cfg.optim)
    run.scheduler = build_scheduler(run.optimizer, cfg.sched, cfg.train.epochs, steps_per_epoch(run))
    start = 0
    if resume:
        restore(run, resume)
        start = run.epoch + 1
    run.tb = TensorBoard(output_dir)
    if dist.is_main():
        with open(os.path.join(output_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        run.tb.text("config", "```\n" + to_yaml(cfg) + "```")
    log.info("training %s on %s (%d process%s), %d train / %d val samples, output %s", cfg.model.name,
             run.device, dist.world_size(), "es" if dist.world_size() > 1 else "", len(run.data.train),
             len(run.data.val), output_dir)
    for epoch in range(start, cfg.train.epochs):
        run.epoch = epoch
        start_epoch_data(run, epoch)
        run.recipes.before_epoch(run)
        train_one_epoch(run)
        metrics = {}
        if (epoch + 1) % cfg.train.eval_every == 0 or epoch + 1 == cfg.train.epochs:
            metrics = run.metrics = evaluate_all(run)
        save(run, metrics)
    run.recipes.finish(run)
    run.tb.hparams(_flat_hparams(cfg.model_dump(mode="json")), run.metrics)
    run.tb.close()
    return run


def _flat_hparams(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_hparams(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
