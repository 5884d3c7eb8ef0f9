"""torchrun / torch.distributed helpers. Single-process runs need none of this."""
import os
import re
import sys
import traceback

import torch
import torch.distributed as dist

from engine.errors import UserError


class WorkerGone(UserError):
    """The process group of this round cannot connect: a peer's worker (or the round's store) is gone."""


def init_distributed(device_type):
    """Join the process group if launched by torchrun. Returns (rank, local_rank, world_size)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 0, 1
    if not dist.is_initialized():
        rank = int(os.environ["RANK"])
        try:
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=_restart_store(rank, world_size),
                                    rank=rank, world_size=world_size)
        except (RuntimeError, TimeoutError) as e:  # DistNetworkError, DistStoreError, gloo's connectFullMesh
            raise _connect_error(e, rank) from e
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), world_size


def _connect_error(error, rank):
    """What a failed init_process_group means, with the address it could not reach."""
    text = str(error)
    peer = re.search(r"remote=\[([^\]]+)\]:(\d+)", text)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if peer:
        return WorkerGone(f"rank {rank}: the process group could not connect to the peer at {peer[1]}:{peer[2]}: "
                          f"that peer's worker is gone (restart {restart}; {text.splitlines()[0][:200]}); "
                          f"torchrun's agents restart the round (--max-restarts) or end the job")
    store = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if "connect" in text.lower() or "timeout" in text.lower() or "timed out" in text.lower():
        return WorkerGone(f"rank {rank}: the process group's store at {store} cannot be reached: the worker or "
                          f"agent hosting it is gone (restart {restart}; {text.splitlines()[0][:200]})")
    return error


def _restart_store(rank, world_size):
    """The store this round's process group meets in; None: env:// (MASTER_ADDR:MASTER_PORT).
    launch.py runs torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: every rendezvous round then
    names a fresh port that rank 0's worker hosts, so each round's workers meet only each other,
    on any agent and backend. torchrun's default instead keeps one agent's TCPStore for all rounds
    (TORCHELASTIC_USE_AGENT_STORE), where a restart's workers can read the dead round's addresses
    (gloo: "connectFullMesh failed ... Connection refused"). With one agent its restart count names
    the round: those keys get a prefix of their own. With several the counts differ (an agent that
    restarts for another's new round counts none), so no prefix is safe: refused, saying why."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agents = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if agents > 1:
        raise WorkerGone(f"rank {rank}: restart {restart} of a job of {agents} torchrun agents on torchrun's shared "
                         f"agent store, which keeps the previous round's worker addresses: run the job through "
                         f"launch.py, or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every torchrun agent")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    return dist.PrefixStore(f"/worker/restart_{restart}", store)


def is_distributed():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if is_distributed() else 0


def is_main():
    return rank() == 0


def world_size():
    return dist.get_world_size() if is_distributed() else 1


def all_gather_list(items):
    """Concatenate python lists from every process (on one process: unchanged)."""
    if not is_distributed():
        return items
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def all_gather_object(obj):
    """[obj of rank 0, obj of rank 1, ...] on every process."""
    if not is_distributed():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj):
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_max(tensor):
    """Element-wise max over processes (flags every process must agree on), in place."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def reduce_mean(tensor):
    if is_distributed():
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return tensor


def on_main(fn, *args, **kwargs):
    """Run fn on rank 0 only; an exception it raises is raised on every process, so all stop together."""
    error = None
    if is_main():
        try:
            fn(*args, **kwargs)
        except Exception as e:
            error = e
    error = broadcast_object(error)
    if error is not None:
        raise error


def cleanup():
    """On success only: a failed process must not wait in a barrier for peers that will never come."""
    if is_distributed():
        dist.barrier()  # let rank 0 finish writing before any process tears the group down
        dist.destroy_process_group()


def exit_on_failure(message=None, code=1):
    """Under torchrun: print the error (or the traceback being handled) and end this process at once,
    without barrier or destructors. Peers blocked in a collective then fail too (gloo) or are
    stopped by torchrun's agent, so the job ends within seconds with the original error shown."""
    if not is_distributed():
        return
    prefix = f"[rank {rank()}] "
    text = message if message is not None else traceback.format_exc()
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def unwrap(model):
    """The module under DDP / torch.compile wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
