"""torchrun / torch.distributed helpers. Single-process runs need none of this."""
import os

import torch
import torch.distributed as dist


def init_distributed(device_type):
    """Join the process group if launched by torchrun. Returns (rank, local_rank, world_size)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), world_size


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


def broadcast_object(obj):
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def cleanup():
    if is_distributed():
        dist.barrier()  # let rank 0 finish writing before any process tears the group down
        dist.destroy_process_group()


def unwrap(model):
    """The module under DDP / torch.compile wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
