"""A time budget (`train.budget: 20m`, `train.py --budget 20m`) in place of train.epochs.

After the recipes' setup (amp's choice) and a few warm-up steps, the run times its steps and plans
how many optimizer steps fit, so that training, the evaluations and the checkpoints end within the
budget, counted from the start of the process (train.py: imports and start-up included). The config's lr
schedule is laid onto the planned steps in closed form: with train.epochs set, the schedule of
those epochs (warm-up, milestones, step sizes, the cosine / poly / linear decay) is scaled to the
plan; without it, the epoch-valued settings are epochs of the run and the decay spans the plan
(`sched.name: linear`, to zero, is the one Li et al., ICLR 2020 found best under a budget).
The plan is measured again at every epoch end (so at every evaluation) and every 5% of the budget's
wall time (each process's clock, agreed in the step's all-reduce of engine.epoch.check_step), and
the remaining steps are corrected: the schedule goes on from where it is at the new pace, without a
jump in the lr. The pace is the slower of the last 10 and the last 3 steps, so a machine that
slows down is seen at once. A measured evaluation is scaled by its own slowdown: a few validation
batches are timed after each evaluation and again when the steps slow down (the evaluation runs a
batch per thread and slows down less). Rank 0 decides, every process follows (one broadcast per check).
A resumed run keeps the plan and the time already spent (both are in the checkpoint).
"""
import io
import logging
import math
import os
import time
from collections import deque

import torch
from torch.optim import lr_scheduler
from torch.utils.data import IterableDataset

from engine import dist
from engine.config import duration_seconds
from engine.errors import Preempted
from engine.evaluation import eval_streams, evaluate
from engine.optim import schedule_factor

log = logging.getLogger(__name__)

WARM_STEPS = 3      # steps after a (re)start that are not timed (allocation, caches, workers)
MEASURE_STEPS = 7   # steps timed before the first plan
CHECK_FRACTION = 0.05  # a re-plan every 5% of the budget's wall time, inside epochs too
RECENT_STEPS = 3  # the pace is the slower of the last 10 steps' mean and the last 3 steps' mean
PROBE_FRACTION = 0.05  # of the validation batches, timed again to see how much slower the evaluation got
RETIME = 1.2  # they are timed again when the steps are this much slower than at the evaluation (or the last probe)
PROVISIONAL_EPOCHS = 10  # the schedule's length before the first plan when train.epochs is unset
_IMPORTED = time.time()


_count_from = None  # set by count_from_process_start: train.py's budget includes its start-up


def count_from_process_start():
    """The command line's budget counts from the start of the process (imports and start-up
    included); a train() called inside a longer process counts from the call."""
    global _count_from
    _count_from = process_start()


def process_start():
    """time.time() when this process started (the torchrun agent's, under torchrun): the budget counts
    Python's and torch's import too. Linux /proc; elsewhere the import of this module."""
    try:
        pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def scaled_schedule(epochs, nominal_steps, planned_steps):
    """The plan line's words for train.epochs' schedule laid onto the planned steps (of those left)."""
    return (f"the schedule of train.epochs {epochs} ({nominal_steps:.0f} steps) fitted to {planned_steps} steps "
            f"(x{planned_steps / max(1, nominal_steps):.3g})")


def fmt(seconds):
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def cost(total, step, ipe, eval_every, every_n, times, pending_end=False, eval_next=False):
    """Seconds from step `step` to the end of a run of `total` steps of `ipe` an epoch: the steps, an
    evaluation at every eval_every-th epoch end and at the last, a checkpoint at every epoch end
    (and every every_n steps). `times`: (step, evaluation, checkpoint) seconds. pending_end: `step`
    ends an epoch whose evaluation and checkpoint are still to come. eval_next: the next epoch end is
    evaluated too (an evaluation not measured yet is measured there)."""
    step_time, eval_time, save_time = times
    epochs = max(1, math.ceil(total / ipe))
    ends = [e for e in range(max(0, step // ipe - pending_end), epochs)
            if min((e + 1) * ipe, total) > step or pending_end and min((e + 1) * ipe, total) == step]
    evals = sum(1 for i, e in enumerate(ends) if (e + 1) % eval_every == 0 or e == epochs - 1 or eval_next and i == 0)
    saves = len(ends) + (total // every_n - step // every_n if every_n else 0)
    return (total - step) * step_time + evals * eval_time + saves * save_time


def steps_that_fit(left, step, ipe, eval_every, every_n, times, pending_end=False, eval_next=False):
    """The largest number of steps (at least `step`, those done) whose cost fits in `left` seconds."""
    lo, hi = step, step + max(0, int(left / times[0])) + 1
    while lo < hi:  # the cost grows with the steps
        mid = (lo + hi + 1) // 2
        if cost(mid, step, ipe, eval_every, every_n, times, pending_end, eval_next) <= left:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Discard:
    """An evaluator that keeps nothing: the probe times the predictions only."""

    def update(self, predictions, targets):
        pass


class BudgetPlan:
    """The planned number of optimizer steps (`total`) and the schedule's clock.

    The schedule is a function of its own iteration v (its length `nominal`); `segments` map the run's
    iteration onto v: from segment (it0, v0, total) on, v grows linearly from v0 at it0 to `nominal` at
    `total`. A correction starts a new segment where the run is, so the lr is continuous."""

    def __init__(self, cfg):
        self.cfg, self.seconds = cfg, duration_seconds(cfg.train.budget)
        self.began = _count_from or time.time()  # this process's start (its start-up counts)
        self.deadline = self.began + self.seconds
        self.train_start = None  # when this process's first epoch began: the start-up ends there
        self.spent_before = 0.0  # seconds spent before a resume
        self.margin = 0.5 + 0.015 * self.seconds  # the end: the last report, TensorBoard, the process exit
        self.nominal, self.segments, self.total = None, [], None
        self.planned, self.last_check, self.check_requested, self.resumed = False, None, False, False
        self.step_times, self.counted, self.tick = deque(maxlen=10), 0, None
        self.warm_times, self.measuring = deque(maxlen=WARM_STEPS), None  # the first steps, timed apart
        self.eval_time = self.save_time = None
        self.eval_pace = None  # the step time when the evaluation was measured
        self.probe_base = None  # seconds of a few validation batches, timed right after the evaluation
        self.probe_ratio = None  # (step pace, evaluation slowdown) of the latest probe
        self.evaluated_step = None  # the step of the last evaluation: the run must end with one
        self.train_end = self.eval_end = None
        self.end_planned = False  # end_training re-planned the epoch end with measured times
        self._factor = None

    # ---------------------------------------------------------------- the schedule

    def scheduler(self, run, ipe):
        """The run's LambdaLR on the plan's clock. Before any plan: the schedule of train.epochs (or of a
        provisional length); a schedule rebuilt on resume (a changed lr) keeps the plan."""
        if not self.segments:
            self.ipe, self.lr = ipe, run.optimizer.defaults["lr"]
            epochs = self.cfg.train.epochs or PROVISIONAL_EPOCHS
            self.nominal = self.total = epochs * ipe
            self.segments = [(0, 0.0, self.nominal)]
            self._factor = schedule_factor(self.cfg.sched, epochs, ipe, self.lr)
        return lr_scheduler.LambdaLR(run.optimizer, lambda it: self._factor(self.clock(it)))

    def clock(self, it):
        """The schedule's iteration at the run's iteration `it`."""
        it0, v0, total = next((s for s in reversed(self.segments) if s[0] <= it), self.segments[0])
        if total <= it0:
            return self.nominal
        return min(self.nominal, v0 + (self.nominal - v0) * (it - it0) / (total - it0))

    # ---------------------------------------------------------------- measuring

    def start_epoch(self, run):
        """Top of an epoch (and the end of the run's last one): the time of the evaluation and
        checkpoint just done is measured, and the plan corrected unless end_training already counted
        them with measured times."""
        now, evaluated = time.perf_counter(), self.eval_end is not None
        self.train_start = self.train_start or time.time()
        if self.train_end is not None:
            self.save_time = now - (self.eval_end or self.train_end)
            if evaluated:
                self.eval_time = self.eval_end - self.train_end
                self.eval_pace = self.pace() if self.step_times or self.warm_times else None
                self.probe_base, self.probe_ratio = None, None
        planned, self.end_planned = self.end_planned, False
        self.train_end = self.eval_end = None
        if (self.step_times or self.warm_times) and not planned:
            self.replan(run, "epoch end")
        if evaluated and dist.is_main() and run.step < self.total:  # the evaluations to come are timed against it
            self.probe_base = self.probe(run)
            self.eval_time += self.probe_base or 0.0  # each evaluation is followed by its probe
        self.tick = time.perf_counter()

    def end_training(self, run):
        """The epoch's steps are done: is it to be evaluated? The last epoch (the plan corrected with
        what was measured), and the first one as long as no evaluation was measured: the estimate
        misses what recipes do before an evaluation (precise_bn), and the last one must not overrun."""
        self.train_end = time.perf_counter()
        if run.step < self.total and (self.step_times or self.warm_times):
            # planned with measured times, the top of the next epoch does not re-plan: the plan's end is
            # not moved after the checkpoint that records it (the wall-clock checks follow the pace)
            self.end_planned = self.eval_time is not None and self.save_time is not None
            self.replan(run, "epoch end", pending_end=True)
        return run.step >= self.total or self.eval_time is None

    def evaluated(self, run):
        self.eval_end, self.evaluated_step = time.perf_counter(), run.step

    def needs_last_evaluation(self, run):
        """The plan is done but its last step was not evaluated: the re-plan after an epoch's checkpoint
        found no room for another step (the checkpoint took longer than the plan's estimate), or the
        run was stopped during its last evaluation and resumed."""
        return run.step >= self.total and run.step > 0 and self.evaluated_step != run.step

    def check_due(self):
        """Is a check of the plan due on this process's clock (5% of the budget since the last)? The
        processes agree in the step's all-reduce (engine.epoch.check_step), which calls request_check."""
        return self.planned and self.last_check is not None and \
            time.perf_counter() - self.last_check >= CHECK_FRACTION * self.seconds

    def request_check(self):
        self.check_requested = True

    def pace(self):
        """Seconds a step: the slower of the last 10 steps' and the last 3 steps' means (warm-up steps only
        when nothing else was timed)."""
        times = list(self.step_times or self.warm_times)
        return max(sum(times) / len(times), sum(times[-RECENT_STEPS:]) / len(times[-RECENT_STEPS:]))

    def after_step(self, run):
        """Times the step; plans after the warm-up, re-plans when a check is due (every 5% of the
        budget's wall time; after a resume once the steps are timed). True when the planned steps are done."""
        now = time.perf_counter()
        if self.tick is not None:
            self.counted += 1
            (self.step_times if self.counted > WARM_STEPS else self.warm_times).append(now - self.tick)
            self.measuring = self.measuring or now
        if self.planned:
            due = self.check_requested or self.resumed and self.counted >= WARM_STEPS + MEASURE_STEPS
        else:  # rank 0 says when: after the measured steps, or sooner when the time runs short
            due = dist.broadcast_object(self.counted >= WARM_STEPS + MEASURE_STEPS or self.short_of_time(now))
        if due:
            self.replan(run, "plan" if not self.planned else "check")
        self.tick = time.perf_counter()
        return run.step >= self.total

    def short_of_time(self, now):
        """Measuring for more than 5% of the budget, or less than a quarter of it left (a slow start-up)."""
        if not dist.is_main() or not (self.step_times or self.warm_times):
            return False
        left = self.deadline - self.margin - time.time()
        return now - self.measuring > CHECK_FRACTION * self.seconds or left < 0.25 * self.seconds

    # ---------------------------------------------------------------- planning

    def probe(self, run):
        """Seconds the evaluation (engine.evaluation.evaluate: its streams, its forward context) takes on
        the first validation batches (5% of them, at least two per stream), or None where the loader
        cannot be sampled so. Rank 0 only; the model is evaluated unwrapped, so no collective runs."""
        loader = run.val_loader
        if getattr(loader, "batch_sampler", None) is None or isinstance(loader.dataset, IterableDataset):
            return None
        streams = eval_streams(run.model, run.device, run.recipes, run)
        count = max(2 * streams, math.ceil(PROBE_FRACTION * len(loader.batch_sampler)))
        batches = [loader.collate_fn([loader.dataset[i] for i in b]) for _, b in zip(range(count), loader.batch_sampler)]
        model, training = dist.unwrap(run.model), run.model.training
        start = time.perf_counter()
        try:
            evaluate(model, batches, _Discard(), run.device, run.recipes, run, show_progress=False, streams=streams)
        except Preempted:  # a stop request: handled at the next step
            return None
        finally:
            model.train(training)
        return time.perf_counter() - start

    def eval_slowdown(self, run):
        """How much slower the evaluation is now than when it was measured. The steps' slowdown does not
        say: on CPU the evaluation runs one batch per thread, and a competing process slows a team of
        threads far more (16x against 5x measured), so a few batches are timed again (at most once
        per 20% change of the step pace). Without a probe: the steps' slowdown."""
        steps = self.step_time / self.eval_pace if self.eval_pace else 1.0
        if steps < RETIME or self.probe_base is None:
            return max(1.0, steps)
        pace, ratio = self.probe_ratio or (None, None)
        if pace is None or not 1 / RETIME < self.step_time / pace < RETIME:
            seconds = self.probe(run)
            ratio = seconds / self.probe_base if seconds else steps
            self.probe_ratio = (self.step_time, ratio)
        return max(1.0, ratio)

    def eval_estimate(self, run):
        """Measured (longer by as much as the evaluation got slower since), or before the first
        evaluation: the validation set's forward passes at about half a training step per batch of the
        same size, plus a second, with 50% to spare."""
        if self.eval_time is not None:
            return self.eval_time * self.eval_slowdown(run)
        per_step = run.cfg.data.batch_size * run.cfg.optim.accumulate_steps
        batches = len(run.val_loader) * (run.cfg.data.eval_batch_size or run.cfg.data.batch_size) / per_step
        return 1.5 * (1.0 + 0.5 * batches * self.step_time)

    def save_estimate(self, run):
        if self.save_time is None:  # the model and optimizer serialized once, with 100% to spare
            start = time.perf_counter()
            torch.save({"model": dist.unwrap(run.model).state_dict(), "optimizer": run.optimizer.state_dict()},
                       io.BytesIO())
            self.save_time = 2 * (time.perf_counter() - start)
        return self.save_time

    def replan(self, run, why, pending_end=False):
        """The largest number of steps whose cost fits in the time left; decided on rank 0."""
        decision = None
        if dist.is_main():
            self.step_time = self.pace()
            left = self.deadline - self.margin - time.time()
            times = (self.step_time, self.eval_estimate(run), self.save_estimate(run))
            total = steps_that_fit(left, run.step, self.ipe, self.cfg.train.eval_every,
                                   self.cfg.checkpoint.every_n_steps, times, pending_end, self.eval_time is None)
            decision = (total, *times, left)
        total, step_time, eval_time, save_time, left = dist.broadcast_object(decision)
        if not self.planned or total != self.total:
            self.overrun(run, planning=True)
        self.step_time, self.resumed = step_time, False
        self.last_check, self.check_requested = time.perf_counter(), False
        if total == self.total and self.planned:
            return
        old = self.total
        self.refit(run.step, total)
        elapsed = time.time() - (self.deadline - self.seconds)
        words = (f"step {step_time:.3f} s, evaluation {eval_time:.2f} s{'' if self.eval_time is not None else ' (estimated)'}, "
                 f"checkpoint {save_time:.2f} s; {total} steps = {total / self.ipe:.2f} epochs of {self.ipe}")
        if not self.planned:
            scale = (scaled_schedule(self.cfg.train.epochs, self.nominal - self.clock(run.step), total - run.step)
                     if self.cfg.train.epochs else f"sched.{self.cfg.sched.name} over the {total} steps")
            end = (f"ending {fmt(self.margin)} before the budget" if elapsed < self.seconds else
                   "the budget is spent already")
            log.info("budget %s: plan at step %d, %s elapsed (start-up included): %s, %s; %s", fmt(self.seconds),
                     run.step, fmt(elapsed), words, end, scale)
            self.planned = True
        else:
            log.info("budget %s: correction (%s) at step %d, %s elapsed, %s left: %d -> %d steps; %s", fmt(self.seconds),
                     why, run.step, fmt(elapsed), fmt(left), old, total, words)

    def overrun(self, run, planning=False):
        """A warning when the budget is spent (the start-up alone can take longer than a short budget):
        by how much, and where the time went; when planning, or at the run's end. Rank 0."""
        over, when = time.time() - self.deadline, "when planning" if planning else "at the end of the run"
        if over <= 0 or not dist.is_main():
            return
        start_up = (self.train_start or time.time()) - self.began
        why = (f"the start-up alone (imports, data, model, the recipes' set-up) took {fmt(start_up)}"
               if start_up >= self.seconds else f"the start-up took {fmt(start_up)}, the training, evaluations and "
               f"checkpoints since {fmt(time.time() - self.began - start_up)}")
        why += f", {fmt(self.spent_before)} before the resume" if self.spent_before else ""
        log.warning("budget %s overrun by %s %s (step %d): %s; %sgive a longer train.budget / --budget",
                    fmt(self.seconds), fmt(over), when, run.step, why,
                    "no more steps are trained, " if planning else "")

    def refit(self, step, total):
        """`total` steps from now on: the schedule goes on from where it is at step `step`, and reaches
        its end at `total`. Without train.epochs, the first plan sets the schedule's length."""
        v = self.clock(step)
        if self.cfg.train.epochs is None and not self.planned:  # the schedule is the plan's
            self.nominal, v = float(total), float(step)
            self._factor = schedule_factor(self.cfg.sched, total / self.ipe, self.ipe, self.lr)
        self.segments.append((step, v, total))
        self.total = total

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self):
        return {"seconds": self.seconds, "elapsed": time.time() - (self.deadline - self.seconds),
                "nominal": self.nominal, "segments": [list(s) for s in self.segments], "total": self.total,
                "planned": self.planned, "step_time": getattr(self, "step_time", None),
                "eval_time": self.eval_time, "eval_pace": self.eval_pace, "save_time": self.save_time,
                "evaluated_step": self.evaluated_step}

    def load_state_dict(self, state, run):
        """A resumed run continues the plan: the time spent before counts, the schedule's clock is kept,
        and the steps are timed again (a correction after the warm-up)."""
        self.deadline = (_count_from or time.time()) + self.seconds - state["elapsed"]
        self.spent_before = state["elapsed"]
        self.nominal, self.segments = state["nominal"], [tuple(s) for s in state["segments"]]
        self.total, self.planned = state["total"], state["planned"]
        self.eval_time, self.save_time = state["eval_time"], state["save_time"]
        if state["step_time"]:  # until this run's steps are timed (a finished run given more time)
            self.step_times.append(state["step_time"])
        if self.cfg.train.epochs is None and self.planned:
            self._factor = schedule_factor(self.cfg.sched, self.nominal / self.ipe, self.ipe, self.lr)
        self.eval_pace = state.get("eval_pace")
        self.evaluated_step = state.get("evaluated_step", self.total)  # older checkpoints: taken as evaluated
        self.resumed = True  # a correction once this run's steps are timed
        log.info("budget %s: %s spent before the resume, plan %d steps", fmt(self.seconds), fmt(state["elapsed"]),
                 self.total)
