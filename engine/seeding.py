"""Random state: seeding a process, capturing and restoring every generator for a checkpoint, and
the per-sample seeds that make augmentations independent of workers, processes and resumes."""
import logging
import random

import numpy as np
import torch
from torch.utils.data import Dataset

from engine import dist

log = logging.getLogger(__name__)


def seed_everything(seed, rank=0):
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def rng_state():
    np_state = np.random.get_state(legacy=False)
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                      "pos": np_state["state"]["pos"], "has_gauss": np_state["has_gauss"],
                      "gauss": np_state["gauss"]}}


def set_rng_state(state):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": n["key"].numpy().astype(np.uint32),
                         "pos": n["pos"]}, "has_gauss": n["has_gauss"], "gauss": n["gauss"]})


def restore_rng(saved, seed, step):
    """This process's states from a checkpoint's list (one per process); on another process count,
    a fresh seed from seed, step and rank."""
    states = saved if isinstance(saved, list) else [saved]  # older checkpoints: rank 0's only
    if len(states) == dist.world_size():
        set_rng_state(states[dist.rank()])
    else:
        seed_everything((seed or 0) * 1_000_003 + step, dist.rank())
        log.warning("the checkpoint holds the random states of %d process(es), this run has %d: re-seeded "
                    "from seed, step and rank", len(states), dist.world_size())


def torch_seeded(seed, fn, *args):
    """fn(*args) with torch's CPU generator seeded (torch.manual_seed would also queue CUDA seeding,
    with a formatted stack trace each time), its state restored afterwards."""
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        return fn(*args)
    finally:
        torch.set_rng_state(state)


class SeededSamples(Dataset):
    """The training set read by (epoch seed, index) keys: each sample draws its augmentation from its
    own seed, whichever process or worker loads it. So augmentations do not depend on data.workers,
    workers can persist across epochs, and a resume (mid-epoch too) sees the same samples.
    A dataset with `seeded_items(indices, seeds)` is handed a batch's seeds at once (so it can draw
    and crop a whole batch in a few calls), one marked `deterministic` is read as it is, any other
    with torch's CPU generator seeded for each sample."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys):  # DataLoader fetches a batch's keys in one call
        indices = [index for _, index in keys]
        if getattr(self.dataset, "deterministic", False):  # draws nothing random: no seeds to set
            return [self.dataset[i] for i in indices]
        seeds = [int(np.random.SeedSequence(key).generate_state(1)[0]) for key in keys]  # 32 bits
        if hasattr(self.dataset, "seeded_items"):
            return self.dataset.seeded_items(indices, seeds)
        return [torch_seeded(seed, self.dataset.__getitem__, index) for index, seed in zip(indices, seeds)]


def start_epoch_data(run, epoch):
    """The shuffle's generator and the samples' augmentation seeds, both a function of (seed, epoch),
    the same on every process: one shuffle cut into global steps (engine.build.GlobalStepBatches),
    each sample's draws from its own seed. Ranks load other samples, so they draw other augmentations."""
    run.train_loader.start_epoch((run.cfg.seed or 0) * 1000 + epoch)
