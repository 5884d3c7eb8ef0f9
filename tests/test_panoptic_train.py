"""End to end: train.py with configs/shapes_panoptic.yaml for two steps (TensorBoard: losses,
PQ and box/mask AP, coloured panoptic images), then evaluate.py's report from the checkpoint and
its saved COCO panoptic predictions rescored by the --panoptic-* mode."""
import contextlib
import io
import json
import os

import pytest

import evaluate
import train
from conftest import ROOT


@pytest.mark.slow
def test_shapes_panoptic_end_to_end(tmp_path):
    out = tmp_path / "run"
    train.main(["--config", os.path.join(ROOT, "configs", "shapes_panoptic.yaml"), "--output-dir", str(out), "--set",
                f"data.root={tmp_path / 'shapes'}", "data.num_train=4", "data.num_val=3", "data.image_size=64",
                "model.min_size=64", "model.max_size=80", "data.batch_size=2", "data.workers=0", "train.epochs=1",
                "train.max_steps_per_epoch=2", "recipes=[]", "model.instance_score_thresh=0.0"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out), size_guidance={"images": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss_sem_seg", "train/loss_mask", "val/panoptic/PQ", "val/panoptic/PQ_th", "val/panoptic/PQ_st",
            "val/bbox/AP", "val/segm/AP", "val/panoptic/semantic_mIoU"} <= scalars
    images = acc.Tags()["images"]
    assert "val/panoptic/panoptic_0" in images and any(t.startswith("val/detections_") for t in images)
    panel = acc.Images("val/panoptic/panoptic_0")[0]
    assert panel.width > panel.height  # image | ground truth | prediction, side by side
    assert "val/panoptic/semantic_0" in images  # the semantic branch, coloured as the segmentation family does

    report_dir = tmp_path / "report"
    with contextlib.redirect_stdout(io.StringIO()):
        report = evaluate.main(["--checkpoint", str(out / "last.pt"), "--report-dir", str(report_dir)])
    saved = json.loads((report_dir / "report.json").read_text())
    assert {"panoptic/PQ", "panoptic/SQ", "panoptic/RQ", "bbox/AP", "segm/AP"} <= set(saved["metrics"])
    assert set(saved["parts"]["panoptic"]["panoptic"]) == {"All", "Things", "Stuff", "per_class"}
    semantic = saved["parts"]["panoptic"]["semantic"]  # stuff classes + "things"
    assert semantic["classes"] == ["things", "sky", "ground", "water"]
    assert semantic["num_pixels"] == _valid_semantic_pixels(tmp_path, 3)
    markdown = (report_dir / "report.md").read_text()
    assert "Panoptic quality on 3 images" in markdown and "Per-category AP (segm" in markdown
    files = report["artifacts"]
    annotations = json.load(open(files["panoptic_json"]))["annotations"]
    assert len(annotations) == 3 and all(os.path.isfile(os.path.join(files["panoptic_folder"], a["file_name"]))
                                         for a in annotations)
    shapes = tmp_path / "shapes" / "annotations"
    with contextlib.redirect_stdout(io.StringIO()):
        again = evaluate.main(["--panoptic-gt-json", str(shapes / "panoptic_val2017.json"), "--panoptic-gt-folder",
                               str(shapes / "panoptic_val2017"), "--panoptic-pred-json", files["panoptic_json"],
                               "--panoptic-pred-folder", files["panoptic_folder"],
                               "--report-dir", str(tmp_path / "again")])
    assert again["panoptic"] == saved["parts"]["panoptic"]["panoptic"]


@pytest.mark.distributed
def test_torchrun_two_processes_gather_pq_like_one(tmp_path):
    """DDP with find_unused_parameters (the COCO recipe's setting); the sharded evaluation gathers
    PQ statistics and predictions from both processes: the same figures as one process."""
    from engine.checkpoint import load_checkpoint
    from engine.config import load_config
    from commands.evaluate import evaluate_checkpoint
    from helpers import torchrun
    overrides = [f"data.root={tmp_path / 'shapes'}", "data.num_train=4", "data.num_val=3", "data.image_size=64",
                 "model.min_size=64", "model.max_size=80", "data.batch_size=1", "data.eval_batch_size=1",
                 "data.workers=0", "train.epochs=1", "recipes=[ddp]", "recipe_args.ddp.find_unused_parameters=true",
                 "model.instance_score_thresh=0.0"]
    torchrun("shapes_panoptic.yaml", tmp_path / "run", overrides)
    state = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert state["step"] == 2  # 4 images, 2 processes, 1 per batch
    report = evaluate_checkpoint(load_config(os.path.join(ROOT, "configs", "shapes_panoptic.yaml"), overrides),
                                 str(tmp_path / "run" / "last.pt"), str(tmp_path / "report"))
    assert report["parts"]["panoptic"]["num_images"] == 3
    for key in ("panoptic/PQ", "panoptic/PQ_st", "bbox/AP", "panoptic/semantic_mIoU", "panoptic/semantic_pixel_accuracy"):
        assert report["metrics"][key] == state["metrics"][f"val/{key}"]
    # the semantic confusion matrix is summed over both processes: every valid pixel counted once
    assert report["parts"]["panoptic"]["semantic"]["num_pixels"] == _valid_semantic_pixels(tmp_path, 3)


def _valid_semantic_pixels(tmp_path, num_val):
    from engine.registry import DATASETS
    val = DATASETS.build("shapes_panoptic", root=str(tmp_path / "shapes"), num_train=4, num_val=num_val,
                         image_size=64).val
    return sum(int((val[i][1]["sem_seg"] != 255).sum()) for i in range(num_val))
