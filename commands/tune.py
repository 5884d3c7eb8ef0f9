"""tune.py's body: a hyperparameter search over a config (tuning/), each trial a train.py process."""
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings

import optuna

from commands.cli import exit_with_error
from engine import processes
from engine.config import ConfigError, duration_seconds, load_config, to_yaml
from engine.errors import Preempted, UserError
from engine.files import atomic_write
from engine.logger import setup_console
from tuning import report, space as spaces, study as studies, trial as trials

log = logging.getLogger(__name__)


class GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid, without its stop once every point is taken: that stop is for study.optimize's loop (and
    raises outside it); here the study's N trials decide when it ends."""

    def after_trial(self, study, trial, state, values):
        pass


def sampler_for(name, space, seed, trials):
    if name == "grid":
        if trials > space.grid_size():
            log.warning("--trials %d over a grid of %d points: the trials beyond it repeat points", trials,
                        space.grid_size())
        return GridSampler(space.grid(), seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar: trials running elsewhere count as bad guesses meanwhile, so parallel trials spread out
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def pruner_for(name):
    if name == "median":  # Optuna's defaults: after 5 completed trials, from the first evaluation on
        return optuna.pruners.MedianPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def core_sets(jobs):
    """The cores of each of `jobs` trials at once (K x threads <= cores), and the threads of each."""
    cores = sorted(os.sched_getaffinity(0))
    threads = max(1, len(cores) // jobs)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the user's cap (e.g. the test suite's one thread)
        threads = max(1, min(threads, int(os.environ["OMP_NUM_THREADS"])))
    if jobs > len(cores):
        log.warning("--jobs %d on %d cores: the trials share cores (1 thread each)", jobs, len(cores))
        return [None] * jobs, 1
    return [set(cores[j * threads:(j + 1) * threads]) for j in range(jobs)], threads


class Search:
    """The trials of this process: K threads, each claiming a waiting trial and running it until none waits,
    a stop is requested, or --max-failures trials in a row failed."""

    def __init__(self, args, study, space, base, objective, budget_seconds):
        self.args, self.study, self.space, self.base = args, study, space, base
        self.objective, self.budget_seconds = objective, budget_seconds
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.failures = []  # (trial number, error) of the failures in a row
        self.gave_up = None
        self.started = time.monotonic()

    def run(self):
        cpus, threads = core_sets(self.args.jobs)
        log.info("%d trial(s) at once x %d thread(s) each on %d core(s)", self.args.jobs, threads,
                 len(os.sched_getaffinity(0)))
        workers = [threading.Thread(target=self.worker, args=(cpus[j], threads), name=f"trial-runner-{j}")
                   for j in range(self.args.jobs)]
        for w in workers:
            w.start()
            time.sleep(0.5)  # the first claims apart: the sampler sees the trials already started
        for w in workers:
            while w.is_alive():
                w.join(timeout=0.5)

    def worker(self, cpus, threads):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        while not self.stop.is_set():
            with self.lock:
                studies.recover(self.study)
                trial = studies.claim(self.study)
            if trial is None:
                return
            self.one(trial, cpus, env)

    def one(self, trial, cpus, env):
        frozen = studies.frozen(self.study, trial.number)
        number, slot = trial.number, studies.slot(frozen)
        folder = os.path.join(self.args.study_dir, f"trial_{slot:03d}")
        try:
            values = self.space.sample(trial)
            cfg = spaces.sampled_config(self.base, values, f"trial {number} of {self.args.space}")
        except UserError as e:
            return self.finish(trial, trials.Outcome(state="failed", error=f"sampled config refused: {e}"), values={})
        trial.set_user_attr("folder", folder)
        old_pid = frozen.user_attrs.get("train_pid") if frozen.user_attrs.get("host") == socket.gethostname() else None
        if old_pid and slot != number:  # the run of the trial this one resumes may still be writing its checkpoint
            wait_for_exit(old_pid, 120)
        os.makedirs(folder, exist_ok=True)
        config_path = os.path.join(folder, "trial.yaml")
        text = f"# tune.py: trial {number} of study {self.study.study_name}\n" + to_yaml(cfg)
        atomic_write(config_path, lambda f: f.write(text))
        log.info("trial %d%s: %s", number, f" (resumes trial {slot})" if slot != number else "",
                 ", ".join(f"{k}={v}" for k, v in values.items()))
        wall_limit = 2 * self.budget_seconds + 300 if self.budget_seconds else None
        outcome = trials.run(trial, config_path, folder, self.objective, self.study.direction.name.lower(), env=env,
                             cpus=cpus, stop=self.stop, wall_limit=wall_limit,
                             heartbeat=lambda: studies.heartbeat(self.study, trial))
        self.finish(trial, outcome, values)

    def finish(self, trial, outcome, values):
        try:
            self.tell(trial, outcome)
        except optuna.exceptions.UpdateFinishedTrialError:
            outcome.state = "lost"
        if outcome.state == "lost":
            log.warning("trial %d was marked failed by another process (no heartbeat for %d s) and queued again: "
                        "this run (%s) is not counted", trial.number, studies.GRACE_SECONDS,
                        trial.user_attrs.get("folder"))
        with self.lock:
            if outcome.state == "failed":
                self.failures.append((trial.number, outcome.error))
                if len(self.failures) >= self.args.max_failures and not self.stop.is_set():
                    self.gave_up = list(self.failures)
                    self.stop.set()
            elif outcome.state in ("complete", "pruned"):
                self.failures = []
            if outcome.state in ("complete", "pruned"):
                report.hparams(self.args.study_dir, trial.number, values, {self.objective: outcome.value})
            self.write_report()

    def tell(self, trial, outcome):
        number = trial.number
        if outcome.state == "lost":
            return
        trial.set_user_attr("seconds", round(outcome.seconds, 1))
        if outcome.state == "complete":
            self.study.tell(trial, outcome.value)
            log.info("trial %d complete: %s %.4f (%.0f s)", number, self.objective, outcome.value, outcome.seconds)
        elif outcome.state == "pruned":
            trial.set_user_attr("pruned_at", {**outcome.pruned_at, "pruner": self.args.pruner})
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            log.info("trial %d pruned at epoch %d (%.0f s)", number, outcome.pruned_at["epoch"], outcome.seconds)
        elif outcome.state == "stopped":  # SIGTERM to tune.py: queued again, resumed from its checkpoint next time
            studies.retry(self.study, studies.frozen(self.study, trial.number), "stopped by a stop request")
        else:
            trial.set_user_attr("error", outcome.error)
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.error("trial %d failed: %s", number, outcome.error)

    def write_report(self):
        try:
            return report.write(self.study, self.space, self.args.study_dir, self.objective,
                                time.monotonic() - self.started)
        except OSError as e:
            log.error("the study's report could not be written: %s", e)


def wait_for_exit(pid, seconds):
    deadline = time.monotonic() + seconds
    while processes.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def prepare(args):
    """The config, the trial budget and the space, checked before anything is written: (the config as data,
    the space, the objective, the study's identity, its name, the trial budget in seconds)."""
    cfg = load_config(args.config, args.set)
    if not cfg.train.best_metric:
        raise ConfigError(f"{args.config}: train.best_metric is not set: tune.py needs the objective, e.g. "
                          f"--set train.best_metric=top1")
    objective = f"val/{cfg.train.best_metric}"
    direction = "maximize" if cfg.train.best_mode == "max" else "minimize"
    budget_seconds = None
    base = cfg.model_dump(mode="json")
    if args.trial_budget:
        try:
            budget_seconds = duration_seconds(args.trial_budget)
        except ValueError as e:
            raise ConfigError(f"--trial-budget: {e}") from None
        base["train"]["budget"] = args.trial_budget
        cfg = spaces.sampled_config(base, {}, "--trial-budget")
    elif cfg.train.budget:
        budget_seconds = duration_seconds(cfg.train.budget)
    space = spaces.load_space(args.space, base)
    if args.sampler == "grid":
        space.grid()
    args.study_dir = args.study_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0] + "-tune")
    ident = studies.identity(to_yaml(cfg), space, args.trial_budget, objective, direction)
    name = args.study_name or os.path.basename(os.path.normpath(args.study_dir))
    return base, space, objective, ident, name, budget_seconds


def main(args):
    setup_console()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # the heartbeat's retry
    try:
        base, space, objective, ident, name, budget_seconds = prepare(args)
        if args.storage:  # reached before anything is written
            storage = studies.open_storage(args.storage)
            studies.check_local_identity(args.study_dir, ident, args.force)
        else:
            studies.check_local_identity(args.study_dir, ident, args.force)
            os.makedirs(args.study_dir, exist_ok=True)
            storage = studies.open_storage(studies.storage_url(None, args.study_dir))
        study = studies.open_study(storage, name, ident, args.trials, sampler_for(args.sampler, space, args.seed, args.trials),
                                   pruner_for(args.pruner), force=args.force)
        os.makedirs(args.study_dir, exist_ok=True)
        studies.save_local_identity(args.study_dir, ident, studies.storage_url(args.storage, args.study_dir), name)
    except UserError as e:
        exit_with_error(e)
    log.info("study %s: %d trials of %s over %s (%s), objective %s (%s), storage %s", name, args.trials,
             args.config, ", ".join(p.key for p in space), args.sampler, objective, ident["direction"],
             studies.hide_password(studies.storage_url(args.storage, args.study_dir)))
    search = Search(args, study, space, base, objective, budget_seconds)
    previous = {s: signal.signal(s, lambda signum, frame: on_stop(search, signum)) for s in (signal.SIGTERM,
                                                                                              signal.SIGINT)}
    try:
        search.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    s = search.write_report() or {}
    for line in report.headline(s, ident["direction"]) if s else []:
        log.info(line)
    log.info("report: %s", os.path.join(os.path.abspath(args.study_dir), "study.html"))
    if search.gave_up:
        exit_with_error(UserError(f"{len(search.gave_up)} trials failed in a row (--max-failures "
                                  f"{args.max_failures}), the study stopped:\n" + "\n".join(
                                      f"  trial {n}: {e}" for n, e in search.gave_up)))
    if search.stop.is_set():
        print("stopped: the running trials wrote their checkpoints; the same command continues the study",
              flush=True)
        sys.exit(Preempted.exit_code)


def on_stop(search, signum):
    if not search.stop.is_set():
        log.warning("%s: stopping the running trials (each writes its checkpoint)", signal.Signals(signum).name)
    search.stop.set()
