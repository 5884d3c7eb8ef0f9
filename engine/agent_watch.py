"""A torchrun worker never outlives its agent. torchrun starts each worker in a session of its own,
so a kill of the agent's process group (what a scheduler sends) kills the agent alone, and its
workers went on training with nobody to restart or stop them. `watch_agent` (called where a worker
starts, engine.build.start_device) polls the parent process; once the agent is gone, one log line
says so and the worker gets what the agent would have sent on its own stop: SIGTERM, so a training
run stops at its next step with a checkpoint and exits 75 (engine.loop.stop_on_signals), then
SIGKILL if the process still lives `kill_after` seconds later (a main thread stuck in C++, e.g. in
a collective or a store whose host is gone; torchrun's agent waits 30 s too).

A watching thread rather than prctl(PR_SET_PDEATHSIG): it works wherever os.getppid does, it logs
before it signals, and it can follow up with SIGKILL. Its reference is the parent at this module's
import, which train.py imports first of all, so an agent that dies at any time after the worker
starts is noticed."""
import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
KILL_AFTER = 30.0  # seconds from the SIGTERM to the SIGKILL, as torchrun's agent waits when it stops its workers
_PARENT = os.getppid()  # the agent, as early as this module is imported
_watching = None


def under_torchrun(environ=os.environ):
    """Started by a torchrun agent (torch.distributed.run sets TORCHELASTIC_RUN_ID for its workers)."""
    return "TORCHELASTIC_RUN_ID" in environ and "LOCAL_RANK" in environ


def watch_agent(kill_after=KILL_AFTER, poll=POLL_SECONDS):
    """Under torchrun, once per process: a daemon thread that stops this process when its parent is
    no longer the agent recorded at import (also when it was gone before this call). Returns the
    thread, or None outside torchrun."""
    global _watching
    if _watching is None and under_torchrun():
        _watching = threading.Thread(target=_watch, args=(_PARENT, kill_after, poll), name="agent-watch",
                                     daemon=True)
        _watching.start()
    return _watching


def _watch(agent, kill_after, poll):
    while os.getppid() == agent:
        time.sleep(poll)
    rank = os.environ.get("RANK", "?")
    log.warning("the torchrun agent (pid %d) is gone: stopping this worker (rank %s) with SIGTERM, as a "
                "preemption would", agent, rank)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(kill_after)  # a process that stops ends this thread with it
    log.error("worker (rank %s) still running %g s after the SIGTERM of its lost agent: SIGKILL", rank, kill_after)
    os.kill(os.getpid(), signal.SIGKILL)
