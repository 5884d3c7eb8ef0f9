"""Issue 37, acceptance 3: workers never outlive their agent. torchrun starts its workers in sessions
of their own, so kill -9 of the agent (what a scheduler's group kill does to it) leaves them orphaned:
they went on training alone. Now each notices (engine.agent_watch), stops at its next step with a
checkpoint and exits 75. The test process is the orphans' subreaper, so it reads their exit codes."""
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from engine.checkpoint import load_checkpoint
from helpers import HELPER, TINY, block

pytestmark = [pytest.mark.distributed, pytest.mark.process, pytest.mark.slow]

PR_SET_CHILD_SUBREAPER = 36
GONE_WITHIN = 10  # seconds, the bound
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def set_subreaper(on):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@pytest.fixture
def adopted():
    """Orphaned descendants of this process become its children (instead of init's), to be waited for;
    those listed here and still running at the end (the old code) are killed and reaped."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_CHILD_SUBREAPER and /proc are Linux's")
    set_subreaper(True)
    pids = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    set_subreaper(False)


def children_of(pid):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # ended meanwhile
            continue
        if ppid == pid:
            found.append(int(entry))
    return sorted(found)


class Job:
    """A torchrun agent (or launch.py's) with `nproc` workers running `args`, its output read as it comes
    (the orphans keep writing to the same pipe)."""

    def __init__(self, nproc, *args, launcher=("-m", "torch.distributed.run")):
        cmd = [sys.executable, *launcher, "--standalone", f"--nproc_per_node={nproc}", *args]
        self.agent = subprocess.Popen(cmd, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.nproc, self.lines = nproc, []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.agent.stdout), daemon=True)
        self.reader.start()

    def log(self):
        return "".join(self.lines)

    def kill_agent_once(self, ready, adopted, timeout=240):
        """kill -9 of the agent alone once `ready()`; its workers' pids (adopted by this process)."""
        start = time.monotonic()
        try:
            while not ready():
                assert self.agent.poll() is None, self.log()[-3000:]
                assert time.monotonic() - start < timeout, f"not ready within {timeout} s:\n{self.log()[-3000:]}"
                time.sleep(0.1)
            workers = children_of(self.agent.pid)
            assert len(workers) == self.nproc, (workers, self.log()[-3000:])
        except BaseException:  # no kill yet: the job ends whole
            adopted.extend(children_of(self.agent.pid))  # killed and reaped by the fixture
            self.agent.kill()
            self.agent.wait(timeout=60)
            raise
        adopted.extend(workers)
        os.kill(self.agent.pid, signal.SIGKILL)  # the agent alone: its workers are in sessions of their own
        self.agent.wait(timeout=60)
        return workers

    def exit_codes(self, workers, seconds):
        """{pid: exit code} of the workers, each reaped here within `seconds`; one still running is killed
        (the old code), and missing."""
        codes, deadline = {}, time.monotonic() + seconds
        while len(codes) < len(workers) and time.monotonic() < deadline:
            for pid in set(workers) - set(codes):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        for pid in set(workers) - set(codes):
            os.kill(pid, signal.SIGKILL)
        self.reader.join(timeout=60)
        return codes


def train(out, *overrides):
    return HELPER, "train", "--config", TINY, "--output-dir", str(out), "--set", "train.epochs=500", *overrides


def assert_all_ended(codes, workers, job, seconds, allowed):
    alive = sorted(set(workers) - set(codes))
    assert not alive, f"still running {seconds} s after the agent's kill: {alive}\n{job.log()[-3000:]}"
    assert set(codes.values()) <= allowed, (codes, job.log()[-3000:])
    assert f"the torchrun agent (pid {job.agent.pid}) is gone" in job.log(), job.log()[-3000:]


LAUNCHERS = {"torchrun": ("-m", "torch.distributed.run"), "launch.py": (os.path.join(ROOT, "launch.py"),)}


@pytest.mark.parametrize("nproc, launcher", [(2, "torchrun"), (1, "torchrun"), (2, "launch.py")])
def test_kill9_of_the_agent_stops_its_workers_with_a_checkpoint(tmp_path, adopted, nproc, launcher):
    """The agent killed with kill -9 once a first step checkpoint exists: every worker is gone within
    10 s with exit code 75, a line names the lost agent, last.pt holds a later step than the one before
    the kill (the stop's checkpoint, named in the stop line), and the run folder's lock is released:
    nothing trains on, and --resume may start. launch.py's workers keep their rendezvous store in rank 0,
    not in the agent."""
    out = tmp_path / "run"
    job = Job(nproc, *train(out, "train.eval_every=1000", "checkpoint.every_n_steps=2"), launcher=LAUNCHERS[launcher])
    workers = job.kill_agent_once(lambda: (out / "last.pt").exists(), adopted)
    before = load_checkpoint(str(out / "last.pt"))["step"]  # written whole (os.replace)
    codes = job.exit_codes(workers, GONE_WITHIN)
    assert_all_ended(codes, workers, job, GONE_WITHIN, {75})
    # the worker that noticed first stopped them all, at one step
    stopped = re.findall(r"stopped: (?:SIGTERM|a stop request on another process): checkpoint written at step (\d+)",
                         job.log())
    state = load_checkpoint(str(out / "last.pt"))
    assert stopped == [str(state["step"])] and state["step"] > before, (before, stopped, job.log()[-3000:])
    assert not state["epoch_complete"] and len(state["rng"]) == nproc
    assert not (out / "run.lock").exists()


def test_kill9_of_the_agent_during_start_up_ends_its_workers(tmp_path, adopted):
    """The agent killed while rank 0 is still starting (a recipe's setup; rank 1 waits for it in a
    collective): both end within 10 s, nothing written, the lock released. Rank 1 exits 75, or 1 when
    rank 0's exit reaches its collective before its own stop does (nothing was trained either way)."""
    out, pid_file = tmp_path / "run", tmp_path / "pid"
    job = Job(2, *train(out, "recipes=[_fault]", block("block_setup", 0, pid_file)))
    workers = job.kill_agent_once(pid_file.exists, adopted)
    codes = job.exit_codes(workers, GONE_WITHIN)
    assert_all_ended(codes, workers, job, GONE_WITHIN, {75, 1})
    assert "stopped: SIGTERM during start-up: nothing was trained yet" in job.log(), job.log()[-3000:]
    assert not (out / "last.pt").exists() and not (out / "run.lock").exists()


WORKER_DEAF_TO_SIGTERM = """
import os, signal, sys, time
sys.path.insert(0, os.getcwd())
from engine.agent_watch import watch_agent
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a main thread stuck in C++ would be
watch_agent(kill_after=2)
open(sys.argv[1] + f".{os.environ['LOCAL_RANK']}", "w").close()
time.sleep(300)
"""


def test_a_worker_that_does_not_stop_on_sigterm_is_killed_as_its_agent_would(tmp_path, adopted):
    """A worker whose SIGTERM is not honoured (here ignored) gets SIGKILL `kill_after` seconds later
    (torchrun's agent waits 30 s, the default; 2 s here), as the agent itself would have done."""
    ready = str(tmp_path / "ready")
    job = Job(2, "--no-python", sys.executable, "-c", WORKER_DEAF_TO_SIGTERM, ready)
    workers = job.kill_agent_once(lambda: all(os.path.exists(f"{ready}.{r}") for r in range(2)), adopted)
    codes = job.exit_codes(workers, GONE_WITHIN)
    assert_all_ended(codes, workers, job, GONE_WITHIN, {-signal.SIGKILL})
    assert job.log().count("still running 2 s after the SIGTERM of its lost agent: SIGKILL") == 2, job.log()[-3000:]


def test_kill9_of_the_agent_while_its_worker_imports_ends_it(tmp_path, adopted):
    """train.py imports engine.agent_watch first (it records the agent's pid in milliseconds): an agent
    killed 0.3 s after starting its worker, in the worker's seconds of imports, is still noticed."""
    out = tmp_path / "run"
    job = Job(1, os.path.join(ROOT, "train.py"), "--config", TINY, "--output-dir", str(out), "--set",
              "train.epochs=500")
    workers = job.kill_agent_once(lambda: len(children_of(job.agent.pid)) == 1 and time.sleep(0.3) is None, adopted)
    codes = job.exit_codes(workers, 60)
    assert_all_ended(codes, workers, job, 60, {75})
    assert "stopped: SIGTERM during start-up: nothing was trained yet" in job.log()
    assert not (out / "last.pt").exists()
