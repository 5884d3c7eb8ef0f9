"""DDP with a model that leaves parameters unused (find_unused_parameters), under a real torchrun of
two processes (gloo, CPU): the run trains, and both processes end with the same weights."""
import os
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT

HELPER = os.path.join(ROOT, "tests", "dist_helper.py")
TINY = os.path.join(ROOT, "tests", "configs", "tiny.yaml")


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_with_unused_parameters_trains_and_both_processes_end_with_the_same_weights(tmp_path):
    """tests/dist_helper.py's _linear with unused: true holds a layer that no loss uses; without
    find_unused_parameters DDP stops at the second step (test_distributed_lifecycle.py checks its
    error). Each process saves its own weights at the end (_final_weights)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", HELPER, "train",
           "--config", TINY, "--output-dir", str(out), "--set", "model={name: _linear, unused: true}",
           "data.train_size=64", "train.epochs=2", "recipes=[ddp,_final_weights]",
           "recipe_args.ddp.find_unused_parameters=true", f"recipe_args._final_weights={{folder: {tmp_path}}}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(2 processes)" in result.stdout
    rank0, rank1 = torch.load(tmp_path / "rank0.pt", weights_only=True), torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert set(rank0) == set(rank1) == {"fc.weight", "fc.bias", "unused.weight", "unused.bias"}
    for k in rank0:
        assert torch.equal(rank0[k], rank1[k]), k
    events = EventAccumulator(str(out))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 16  # 64 samples / (4 x 2 processes) = 8 steps an epoch, 2 epochs
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses  # it learns
