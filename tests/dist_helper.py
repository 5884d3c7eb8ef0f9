"""Faults and probes for the lifecycle and distributed tests, run as a real process:

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_helper.py train --config ... (train.py's options)
    python -m torch.distributed.run --nproc_per_node=2 tests/dist_helper.py augment OUT.json

It registers test-only recipes and models, then runs train.py's main (or a probe)."""
import contextlib
import json
import math
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import dist  # noqa: E402
from engine.hooks import Recipe  # noqa: E402
from engine.registry import MODELS, RECIPES, Range  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.yaml")


@RECIPES.register("_fault")
class Fault(Recipe):
    """kind nan: NaN inputs; raise: an exception; block: write the pid to `pid_file` (once) and wait
    for a signal (SIGTERM, or kill -9); block_eval: the same in the evaluation after step `step`;
    block_setup: the same during start-up (where amp times its candidates); none: nothing. On
    process `rank`, at optimizer step `step`."""

    def __init__(self, kind="nan", rank=1, step=2, pid_file=None):
        self.kind, self.rank, self.step, self.pid_file = kind, rank, step, pid_file

    def setup(self, run):
        self.run = run
        if self.kind == "block_setup" and dist.rank() == self.rank:
            self._block(run)

    def _now(self):
        return dist.rank() == self.rank and self.run.step + 1 == self.step and self.run.model.training

    def prepare_inputs(self, inputs):
        if self.kind == "nan" and self._now():
            return inputs * math.nan
        if self.kind == "raise" and self._now():
            raise RuntimeError(f"injected fault on rank {dist.rank()} at step {self.step}")
        if (self.kind == "block_eval" and dist.rank() == self.rank and self.run.step == self.step
                and not self.run.model.training):
            self._block(self.run)
        return inputs

    def after_step(self, run):
        if self.kind == "block" and dist.rank() == self.rank and run.step == self.step:
            self._block(run)

    def _block(self, run):
        if os.path.exists(self.pid_file):  # once (not again after --resume)
            return
        with open(self.pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(self.pid_file + ".tmp", self.pid_file)
        deadline = time.time() + 120
        while run.stop_signal is None and time.time() < deadline:
            time.sleep(0.05)


@RECIPES.register("_fault2")
class SecondFault(Fault):
    """A second fault of the same kinds beside _fault: e.g. one in the round after the first one's restart."""


@RECIPES.register("_log_ids")
class LogIds(Recipe):
    """Appends {"step": global step, "keys": the (epoch seed, sample index) keys of the step's batches
    on every process, sorted} to <run folder>/ids.jsonl (JSON lines, rank 0) after each optimizer
    step. Needs data.workers=0 (no batch fetched ahead of the step)."""

    def __init__(self):
        self.pending = []

    def setup(self, run):
        recipe, batches = self, run.train_loader.batch_sampler
        self.path = os.path.join(run.output_dir, "ids.jsonl")

        class Recording(type(batches)):
            def __iter__(self):
                for keys in super().__iter__():
                    recipe.pending.append([list(k) for k in keys])
                    yield keys

        batches.__class__ = Recording

    def after_step(self, run):
        mine = self.pending[-run.cfg.optim.accumulate_steps:]  # the step's (precise_bn reads batches too)
        keys = sorted(k for part in dist.all_gather_object(mine) for batch in part for k in batch)
        self.pending = []
        if dist.is_main():
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": run.step, "keys": keys}) + "\n")


@RECIPES.register("_final_step")
class FinalStep(Recipe):
    """Each process writes the step it ended at to `<folder>/rank<r>.step` (finish)."""

    def __init__(self, folder=None):
        self.folder = folder

    def finish(self, run):
        with open(os.path.join(self.folder, f"rank{dist.rank()}.step"), "w") as f:
            f.write(str(run.step))


@RECIPES.register("_final_weights")
class FinalWeights(Recipe):
    """Each process saves its own model's weights (unwrapped from DDP) to `<folder>/rank<r>.pt` (finish)."""

    def __init__(self, folder=None):
        self.folder = folder

    def finish(self, run):
        torch.save(dist.unwrap(run.model).state_dict(), os.path.join(self.folder, f"rank{dist.rank()}.pt"))


class _Clock:
    """engine.budget's `time` in a simulated run: time passes only when _sim_clock says so."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    def perf_counter(self):
        return self.now


@RECIPES.register("_sim_clock")
class SimClock(Recipe):
    """The time budget on a simulated clock (engine.budget's `time`), so that its plan does not depend on
    the machine's speed or load: the start-up takes `start_up` seconds, each training forward `step`, each
    evaluation batch `eval_batch`; from `after` seconds on, the steps of process `slow_rank` take `extra`
    more (a competing load). Under torchrun the processes meet in each step's all-reduce: every clock
    moves on to the latest (a fast process waits for a slow one), after each checked its own. With `folder`,
    a process that finishes writes its simulated seconds to <folder>/clock<rank>.seconds."""
    order = 0

    def __init__(self, start_up=2.0, step=0.1, eval_batch=0.01, slow_rank=0, after=1e9, extra=0.0, folder=None):
        self.start_up, self.step, self.eval_batch, self.folder = start_up, step, eval_batch, folder
        self.slow_rank, self.after, self.extra = slow_rank, after, extra
        self.clock = _Clock()

    def setup(self, run):
        import engine.budget
        engine.budget.time = self.clock
        engine.budget._count_from = self.began = self.clock.now  # the process starts now
        self.clock.now += self.start_up

    @contextlib.contextmanager
    def forward_context(self, run):
        yield
        self.clock.now += self.step if torch.is_grad_enabled() else self.eval_batch  # evaluations: no_grad

    def after_step(self, run):
        self.clock.now = dist.reduce_max(torch.tensor([self.clock.now], dtype=torch.float64)).item()
        if dist.rank() == self.slow_rank and self.clock.now - self.began > self.after:
            self.clock.now += self.extra

    def finish(self, run):
        if self.folder:
            with open(os.path.join(self.folder, f"clock{dist.rank()}.seconds"), "w") as f:
                f.write(str(self.clock.now - self.began))


@RECIPES.register("_fp16_scaler")
class Fp16Scaler(Recipe):
    """The GradScaler fp16 AMP uses, on CPU: a non-finite step is skipped, not fatal."""

    def setup(self, run):
        run.scaler = torch.amp.GradScaler("cpu", enabled=True)


class RankLoss(nn.Module):
    """A loss of 1 + rank (its gradient 0): the logged mean over 2 processes is 1.5."""

    def __init__(self, num_classes):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, num_classes)

    def forward(self, x, targets=None):
        logits = self.fc(x.flatten(1))
        if not self.training:
            return logits
        return {"loss_cls": logits.sum() * 0 + 1.0 + dist.rank()}


@MODELS.register("_rank_loss", ranges={"num_classes": Range(ge=1)})
def rank_loss(num_classes=2, width_mult=None, reduced_tail=None, dropout=None):  # those of tiny.yaml: unused
    return RankLoss(num_classes)


class Linear(nn.Module):
    """No dropout, no BatchNorm: the loss of a batch is the mean of its samples' losses."""

    def __init__(self, num_classes, unused):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, num_classes)
        self.unused = nn.Linear(2, 2) if unused else None

    def forward(self, x, targets=None):
        logits = self.fc(x.flatten(1))
        return {"loss_cls": nn.functional.cross_entropy(logits, targets)} if self.training else logits


@MODELS.register("_linear", ranges={"num_classes": Range(ge=1)})
def linear(num_classes=2, unused=False, width_mult=None, reduced_tail=None, dropout=None):  # those of tiny.yaml: unused
    return Linear(num_classes, unused)


def augment(out):
    """The augmentation draws of the first training batch on each process."""
    import datasets, models, recipes  # noqa: E401,F401
    from engine.config import load_config
    from engine.build import build_run
    from engine.seeding import start_epoch_data
    run = build_run(load_config(TINY, ["data.workers=1"]), os.path.dirname(out))
    run.data.train.transform = lambda image: torch.rand(4)  # what RandomResizedCrop etc. would draw
    start_epoch_data(run, 0)
    inputs, _ = next(iter(run.train_loader))
    draws = dist.all_gather_object(inputs.tolist())
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(draws, f)


if __name__ == "__main__":
    if sys.argv[1] == "augment":  # then train, if train.py's options follow
        augment(sys.argv[2])
        if len(sys.argv) == 3:
            dist.cleanup()
            sys.exit()
    import train
    train.command(sys.argv[sys.argv.index("--config"):])
