"""Train any model of the zoo from a YAML config.

    python train.py --config configs/demo.yaml [--set optim.lr=0.1 data.batch_size=32]
                    [--output-dir runs/x] [--resume [PATH|auto]] [--overwrite] [--force] [--budget 20m]
    torchrun --nproc_per_node=N [--max-restarts=K] train.py --config ... --resume auto

Exit codes: 0 done, 1 error, 75 stopped by SIGTERM/SIGINT with a checkpoint (continue with --resume),
or during start-up (nothing trained yet).
"""
import os
import signal
import sys

from engine import agent_watch  # first: it records the torchrun agent's pid before the slow imports
from engine.errors import Preempted, UserError  # no torch: imported in milliseconds


def exit_75_on_stop_during_start_up():
    """SIGTERM / SIGINT before the loop's handlers (engine.loop.stop_on_signals) take over: one line and
    exit 75 at once, from the first lines of the process on (the imports alone take seconds). Nothing
    is written before the loop starts, so nothing is lost. For the process entry only: a module that
    imports train.py keeps its own handlers."""
    def stop(signum, frame):
        if os.environ.get("RANK", "0") == "0":  # under torchrun: one line, from rank 0
            print(f"stopped: {signal.Signals(signum).name} during start-up: nothing was trained yet", flush=True)
        os._exit(Preempted.exit_code)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)


if __name__ == "__main__":  # before the heavy imports below
    exit_75_on_stop_during_start_up()

import argparse  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402

from commands.cli import exit_with_error  # noqa: E402
from engine import dist  # noqa: E402
from engine.budget import count_from_process_start  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.loop import train  # noqa: E402

import datasets, models, recipes  # noqa: E401,E402,F401  (their modules register builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (may inherit through _base_)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    p.add_argument("--output-dir", help="run folder (default: output_dir of the config, else runs/<config>)")
    p.add_argument("--resume", nargs="?", const="last", metavar="PATH|auto",
                   help="continue a run from PATH (default: <output-dir>/last.pt); auto: from last.pt when it "
                        "exists, else start fresh (for torchrun --max-restarts); also the config key `resume`")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in the output folder")
    p.add_argument("--force", action="store_true",
                   help="resume although the config changed the model, data, seed, optimizer type or recipes")
    p.add_argument("--budget", metavar="TIME", help="train for this wall time (e.g. 20m, 90s, 1.5h) instead of "
                   "train.epochs, the lr schedule fitted to it; the same as --set train.budget=TIME")
    return p.parse_args(argv)


def output_dir_for(args, cfg):
    return args.output_dir or cfg.output_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0])


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set + ([f"train.budget={args.budget}"] if args.budget else []))
    except UserError as e:
        exit_with_error(e)
    output_dir = output_dir_for(args, cfg)
    resume = args.resume or cfg.resume
    resume = os.path.join(output_dir, "last.pt") if resume == "last" else resume
    try:
        train(cfg, output_dir, resume, overwrite=args.overwrite, force=args.force, config_file=args.config)
    except Preempted as e:
        if dist.is_main():
            print(f"stopped: {e}", flush=True)
        if not e.agreed:  # start-up or evaluation: peers may be in a collective, no barrier
            dist.exit_on_failure(f"stopped: {e}", code=Preempted.exit_code)
        dist.cleanup()  # every process agreed on the step: a clean teardown
        sys.exit(Preempted.exit_code)
    except UserError as e:  # under torchrun this process ends at once (no barrier that would hang)
        exit_with_error(e)
    except BaseException:
        dist.exit_on_failure()  # under torchrun: the traceback, then exit without waiting for peers
        raise
    dist.cleanup()  # barrier only on success


def command(argv=None):
    """main() as the whole process: a budget counts from the process start (main() called inside a
    longer process counts from its call), and the exit skips the interpreter's last garbage collection over
    torch's objects (1.4-2 s here, time that train.budget counts); files and loaders are closed by then."""
    exit_75_on_stop_during_start_up()  # also when a helper imports train.py and calls this (tests/dist_helper.py)
    count_from_process_start()  # train.budget: the wall time of the command, start-up included
    try:
        main(argv)
    finally:
        gc.freeze()
    if agent_watch.under_torchrun():  # done, the process group torn down: flush, then end without teardown
        end_worker()


def end_worker():
    """A torchrun worker that finished ends with os._exit(0) once its output is flushed. The interpreter's
    own teardown of libtorch's objects sometimes aborted a finished worker ("terminate called without an
    active exception", exit -6: about 1 run in 30 of the multi-process tests under load, on 4 processes
    and on 2 agents), which torchrun counts as a failure: it restarted a finished job, or left the other
    agent waiting 300 s. Its files are closed and fsynced by then (checkpoints, metrics.jsonl, TensorBoard)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    command()
