"""Atomic checkpoints, loaded with weights_only=True, and RNG state capture for exact resume."""
import hashlib
import os
import random
import tempfile

import numpy as np
import torch


def save_checkpoint(state, path):
    """Write to a temporary file in the same folder, then os.replace: never a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: not a loadable checkpoint ({type(e).__name__}: {e})") from None


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def seed_everything(seed, rank=0):
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
