"""Distributed mIoU (acceptance 4): torchrun with 2 CPU processes (gloo) on an odd-sized validation
set gives the mIoU, pixel accuracy and pixel count of a single-process evaluation."""
import os

import pytest

from conftest import ROOT
from engine.checkpoint import load_checkpoint
from engine.config import load_config
from helpers import torchrun

pytestmark = pytest.mark.distributed


def test_two_process_miou_equals_single_process(tmp_path):
    overrides = [f"data.root={tmp_path / 'shapes'}", "data.num_train=8", "data.num_val=7", "data.image_size=48",
                 "data.batch_size=2", "train.epochs=1", "train.max_steps_per_epoch=1",
                 "recipes=[]"]
    out = tmp_path / "run"
    torchrun("shapes_lraspp.yaml", out, overrides)  # 7 images: 4 on rank 0, 3 on rank 1
    state = load_checkpoint(str(out / "last.pt"))
    from commands.evaluate import evaluate_checkpoint
    report = evaluate_checkpoint(load_config(os.path.join(ROOT, "configs", "shapes_lraspp.yaml"), overrides),
                                 str(out / "last.pt"), str(tmp_path / "report"))
    assert report["metrics"]["mIoU"] == state["metrics"]["val/mIoU"]
    assert report["metrics"]["pixel_accuracy"] == state["metrics"]["val/pixel_accuracy"]
    from engine.registry import DATASETS
    val = DATASETS.build("shapes_semantic", root=str(tmp_path / "shapes"), num_train=8, num_val=7, image_size=48).val
    assert report["num_pixels"] == sum(int((val[i][1] != 255).sum()) for i in range(7))  # every pixel once
    metrics_table = (tmp_path / "report" / "report.md").read_text().split("## Analysis")[0]  # then issue 20's tables
    assert metrics_table.count("| circle |") == 1
