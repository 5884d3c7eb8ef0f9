"""One training epoch: forward, backward, optimizer step, with gradient accumulation and DDP's
no_sync. The loop (engine/loop.py) runs epochs; benchmark.py runs this one alone to time it."""
import contextlib
import logging
import time

import torch

from engine import dist
from engine.build import all_skipped
from engine.errors import UserError
from engine.logger import progress
from engine.optim import schedule_lr

log = logging.getLogger(__name__)


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
    """Non-finite loss terms, stop requests (signals) and a time budget's due check, decided across
    processes in one small all-reduce, so that all act at the same step. With fp16 AMP the
    GradScaler skips the step."""
    flags = [~torch.isfinite(v.detach()).all() for v in losses.values()]
    asks = [run.stop_signal is not None, run.limits is not None and run.limits.check_due()]
    flags = torch.stack(flags + [torch.tensor(a, device=flags[0].device) for a in asks]).float()
    *bad, stop, check = dist.reduce_max(flags).tolist()
    if check:
        run.limits.request_check()
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


class NothingToTrain(UserError):
    """data.skip_bad_samples left out every step of an epoch: each held a batch of unreadable samples only."""


def skipped_step(run, batch):
    """Does this batch leave its optimizer step out (data.skip_bad_samples: every sample of the batch
    unreadable)? Decided on every process at once (one small all-reduce a batch, only with
    skip_bad_samples under torchrun), so that all leave out the same step and no collective waits."""
    mine = all_skipped(batch)
    if not dist.is_distributed() or not run.cfg.data.model_extra.get("skip_bad_samples"):
        return mine
    return bool(dist.reduce_max(torch.tensor(float(mine), device=run.device)).item())


def train_one_epoch(run, skip=0, between_steps=None):
    """`skip`: batches of a resumed epoch already done. `between_steps(run)`: called after each
    optimizer step and its logging (the loop's step checkpoints and stop requests). A step that holds
    a batch whose every sample is unreadable (data.skip_bad_samples) is left out and counted."""
    cfg, accum = run.cfg, run.cfg.optim.accumulate_steps
    run.model.train()
    total = steps_per_epoch(run) * accum  # batches
    epochs = run.limits.planned_epochs if run.limits else cfg.train.epochs
    bar = progress(total=total, initial=skip, desc=f"epoch {run.epoch + 1}/{epochs}")
    meter, data_time = LossMeter(), 0.0
    skipped = []  # unreadable samples left out of their batch (data.skip_bad_samples)
    trained, left_out, leave_out = 0, 0, False  # steps trained and left out (every sample of a batch unreadable)
    batches = run.train_loader.batch_sampler
    batches.skip, batches.stop = skip, total  # no batch past the epoch's last step is read
    run.train_loader.keep_skipped = True
    step_start = tick = time.perf_counter()
    try:  # the bar ends its line before an error is printed under it
        for i, batch in enumerate(run.train_loader, start=skip):
            data_time += time.perf_counter() - tick
            skipped += getattr(batch, "skipped", [])
            boundary = (i + 1) % accum == 0  # this batch completes an optimizer step
            if i % accum == 0:
                run.optimizer.zero_grad(set_to_none=True)
                leave_out = False
            leave_out = leave_out or skipped_step(run, batch)
            if not leave_out:
                sync = boundary or not hasattr(run.model, "no_sync")  # DDP: all-reduce on the step's last batch only
                with contextlib.nullcontext() if sync else run.model.no_sync():
                    losses = run.training_forward(run.model, batch)
                    check_step(run, losses)
                    loss = sum(losses.values())
                    run.scaler.scale(loss / accum if accum > 1 else loss).backward()
                meter.add(losses)
            run.batches_done = i + 1
            bar.update()
            tick = time.perf_counter()
            if not boundary:
                continue
            if leave_out:
                left_out += 1
                step_start, data_time = tick, 0.0
                continue
            optimizer_step(run)
            trained += 1
            step_time = time.perf_counter() - step_start
            if run.step % cfg.train.log_every == 0 or i + 1 == total:
                values = meter.mean()
                values.update(lr=schedule_lr(run.optimizer), data_time=data_time, step_time=step_time,
                              samples_per_s=len(batch[1]) * accum * dist.world_size() / step_time)
                run.tb.scalars(values, run.step, "train")
                bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
            if between_steps:
                between_steps(run)
            if run.limits and run.limits.after_step(run):  # a time budget's planned steps are done
                break
            step_start = tick = time.perf_counter()
            data_time = 0.0
    finally:
        batches.skip, batches.stop = 0, None
        run.train_loader.keep_skipped = False
        bar.close()
    where = "; ".join(f"{s.where} ({s.reason})" for s in skipped)
    if left_out and not trained:
        raise NothingToTrain(f"epoch {run.epoch + 1}: data.skip_bad_samples left out all {left_out} of its steps: "
                             f"each held a batch whose every sample is unreadable, nothing was trained. "
                             f"{len(skipped)} unreadable training samples: {where}")
    if skipped:
        log.warning("epoch %d: %d unreadable training samples skipped (data.skip_bad_samples)%s: %s", run.epoch + 1,
                    len(skipped), f", {left_out} step(s) left out (a batch of unreadable samples only)"
                    if left_out else "", where)
