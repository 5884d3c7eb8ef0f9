"""The detection analysis (evaluators/detection_analysis.py through evaluators/coco.py): TIDE numbers against
tidecv, PR curves against the reported AP, the confusion matrix's totals, F1, the worst images, and
perturbations of a detector's predictions attributed to their own error type (issue 20)."""
import contextlib
import copy
import io
import json
import os

import numpy as np
import pytest

import evaluate
from conftest import shared_data
from engine.report import plots
from evaluators.coco import CocoEvaluator, evaluate_results, load_gt, resolve_backend
from evaluators.detection_analysis import COLOURS, draw_boxes, label_layout
from datasets.shapes import ensure_shapes
from PIL import Image
from torchvision.io import read_image

MAIN = ("cls", "loc", "both", "dupe", "bkg", "miss")


def _coco6():
    path = os.path.join(shared_data("coco6"), "annotations", "instances_val2017.json")
    with open(path) as f:
        return path, json.load(f)


def _noisy(gt, seed):
    """Imperfect detections of the ground truth's own categories: jittered boxes, wrong classes,
    misses and random boxes, scores at random."""
    rng = np.random.default_rng(seed)
    cats = sorted({a["category_id"] for a in gt["annotations"]})
    images = {img["id"]: img for img in gt["images"]}
    dets = []
    for a in gt["annotations"]:
        if a.get("iscrowd") or rng.random() < 0.15:
            continue
        x, y, w, h = a["bbox"]
        j = rng.normal(0, 0.15, size=4)
        box = [x + j[0] * w, y + j[1] * h, max(1.0, w * (1 + j[2])), max(1.0, h * (1 + j[3]))]
        cat = a["category_id"] if rng.random() < 0.8 else int(rng.choice(cats))
        dets.append({"image_id": a["image_id"], "category_id": cat, "bbox": box, "score": float(rng.random())})
        if rng.random() < 0.1:  # a duplicate
            dets.append({**dets[-1], "score": float(rng.random())})
    for image_id, img in images.items():
        for _ in range(int(rng.integers(1, 6))):
            w, h = rng.uniform(5, img["width"] / 2), rng.uniform(5, img["height"] / 2)
            dets.append({"image_id": image_id, "category_id": int(rng.choice(cats)), "score": float(rng.random()),
                         "bbox": [float(rng.uniform(0, img["width"] - w)), float(rng.uniform(0, img["height"] - h)), w, h]})
    return dets


def _sections(report):
    return {s["title"]: s for s in report["analysis"]}


def _tide(report, iou_type="bbox"):
    metrics = _sections(report)[f"{iou_type}: error analysis (TIDE)"]["metrics"]
    return {k.rsplit("/", 1)[1]: v for k, v in metrics.items()}


def _tidecv(gt, dets):
    from tidecv import TIDE, Data
    truth, preds = Data("gt"), Data("pred")
    for img in gt["images"]:  # tidecv evaluates the images it knows (their detections count where no box is)
        truth.add_image(img["id"], img["file_name"])
    for c in gt["categories"]:
        truth.add_class(c["id"], c["name"])
    for a in gt["annotations"]:
        truth.add_ground_truth(a["image_id"], a["category_id"], a["bbox"], None)
    for d in dets:
        preds.add_detection(d["image_id"], d["category_id"], d["score"], d["bbox"], None)
    tide = TIDE()
    tide.evaluate(truth, preds, mode=TIDE.BOX)
    main, special = tide.get_main_errors()["pred"], tide.get_special_errors()["pred"]
    names = {"Cls": "cls", "Loc": "loc", "Both": "both", "Dupe": "dupe", "Bkg": "bkg", "Miss": "miss",
             "FalsePos": "FP", "FalseNeg": "FN"}
    return tide.runs["pred"].ap, {f"dAP_{names[k]}": v for k, v in {**main, **special}.items()}


def test_tide_matches_tidecv(seed=0):
    """Acceptance 2: the same detections give tidecv's numbers within 0.5 AP points (crowd regions
    left out: tidecv's oracle turns detections COCO ignores on them into true positives)."""
    pytest.importorskip("tidecv")
    _, gt = _coco6()
    gt["annotations"] = [a for a in gt["annotations"] if not a.get("iscrowd")]
    present = {a["category_id"] for a in gt["annotations"]}
    gt["categories"] = [c for c in gt["categories"] if c["id"] in present]
    dets = _noisy(gt, seed)
    report = evaluate_results(gt, dets, ("bbox",), "pycocotools", analysis={"num_worst": 0})
    ours = _tide(report)
    ap, theirs = _tidecv(gt, dets)
    assert ours["AP50"] == pytest.approx(report["bbox"]["AP50"], abs=1e-6)  # the baseline is COCO's AP50
    assert 100 * ours["AP50"] == pytest.approx(ap, abs=0.01)
    assert sum(theirs[f"dAP_{k}"] for k in MAIN) > 10  # several error types matter here
    for key, value in theirs.items():
        assert 100 * ours[key] == pytest.approx(value, abs=0.5), key


def test_faster_backend_gives_the_same_analysis():
    """faster-coco-eval does not expose its per-image matching: the analysis re-runs COCO's rule
    (crowd regions included) and must agree with pycocotools' evalImgs everywhere."""
    pytest.importorskip("faster_coco_eval")
    path, gt = _coco6()
    dets = _noisy(gt, 2)
    reports = [evaluate_results(load_gt(path, b), dets, ("bbox",), b, analysis={"num_worst": 3})
               for b in ("pycocotools", "faster_coco_eval")]
    assert any(a.get("iscrowd") for a in gt["annotations"])
    a, b = (_sections(r) for r in reports)
    assert a.keys() == b.keys()
    for title in a:
        assert a[title].get("metrics") == pytest.approx(b[title].get("metrics")), title
    assert a["bbox: confusion matrix"]["plots"] == b["bbox: confusion matrix"]["plots"]


def test_pr_curves_area_is_the_reported_ap():
    """Acceptance 3: the curves' mean precision over the 101 recall points is AP50 / AP75, overall
    and per class, for boxes and masks."""
    path, gt = _coco6()
    dets = _noisy(gt, 3)
    from pycocotools import mask as mask_utils
    images = {img["id"]: img for img in gt["images"]}
    for d in dets:  # a mask: the box's upper two thirds
        img = images[d["image_id"]]
        m = np.zeros((img["height"], img["width"]), np.uint8, order="F")
        x, y, w, h = (int(v) for v in d["bbox"])
        m[max(y, 0):y + 2 * h // 3 + 1, max(x, 0):x + w + 1] = 1
        d["segmentation"] = mask_utils.encode(m)
        d["segmentation"]["counts"] = d["segmentation"]["counts"].decode()
    report = evaluate_results(path, dets, ("bbox", "segm"), "pycocotools", analysis={"num_worst": 0})
    for iou_type in ("bbox", "segm"):
        s = _sections(report)[f"{iou_type}: precision-recall"]
        assert report[iou_type]["AP50"] > 0.01  # box-shaped masks on polygons: low, not zero
        for iou, key in ((0.5, "AP50"), (0.75, "AP75")):
            curves = {c["class"]: c for c in s["plots"][0]["series"] if c["iou"] == iou}
            assert len(curves["all"]["x"]) == 101
            assert np.mean(curves["all"]["y"]) == pytest.approx(report[iou_type][key], abs=1e-3)
            for row in report["per_category"][iou_type]:
                if key == "AP50" and row["name"] in curves:
                    assert np.mean(curves[row["name"]]["y"]) == pytest.approx(row["AP50"], abs=1e-3)
        per_class = {r[0]: r for r in s["tables"][0]["rows"]}
        assert set(per_class) == {r["name"] for r in report["per_category"][iou_type] if r["num_gt"]}


def test_confusion_matrix_adds_up():
    """Acceptance 3: rows add up to each class's ground truth, columns to its detections at the
    threshold; matched + missed = ground truth, matched + false positives = detections."""
    _, gt = _coco6()
    gt["annotations"] = [a for a in gt["annotations"] if not a.get("iscrowd")]
    dets = _noisy(gt, 4)
    report = evaluate_results(gt, dets, ("bbox",), "pycocotools", analysis={"num_worst": 0, "score_threshold": 0.3})
    s = _sections(report)["bbox: confusion matrix"]
    plot, m = s["plots"][0], s["metrics"]
    cm = np.array(plot["values"])
    names = {c["id"]: c["name"] for c in gt["categories"]}
    for i, name in enumerate(plot["labels"][:-1]):
        assert cm[i].sum() == sum(names[a["category_id"]] == name for a in gt["annotations"]), name
        assert cm[:, i].sum() == sum(names[d["category_id"]] == name and d["score"] >= 0.3 for d in dets), name
    shown = sum(d["score"] >= 0.3 for d in dets)
    assert m["bbox/confusion/matched"] + m["bbox/confusion/missed"] == len(gt["annotations"])
    assert m["bbox/confusion/matched"] + m["bbox/confusion/false_positives"] == shown
    assert 0 < m["bbox/confusion/correct"] < m["bbox/confusion/matched"]  # some boxes found with the wrong class


def _box_gt(boxes, cats=("a", "b")):
    """A one-image COCO data set from [(category id, [x, y, w, h])]."""
    return {"images": [{"id": 1, "file_name": "1.png", "width": 200, "height": 200}],
            "categories": [{"id": i + 1, "name": n} for i, n in enumerate(cats)],
            "annotations": [{"id": i + 1, "image_id": 1, "category_id": c, "bbox": b, "area": b[2] * b[3],
                             "iscrowd": 0} for i, (c, b) in enumerate(boxes)]}


def test_each_hand_built_error_lands_in_its_bucket():
    gt = _box_gt([(1, [10, 10, 40, 40]), (1, [100, 10, 40, 40]), (2, [10, 100, 40, 40]), (2, [100, 100, 40, 40]),
                  (1, [150, 150, 30, 30]), (2, [60, 55, 30, 30])])
    det = lambda c, b, s: {"image_id": 1, "category_id": c, "bbox": b, "score": s}  # noqa: E731
    dets = [det(1, [10, 10, 40, 40], 0.9),      # TP
            det(1, [12, 12, 40, 40], 0.8),      # dupe of the first
            det(1, [100, 10, 40, 40], 0.75),    # TP, below the dupe: removing the dupe lifts AP
            det(1, [10, 100, 40, 40], 0.7),     # cls: on a box of class 2
            det(2, [125, 100, 40, 40], 0.85),   # loc: IoU 0.23 with its class-2 box
            det(2, [0, 160, 20, 20], 0.99),     # bkg, above the one class-2 TP
            det(2, [60, 55, 30, 30], 0.6)]      # TP
    report = evaluate_results(gt, dets, ("bbox",), "pycocotools", analysis={"num_worst": 1, "score_threshold": 0.5})
    s = _sections(report)
    tide_table = s["bbox: error analysis (TIDE)"]["tables"][0]
    counts = {r[0]: r[tide_table["columns"].index("count")] for r in tide_table["rows"]}
    assert counts == {"cls": 1, "loc": 1, "both": 0, "dupe": 1, "bkg": 1, "miss": 1, "FP": "-", "FN": "-"}
    tide = _tide(report)
    for key in MAIN:
        assert tide[f"dAP_{key}"] > 0 if key != "both" else tide[f"dAP_{key}"] == 0, key
    # confusion at score >= 0.5: rows ground truth, columns predicted, last = background
    cm = np.array(s["bbox: confusion matrix"]["plots"][0]["values"])
    assert cm.tolist() == [[2, 0, 1],   # a: two found, the small one missed
                           [1, 1, 1],   # b: one taken for an a, one found, one boxed loosely (IoU 0.23): missed
                           [1, 2, 0]]   # background: the dupe, the loose box, the box on nothing
    m = s["bbox: confusion matrix"]["metrics"]
    assert (m["bbox/confusion/matched"], m["bbox/confusion/missed"], m["bbox/confusion/false_positives"]) == (4, 2, 3)
    worst = s["bbox: worst images"]["images"][0]
    assert worst["errors"] == 4 + 3  # four false positives at score >= 0.5, three boxes none of them found
    assert sorted(b["kind"] for b in worst["boxes"]) == sorted(
        ["gt", "gt", "gt", "miss", "miss", "miss", "ok", "ok", "ok", "dupe", "cls", "loc", "bkg"])


@pytest.fixture(scope="module")
def shapes_val(tmp_path_factory):
    """A small shapes data set (80 val images of 64 px): (annotations dict, images folder)."""
    root = ensure_shapes(str(tmp_path_factory.mktemp("shapes") / "s"), seed=0, num_train=1, num_val=80, image_size=64)
    with open(os.path.join(root, "annotations", "instances_val2017.json")) as f:
        return json.load(f), os.path.join(root, "val2017")


GT_COLOURS = {k: tuple(int(COLOURS[k][i:i + 2], 16) for i in (1, 3, 5)) for k in ("gt", "miss")}


def _assert_drawn(path, entry, gt):
    """A worst image on disk: its image enlarged to 480 px (a 64-px image, x7.5) with its ground-truth
    boxes drawn: an edge of at least one of them is (in dashes) in its kind's colour."""
    info = next(i for i in gt["images"] if i["id"] == entry["image_id"])
    scale = 480 / max(info["height"], info["width"])
    with Image.open(path) as im:
        pixels = np.asarray(im.convert("RGB"))
    # labels with no room in the image go to a strip under it: as wide, maybe taller
    assert pixels.shape[1:] == (round(info["width"] * scale), 3), (path, pixels.shape)
    assert pixels.shape[0] >= round(info["height"] * scale), (path, pixels.shape)
    hits = 0
    for b in entry["boxes"]:
        if b["kind"] in GT_COLOURS:
            x, y, w, h = b["bbox"]
            x0, y0, x1, y1 = (round(v * scale) for v in (x, y, x + w, y + h))
            edges = [pixels[max(y0 - 2, 0):y0 + 3, x0:x1 + 1], pixels[max(y1 - 2, 0):y1 + 3, x0:x1 + 1],
                     pixels[y0:y1 + 1, max(x0 - 2, 0):x0 + 3], pixels[y0:y1 + 1, max(x1 - 2, 0):x1 + 3]]
            hits += any((e.reshape(-1, 3) == GT_COLOURS[b["kind"]]).all(1).any() for e in edges)
    assert hits > 0, (path, entry["boxes"])


def _detector(gt, rng):
    """A shapes detector's predictions: most boxes found (IoU ~0.8) with high scores, some missed, some
    found loosely, and low-scored false positives on the background."""
    images = {img["id"]: img for img in gt["images"]}
    dets = []
    for a in gt["annotations"]:
        if rng.random() < 0.1:
            continue
        x, y, w, h = a["bbox"]
        j = rng.normal(0, 0.04, size=4)
        dets.append({"image_id": a["image_id"], "category_id": a["category_id"], "score": float(rng.uniform(0.4, 1)),
                     "bbox": [x + j[0] * w, y + j[1] * h, w * (1 + j[2]), h * (1 + j[3])]})
        if rng.random() < 0.5:  # a low-scored box of another class on the same object
            dets.append({**dets[-1], "category_id": a["category_id"] % 3 + 1, "score": float(rng.uniform(0.01, 0.2))})
    for image_id, img in images.items():
        for _ in range(2):
            w, h = rng.uniform(4, img["width"] / 4, size=2)
            dets.append({"image_id": image_id, "category_id": int(rng.integers(1, 4)), "score": float(rng.uniform(0, 0.5)),
                         "bbox": [float(rng.uniform(0, img["width"] - w)), float(rng.uniform(0, img["height"] - h)), w, h]})
    return dets


def _perturb(kind, dets, gt, rng, fraction=0.3):
    """One controlled change of the predictions."""
    dets = copy.deepcopy(dets)
    chosen = rng.random(len(dets)) < fraction
    if kind == "loc":  # box jitter: shifted by 60% of its size (IoU ~0.25 with its own box)
        for d, c in zip(dets, chosen):
            if c:
                d["bbox"][0] += 0.6 * d["bbox"][2] * rng.choice([-1, 1])
    elif kind == "cls":  # label swaps
        for d, c in zip(dets, chosen):
            if c:
                d["category_id"] = int(rng.choice([k for k in (1, 2, 3) if k != d["category_id"]]))
    elif kind == "dupe":  # duplicated detections, slightly moved, scored a little lower
        dets += [{**d, "bbox": [v + 0.5 for v in d["bbox"]], "score": d["score"] * 0.95}
                 for d, c in zip(dets, chosen) if c]
    elif kind == "bkg":  # random boxes added, scored like true detections
        for img in gt["images"]:
            for _ in range(2):
                w, h = rng.uniform(4, img["width"] / 4, size=2)
                dets.append({"image_id": img["id"], "category_id": int(rng.integers(1, 4)),
                             "score": float(rng.uniform(0.3, 1)),
                             "bbox": [float(rng.uniform(0, img["width"] - w)), float(rng.uniform(0, img["height"] - h)), w, h]})
    elif kind == "miss":  # dropped detections: every detection of 30% of the objects (a detector's other
        # boxes on an object, e.g. low-scored ones of another class, would otherwise still find it)
        from pycocotools import mask as mask_utils
        lost = [a for a in gt["annotations"] if rng.random() < fraction]
        boxes = {}
        for a in lost:
            boxes.setdefault(a["image_id"], []).append(a["bbox"])
        dets = [d for d in dets if d["image_id"] not in boxes
                or np.max(mask_utils.iou([d["bbox"]], boxes[d["image_id"]], [0] * len(boxes[d["image_id"]]))) < 0.1]
    return dets


def attribution(gt, dets, kinds=("loc", "cls", "dupe", "bkg", "miss"), seed=0):
    """{kind: (share of the increase of the six dAP that went to its own type, AP50 before, after)}."""
    backend = resolve_backend()

    def tide(d):
        return _tide(evaluate_results(gt, d, ("bbox",), backend, analysis={"num_worst": 0}))
    base = tide(dets)
    out = {}
    for kind in kinds:
        after = tide(_perturb(kind, dets, gt, np.random.default_rng(seed)))
        rise = {k: max(after[f"dAP_{k}"] - base[f"dAP_{k}"], 0.0) for k in MAIN}
        out[kind] = (rise[kind] / max(sum(rise.values()), 1e-12), base["AP50"], after["AP50"])
    return out


def test_perturbations_land_in_their_own_bucket(shapes_val):
    """Acceptance 1: each controlled perturbation of a detector's predictions, alone, is attributed
    mostly (>= 60% of the rise of the dAPs) to its own error type."""
    gt, _ = shapes_val
    dets = _detector(gt, np.random.default_rng(0))
    for kind, (share, before, after) in attribution(gt, dets).items():
        assert after < before - 0.03, kind  # the perturbation costs AP
        assert share >= 0.6, (kind, share)


def test_evaluator_sections_images_and_switch(shapes_val, tmp_path):
    """The loop's evaluator: sections in report(), the worst images drawn in save_artifacts and
    referenced by path, TensorBoard extras; set_analysis(False) leaves the 12 numbers only."""
    import torch
    from torch.utils.tensorboard import SummaryWriter
    gt, images = shapes_val
    dets = _detector(gt, np.random.default_rng(1))
    ev = CocoEvaluator(load_gt(gt, "pycocotools"), {1: 1, 2: 2, 3: 3}, backend="pycocotools", img_folder=images,
                       num_worst=3)
    for img in gt["images"]:
        mine = [d for d in dets if d["image_id"] == img["id"]]
        boxes = torch.tensor([d["bbox"] for d in mine]).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        ev.update([{"boxes": boxes, "scores": torch.tensor([d["score"] for d in mine]),
                    "labels": torch.tensor([d["category_id"] for d in mine])}], [{"image_id": img["id"]}])
    report = ev.report()
    titles = [s["title"] for s in report["analysis"]]
    assert titles == ["bbox: error analysis (TIDE)", "bbox: precision-recall", "bbox: confusion matrix",
                      "bbox: calibration (score vs matched at IoU 0.5)", "bbox: worst images"]
    json.dumps(report)  # plain JSON
    saved = ev.save_artifacts(str(tmp_path))
    worst = _sections(report)["bbox: worst images"]["images"]
    assert len(worst) == 3
    for w in worst:
        _assert_drawn(tmp_path / w["path"], w, gt)
    assert sorted(saved) == ["detections", "worst_0", "worst_1", "worst_2"]
    # TensorBoard's val/detections_k: ground truth labelled too, labels on a filled background
    image = ev.draw()[0][1].permute(1, 2, 0).numpy().reshape(-1, 3)
    assert (image == GT_COLOURS["gt"]).all(1).sum() > 300  # the fill of a "GT <class>" label, not a 2-px line
    with SummaryWriter(str(tmp_path / "tb")) as writer:
        ev.log_extras(writer, 1, "val")
    # what TensorBoard reads back from the events: the report's PR curves, confusion matrix and ECE
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "images": 0}).Reload()
    classes = [row[0] for row in _sections(report)["bbox: precision-recall"]["tables"][0]["rows"]]
    curves = {f"val/bbox_PR_IoU50/{c}" for c in ["all"] + classes} | {"val/bbox_PR_IoU75/all"}
    assert curves <= {t.removesuffix("/pr_curves") for t in events.Tags()["tensors"]}, events.Tags()["tensors"]
    assert "val/bbox_confusion" in events.Tags()["images"]
    ece = _sections(report)["bbox: calibration (score vs matched at IoU 0.5)"]["metrics"]["bbox/calibration/ECE"]
    assert [e.value for e in events.Scalars("val/bbox_ECE")] == [pytest.approx(ece)]
    ev.set_analysis(False)
    assert "analysis" not in ev.report() and ev.report()["bbox"] == report["bbox"]


def test_scoring_mode_writes_the_analysis(shapes_val, tmp_path):
    gt, images = shapes_val
    gt_path, res = tmp_path / "gt.json", tmp_path / "dets.json"
    gt_path.write_text(json.dumps(gt))
    res.write_text(json.dumps(_detector(gt, np.random.default_rng(2))))
    with contextlib.redirect_stdout(io.StringIO()):
        evaluate.main(["--coco-gt", str(gt_path), "--coco-results", str(res), "--coco-images", images,
                       "--report-dir", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    worst = _sections(report)["bbox: worst images"]["images"]
    assert worst
    for w in worst:
        _assert_drawn(tmp_path / "r" / w["path"], w, gt)
    assert "TIDE" in (tmp_path / "r" / "report.md").read_text()
    with contextlib.redirect_stdout(io.StringIO()):
        evaluate.main(["--coco-gt", str(gt_path), "--coco-results", str(res), "--no-analysis",
                       "--report-dir", str(tmp_path / "plain")])
    assert "analysis" not in json.loads((tmp_path / "plain" / "report.json").read_text())


def _rgb(colour):
    return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])


def test_worst_image_labels_do_not_overlap_and_name_every_box():
    """Issue 39, item 6: the worst images of the real COCO images (coco6: up to 16 objects in one image) with
    noisy detections: every box is labelled (ground truth with its class), no label overlaps another, each on
    a fill of its box's colour; one colour key for the section, not a caption repeated under every image."""
    path, gt = _coco6()
    report = evaluate_results(gt, _noisy(gt, 4), ("bbox",), "pycocotools",
                              analysis={"num_worst": 6, "score_threshold": 0.2})
    worst = _sections(report)["bbox: worst images"]
    names = {c["name"] for c in gt["categories"]}
    sizes = {i["id"]: (i["height"], i["width"]) for i in gt["images"]}
    assert {x["colour"] for x in worst["legend"]} == {COLOURS[b["kind"]] for w in worst["images"] for b in w["boxes"]}
    assert not any("ground truth" in w["caption"] for w in worst["images"])
    crowded = max(worst["images"], key=lambda w: len(w["boxes"]))
    assert len(crowded["boxes"]) >= 20
    for entry in worst["images"]:
        for b in entry["boxes"]:
            if b["kind"] in ("gt", "miss"):
                assert b["label"].removeprefix("GT ").removeprefix("miss: ") in names, b
        height, width = sizes[entry["image_id"]]
        scale = max(1.0, 480 / max(height, width))
        _, _, labelled, rects, canvas_h, _ = label_layout(entry["boxes"], scale, round(height * scale),
                                                          round(width * scale))
        assert len(rects) == len(labelled) == len(entry["boxes"])
        for i, (x, y, w, h) in enumerate(rects):
            assert 0 <= x and x + w <= round(width * scale) and 0 <= y and y + h <= canvas_h
            for x2, y2, w2, h2 in rects[i + 1:]:
                assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, (entry["image_id"], i)
    # drawn: each label's rectangle is mostly its box's colour (a fill), with text in black or white on it
    info = next(i for i in gt["images"] if i["id"] == crowded["image_id"])
    image = read_image(os.path.join(os.path.dirname(os.path.dirname(path)), "val2017", info["file_name"]))
    drawn = draw_boxes(image, crowded["boxes"]).permute(1, 2, 0).numpy().astype(int)
    boxes, _, labelled, rects, _, _ = label_layout(crowded["boxes"], 1.0, *image.shape[-2:])
    for i, (x, y, w, h) in zip(labelled, rects):
        inside = drawn[y + 1:y + h - 1, x + 1:x + w - 1].reshape(-1, 3)
        fill = (np.abs(inside - _rgb(COLOURS[boxes[i]["kind"]])).sum(1) < 10).mean()
        ink = ((inside.sum(1) < 60) | (inside.sum(1) > 700)).mean()
        assert fill > 0.5 and ink > 0.05, (boxes[i]["label"], fill, ink)


def test_pr_curves_are_small_multiples_with_ap_and_calibration_has_two_panels_with_counts(shapes_val):
    """Issue 39, items 4 and 5: one PR panel per class ("all" first, drawn thicker), AP in each legend, as
    wide as the page; calibration as scored and after temperature side by side, each over its counts."""
    gt, _ = shapes_val
    report = evaluate_results(gt, _detector(gt, np.random.default_rng(3)), ("bbox",), "pycocotools",
                              analysis={"num_worst": 0})
    s = _sections(report)
    table = s["bbox: precision-recall"]["tables"][0]
    classes = [row[0] for row in table["rows"]]
    pr = s["bbox: precision-recall"]["plots"][0]
    fig = plots.figure(pr)
    assert [a.get_title() for a in fig.axes] == ["all classes (mean)"] + [f"{c} ({row[1]} objects)"
                                                                         for c, row in zip(classes, table["rows"])]
    expected = [(report["bbox"]["AP50"], report["bbox"]["AP75"])] + [(row[2], row[3]) for row in table["rows"]]
    for ax, (ap50, ap75) in zip(fig.axes, expected):
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert [t.split(": AP ")[0] for t in texts] == ["IoU 0.5", "IoU 0.75"]
        assert [float(t.split(": AP ")[1]) for t in texts] == pytest.approx([100 * ap50, 100 * ap75], abs=0.06)
        assert min(t.get_fontsize() for t in ax.get_legend().get_texts()) >= 8
    assert min(x.get_linewidth() for x in fig.axes[0].get_lines()) > max(x.get_linewidth() for x in fig.axes[1].get_lines())
    assert Image.open(io.BytesIO(plots.png(pr))).size[0] >= 1000
    cal = s["bbox: calibration (score vs matched at IoU 0.5)"]["plots"][0]
    fig = plots.figure(cal)
    assert len(fig.axes) == 4  # as scored | after temperature, each: reliability over counts
    for counts_ax, bins in ((fig.axes[1], cal["bins"]), (fig.axes[3], cal["after"]["bins"])):
        assert sorted(int(t.get_text()) for t in counts_ax.texts) == sorted(b["count"] for b in bins if b["count"])
