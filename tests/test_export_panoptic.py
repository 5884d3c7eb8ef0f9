"""Panoptic FPN leaves the repository as ONNX (issue 36): one image of any size in; boxes, masks and
the semantic maps out; the panoptic fusion outside the graph, in numpy (runtime/panoptic.py). A tiny
model trained a few steps on built-in shapes: export.py's check, the safe loader's outputs against the
eager model's, the numpy fusion against the torch one, evaluate.py --artifact against --checkpoint,
predict.py's pictures and COCO panoptic files (scored by evaluate.py's --panoptic-* scorer), and the
formats still refused, before any data is built."""
import json
import os

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

import evaluate
import export
import predict
from artifacts.load import load_artifact, load_run
from commands.export import format_table
from conftest import shared_data
from engine.config import config_from_data
from engine.loop import train
from helpers import crafted_onnx_is_refused, evaluate_without_torch
from runtime.panoptic import fuse, image_input, read_ids

MODEL = {"name": "panoptic_fpn_mobilenet_v3_large", "min_size": 64, "max_size": 80, "fpn_channels": 32,
         "sem_channels": 32, "mask_head": [32], "box_head_dim": 64, "box_score_thresh": 0.0,
         "box_detections_per_img": 100, "instance_score_thresh": 0.0, "mask_thresh": 0.25, "stuff_area_thresh": 40,
         "maskrcnn_args": {"rpn_pre_nms_top_n_test": 50, "rpn_post_nms_top_n_test": 20,
                           "rpn_pre_nms_top_n_train": 100, "rpn_post_nms_top_n_train": 30,
                           "box_batch_size_per_image": 32}}
OUTPUTS = ["boxes", "scores", "labels", "masks", "sem_prob", "sem_label"]


@pytest.fixture(scope="module")
def pfpn(tmp_path_factory):
    """last.pt of 80 steps on 16 shapes images of 64 px (PQ 15: the equalities below are not 0 == 0) (the val images have several sizes)."""
    out = tmp_path_factory.mktemp("pfpn")
    cfg = config_from_data({"seed": 0, "device": "cpu", "optim": {"name": "adamw", "lr": 0.003},
                            "sched": {"name": "constant"}, "model": MODEL,
                            "data": {"name": "shapes_panoptic", "root": str(out / "shapes"), "num_train": 16,
                                     "num_val": 4, "image_size": 64, "workers": 0, "batch_size": 2},
                            "train": {"epochs": 10, "eval_every": 10, "log_every": 100, "analysis": False}})
    train(cfg, str(out))
    return str(out / "last.pt")


@pytest.fixture(scope="module")
def exported(pfpn, tmp_path_factory):
    out = tmp_path_factory.mktemp("pfpn_onnx")
    return export.main(["--checkpoint", pfpn, "--format", "onnx", "--output", str(out)])


@pytest.fixture(scope="module")
def eager(pfpn):
    """(data, model) of the checkpoint, and the model's unfused outputs and eval dicts per val image."""
    _, _, data, model = load_run(pfpn)
    images = [data.val[i][0] for i in range(len(data.val))]
    with torch.no_grad():
        unfused = [model.unfused([x])[0] for x in images]
        outputs = [model([x])[0] for x in images]
    return data, model, images, unfused, outputs


def _same_segments(a, b):
    """Equal segments but for a stuff segment's score (a float32 mean, summed in another order)."""
    assert [{k: v for k, v in s.items() if k != "score"} for s in a] == \
        [{k: v for k, v in s.items() if k != "score"} for s in b]
    assert [s["score"] for s in a] == pytest.approx([s["score"] for s in b], rel=1e-5)


@pytest.mark.slow
def test_onnx_export_gives_the_eager_outputs_and_panoptic_maps_at_any_image_size(exported, eager):
    path, spec = exported
    with open(path + ".json") as f:
        assert json.load(f)["check"] == spec["check"]
    check = spec["check"]
    assert check["ok"] and check["images"] == 4 and check["detections_compared"] > 0, check
    assert check["sem_label_pixels_differ"] == check["panoptic_pixels_differ"] == 0
    assert spec["adapter"] == "PanopticSegmenter" and spec["inputs"] == ["image"] and not spec["dynamic_batch"]
    assert spec["outputs"] == OUTPUTS and spec["classes"] == ["__background__", "circle", "square", "triangle",
                                                              "sky", "ground", "water"]
    post = spec["postprocessing"]
    assert post["stuff_labels"] == [4, 5, 6] and post["fusion"]["stuff_area_thresh"] == 40
    assert spec["label_to_category_id"] == {"1": 1, "2": 2, "3": 3, "4": 101, "5": 102, "6": 103}
    assert [(c["id"], c["name"], c["isthing"]) for c in post["categories"]][::3] == [(1, "circle", 1), (101, "sky", 0)]

    loaded = load_artifact(path)  # the safe loader: artifacts.safety, then the SHA-256 of the spec
    assert type(loaded.adapter).__name__ == "PanopticSegmenter" and loaded.batch_limit == 1
    data, model, images, unfused, outputs = eager
    assert len({tuple(x.shape) for x in images}) > 1  # the graph was traced on one size and runs on others
    for x, ref in zip(images, unfused):
        got = dict(zip(OUTPUTS, loaded.runner(*loaded.adapter.collate([x]))))
        assert got["masks"].shape == (len(ref["boxes"]), 1, *x.shape[1:]) and got["sem_label"].shape == x.shape[1:]
        assert torch.equal(got["labels"], ref["labels"]) and torch.allclose(got["boxes"], ref["boxes"], atol=1e-3)
        assert torch.allclose(got["masks"], ref["masks"], atol=1e-3)
        assert torch.equal(got["sem_label"], ref["sem_seg"]) and torch.allclose(got["sem_prob"], ref["sem_prob"], atol=1e-4)
    # what evaluate.py --artifact evaluates: the eager model's eval dicts, the fusion run in numpy
    as_model = loaded.adapter.eval_model(loaded.runner, path)
    for got, ref in zip(as_model(images), outputs):
        assert list(got) == list(ref)
        assert torch.equal(got["panoptic"], ref["panoptic"]) and torch.equal(got["sem_seg"], ref["sem_seg"])
        _same_segments(got["segments_info"], ref["segments_info"])
    assert sum(s["isthing"] for o in outputs for s in o["segments_info"]) > 4


@pytest.fixture(scope="module")
def reports(pfpn, exported, tmp_path_factory):
    """(checkpoint, artifact) reports of evaluate.py, the checkpoint one image per forward (a batch pads
    its images to one size, which moves its outputs), the artifact called from two threads at once."""
    out = tmp_path_factory.mktemp("pfpn_reports")
    ckpt = evaluate.main(["--checkpoint", pfpn, "--report-dir", str(out / "ckpt"), "--set", "data.eval_batch_size=1",
                          "--no-analysis"])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        art = evaluate.main(["--artifact", exported[0], "--report-dir", str(out / "art"), "--no-analysis"])
    finally:
        torch.set_num_threads(threads)
    return ckpt, art


@pytest.mark.slow
def test_evaluating_the_onnx_artifact_gives_the_checkpoints_pq_ap_and_miou(reports):
    ckpt, art = reports
    assert art["metrics"]["panoptic/PQ"] == pytest.approx(ckpt["metrics"]["panoptic/PQ"], abs=0.005)
    for key in ("bbox/AP", "segm/AP", "panoptic/semantic_mIoU", "panoptic/PQ_th", "panoptic/PQ_st"):
        assert art["metrics"][key] == pytest.approx(ckpt["metrics"][key], abs=0.005), key
    panoptic = art["parts"]["panoptic"]
    assert panoptic["num_images"] == 4 and panoptic["panoptic"]["All"]["n"] > 0
    assert art["metrics"]["panoptic/PQ"] > 0  # a model that found something: the equality is not 0 == 0


@pytest.mark.slow
def test_the_onnx_artifact_scores_the_same_where_torch_cannot_be_imported(pfpn, exported, reports, tmp_path):
    """Issue 36 acceptance 1: evaluate_onnx.py (runtime/: the graph under ONNX Runtime, the fusion and
    PQ in numpy) in a process where torch cannot be imported gives evaluate.py --artifact's PQ."""
    _, art = reports
    root = os.path.join(os.path.dirname(pfpn), "shapes")
    report = evaluate_without_torch(
        "--artifact", exported[0], "--images", os.path.join(root, "val2017"),
        "--panoptic-gt-json", os.path.join(root, "annotations", "panoptic_val2017.json"),
        "--panoptic-gt-folder", os.path.join(root, "annotations", "panoptic_val2017"), "--output", tmp_path)
    assert report["imported_torch"] == [] and report["images"] == 4
    for key in ("panoptic/PQ", "panoptic/SQ", "panoptic/RQ", "panoptic/PQ_th", "panoptic/PQ_st"):
        assert report["metrics"][key] == pytest.approx(art["metrics"][key], abs=1e-6), key
    assert report["metrics"]["panoptic/PQ"] > 0


@pytest.mark.slow
def test_predict_writes_pictures_and_coco_panoptic_files_the_scorer_reads(pfpn, exported, reports, tmp_path):
    root = os.path.join(os.path.dirname(pfpn), "shapes")
    val = os.path.join(root, "val2017")
    from_artifact = predict.main(["--checkpoint", exported[0], val, "--output", str(tmp_path / "a")])
    from_checkpoint = predict.main(["--checkpoint", pfpn, val, "--output", str(tmp_path / "c")])
    assert len(from_artifact) == len(from_checkpoint) == 4
    for a, c in zip(from_artifact, from_checkpoint):
        assert a["input"] == c["input"] and a["image_id"] == int(os.path.splitext(os.path.basename(a["input"]))[0])
        assert [(s["category_id"], s["area"]) for s in a["segments"]] == [(s["category_id"], s["area"])
                                                                          for s in c["segments"]]
        ids = read_ids(a["panoptic_png"])
        assert ids.shape == (a["height"], a["width"])
        assert sorted(set(np.unique(ids).tolist()) - {0}) == sorted(s["id"] for s in a["segments"])
        with Image.open(a["drawn"]) as drawn, Image.open(a["input"]) as image:  # drawn larger, same shape
            assert drawn.width * image.height == drawn.height * image.width and drawn.width >= 384
    with open(tmp_path / "a" / "panoptic.json") as f:
        written = json.load(f)
    assert {c["id"] for c in written["categories"]} == {1, 2, 3, 101, 102, 103}
    # the JSON and PNGs scored against the ground truth: the artifact's own evaluation, exactly
    scored = evaluate.main(["--panoptic-gt-json", os.path.join(root, "annotations", "panoptic_val2017.json"),
                            "--panoptic-gt-folder", os.path.join(root, "annotations", "panoptic_val2017"),
                            "--panoptic-pred-json", str(tmp_path / "a" / "panoptic.json"),
                            "--panoptic-pred-folder", str(tmp_path / "a" / "panoptic"),
                            "--report-dir", str(tmp_path / "scored")])
    assert scored["metrics"]["PQ"] == pytest.approx(reports[1]["metrics"]["panoptic/PQ"], abs=1e-9)


@pytest.mark.slow
def test_predict_with_the_artifact_on_photos(exported, tmp_path):
    photos = shared_data("photos")
    results = predict.main(["--checkpoint", exported[0], photos, "--output", str(tmp_path)])
    assert len(results) == len(os.listdir(photos))
    for r in results:  # each photo at its own size: the ids in its pixels, the picture over it
        with Image.open(r["input"]) as image:
            assert read_ids(r["panoptic_png"]).shape == (image.height, image.width)
            with Image.open(r["drawn"]) as drawn:
                assert drawn.width * image.height == drawn.height * image.width and drawn.width >= image.width
        assert sum(s["area"] for s in r["segments"]) <= r["height"] * r["width"]
    # the torch-free path (runtime/): PIL, numpy and an ONNX Runtime session, the same PNG
    with open(exported[0] + ".json") as f:
        spec = json.load(f)
    session = ort.InferenceSession(exported[0], providers=["CPUExecutionProvider"])
    with Image.open(results[0]["input"]) as image:
        ids, segments = fuse(session.run(None, {"image": image_input(image)}), spec)
    assert np.array_equal(ids, read_ids(results[0]["panoptic_png"]))
    assert [s["category_id"] for s in segments] == [s["category_id"] for s in results[0]["segments"]]


@pytest.mark.slow
def test_torch_export_and_dynamic_batch_are_refused_before_any_data_is_built(pfpn, tmp_path):
    for name in ("panoptic_fpn_mobilenet_v3_large", "panoptic_fpn_resnet50", "panoptic_fpn_resnet50_v2"):
        row = format_table()[name]  # what export.py --list shows
        assert row["onnx"] is True and "proposals and detections depend on the data" in row["torch_export"]
    root = tmp_path / "shapes_never_built"  # the shapes builder would write its images here
    common = ["--checkpoint", pfpn, "--output", str(tmp_path / "out"), "--set", f"data.root={root}"]
    with pytest.raises(SystemExit) as e:
        export.main([*common, "--format", "torch_export"])
    assert "panoptic_fpn_mobilenet_v3_large, format torch_export" in str(e.value.code)
    assert "cannot trace a two-stage detector" in str(e.value.code) and "--format onnx" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        export.main([*common, "--format", "onnx", "--dynamic-batch"])
    assert "takes one image at a time" in str(e.value.code) and "without --dynamic-batch" in str(e.value.code)
    assert not root.exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_crafted_copies_of_the_onnx_artifact_are_refused_by_both_loaders(exported, tmp_path):
    crafted_onnx_is_refused(exported[0], tmp_path)
