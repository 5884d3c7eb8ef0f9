"""torchrun with two CPU processes (gloo): DDP, sharded data, evaluation that counts every sample once."""
import os
import subprocess
import sys

import pytest

from engine.checkpoint import load_checkpoint
from engine.config import load_config

from conftest import ROOT
from test_engine import TINY

pytestmark = pytest.mark.distributed


def torchrun(config, out, overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", config),
           "--output-dir", str(out), "--set", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[:3000] + result.stderr[-3000:]
    assert "(2 processes)" in result.stdout


def test_torchrun_two_processes_train_and_evaluate_like_one(tmp_path):
    out = tmp_path / "run"
    overrides = TINY + ["data.val_size=30", "train.epochs=1", "recipes=[precise_bn,syncbn,ddp]",
                        "recipe_args.ddp.find_unused_parameters=true"]
    torchrun("demo.yaml", out, overrides)
    state = load_checkpoint(str(out / "last.pt"))
    assert state["step"] == 48 // (16 * 2)  # each process sees half the data per epoch
    assert not any(k.startswith("module.") for k in state["model"])  # saved unwrapped

    from commands.evaluate import evaluate_checkpoint
    report = evaluate_checkpoint(load_config(os.path.join(ROOT, "configs", "demo.yaml"), overrides),
                                 str(out / "last.pt"), str(tmp_path / "report"))
    assert report["num_samples"] == 30
    assert report["metrics"]["top1"] == state["metrics"]["val/top1"]


def test_torchrun_text_model_shares_rank0_tokenizer(tmp_path):
    overrides = ["train.epochs=1", "data.train_size=200", "data.val_size=50"]
    torchrun("transformer_text_synthetic.yaml", tmp_path, overrides)
    from commands.evaluate import evaluate_checkpoint
    report = evaluate_checkpoint(load_config(os.path.join(ROOT, "configs", "transformer_text_synthetic.yaml"),
                                             overrides), str(tmp_path / "last.pt"), str(tmp_path / "report"))
    assert report["num_samples"] == 50
    assert report["metrics"]["top1"] == load_checkpoint(str(tmp_path / "last.pt"))["metrics"]["val/top1"]
