"""Processes of this host by pid: whether one lives, and when it started (a pid and its start name one
process, as pids are reused). Read from /proc and signal 0: nothing is sent."""
import os


def alive(pid):
    """Does a process with this pid live (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_time(pid):
    """The process's start time in clock ticks since boot, or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
