"""Checkpoints and run folders: atomic writes, weights_only loads, a lock per run folder. (What a
config may change against a checkpoint's: engine.config_changes.)"""
import contextlib
import glob
import logging
import os
import pickle
import re
import shutil
import socket
import threading

import torch

from engine import processes
from engine.errors import UserError
from engine.files import atomic_write

log = logging.getLogger(__name__)

LOCK = "run.lock"
RUN_FILES = ("last.pt", "best.pt", "config.yaml")  # a folder holding any of them holds a run
def epoch_number(state):
    """The epoch a person reads (counted from 1) of a checkpoint, whose "epoch" is the loop's 0-based index."""
    epoch = state.get("epoch")
    return None if epoch is None else epoch + 1


METRICS_LOG = "metrics.jsonl"  # a line per evaluation (engine.evaluation.append_metrics)
RUN_LOGS = (METRICS_LOG,)  # a run's logs beside its TensorBoard events: replaced with it (--overwrite)


class RunFolderError(UserError):
    """A run folder that cannot be used: in use, holding another run, not writable, full."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded, or whose weights do not fit the model."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    pass


def _os_error(e):
    """The OSError behind e (torch.save turns a failed write into a RuntimeError, the OSError its context)."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e


def save_checkpoint(state, path):
    """Written whole or not at all (engine.files.atomic_write), with the user's umask."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        atomic_write(path, lambda f: torch.save(state, f), binary=True)
    except BaseException as e:
        cause = _os_error(e)
        if cause is not None and cause.strerror:
            raise RunFolderError(f"cannot write checkpoint {path} in run folder {folder} (the previous "
                                 f"checkpoint is intact):\n{cause.strerror}") from e
        raise


def load_checkpoint(path):
    if not os.path.isfile(path):
        raise CheckpointNotFound(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(e))
        if found or "Weights only load failed" in str(e):
            what = f"a pickled Python object ({found.group(1)})" if found else "a pickled Python object"
            raise CheckpointError(
                f"{path}: refused: the file holds {what}, which torch.load(weights_only=True) will not "
                f"run, since unpickling it could execute arbitrary code. Checkpoints of train.py and weights "
                f"files hold only tensors and plain values; do not load this file unless you trust where it "
                f"came from.") from None
        raise CheckpointError(f"{path}: not a loadable checkpoint (truncated or corrupt: {e})") from None
    except Exception as e:
        raise CheckpointError(f"{path}: not a loadable checkpoint ({type(e).__name__}: {e})") from None


def load_model_state(module, weights, path, strict=True):
    """load_state_dict with an error listing the missing and unexpected keys (checkpoint.strict)."""
    try:
        missing, unexpected = module.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes that do not fit
        raise CheckpointError(f"{path}: the weights do not fit the model: {e}") from None
    if not (missing or unexpected):
        return
    msg = (f"{path}: the weights do not match the model ({len(missing)} missing, {len(unexpected)} unexpected "
           f"keys): was it trained with another model or config?\n  missing: {', '.join(missing) or '-'}\n"
           f"  unexpected: {', '.join(unexpected) or '-'}")
    if strict:
        raise CheckpointError(msg + "\n(set checkpoint.strict=false to load the keys that match)")
    log.warning("%s\n(checkpoint.strict is false: loaded the keys that match)", msg)


# ---------------------------------------------------------------- the run folder

REPLACED = ".replaced"  # --overwrite: the old run, kept until the new one writes its first checkpoint
LOCK_LEASE = 300.0  # seconds: a lock not refreshed for this long is a dead run's (checkpoint.lock_lease)


def _lock_holder(lock):
    """(host, pid) written in the lock file, or None."""
    try:
        host, pid = open(lock).read().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _lock_age(folder, lock):
    """Seconds since the lock was last refreshed, on the folder's own clock (a file written now), so
    that hosts whose clocks differ agree on it."""
    probe = os.path.join(folder, f".tmp-clock-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        return os.stat(probe).st_mtime - os.stat(lock).st_mtime
    except OSError:
        return 0.0
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def _alive(host, pid, folder, lock, lease):
    """Is the pid alive (on this host: elsewhere it cannot be told), and has the lock been refreshed
    within its lease."""
    if host == socket.gethostname() and (pid == os.getpid() or not processes.alive(pid)):
        return False
    return _lock_age(folder, lock) < lease  # on this host too: a pid may have been reused


def prepare_run_folder(folder, resume=False, overwrite=False, lease=LOCK_LEASE):
    """Before anything is written: refuse a folder in use by a live run (its lock file holds host
    and pid, refreshed while it runs: see hold_lock) or holding another run unless resumed or
    overwritten; take the lock, or take over a dead run's; remove temporaries a crashed writer left.
    The lock write is also the check that the folder is writable. --overwrite removes nothing here:
    set_aside_run moves the old run aside once the new one has passed its checks; a run killed before
    its first checkpoint left it aside, and it comes back here (recover_run_folder)."""
    lock = os.path.join(folder, LOCK)
    holder = _lock_holder(lock)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if holder and holder[0] != socket.gethostname() and resume and restarted:
        log.warning("taking over %s from %s: a torchrun restart of its run", lock, holder[0])
    elif holder and _alive(*holder, folder, lock, lease):
        raise RunFolderError(f"run folder {folder} is in use by process {holder[1]} on {holder[0]} (lock "
                             f"file {lock}, refreshed {_lock_age(folder, lock):.0f} s ago; a lock not refreshed "
                             f"for checkpoint.lock_lease={lease:g} s is taken over): wait for that run to end, "
                             f"or choose another --output-dir")
    elif holder:
        log.warning("taking over %s from process %d on %s: %s", lock, holder[1], holder[0],
                    "it is not running" if holder[0] == socket.gethostname() else
                    f"its lock was last refreshed {_lock_age(folder, lock):.0f} s ago (lease {lease:g} s)")
    if not (resume or overwrite):
        _refuse_existing_run(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        if holder:  # a dead run's
            os.remove(lock)
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
    except FileExistsError:  # another run took it in between
        raise RunFolderError(f"run folder {folder} is in use by another run (lock file {lock})") from None
    except OSError as e:
        raise RunFolderError(f"cannot write in run folder {folder}:\n{e.strerror}") from e
    for tmp in glob.glob(os.path.join(glob.escape(folder), ".tmp-*")):
        log.info("removing %s, left by a writer that crashed", tmp)
        os.remove(tmp)
    if recover_run_folder(folder) and not (resume or overwrite):
        release_run_folder(folder)
        _refuse_existing_run(folder)


def _refuse_existing_run(folder):
    existing = [f for f in RUN_FILES if os.path.exists(os.path.join(folder, f))]
    if existing:
        raise RunFolderError(f"run folder {folder} already holds a run ({', '.join(existing)}): pass --resume "
                             f"to continue it, --overwrite to replace it, or choose another --output-dir")


@contextlib.contextmanager
def hold_lock(folder, lease=LOCK_LEASE):
    """Refresh the lock's time every lease / 4 seconds while the run lives, from a thread of its
    own (a long step or evaluation does not let the lease lapse)."""
    lock, done = os.path.join(folder, LOCK), threading.Event()

    def refresh():
        while not done.wait(lease / 4):
            with contextlib.suppress(OSError):
                os.utime(lock)

    thread = threading.Thread(target=refresh, name="run-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _run_outputs(folder):
    return [f for f in RUN_FILES + RUN_LOGS if os.path.exists(os.path.join(folder, f))] + [
        os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(folder), "events.out.tfevents.*"))]


def _has_checkpoint(folder):
    return any(os.path.exists(os.path.join(folder, f)) for f in ("last.pt", "best.pt"))


# --overwrite keeps the old run whole until the new one has a checkpoint, through a kill -9 at any
# moment: the old run's files move into SETTING_ASIDE, which is renamed REPLACED once all are in;
# putting them back renames REPLACED to RESTORING once the failed run's files are gone. Each rename is
# atomic, so the next run that takes the lock knows how far a killed one got (recover_run_folder).
SETTING_ASIDE, RESTORING = ".replacing", ".restoring"


def set_aside_run(folder):
    """--overwrite, once the new run has passed its checks: the old run's files move to
    <folder>/.replaced/ (removed by remove_replaced_run at the new run's first checkpoint)."""
    names, aside = _run_outputs(folder), os.path.join(folder, REPLACED)
    if os.path.isdir(aside):  # not put back by recover_run_folder
        if not _has_checkpoint(folder) and _has_checkpoint(aside):  # the folder's are leftovers: keep the run aside
            for name in names:
                os.remove(os.path.join(folder, name))
            return
        shutil.rmtree(aside)
    if not names:
        return
    moving = os.path.join(folder, SETTING_ASIDE)
    os.makedirs(moving, exist_ok=True)
    for name in names:
        os.replace(os.path.join(folder, name), os.path.join(moving, name))
    os.replace(moving, aside)
    log.info("--overwrite: the previous run (%s) is in %s until this run writes its first checkpoint",
             ", ".join(names), aside)


def remove_replaced_run(folder):
    aside = os.path.join(folder, REPLACED)
    if os.path.isdir(aside):
        shutil.rmtree(aside)
        log.info("--overwrite: removed the previous run (%s): this run has its first checkpoint", aside)


def restore_replaced_run(folder, why="this run ended before its first checkpoint"):
    """A run that ended before its first checkpoint: the run it was to replace comes back (what the
    failed run logged goes). Returns whether there was one to put back."""
    aside, back = os.path.join(folder, REPLACED), os.path.join(folder, RESTORING)
    if os.path.isdir(aside):
        for name in _run_outputs(folder):  # the failed run's
            os.remove(os.path.join(folder, name))
        os.replace(aside, back)
    if not os.path.isdir(back):
        return False
    for name in os.listdir(back):
        os.replace(os.path.join(back, name), os.path.join(folder, name))
    os.rmdir(back)
    log.warning("--overwrite: %s: the previous run is back in %s", why, folder)
    return True


def recover_run_folder(folder):
    """Under the lock, before the run starts: what an --overwrite run killed (kill -9) before its
    first checkpoint left. Its previous run comes back, so that neither --resume nor another
    --overwrite that fails in turn can lose it; once the killed run had a checkpoint, that one stands."""
    moving = os.path.join(folder, SETTING_ASIDE)
    if os.path.isdir(moving):  # killed while setting the old run aside: nothing of the new run is written yet
        for name in os.listdir(moving):
            os.replace(os.path.join(moving, name), os.path.join(folder, name))
        os.rmdir(moving)
        log.warning("--overwrite: a run was killed while setting the previous run aside: it is back in %s", folder)
        return True
    if os.path.isdir(os.path.join(folder, REPLACED)) and os.path.exists(os.path.join(folder, "last.pt")):
        remove_replaced_run(folder)  # killed between its first checkpoint and this removal
        return False
    return restore_replaced_run(folder, "the run that was to replace it was killed before its first checkpoint")


def release_run_folder(folder):
    lock = os.path.join(folder, LOCK)
    holder = _lock_holder(lock)
    if holder and holder == (socket.gethostname(), os.getpid()):
        os.remove(lock)


def check_free_space(folder, nbytes):
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise RunFolderError(f"run folder {folder} has {free / 2**20:.0f} MiB free, the checkpoints need about "
                             f"{nbytes / 2**20:.0f} MiB:\nNo space left on device")
