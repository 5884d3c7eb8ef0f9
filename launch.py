"""torchrun, with an exit code a scheduler can act on. The same arguments as torchrun:

    python launch.py --nproc_per_node=N [--max-restarts=K] train.py --config ... --resume auto
    python launch.py --nnodes=1:2 --nproc_per_node=N --rdzv-backend etcd-v2 --rdzv-endpoint HOST:2379 \
        --rdzv-id JOB --max-restarts=3 train.py --config ... --resume auto   (on every node)

torchrun exits 1 when it is stopped by a signal, as for any failure. This exits 75 (EX_TEMPFAIL,
as train.py does) when the job was stopped by SIGTERM / SIGINT, torchrun's agent having passed the
signal to every process, which checkpoint and exit 75 themselves; or when the failed processes
exited 75 (those the agent then stopped: -15). A SLURM script can then requeue on 75 and stop on anything else.

Every rendezvous round gets a store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, hosted by
that round's rank 0 worker), so that a restart's workers meet only each other across agents
(engine.dist._restart_store). A rendezvous that cannot be reached or is lost ends in one line.
"""
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import parse_args, run

STOPPED = 75


def rendezvous_failure(args, error):
    """One line: the backend, the endpoint and what went wrong."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    cause = error.__cause__
    if cause is not None and str(cause):
        reason += f" ({str(cause).splitlines()[0][:200]})"
    lost = (" c10d keeps its rendezvous in the agent that hosts the endpoint: when that agent is gone the job ends "
            "(etcd-v2 has no such agent)." if args.rdzv_backend == "c10d" else "")
    return (f"launch.py: the {args.rdzv_backend} rendezvous at {args.rdzv_endpoint} (run id {args.rdzv_id}) failed: "
            f"{type(error).__name__}: {reason}.{lost}")


def main(argv=None):
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # a store per round, not one agent's
    args = parse_args(argv)
    try:
        record(run)(args)  # torchrun's main: the failures' error files
    except SignalException as e:
        print(f"launch.py: stopped by {e.sigval.name}: the processes were asked to checkpoint and stop; "
              f"continue with --resume auto", file=sys.stderr, flush=True)
        sys.exit(STOPPED)
    except RendezvousError as e:
        print(rendezvous_failure(args, e), file=sys.stderr, flush=True)
        sys.exit(1)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if STOPPED in codes and codes <= {STOPPED, -signal.SIGTERM}:  # the agent ends the slower ones
            sys.exit(STOPPED)
        raise


if __name__ == "__main__":
    main()
