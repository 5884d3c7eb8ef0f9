"""torchrun with two CPU processes (gloo): DDP, sharded data, evaluation that counts every sample once."""
import os

import pytest

from engine.checkpoint import load_checkpoint
from engine.config import load_config

from conftest import ROOT
from helpers import TINY_SETS, torchrun

pytestmark = pytest.mark.distributed


def test_torchrun_two_processes_train_and_evaluate_like_one(tmp_path):
    out = tmp_path / "run"
    overrides = TINY_SETS + ["data.val_size=30", "train.epochs=1", "recipes=[precise_bn,syncbn,ddp]",
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
