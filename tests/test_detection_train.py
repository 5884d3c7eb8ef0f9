"""End to end (acceptance 5): train.py with configs/ssd300.yaml on coco6 for a few steps, TensorBoard
logs and a checkpoint, then evaluate.py's COCO report from that checkpoint."""
import contextlib
import io
import json
import os

import pytest

import evaluate
import train
from conftest import ROOT, shared_data
from engine.checkpoint import load_checkpoint
from evaluators.coco import STAT_KEYS
from helpers import assert_same_weights, weights


@pytest.mark.slow
def test_ssd300_config_end_to_end_on_coco6(tmp_path):
    root = shared_data("coco6")
    out = tmp_path / "run"
    train.main(["--config", os.path.join(ROOT, "configs", "ssd300.yaml"), "--output-dir", str(out), "--set",
                f"data.root={root}", "data.train_split=val", "model.weights_backbone=null", "data.batch_size=2",
                "data.eval_batch_size=3", "data.workers=0", "train.epochs=1", "train.max_steps_per_epoch=2",
                "recipes=[channels_last]"])
    assert (out / "last.pt").is_file() and (out / "best.pt").is_file()
    events = [f for f in os.listdir(out) if f.startswith("events.out.tfevents")]
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out), size_guidance={"images": 0})
    acc.Reload()
    assert {"train/loss", "train/classification", "train/bbox_regression", "val/bbox/AP", "val/bbox/AP50"} <= set(
        acc.Tags()["scalars"])
    assert any(t.startswith("val/detections_") for t in acc.Tags()["images"])
    # one epoch, one evaluation: best.pt is that state, holding the box AP that TensorBoard logged
    best = load_checkpoint(str(out / "best.pt"))
    assert_same_weights(best["model"], weights(out / "last.pt"))
    logged = acc.Scalars("val/bbox/AP")
    assert len(logged) == 1 and best["best"] == pytest.approx(logged[0].value, abs=1e-6)

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        evaluate.main(["--checkpoint", str(out / "last.pt"), "--report-dir", str(tmp_path / "report")])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert list(report["bbox"]) == list(STAT_KEYS) and all(-1 <= v <= 1 for v in report["bbox"].values())
    assert report["num_images"] == 6 and report["num_gt_instances"] == 35
    assert "Per-category AP" in (tmp_path / "report" / "report.md").read_text() and "AP50" in printed.getvalue()
    detections = json.loads((tmp_path / "report" / "detections.json").read_text())
    assert len(detections) == report["num_detections"] > 0
    assert set(detections[0]) == {"image_id", "category_id", "bbox", "score"}
    # the saved detections score the same through the results-file mode
    with contextlib.redirect_stdout(io.StringIO()):
        again = evaluate.main(["--coco-gt", os.path.join(root, "annotations", "instances_val2017.json"),
                               "--coco-results", str(tmp_path / "report" / "detections.json"),
                               "--report-dir", str(tmp_path / "again")])
    assert again["bbox"] == report["bbox"]
