"""One trial: a real `train.py` run in its own folder and process (a crash or an out-of-memory stays in
its trial), watched while it trains. Each evaluation it appends to metrics.jsonl is reported to Optuna;
when the pruner says so, the run gets SIGTERM and stops at its next step with a checkpoint (exit 75), as
a preemption would. The trial's value is the run's best val/<train.best_metric>."""
import ctypes
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from optuna.exceptions import UpdateFinishedTrialError

from engine.checkpoint import METRICS_LOG

log = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
POLL_SECONDS = 0.2
STOPPED = 75  # train.py's exit status after a stop request, with a checkpoint


@dataclass
class Outcome:
    state: str  # complete | pruned | failed | stopped (tune.py was asked to stop) | lost (finished by another process)
    value: float = None             # the best objective seen
    pruned_at: dict = None          # {"epoch", "step", "value"} where the pruner stopped it
    error: str = None               # the run's last error line(s)
    seconds: float = 0.0


def read_evaluations(folder, objective):
    """{epoch: (step, value of the objective)} from the run's metrics.jsonl; a line still being written
    (no newline yet) is left for the next read."""
    path = os.path.join(folder, METRICS_LOG)
    found = {}
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return found
    for line in text.split("\n")[:-1]:
        try:
            entry = json.loads(line)
            value = entry["metrics"][objective]
        except (ValueError, KeyError, TypeError):
            continue
        found[int(entry["epoch"])] = (int(entry["step"]), float(value))
    return found


try:  # loaded here: the child between fork and exec only calls it (no loader lock there, with threads)
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux
    _prctl = None


def _die_with_parent():
    """In the child before exec: SIGTERM when tune.py dies (kill -9 included), so a run never trains on
    without its study; it stops with a checkpoint and the next tune.py resumes it."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _error_line(log_path):
    """The run's own last error line (`error: ...`, or a traceback's last line), else its last line."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if line.startswith("error:") or re.match(r"[A-Za-z_.]*(Error|Exception)\b", line):
            return line
    return lines[-1] if lines else "no output"


def run(trial, config_path, folder, objective, direction, env=None, cpus=None, stop=None, wall_limit=None,
        heartbeat=None, clock=time.monotonic):
    """Train one trial in `folder` (resumed from its last.pt when it has one) and report its evaluations
    to `trial`; `stop` (a threading.Event) set: the run gets SIGTERM and the outcome is "stopped".
    `heartbeat()` is called while it runs (Optuna's heartbeat of RDB storages)."""
    os.makedirs(folder, exist_ok=True)
    log_path = os.path.join(folder, "train.log")
    cmd = [sys.executable, TRAIN, "--config", config_path, "--output-dir", folder, "--resume", "auto"]
    start = clock()

    def preexec():
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log_path, "a") as out:
        # a process group of its own: a terminal's Ctrl-C reaches tune.py, which stops its trials itself
        proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=preexec, process_group=0)
    trial.set_user_attr("train_pid", proc.pid)
    reported, pruned, stopped, killed, lost = set(), None, False, False, False
    better = max if direction == "maximize" else min
    last_beat = -math.inf
    while True:
        code = proc.poll()
        evaluations = read_evaluations(folder, objective)
        for epoch in sorted(set(evaluations) - reported):
            reported.add(epoch)
            if pruned:
                continue
            step, value = evaluations[epoch]
            try:
                trial.report(value, epoch)
            except UpdateFinishedTrialError:  # another process failed it (no heartbeat for GRACE_SECONDS)
                lost = True
                proc.send_signal(signal.SIGTERM) if code is None else None
                break
            if code is None and trial.should_prune():
                pruned = {"epoch": epoch, "step": step, "value": value}
                log.info("trial %d pruned at epoch %d (step %d): %s %.4g", trial.number, epoch, step, objective, value)
                proc.send_signal(signal.SIGTERM)
        if code is not None or lost:
            break
        if stop is not None and stop.is_set() and not stopped:
            stopped = True
            proc.send_signal(signal.SIGTERM)
        if wall_limit and clock() - start > wall_limit and not killed:
            killed = True
            log.error("trial %d: still running %.0f s after its start (limit %.0f s): SIGTERM", trial.number,
                      clock() - start, wall_limit)
            proc.send_signal(signal.SIGTERM)
        if heartbeat and clock() - last_beat > 5:
            heartbeat()
            last_beat = clock()
        time.sleep(POLL_SECONDS)
    if lost:
        proc.wait()
        return Outcome(state="lost", seconds=clock() - start)
    values = {e: v for e, (_, v) in read_evaluations(folder, objective).items()}
    outcome = Outcome(state="complete", seconds=clock() - start,
                      value=better(values.values()) if values else None)
    if pruned and code in (0, STOPPED):
        outcome.state, outcome.pruned_at = "pruned", pruned
    elif stopped and code == STOPPED:
        outcome.state = "stopped"
    elif code != 0 or killed:
        outcome.state = "failed"
        outcome.error = (f"exceeded its wall limit of {wall_limit:.0f} s; " if killed else "") + \
            f"train.py exited {code}: {_error_line(log_path)} (log: {log_path})"
    elif not values:
        outcome.state, outcome.error = "failed", f"the run ended without an evaluation of {objective} (log: {log_path})"
    return outcome
