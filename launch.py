"""torchrun, with an exit code a scheduler can act on. The same arguments as torchrun:

    python launch.py --nproc_per_node=N [--max-restarts=K] train.py --config ... --resume auto

torchrun exits 1 when it is stopped by a signal, as for any failure. This exits 75 (EX_TEMPFAIL,
as train.py does) when the job was stopped by SIGTERM / SIGINT, torchrun's agent having passed the
signal to every process, which checkpoint and exit 75 themselves; or when the failed processes
exited 75 (those the agent then stopped: -15). A SLURM script can then requeue on 75 and stop on anything else.
"""
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

STOPPED = 75


def main(argv=None):
    try:
        torchrun(argv)
    except SignalException as e:
        print(f"launch.py: stopped by {e.sigval.name}: the processes were asked to checkpoint and stop; "
              f"continue with --resume auto", file=sys.stderr, flush=True)
        sys.exit(STOPPED)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if STOPPED in codes and codes <= {STOPPED, -signal.SIGTERM}:  # the agent ends the slower ones
            sys.exit(STOPPED)
        raise


if __name__ == "__main__":
    main()
