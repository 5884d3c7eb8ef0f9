"""Faster R-CNN leaves the repository as ONNX (issue 36): one image of any size in, its detections out,
exported whole by the TorchScript-based exporter and run by ONNX Runtime. A tiny model trained a few
steps on built-in shapes: export.py's check, the safe loader's detections against the eager model's,
evaluate.py --artifact against --checkpoint, predict.py's drawings and COCO files (results.json loads
with pycocotools), and the formats and options still refused, before any data is built."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO

import evaluate
import export
import predict
from artifacts.load import load_artifact, load_run
from conftest import shared_data
from engine.config import config_from_data
from engine.loop import train
from exporters import match_detections
from helpers import crafted_onnx_is_refused, evaluate_without_torch

MODEL = {"name": "fasterrcnn_mobilenet_v3_large_320_fpn", "min_size": 96, "max_size": 160,
         "rpn_pre_nms_top_n_test": 50, "rpn_post_nms_top_n_test": 20, "box_score_thresh": 0.0,
         "rpn_pre_nms_top_n_train": 200, "rpn_post_nms_top_n_train": 50, "box_batch_size_per_image": 64}
KEYS = ("boxes", "scores", "labels")


@pytest.fixture(scope="module")
def frcnn(tmp_path_factory):
    """last.pt of 4 steps on 16 shapes images of 96 px (the val images have several sizes)."""
    out = tmp_path_factory.mktemp("frcnn")
    cfg = config_from_data({"seed": 0, "device": "cpu", "optim": {"name": "adamw", "lr": 0.003},
                            "sched": {"name": "constant"}, "model": MODEL,
                            "data": {"name": "shapes", "root": str(out / "shapes"), "num_train": 16, "num_val": 4,
                                     "image_size": 96, "workers": 0, "batch_size": 4},
                            "train": {"epochs": 1, "max_steps_per_epoch": 4, "log_every": 100}})
    train(cfg, str(out))
    return str(out / "last.pt")


@pytest.fixture(scope="module")
def exported(frcnn, tmp_path_factory):
    out = tmp_path_factory.mktemp("frcnn_onnx")
    path, spec = export.main(["--checkpoint", frcnn, "--format", "onnx", "--output", str(out)])
    return path, spec


def _as_dicts(outputs):
    return [dict(zip(KEYS, o)) for o in outputs]


def _same_detections(ref, got):
    """Every detection of each side has its counterpart in the other (no score floor)."""
    result = match_detections(ref, got, min_score=0.0)
    assert result["ok"] and result["detections_compared"] > 0, result
    assert [len(r["scores"]) for r in ref] == [len(g["scores"]) for g in got]


@pytest.mark.slow
def test_onnx_export_of_faster_rcnn_gives_the_eager_detections_at_any_image_size(frcnn, exported):
    path, spec = exported
    with open(path + ".json") as f:
        assert json.load(f)["check"] == spec["check"]
    check = spec["check"]
    assert check["ok"] and check["images"] == 4 and check["detections_compared"] > 0
    assert spec["adapter"] == "RCNNDetector" and spec["inputs"] == ["image"] and not spec["dynamic_batch"]
    assert spec["outputs"] == list(KEYS) and spec["classes"] == ["__background__", "circle", "square", "triangle"]
    assert spec["preprocessing"]["in_model"]["min_size"] == [96]
    assert spec["postprocessing"]["in_model"]["rpn_post_nms_top_n_test"] == 20

    loaded = load_artifact(path)  # the safe loader: artifacts.safety, then the SHA-256 of the spec
    _, _, data, model = load_run(frcnn)
    images = [data.val[i][0] for i in range(len(data.val))]
    assert len({tuple(x.shape) for x in images}) > 1  # the graph was traced on one size and runs on others
    with torch.no_grad():
        eager = [model([x])[0] for x in images]
    got = _as_dicts(loaded.runner(*loaded.adapter.collate([x])) for x in images)
    _same_detections(eager, got)
    assert all(g["labels"].dtype == torch.int64 and g["boxes"].shape[1] == 4 for g in got)


def _detections_by_image(report_dir):
    """The evaluator's detections.json (COCO results) as one {boxes xyxy, scores, labels} dict per image id."""
    with open(os.path.join(report_dir, "detections.json")) as f:
        found = json.load(f)
    by_image = {}
    for d in found:
        by_image.setdefault(d["image_id"], []).append(d)
    out = {}
    for image_id, dets in sorted(by_image.items()):
        x, y, w, h = torch.tensor([d["bbox"] for d in dets]).unbind(1)
        out[image_id] = {"boxes": torch.stack([x, y, x + w, y + h], 1),
                         "scores": torch.tensor([d["score"] for d in dets]),
                         "labels": torch.tensor([d["category_id"] for d in dets])}
    return out


@pytest.mark.slow
def test_evaluating_the_onnx_artifact_gives_the_checkpoints_ap_and_detections(frcnn, exported, tmp_path):
    path, _ = exported
    # the checkpoint one image per forward (a batch pads its images to one size, which moves the boxes)
    ckpt = evaluate.main(["--checkpoint", frcnn, "--report-dir", str(tmp_path / "ckpt"),
                          "--set", "data.eval_batch_size=1", "--no-analysis"])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the eval runner then calls the artifact from two threads at once
    try:
        art = evaluate.main(["--artifact", path, "--report-dir", str(tmp_path / "art"), "--no-analysis"])
    finally:
        torch.set_num_threads(threads)
    for key in ("bbox/AP", "bbox/AP50"):
        assert art["metrics"][key] == pytest.approx(ckpt["metrics"][key], abs=0.005)
    ref, got = _detections_by_image(tmp_path / "ckpt"), _detections_by_image(tmp_path / "art")
    assert sorted(ref) == sorted(got) and len(ref) == 4
    _same_detections([ref[i] for i in sorted(ref)], [got[i] for i in sorted(got)])


@pytest.mark.slow
def test_the_onnx_artifact_scores_the_same_where_torch_cannot_be_imported(frcnn, exported, tmp_path):
    """Issue 36 acceptance 1: evaluate_onnx.py (runtime/: numpy, ONNX Runtime, pycocotools) in a process
    where torch cannot be imported gives evaluate.py --artifact's box AP."""
    path, _ = exported
    art = evaluate.main(["--artifact", path, "--report-dir", str(tmp_path / "art"), "--no-analysis"])
    root = os.path.join(os.path.dirname(frcnn), "shapes")
    report = evaluate_without_torch("--artifact", path, "--images", os.path.join(root, "val2017"), "--coco-gt",
                                    os.path.join(root, "annotations", "instances_val2017.json"),
                                    "--output", tmp_path / "runtime")
    assert report["imported_torch"] == [] and report["images"] == 4 and report["detections"] > 0
    for key in ("bbox/AP", "bbox/AP50", "bbox/AR100"):  # ~0 for 4 steps: the detections are compared too
        assert report["metrics"][key] == pytest.approx(art["metrics"][key], abs=1e-4), key
    ref, got = _detections_by_image(tmp_path / "art"), _detections_by_image(tmp_path / "runtime")
    assert sorted(ref) == sorted(got) and len(ref) == 4
    _same_detections([ref[i] for i in sorted(ref)], [got[i] for i in sorted(got)])


def _predict(*argv):
    return predict.main([*argv, "--score-thresh", "0.0"])


def _coco_files_load(out, results):
    coco = COCO(str(out / "detections.json"))
    res = coco.loadRes(str(out / "results.json"))  # COCO's results format, image ids of detections.json
    assert len(coco.getImgIds()) == len(results)
    assert len(res.anns) == len(coco.anns) == sum(len(r["detections"]) for r in results) > 0
    assert sorted(c["name"] for c in coco.loadCats(coco.getCatIds())) == ["circle", "square", "triangle"]


@pytest.mark.slow
def test_predict_with_the_artifact_and_the_checkpoint_on_shapes_images(frcnn, exported, tmp_path):
    path, _ = exported
    val = os.path.join(os.path.dirname(frcnn), "shapes", "val2017")
    names = sorted(os.listdir(val))
    from_artifact = _predict("--checkpoint", path, val, "--output", str(tmp_path / "a"))
    from_checkpoint = _predict("--checkpoint", frcnn, val, "--output", str(tmp_path / "c"), "--batch-size", "8")
    assert len(from_artifact) == len(from_checkpoint) == len(names) == 4  # one image per forward, none dropped
    for a, c in zip(from_artifact, from_checkpoint):
        assert a["input"] == c["input"] and len(a["detections"]) == len(c["detections"]) > 0
        with Image.open(a["drawn"]) as drawn, Image.open(a["input"]) as image:
            assert drawn.size == image.size
    with open(tmp_path / "a" / "predictions.json") as f:
        assert len(json.load(f)["predictions"]) == 4
    _coco_files_load(tmp_path / "a", from_artifact)
    _coco_files_load(tmp_path / "c", from_checkpoint)


@pytest.mark.slow
def test_predict_with_the_artifact_on_photos(exported, tmp_path):
    photos = shared_data("photos")
    path, _ = exported
    results = _predict("--checkpoint", path, photos, "--output", str(tmp_path))
    assert len(results) == len(os.listdir(photos))
    for r in results:  # each photo at its own size, boxes drawn over it, in its pixels
        with Image.open(r["drawn"]) as drawn, Image.open(r["input"]) as image:
            assert drawn.size == image.size
            assert not np.array_equal(np.asarray(drawn.convert("RGB")), np.asarray(image.convert("RGB")))
        for d in r["detections"]:
            x0, y0, x1, y1 = d["bbox_xyxy"]
            assert 0 <= x0 <= x1 <= r["width"] and 0 <= y0 <= y1 <= r["height"]
    _coco_files_load(tmp_path, results)


@pytest.mark.slow
def test_torch_export_and_dynamic_batch_are_refused_before_any_data_is_built(frcnn, tmp_path):
    root = tmp_path / "shapes_never_built"  # the shapes builder would write its images here
    common = ["--checkpoint", frcnn, "--output", str(tmp_path / "out"), "--set", f"data.root={root}"]
    with pytest.raises(SystemExit) as e:
        export.main([*common, "--format", "torch_export"])
    assert "fasterrcnn_mobilenet_v3_large_320_fpn, format torch_export" in str(e.value.code)
    assert "proposals and detections depend on the data" in str(e.value.code) and "--format onnx" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        export.main([*common, "--format", "onnx", "--dynamic-batch"])
    assert "takes one image at a time" in str(e.value.code) and "without --dynamic-batch" in str(e.value.code)
    assert not root.exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_crafted_copies_of_the_onnx_artifact_are_refused_by_both_loaders(exported, tmp_path):
    crafted_onnx_is_refused(exported[0], tmp_path)
