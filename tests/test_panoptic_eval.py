"""PQ against the COCO panoptic definition (panopticapi): hand-built cases, ground truth scored as
its own prediction on real COCO panoptic data, the --panoptic-* mode of evaluate.py and its errors."""
import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import evaluate
from conftest import shared_data
from evaluators.panoptic import (PanopticEvaluator, PanopticFormatError, pq_image, pq_summary,
                                    score_panoptic_files)
from evaluators.segmentation import segmentation_metrics
from evaluators.panoptic_ids import id_to_rgb

CATS = [{"id": 1, "name": "a", "isthing": 1}, {"id": 2, "name": "b", "isthing": 1},
        {"id": 3, "name": "sky", "isthing": 0}]
INDEX = {c["id"]: i for i, c in enumerate(CATS)}


def seg(id_, cat, ids, crowd=0):
    return {"id": id_, "category_id": cat, "iscrowd": crowd, "area": int((ids == id_).sum())}


def score(gt, gt_segs, pred, pred_segs):
    stats = pq_image(gt, gt_segs, pred, pred_segs, INDEX, image_id=7)
    return stats, pq_summary(stats, CATS)


def test_prediction_on_void_is_ignored_and_void_leaves_the_union():
    gt = np.zeros((10, 10), np.int32)
    gt[:, 5:] = 1                       # thing 'a', 50 px; the left half is void
    pred = np.zeros((10, 10), np.int32)
    pred[:, 2:] = 1                     # 'a' over the gt segment + 30 void pixels: IoU 50 / (80 + 50 - 50 - 30) = 1
    pred[:, :2] = 2                     # 'b' entirely on void: not a false positive
    stats, summary = score(gt, [seg(1, 1, gt)], pred, [{"id": 1, "category_id": 1}, {"id": 2, "category_id": 2}])
    assert stats[INDEX[1]].tolist() == [1, 0, 0, 1.0]
    assert stats[INDEX[2]].tolist() == [0, 0, 0, 0]
    assert summary["All"] == {"pq": 1.0, "sq": 1.0, "rq": 1.0, "n": 1}

    pred = np.zeros((10, 10), np.int32)
    pred[:, 2:8] = 1                    # 'a': 30 px on void, 30 on the segment
    pred[:, 8:] = 2                     # 'b': 20 px, none on void -> a false positive
    stats, _ = score(gt, [seg(1, 1, gt)], pred, [{"id": 1, "category_id": 1}, {"id": 2, "category_id": 2}])
    # 'a': intersection 30, union 60 + 50 - 30 - 30 (void) = 50 -> IoU 0.6
    assert stats[INDEX[1]].tolist() == [1, 0, 0, pytest.approx(0.6)]
    assert stats[INDEX[2]].tolist() == [0, 1, 0, 0]


def test_prediction_over_a_crowd_region():
    gt = np.full((10, 10), 3, np.int32)  # stuff 'sky' everywhere ...
    gt[:, :6] = 9                        # ... but a crowd region of 'a' on the left 60 px
    gt_segs = [seg(3, 3, gt), seg(9, 1, gt, crowd=1)]
    pred = np.full((10, 10), 3, np.int32)
    pred[:, :6] = 0
    pred[:, :5] = 5                      # 'a' on the crowd of 'a': never matched, and not a false positive
    pred[:, 5] = 6                       # 'b' on the crowd of 'a': a false positive (crowd of another category)
    pred_segs = [{"id": 3, "category_id": 3}, {"id": 5, "category_id": 1}, {"id": 6, "category_id": 2}]
    stats, summary = score(gt, gt_segs, pred, pred_segs)
    assert stats[INDEX[1]].tolist() == [0, 0, 0, 0]  # the crowd is no false negative either
    assert stats[INDEX[2]].tolist() == [0, 1, 0, 0]
    assert stats[INDEX[3]].tolist() == [1, 0, 0, pytest.approx(40 / 40)]  # sky: 40 px, exact
    assert summary["Things"]["n"] == 1 and summary["Things"]["pq"] == 0
    assert summary["Stuff"] == {"pq": 1.0, "sq": 1.0, "rq": 1.0, "n": 1}


def test_split_instance():
    gt = np.full((10, 10), 3, np.int32)
    gt[:4, :5] = 1                       # 'a', 20 px
    pred = gt.copy()
    pred[:4, 3:5] = 2                    # the prediction splits it: 12 px (id 1) + 8 px (id 2)
    stats, summary = score(gt, [seg(1, 1, gt), seg(3, 3, gt)], pred,
                           [{"id": 1, "category_id": 1}, {"id": 2, "category_id": 1}, {"id": 3, "category_id": 3}])
    # id 1: IoU 12/20 = 0.6 -> TP; id 2: IoU 8/20 = 0.4 -> FP
    assert stats[INDEX[1]].tolist() == [1, 1, 0, pytest.approx(0.6)]
    assert summary["per_class"]["1"]["pq"] == pytest.approx(0.6 / (1 + 0.5))
    assert summary["per_class"]["1"]["sq"] == pytest.approx(0.6)
    assert summary["per_class"]["1"]["rq"] == pytest.approx(1 / 1.5)


def test_merged_instance():
    gt = np.full((10, 10), 3, np.int32)
    gt[:4, :3] = 1                       # 'a', 12 px
    gt[:4, 3:5] = 2                      # another 'a', 8 px
    pred = np.full((10, 10), 3, np.int32)
    pred[:4, :5] = 1                     # one prediction over both
    stats, summary = score(gt, [seg(1, 1, gt), seg(2, 1, gt), seg(3, 3, gt)], pred,
                           [{"id": 1, "category_id": 1}, {"id": 3, "category_id": 3}])
    # IoU with the 12-px instance 12/20 = 0.6 -> TP; the 8-px one is missed -> FN
    assert stats[INDEX[1]].tolist() == [1, 0, 1, pytest.approx(0.6)]
    assert summary["per_class"]["1"]["pq"] == pytest.approx(0.6 / 1.5)


def test_category_with_only_false_positives_counts_in_the_average():
    gt = np.full((10, 10), 3, np.int32)
    gt[:5, :5] = 1                       # 'a'
    pred = gt.copy()                     # predicted as 'b'
    stats, summary = score(gt, [seg(1, 1, gt), seg(3, 3, gt)], pred,
                           [{"id": 1, "category_id": 2}, {"id": 3, "category_id": 3}])
    assert stats[INDEX[1]].tolist() == [0, 0, 1, 0] and stats[INDEX[2]].tolist() == [0, 1, 0, 0]
    assert summary["per_class"]["2"] == {"name": "b", "isthing": 1, "tp": 0, "fp": 1, "fn": 0,
                                               "pq": 0.0, "sq": 0.0, "rq": 0.0}
    assert summary["Things"]["n"] == 2 and summary["Things"]["pq"] == 0.0
    assert summary["All"]["n"] == 3 and summary["All"]["pq"] == pytest.approx(1 / 3)  # sky is exact


# ---------------------------------------------------------------- files and evaluate.py

def _write(folder, name, ids):
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(id_to_rgb(ids)).save(os.path.join(folder, name))


def test_ground_truth_scored_as_prediction_is_perfect(tmp_path):
    root = shared_data("coco_panoptic2")
    gt_json = os.path.join(root, "annotations", "panoptic_val2017.json")
    gt_folder = os.path.join(root, "annotations", "panoptic_val2017")
    with contextlib.redirect_stdout(io.StringIO()):
        report = evaluate.main(["--panoptic-gt-json", gt_json, "--panoptic-gt-folder", gt_folder,
                                "--panoptic-pred-json", gt_json, "--panoptic-pred-folder", gt_folder,
                                "--report-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "report.json").read_text())
    for group in ("All", "Things", "Stuff"):
        assert saved["panoptic"][group]["pq"] == saved["panoptic"][group]["sq"] == saved["panoptic"][group]["rq"] == 1
    # every category with a non-crowd segment counts once
    gt = json.load(open(gt_json))
    used = {s["category_id"] for a in gt["annotations"] for s in a["segments_info"] if not s["iscrowd"]}
    assert saved["panoptic"]["All"]["n"] == len(used)
    assert report["metrics"]["PQ"] == 1.0 and "PQ_th" in report["metrics"]
    assert "| All | 100.0 | 100.0 | 100.0 |" in (tmp_path / "report.md").read_text()


def _tiny_files(tmp_path):
    gt_ids = np.full((6, 8), 3, np.int32)
    gt_ids[:3, :3] = 1
    gt = {"images": [{"id": 5, "file_name": "5.jpg", "height": 6, "width": 8}], "categories": CATS,
          "annotations": [{"image_id": 5, "file_name": "5.png", "segments_info": [seg(1, 1, gt_ids), seg(3, 3, gt_ids)]}]}
    _write(tmp_path / "gt", "5.png", gt_ids)
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    pred = {"annotations": [{"image_id": 5, "file_name": "5.png",
                             "segments_info": [{"id": 1, "category_id": 1}, {"id": 3, "category_id": 3}]}]}
    shutil.copytree(tmp_path / "gt", tmp_path / "pred")
    return gt_ids, pred


def _score(tmp_path, pred):
    (tmp_path / "pred.json").write_text(json.dumps(pred))
    return score_panoptic_files(str(tmp_path / "gt.json"), str(tmp_path / "gt"), str(tmp_path / "pred.json"),
                                str(tmp_path / "pred"))


def test_scorer_errors_name_the_image_and_the_id(tmp_path):
    gt_ids, pred = _tiny_files(tmp_path)
    assert _score(tmp_path, pred)["panoptic"]["All"]["pq"] == 1.0
    ids = gt_ids.copy()
    ids[5, 7] = 42
    _write(tmp_path / "pred", "5.png", ids)
    with pytest.raises(PanopticFormatError, match=r"image 5: segment id\(s\) \[42\] are in the PNG but not in the JSON"):
        _score(tmp_path, pred)
    _write(tmp_path / "pred", "5.png", gt_ids)
    pred["annotations"][0]["segments_info"].append({"id": 8, "category_id": 2})
    with pytest.raises(PanopticFormatError, match=r"image 5: segment id\(s\) \[8\] are in the JSON but not in the PNG"):
        _score(tmp_path, pred)
    pred["annotations"][0]["segments_info"] = [{"id": 1, "category_id": 77}, {"id": 3, "category_id": 3}]
    with pytest.raises(PanopticFormatError, match="image 5: segment 1 has unknown category_id 77"):
        _score(tmp_path, pred)
    with pytest.raises(PanopticFormatError, match="ground-truth image 5 has no prediction"):
        _score(tmp_path, {"annotations": []})


def test_evaluate_py_reports_a_bad_prediction_as_an_error(tmp_path):
    _tiny_files(tmp_path)
    (tmp_path / "pred.json").write_text(json.dumps({"annotations": []}))
    with pytest.raises(SystemExit, match="ground-truth image 5 has no prediction"):
        evaluate.main(["--panoptic-gt-json", str(tmp_path / "gt.json"), "--panoptic-gt-folder", str(tmp_path / "gt"),
                       "--panoptic-pred-json", str(tmp_path / "pred.json"), "--panoptic-pred-folder",
                       str(tmp_path / "pred")])
    with pytest.raises(SystemExit, match="go together"):
        evaluate.main(["--panoptic-gt-json", str(tmp_path / "gt.json")])


# ---------------------------------------------------------------- the semantic branch

def _semantic_evaluator(tmp_path):
    """Things a, b; stuff sky, ground (labels = category ids 1..4); one 2 x 4 image, one void pixel."""
    cats = CATS[:2] + [{"id": 3, "name": "sky", "isthing": 0}, {"id": 4, "name": "ground", "isthing": 0}]
    gt_ids = np.array([[1, 2, 3, 3], [4, 4, 0, 5]], np.int32)
    segments = [seg(1, 1, gt_ids), seg(2, 2, gt_ids), seg(3, 3, gt_ids), seg(4, 4, gt_ids), seg(5, 1, gt_ids)]
    _write(tmp_path / "gt", "7.png", gt_ids)
    gt = {"categories": cats, "annotations": [{"image_id": 7, "file_name": "7.png", "segments_info": segments}]}
    evaluator = PanopticEvaluator(gt, str(tmp_path / "gt"), {c: c for c in range(1, 5)})
    prediction = {"panoptic": torch.from_numpy(gt_ids), "segments_info": [
        {"id": s["id"], "category_id": s["category_id"], "isthing": s["category_id"] <= 2, "score": 1.0,
         "area": s["area"]} for s in segments]}
    target = {"image_id": 7, "sem_seg": torch.tensor([[0, 1, 2, 2], [3, 3, 255, 0]])}  # label - 1, 255 void
    return evaluator, prediction, target


@pytest.mark.parametrize("head", ["stuff", "all"])
def test_semantic_branch_miou_is_the_segmentation_metric_of_the_same_confusion_matrix(tmp_path, head):
    evaluator, prediction, target = _semantic_evaluator(tmp_path)
    # "stuff" head: 0 = things; an "all" head predicts thing classes, merged into "things"
    things = (0, 0, 0) if head == "stuff" else (1, 2, 2)
    prediction["sem_seg"] = torch.tensor([[things[0], 3, 3, 4], [4, things[1], 3, things[2]]])
    evaluator.update([prediction], [target])
    report = evaluator.report()
    # classes things, sky, ground; truth [[th, th, sky, sky], [gr, gr, void, th]]
    # vs prediction [[th, sky, sky, gr], [gr, th, sky, th]]
    cm = [[2, 1, 0], [0, 1, 1], [1, 0, 1]]
    semantic = report["semantic"]
    assert semantic["classes"] == ["things", "sky", "ground"]
    assert semantic["confusion_matrix"] == cm and semantic["num_pixels"] == 7
    assert semantic["metrics"] == segmentation_metrics(torch.tensor(cm))[0]
    assert semantic["per_class_iou"] == pytest.approx({"things": 2 / 4, "sky": 1 / 3, "ground": 1 / 3})
    assert report["metrics"]["semantic_mIoU"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 3) / 3)
    assert report["metrics"]["semantic_pixel_accuracy"] == pytest.approx(4 / 7)
    assert report["metrics"]["PQ"] == 1.0  # the panoptic map itself is the ground truth
    assert "Semantic branch" in evaluator.markdown(report) and "| sky | 33.3 |" in evaluator.markdown(report)


def test_semantic_branch_ground_truth_as_prediction_and_bad_labels(tmp_path):
    evaluator, prediction, target = _semantic_evaluator(tmp_path)
    prediction["sem_seg"] = torch.where(target["sem_seg"] == 255, 3, target["sem_seg"] + 1)  # void: anything
    evaluator.update([prediction], [target])
    metrics = evaluator.compute()
    assert metrics["semantic_mIoU"] == metrics["semantic_pixel_accuracy"] == metrics["semantic_mean_accuracy"] == 1.0

    evaluator, prediction, target = _semantic_evaluator(tmp_path)
    prediction["sem_seg"] = torch.full((2, 4), 9)
    with pytest.raises(ValueError, match=r"semantic labels \[9\] are outside 0..4"):
        evaluator.update([prediction], [target])
