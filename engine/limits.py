"""When a run ends: after train.epochs, when train.early_stopping's patience runs out, or when
train.budget's time is spent (engine/budget.py). The loop asks `epochs(run)` for the epochs to
run, `last_epoch(run, epoch)` after each, and reports evaluations to `after_eval`."""
import logging

from engine import dist
from engine.budget import BudgetPlan, fmt
from engine.optim import build_scheduler

log = logging.getLogger(__name__)


class EarlyStopping:
    """Counted in evaluations: `patience` evaluations in a row without an improvement of
    val/<train.best_metric> by more than `min_delta` stop the run. The decision is rank 0's,
    broadcast, so that every process stops after the same step."""

    def __init__(self, cfg):
        self.patience, self.min_delta, self.mode = cfg.patience, cfg.min_delta, None
        self.best, self.best_epoch, self.bad_evals, self.stopped = None, None, 0, None

    def update(self, run, metrics, key):
        reason = None
        if dist.is_main():
            value, up = metrics[key], run.cfg.train.best_mode == "max"
            if self.best is None or (value > self.best + self.min_delta if up else value < self.best - self.min_delta):
                self.best, self.best_epoch, self.bad_evals = value, run.epoch + 1, 0
            else:
                self.bad_evals += 1
            if self.bad_evals >= self.patience:
                reason = (f"early stopping: {key} {value:.4f} has not improved on {self.best:.4f} (epoch "
                          f"{self.best_epoch}) by more than min_delta {self.min_delta:g} for {self.bad_evals} "
                          f"evaluation(s) (patience {self.patience}): stopped after epoch {run.epoch + 1}, step "
                          f"{run.step}; best.pt holds the best {key}")
        self.best, self.best_epoch, self.bad_evals, self.stopped = dist.broadcast_object(
            (self.best, self.best_epoch, self.bad_evals, reason))
        if self.stopped:
            log.warning("%s", self.stopped)

    def state_dict(self):
        return {"best": self.best, "best_epoch": self.best_epoch, "bad_evals": self.bad_evals,
                "stopped": self.stopped}

    def load_state_dict(self, state, changed):
        """A stopped run stays stopped unless the resume changed the patience (the count is kept and
        compared with the new one) or the epochs (the count starts again)."""
        self.best, self.best_epoch, self.bad_evals = state["best"], state["best_epoch"], state["bad_evals"]
        if "train.epochs" in changed or "train.budget" in changed:
            self.bad_evals = 0
        self.stopped = state["stopped"] if self.bad_evals >= self.patience else None
        if state["stopped"] and not self.stopped:
            log.warning("resuming a run that stopped early (%s): the changed %s lets it continue",
                        state["stopped"], "epochs" if not self.bad_evals else "patience")


class Limits:
    def __init__(self, cfg):
        self.cfg = cfg
        es = cfg.train.early_stopping
        self.early = EarlyStopping(es) if es else None
        self.budget = BudgetPlan(cfg) if cfg.train.budget is not None else None
        self.stopped = None  # why the run stopped before its end (early stopping)
        self.ended = None    # why a budget run ended: its plan done
        if self.budget and cfg.train.epochs:
            log.info("train.budget %s replaces train.epochs %d: the schedule of %d epochs is fitted to the "
                     "budget", cfg.train.budget, cfg.train.epochs, cfg.train.epochs)

    def scheduler(self, run, ipe):
        """The lr schedule: the config's over train.epochs, or fitted to the budget's plan."""
        if self.budget:
            return self.budget.scheduler(run, ipe)
        return build_scheduler(run.optimizer, self.cfg.sched, self.cfg.train.epochs, ipe)

    @property
    def planned_epochs(self):
        if not self.budget:
            return self.cfg.train.epochs
        return -(-self.budget.total // self.budget.ipe)

    def epochs(self, run):
        """The epochs to run from run.epoch on (0-based)."""
        epoch = run.epoch
        while True:
            if self.budget:
                self.budget.start_epoch(run)
            if self.stopped:
                if epoch == run.epoch:
                    log.warning("the run stopped early, nothing to do: %s. Raise train.early_stopping.patience "
                                "or train.epochs to continue it", self.stopped)
                return
            if self.budget and self.budget.needs_last_evaluation(run):
                log.info("budget: the plan ended at step %d, after an epoch end that was not evaluated; "
                         "evaluating it now", run.step)
                last = epoch if run.eval_pending else epoch - 1  # resumed during that evaluation: run.epoch is it
                run.eval_pending = True  # the loop evaluates and saves without training
                yield last
                self.budget_ended(run)
                return
            if (run.step >= self.budget.total) if self.budget else epoch >= self.cfg.train.epochs:
                if self.budget:
                    self.budget_ended(run)
                return
            yield epoch
            epoch += 1

    def _ended(self, run):
        b = self.budget
        return (f"budget {fmt(b.seconds)} reached: the plan's {b.total} steps ({b.total / b.ipe:.2f} epochs of "
                f"{b.ipe}) are trained; the run ends at step {run.step}, epoch {run.epoch + 1}")

    def budget_ended(self, run):
        """The line that says the budget ended the run (last.pt holds it: set before the last save)."""
        self.ended = self.ended or self._ended(run)
        log.info("%s", self.ended)
        self.budget.overrun(run)

    def last_epoch(self, run, epoch):
        """After the epoch's steps: is it the run's last (then it is evaluated)? Under a budget also the
        first epoch, while no evaluation was timed (engine.budget.BudgetPlan.end_training)."""
        if self.budget:
            last = self.budget.end_training(run)
            if last and run.step >= self.budget.total:
                self.ended = self._ended(run)
            return last
        return epoch + 1 == self.cfg.train.epochs

    def after_eval(self, run, metrics):
        if self.budget:
            self.budget.evaluated(run)
        if self.early and metrics:
            key = f"val/{self.cfg.train.best_metric}" if self.cfg.train.best_metric else next(
                (k for k in metrics if k.startswith("val/")), None)
            if key in metrics:
                self.early.update(run, metrics, key)
                self.stopped = self.early.stopped

    def after_step(self, run):
        """True when the budget's planned steps are done."""
        return bool(self.budget) and self.budget.after_step(run)

    def check_due(self):
        """Is the budget's check of its plan due on this process's clock (engine.budget.BudgetPlan.check_due)?"""
        return self.budget is not None and self.budget.check_due()

    def request_check(self):
        """The processes agreed that a check is due (engine.epoch.check_step): the budget re-plans."""
        self.budget.request_check()

    def state_dict(self):
        return {"early_stopping": self.early.state_dict() if self.early else None,
                "budget": self.budget.state_dict() if self.budget else None, "stopped": self.stopped,
                "ended": self.ended}

    def load_state_dict(self, state, run, changed):
        state = state or {}
        if self.early and state.get("early_stopping"):
            self.early.load_state_dict(state["early_stopping"], changed)
            self.stopped = self.early.stopped
        elif state.get("stopped") and not self.early:
            log.warning("the run had stopped early (%s); train.early_stopping is now unset: it continues",
                        state["stopped"])
        if self.budget and state.get("budget"):
            self.budget.load_state_dict(state["budget"], run)
