"""evaluate.py's COCO scoring against pycocotools itself (acceptance 2), both backends, bad files."""
import contextlib
import io
import json
import os

import numpy as np
import pytest

import evaluate
from conftest import shared_data
from evaluators.coco import STAT_KEYS, evaluate_results, load_gt


def _gt_path():
    return os.path.join(shared_data("coco6"), "annotations", "instances_val2017.json")


def _random_detections(gt, seed=0, masks=False):
    """Imperfect detections: jittered true boxes, wrong classes, misses, false positives."""
    rng = np.random.default_rng(seed)
    cats = sorted(c["id"] for c in gt["categories"])
    images = {img["id"]: img for img in gt["images"]}
    dets = []
    for a in gt["annotations"]:
        if rng.random() < 0.15:
            continue  # a miss
        x, y, w, h = a["bbox"]
        j = rng.normal(0, 0.15, size=4)
        box = [x + j[0] * w, y + j[1] * h, max(1.0, w * (1 + j[2])), max(1.0, h * (1 + j[3]))]
        cat = a["category_id"] if rng.random() < 0.8 else int(rng.choice(cats))
        dets.append({"image_id": a["image_id"], "category_id": cat, "bbox": box, "score": float(rng.random())})
    for image_id, img in images.items():
        for _ in range(int(rng.integers(1, 6))):
            w, h = rng.uniform(5, img["width"] / 2), rng.uniform(5, img["height"] / 2)
            dets.append({"image_id": image_id, "category_id": int(rng.choice(cats)), "score": float(rng.random()),
                         "bbox": [float(rng.uniform(0, img["width"] - w)), float(rng.uniform(0, img["height"] - h)), w, h]})
    if masks:
        from pycocotools import mask as mask_utils
        for d in dets:
            img = images[d["image_id"]]
            x, y, w, h = d["bbox"]
            m = np.zeros((img["height"], img["width"]), np.uint8, order="F")
            m[int(y):int(y + h * rng.uniform(0.6, 1)), int(x):int(x + w)] = 1  # a partial box mask
            rle = mask_utils.encode(m)
            rle["counts"] = rle["counts"].decode()
            d["segmentation"] = rle
    return dets


def _pycocotools(gt_path, dets, iou_type):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(gt_path)
        dt = gt.loadRes(json.loads(json.dumps(dets)))
        E = COCOeval(gt, dt, iou_type)
        E.evaluate()
        E.accumulate()
        E.summarize()
    return E.stats


def test_evaluate_py_equals_pycocotools(tmp_path):
    gt_path = _gt_path()
    with open(gt_path) as f:
        gt = json.load(f)
    dets = _random_detections(gt)
    res = tmp_path / "detections.json"
    res.write_text(json.dumps(dets))
    with contextlib.redirect_stdout(io.StringIO()):
        evaluate.main(["--coco-gt", gt_path, "--coco-results", str(res), "--report-dir", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert list(report["bbox"]) == list(STAT_KEYS)
    expected = _pycocotools(gt_path, dets, "bbox")
    markdown = (tmp_path / "r" / "report.md").read_text()  # the table shows pycocotools' AP, in %
    assert f"| AP | {100 * expected[0]:.1f} |" in markdown and f"| AP50 | {100 * expected[1]:.1f} |" in markdown
    assert 0.05 < expected[0] < 0.95  # imperfect detections: neither 0 nor 1
    for key, value in zip(STAT_KEYS, expected):
        assert report["bbox"][key] == pytest.approx(float(value), abs=1e-9), key
    assert report["num_detections"] == len(dets) and report["num_images"] == 6
    assert {r["name"] for r in report["per_category"]["bbox"]} >= {"person", "car"}


@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_backends_agree(iou_type):
    pytest.importorskip("faster_coco_eval")
    gt_path = _gt_path()
    with open(gt_path) as f:
        gt = json.load(f)
    dets = _random_detections(gt, seed=1, masks=iou_type == "segm")
    reports = {b: evaluate_results(load_gt(gt_path, b), dets, (iou_type,), b) for b in ("pycocotools", "faster_coco_eval")}
    a, b = reports["pycocotools"][iou_type], reports["faster_coco_eval"][iou_type]
    assert a["AP"] > 0.01
    for key in STAT_KEYS:
        assert a[key] == pytest.approx(b[key], abs=1e-9), key
    if iou_type == "bbox":
        expected = _pycocotools(gt_path, dets, "bbox")
        assert a["AP"] == pytest.approx(float(expected[0]), abs=1e-12)


def test_no_detections_scores_zero():
    report = evaluate_results(_gt_path(), [], ("bbox",), "pycocotools")
    assert report["bbox"]["AP"] == 0.0 and report["num_detections"] == 0


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.__setitem__("image_id", 123456789), "image id"),
    (lambda d: d.__setitem__("category_id", 999), "category id"),
    (lambda d: d.__setitem__("bbox", [10, 10, 5]), "bbox"),
    (lambda d: d.__setitem__("bbox", [100, 100, 50, -20]), "negative width or height"),
    (lambda d: d.pop("score"), "score"),
])
def test_mismatching_results_file_is_a_clear_error(tmp_path, mutate, message):
    gt_path = _gt_path()
    with open(gt_path) as f:
        gt = json.load(f)
    dets = _random_detections(gt)
    mutate(dets[3])
    res = tmp_path / "bad.json"
    res.write_text(json.dumps(dets))
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--coco-gt", gt_path, "--coco-results", str(res), "--report-dir", str(tmp_path)])
    assert message in str(e.value) and "bad.json" in str(e.value)


def test_results_mode_arguments(tmp_path):
    with pytest.raises(SystemExit, match="go together"):
        evaluate.main(["--coco-gt", _gt_path()])
    with pytest.raises(SystemExit, match="--checkpoint"):
        evaluate.main(["--coco-gt", _gt_path(), "--coco-results", "x.json", "--checkpoint", "a.pt"])
    not_a_list = tmp_path / "r.json"
    not_a_list.write_text('{"annotations": []}')
    with pytest.raises(SystemExit, match="expected a JSON list"):
        evaluate.main(["--coco-gt", _gt_path(), "--coco-results", str(not_a_list)])


@pytest.mark.parametrize("backend", ["pycocotools", "faster_coco_eval"])
def test_boxes_and_masks_file_equals_pycocotools(tmp_path, backend, monkeypatch):
    """detectron2-style results (bbox and segmentation on every detection): pycocotools' loadRes
    takes the segm area from the bbox, so APs/APm/APl must follow it on either backend."""
    if backend == "faster_coco_eval":
        pytest.importorskip("faster_coco_eval")
    import evaluators.coco as coco_eval
    monkeypatch.setattr(coco_eval, "resolve_backend", lambda b="auto": backend)
    gt_path = _gt_path()
    with open(gt_path) as f:
        gt = json.load(f)
    from pycocotools import mask as mask_utils
    from pycocotools.coco import COCO
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(gt_path)
    rng = np.random.default_rng(3)
    dets = []
    for a in gt["annotations"]:  # true masks with loose boxes (1.2-2x the area), and a shifted false positive
        mask = coco.annToMask(a)
        x, y, w, h = a["bbox"]
        s = float(rng.uniform(1.1, 1.4))
        box = [x - w * (s - 1) / 2, y - h * (s - 1) / 2, w * s, h * s]
        shift = int(w) + 5
        moved = np.zeros_like(mask)
        moved[:, shift:] = mask[:, :max(0, mask.shape[1] - shift)]
        for m, b in ((mask, box), (moved, [box[0] + shift] + box[1:])):
            rle = mask_utils.encode(np.asfortranarray(m))
            rle["counts"] = rle["counts"].decode()
            dets.append({"image_id": a["image_id"], "category_id": a["category_id"], "score": float(rng.random()),
                         "bbox": b, "segmentation": rle})
    ranges = lambda a: int(a >= 32 ** 2) + int(a >= 96 ** 2)  # noqa: E731
    assert sum(ranges(d["bbox"][2] * d["bbox"][3]) != ranges(float(mask_utils.area(d["segmentation"])))
               for d in dets) >= 2  # mask and box areas fall in different COCO area ranges
    res = tmp_path / "detections.json"
    res.write_text(json.dumps(dets))
    with contextlib.redirect_stdout(io.StringIO()):
        evaluate.main(["--coco-gt", gt_path, "--coco-results", str(res), "--iou-types", "bbox", "segm",
                       "--report-dir", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["backend"] == backend
    for iou_type in ("bbox", "segm"):
        expected = _pycocotools(gt_path, dets, iou_type)
        for key, value in zip(STAT_KEYS, expected):
            assert report[iou_type][key] == pytest.approx(float(value), abs=1e-9), (iou_type, key)
