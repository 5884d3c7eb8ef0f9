"""The detectors learn: the shapes configs of configs/ with short schedules, from scratch, scored on
held-out images (the shapes data set's val split, generated apart from the training images) above a
threshold that an untrained model cannot reach.

Measured on 2 CPU cores shared with other jobs (OMP_NUM_THREADS=1; CPU seconds of the whole test, data
generation and evaluation included). "Untrained": the same run with lr 1e-12 for one step.

| config | schedule | untrained | seed 0 | seed 1 | threshold | CPU |
|---|---|---|---|---|---|---|
| shapes_demo.yaml (SSDlite) | 128 px, 400 images, 4 epochs (100 steps of 16) | AP50 0.004 | 0.247 | 0.199 | 0.1 | 40 s |
| (the same, AP over IoU 0.5-0.95) | | | 0.070 (2 threads: 0.061) | 0.051 | 0.04 | |
| shapes_fasterrcnn_320.yaml | 192 px, 400 images, 1 epoch (100 steps of 4) | AP50 0.0002 | 0.178 | 0.269 | 0.08 | 60-65 s |
| shapes_panoptic.yaml | 128 px, 480 images, 1 epoch (120 steps of 4) | PQ 0.0, AP50 0.0002 | PQ 0.418, AP50 0.284 | PQ 0.360, AP50 0.303 | PQ 0.2, AP50 0.12 | 50 s |

Broken on purpose (issue 34): without the box-regression loss, SSDlite on 2 threads (as the suite runs)
still reaches AP50 0.117, over the AP50 bound, since the anchors alone overlap the shapes by IoU 0.5; its
AP 0.031 is what fails (on 1 thread AP50 0.070 / 0.051 and AP 0.014 / 0.011 for seeds 0 / 1). Faster
R-CNN without it reaches AP50 0.056 and fails.
"""
import contextlib
import io
import os

import pytest

import train
from conftest import ROOT
from engine.checkpoint import load_checkpoint


def _trained_metrics(tmp_path, config, *overrides):
    """train.py with the config shortened; the metrics of its evaluation on the held-out images."""
    out = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(["--config", os.path.join(ROOT, "configs", config), "--output-dir", str(out), "--set", "seed=0",
                    "device=cpu", "data.workers=0", "train.analysis=false", f"data.root={tmp_path / 'data'}",
                    "train.epochs=1", "train.eval_every=1", *overrides])
    return load_checkpoint(str(out / "last.pt"))["metrics"]


@pytest.mark.slow
def test_ssdlite_of_the_shapes_demo_learns_to_detect(tmp_path):
    metrics = _trained_metrics(tmp_path, "shapes_demo.yaml", "data.num_train=400", "data.num_val=50",
                               "data.image_size=128", "model.size=128", "train.epochs=4", "train.eval_every=4",
                               "recipes=[channels_last,precise_bn]")  # the config's amp times fp32 / bf16 at start-up
    assert metrics["val/bbox/AP50"] > 0.1, metrics
    assert metrics["val/bbox/AP"] > 0.04, metrics  # the boxes are regressed, not the anchors' (see above)


@pytest.mark.slow
def test_faster_rcnn_320_learns_to_detect(tmp_path):
    metrics = _trained_metrics(tmp_path, "shapes_fasterrcnn_320.yaml", "data.num_train=400", "data.num_val=50")
    assert metrics["val/bbox/AP50"] > 0.08, metrics


@pytest.mark.slow
def test_panoptic_fpn_learns_things_and_stuff(tmp_path):
    metrics = _trained_metrics(tmp_path, "shapes_panoptic.yaml", "data.num_train=480", "data.num_val=50")
    assert metrics["val/panoptic/PQ"] > 0.2 and metrics["val/bbox/AP50"] > 0.12, metrics  # stuff and things
