"""What a dataset builder hands to the loop, and the checks every family shares (the data errors
themselves, DataError, MissingData and BadSample, are in engine/errors.py)."""
import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import numpy as np
from PIL import Image
from torch.utils.data import Dataset, default_collate
from engine.errors import BadSample, DataError, MissingData

log = logging.getLogger(__name__)
_collecting = threading.local()  # the list of collecting_problems(), per thread


@dataclass(frozen=True)
class Skipped:
    """Returned by a dataset in place of a bad sample when data.skip_bad_samples is on."""
    where: str    # the file (and row)
    reason: str


def read_image(path):
    """RGB PIL image; a file PIL cannot decode (truncated, corrupt, not an image) is a BadSample naming it."""
    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        raise BadSample(path, f"cannot read image ({type(e).__name__}: {e})") from None


def read_or_skip(read, skip):
    """read(), or with skip a Skipped marker for a BadSample it raises (logged with the file)."""
    try:
        return read()
    except BadSample as e:
        if getattr(_collecting, "found", None) is not None:  # the data doctor lists it
            _collecting.found.append(e)
            return Skipped(e.where, e.reason or "")
        if not skip:
            raise BadSample(e.where, f"{e.reason}; data.skip_bad_samples: true would skip it") from None
        log.warning("skipped bad sample %s", e)
        return Skipped(e.where, e.reason or "")


class ReadDataset(Dataset):
    """A data set of (image, target) pairs that a subclass reads with read(index): a BadSample there goes
    through read_or_skip (data.skip_bad_samples), then the pair through transforms(image, target) when set."""
    transforms = None
    skip_bad_samples = False

    def __getitem__(self, index):
        item = read_or_skip(partial(self.read, index), self.skip_bad_samples)
        if isinstance(item, Skipped) or self.transforms is None:
            return item
        return self.transforms(*item)


@contextlib.contextmanager
def collecting_problems():
    """Within this block, the loaders' per-record checks that call `problem()` record their error and
    leave the record out instead of stopping at the first one: the data doctor (doctor.py) builds a
    data set through the training builders this way and lists every problem. Yields the list."""
    found = []
    previous = getattr(_collecting, "found", None)
    _collecting.found = found
    try:
        yield found
    finally:
        _collecting.found = previous


def problem(error):
    """Raise `error` (a DataError naming file and record), or record it under collecting_problems()
    and return, so that the caller leaves the record out and goes on."""
    found = getattr(_collecting, "found", None)
    if found is None:
        raise error
    found.append(error)


class Batch(list):
    """[inputs, targets] of a batch, with `skipped`: the Skipped samples left out of it."""
    skipped = ()


class SkippedBatch:
    """In place of a batch whose every sample is unreadable: the training epoch leaves its step out
    and counts it, the run's loaders leave it out of anything else (engine.build.SkippingLoader).
    Unpacked by code that does not expect it, it raises the BadSample that names its files."""
    all_skipped = True

    def __init__(self, skipped):
        self.skipped = skipped

    def __iter__(self):
        raise BadSample(f"every sample of a batch is unreadable: "
                        f"{', '.join(f'{s.where} ({s.reason})' for s in self.skipped)}")


class SkipCollate:
    """Collate that leaves Skipped markers out and carries them on the batch (`batch.skipped`), so the
    loop counts and reports them, whatever process (DataLoader worker) read the samples. A batch of
    Skipped markers only (batch size 1 and a bad file) becomes a SkippedBatch."""

    def __init__(self, collate=None):
        self.collate = collate or default_collate

    def __call__(self, items):
        skipped = [x for x in items if isinstance(x, Skipped)]
        good = [x for x in items if not isinstance(x, Skipped)]
        if not good:
            return SkippedBatch(skipped)
        batch = Batch(self.collate(good))
        batch.skipped = skipped
        return batch


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

    def skip_bad_samples(self, skip):
        """With skip, batches leave out the Skipped markers of the datasets (see SkipCollate)."""
        if skip:
            self.collate_fn = SkipCollate(self.collate_fn)
        return self


def require_dir(path, layout, dataset):
    """Stop with an error that names the missing path and the expected layout."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"{dataset}: {os.path.abspath(path)} is a file, expected a folder\n"
                        f"expected layout:\n{layout}")
    if not os.path.isdir(path):
        raise MissingData(
            f"{dataset}: data folder not found: {os.path.abspath(path)}\n"
            f"expected layout:\n{layout}\n"
            f"set data.root in the config or with --set data.root=PATH")


def stratified_split(labels, val_fraction, seed):
    """(train indices, val indices): each class split by the same fraction, fixed seed."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
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
