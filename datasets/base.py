"""What a dataset builder hands to the loop."""
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
from torch.utils.data import Dataset


@dataclass
class DataSplits:
    train: Optional[Dataset]
    val: Dataset
    evaluator: Callable[[], Any]              # () -> engine.evaluation.Evaluator for this task
    collate_fn: Optional[Callable] = None     # None = torch's default collate
    # (dataset, sampler, batch_size) -> batch sampler for training; None = plain batches
    train_batch_sampler: Optional[Callable] = None
    # defaults for model arguments the config leaves unset (e.g. num_classes, vocab_size)
    model_defaults: dict = field(default_factory=dict)
    classes: Optional[list] = None


def require_dir(path, layout, dataset):
    """Stop with an error that names the missing path and the expected layout."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{dataset}: data folder not found: {os.path.abspath(path)}\n"
            f"expected layout:\n{layout}\n"
            f"set data.root in the config or with --set data.root=PATH")


def stratified_split(labels, val_fraction, seed):
    """(train indices, val indices): each class split by the same fraction, fixed seed."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    train, val = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val = int(round(len(idx) * val_fraction))
        if len(idx) > 1:
            n_val = min(max(n_val, 1), len(idx) - 1)
        val += idx[:n_val].tolist()
        train += idx[n_val:].tolist()
    return sorted(train), sorted(val)
