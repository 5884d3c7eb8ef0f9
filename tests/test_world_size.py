"""Resuming on another number of processes at the same global batch (issue 23): the sample stream
is defined by the global batch, so a 2-process run killed with kill -9 and resumed on 1 or 4
processes trains every global step on the same samples as the uninterrupted 2-process run."""
import copy
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import ConfigError
from engine.world import keep_global_batch, per_process_split

from conftest import ROOT
from helpers import wait_for

HELPER = os.path.join(ROOT, "tests", "dist_helper.py")
TINY = os.path.join(ROOT, "tests", "configs", "tiny.yaml")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
# no BatchNorm, no dropout: the weights depend on the samples of each step only (up to float sums)
COMMON = ["model={name: _linear}", "data.train_size=48", "data.batch_size=4", "checkpoint.every_n_steps=2",
          "train.log_every=100"]  # global batch 8: 6 steps an epoch, 12 in all


def command(nproc, out, *overrides, resume=False):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*(launcher if nproc > 1 else [sys.executable]), HELPER, "train", "--config", TINY, "--output-dir",
            str(out), *(["--resume"] if resume else []), "--set", *COMMON, *overrides]


def steps(path):
    """{global step: its sample keys}; a step logged twice (before a kill and after the resume) keeps the last."""
    return {e["step"]: e["keys"] for e in map(json.loads, open(path))}


def test_split_of_the_global_batch():
    assert per_process_split(8, 1, 4) == (4, 2)   # fewer processes: more accumulation
    assert per_process_split(8, 4, 4) == (2, 1)   # more processes: a smaller per-process batch
    assert per_process_split(24, 2, 8) == (6, 2)  # the largest batch below 8 that divides 12
    assert per_process_split(8, 3, 4) is None


def test_a_checkpoint_of_three_processes_resumed_here_keeps_its_global_batch():
    from engine.config import config_from_data
    cfg = config_from_data({"model": {"name": "_linear"}, "data": {"name": "synthetic_classification",
                            "batch_size": 4}, "optim": {"lr": 0.1}, "train": {"epochs": 1}})
    state = {"rng": [{}] * 3, "config": cfg.model_dump(mode="json"), "batches_done": 2}
    out = keep_global_batch(cfg, state, "x.pt")
    assert (out.data.batch_size, out.optim.accumulate_steps) == (4, 3) and cfg.optim.accumulate_steps == 1
    # the checkpoint, seen from here: its config in the new split, 2 steps of the epoch = 6 batches here
    assert state["config"]["optim"]["accumulate_steps"] == 3 and state["batches_done"] == 6
    state = {"rng": [{}] * 2, "config": cfg.model_dump(mode="json")}
    with pytest.raises(ConfigError, match=r"global batch 8 \(data.batch_size 4 x 2 process\(es\) x optim.accumulate_steps "
                                          r"1\) cannot be split evenly among 3 process\(es\)"):
        keep_global_batch(cfg, state, "x.pt", world=3)


def test_a_run_that_shrank_and_grows_back_gets_its_split_back():
    """2 processes at 4 x 1 shrink to 1 (checkpointed at 4 x 2, batch_split 4 x 1): back on 2 the config as
    configured gets the global batch 8 as 4 x 2 x 1, and the position in the epoch in whole steps (the old
    code saw a changed config, kept 10 batches of the 1-process epoch and skipped the rest of it). Resumed
    alone again, it keeps 4 x 2; a config whose batch settings the user changed is left as it is."""
    from engine.config import config_from_data
    cfg = config_from_data({"model": {"name": "_linear"}, "data": {"name": "synthetic_classification",
                            "batch_size": 4}, "optim": {"lr": 0.1}, "train": {"epochs": 1}})
    alone = cfg.model_dump(mode="json")
    alone["optim"]["accumulate_steps"] = 2
    state = {"rng": [{}], "config": copy.deepcopy(alone), "batch_split": [4, 1], "batches_done": 10}
    out = keep_global_batch(cfg, state, "x.pt", world=2)
    assert (out.data.batch_size, out.optim.accumulate_steps) == (4, 1) and state["batches_done"] == 5
    state = {"rng": [{}], "config": copy.deepcopy(alone), "batch_split": [4, 1], "batches_done": 10}
    out = keep_global_batch(cfg, state, "x.pt", world=1)
    assert (out.data.batch_size, out.optim.accumulate_steps) == (4, 2) and state["batches_done"] == 10
    changed = cfg.model_copy(deep=True)
    changed.data.batch_size = 8
    state = {"rng": [{}], "config": copy.deepcopy(alone), "batch_split": [4, 1], "batches_done": 10}
    assert keep_global_batch(changed, state, "x.pt", world=2) is changed and state["batches_done"] == 10


def run_until_killed(cmd, pid_file):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT)
    os.kill(wait_for(pid_file, proc, timeout=600), signal.SIGKILL)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode != 0, out[-3000:]


def run(cmd):
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    return out


@pytest.mark.process
@pytest.mark.distributed
def test_killed_on_two_processes_resumed_on_one_and_on_four_trains_on_the_same_samples(tmp_path):
    straight = tmp_path / "straight"
    run(command(2, straight, "recipes=[_log_ids]"))
    # rank 1 stops after step 9 (mid-epoch 2) and is killed with kill -9; last.pt holds step 8
    killed, pid_file = tmp_path / "killed", tmp_path / "pid"
    recipes = ["recipes=[_log_ids, _fault]", f"recipe_args._fault={{kind: block, rank: 1, step: 9, pid_file: {pid_file}}}"]
    run_until_killed(command(2, killed, *recipes), pid_file)
    assert load_checkpoint(str(killed / "last.pt"))["step"] == 8
    shutil.copytree(killed, tmp_path / "four")

    out = run(command(1, killed, *recipes, resume=True))
    assert "resuming a run of 2 process(es) on 1: global batch 8 kept = 4 per process x 1 process(es) x 2 " \
           "accumulation step(s)" in out and "at epoch 2 (batch 4), step 8" in out, out[-3000:]
    out = run(command(4, tmp_path / "four", *recipes, resume=True))
    assert "global batch 8 kept = 2 per process x 4 process(es) x 1 accumulation step(s)" in out, out[-3000:]

    reference = steps(straight / "ids.jsonl")
    assert sorted(reference) == list(range(1, 13)) and all(len(k) == 8 for k in reference.values())
    assert steps(killed / "ids.jsonl") == reference
    assert steps(tmp_path / "four" / "ids.jsonl") == reference
    a = load_checkpoint(str(straight / "last.pt"))["model"]
    for folder in ("killed", "four"):
        b = load_checkpoint(str(tmp_path / folder / "last.pt"))["model"]
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), (folder, k)
