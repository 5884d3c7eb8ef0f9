"""COCO panoptic loader on real COCO panoptic files (coco_panoptic2) and on the shapes set; the
PanopticEvaluator's PQ, saved predictions and drawings."""
import json
import os
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import shared_data
from datasets.coco_panoptic import CocoPanopticDataset, eval_preset, instances_from_panoptic
from evaluators.panoptic import PanopticEvaluator, read_ids, score_panoptic_files
from engine.registry import DATASETS


def coco_panoptic2():
    root = shared_data("coco_panoptic2")
    return root, CocoPanopticDataset(os.path.join(root, "val2017"),
                                     os.path.join(root, "annotations", "panoptic_val2017.json"),
                                     os.path.join(root, "annotations", "panoptic_val2017"), eval_preset())


def test_loader_targets_agree_with_the_json():
    root, ds = coco_panoptic2()
    cats = ds.categories
    assert (cats.num_things, cats.num_stuff) == (80, 53)
    assert len(ds) == 2
    crowd_total = 0
    for index in range(len(ds)):
        image, target = ds[index]
        ann = ds.annotations[index]
        assert image.shape[-2:] == target["sem_seg"].shape and image.dtype == torch.float32
        segments = ann["segments_info"]
        things = [s for s in segments if ds.isthing[s["category_id"]] and not s["iscrowd"]]
        crowd = [s for s in segments if s["iscrowd"]]
        crowd_total += len(crowd)
        # thing targets: the non-crowd thing segments, masks of their JSON areas, boxes of their JSON bboxes
        assert target["labels"].tolist() == [cats.cat_to_label[s["category_id"]] for s in things]
        assert target["masks"].sum((1, 2)).tolist() == [s["area"] for s in things]
        xywh = torch.tensor([s["bbox"] for s in things], dtype=torch.float)
        assert torch.equal(target["boxes"], torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1))
        # semantic map: each class has the pixels of its non-crowd segments; crowd and void are 255
        sem = target["sem_seg"]
        expected = Counter()
        for s in segments:
            if not s["iscrowd"]:
                expected[cats.cat_to_label[s["category_id"]] - 1] += s["area"]
        values, counts = torch.unique(sem, return_counts=True)
        got = dict(zip(values.tolist(), counts.tolist()))
        assert {k: v for k, v in got.items() if k != 255} == dict(expected)
        ids = read_ids(os.path.join(ds.png_folder, ann["file_name"]))
        void_or_crowd = (ids == 0) | np.isin(ids, [s["id"] for s in crowd])
        assert got[255] == void_or_crowd.sum() and (sem.numpy()[void_or_crowd] == 255).all()
    assert crowd_total == 3


def test_instances_converted_from_panoptic_match_cocos_instances():
    root, ds = coco_panoptic2()
    converted = instances_from_panoptic(ds)
    with open(os.path.join(root, "annotations", "instances_val2017.json")) as f:
        reference = json.load(f)
    things = {c["id"] for c in ds.data["categories"] if c["isthing"]}  # the instances file has stuff too

    def key(a):
        return a["image_id"], a["category_id"], a["area"], a["iscrowd"], tuple(round(v) for v in a["bbox"])
    assert sorted(map(key, converted["annotations"])) == sorted(
        key(a) for a in reference["annotations"] if a["category_id"] in things)
    assert {c["id"] for c in converted["categories"]} == {c["id"] for c in ds.data["categories"] if c["isthing"]}


def test_unknown_png_id_is_an_error_naming_the_image(tmp_path):
    root, ds = coco_panoptic2()
    ds.annotations[0] = dict(ds.annotations[0], segments_info=ds.annotations[0]["segments_info"][1:])
    with pytest.raises(ValueError, match=r"image 142238 has segment id\(s\) \[3937500\] in the PNG"):
        ds[0]


def perfect_predictions(ds):
    """Ground truth as the model would output it: panoptic ids + segments with contiguous labels."""
    out = []
    for index, ann in enumerate(ds.annotations):
        ids = read_ids(os.path.join(ds.png_folder, ann["file_name"]))
        crowd = [s["id"] for s in ann["segments_info"] if s["iscrowd"]]
        ids[np.isin(ids, crowd)] = 0
        segments = [{"id": s["id"], "category_id": ds.categories.cat_to_label[s["category_id"]],
                     "isthing": ds.isthing[s["category_id"]], "score": 1.0, "area": s["area"]}
                    for s in ann["segments_info"] if not s["iscrowd"]]
        out.append(({"panoptic": torch.from_numpy(ids.astype(np.int32)), "segments_info": segments},
                    {"image_id": ann["image_id"]}))
    return out


def test_evaluator_scores_ground_truth_as_perfect_and_saves_coco_panoptic_files(tmp_path):
    root, ds = coco_panoptic2()
    evaluator = PanopticEvaluator(ds.data, ds.png_folder, ds.categories.label_to_cat, img_folder=ds.img_folder)
    for pred, target in perfect_predictions(ds):
        evaluator.update([pred], [target])
    metrics = evaluator.compute()
    assert metrics["PQ"] == metrics["SQ"] == metrics["RQ"] == metrics["PQ_th"] == metrics["PQ_st"] == 1.0
    files = evaluator.save_artifacts(str(tmp_path))
    saved = json.load(open(files["panoptic_json"]))
    assert [a["image_id"] for a in saved["annotations"]] == ds.image_ids
    again = score_panoptic_files(os.path.join(root, "annotations", "panoptic_val2017.json"), ds.png_folder,
                                 files["panoptic_json"], files["panoptic_folder"])
    assert again["metrics"] == metrics
    drawn = evaluator.draw()
    assert len(drawn) == 2 and drawn[0][1].shape == (3, 427, 3 * 640) and drawn[0][1].dtype == torch.uint8


def test_shapes_panoptic_through_the_coco_panoptic_loader(tmp_path):
    data = DATASETS.build("shapes_panoptic", root=str(tmp_path / "shapes"), num_train=4, num_val=3, image_size=64)
    assert data.model_defaults == {"num_classes": 4, "num_stuff_classes": 3}
    assert data.classes == ["__background__", "circle", "square", "triangle", "sky", "ground", "water"]
    with open(tmp_path / "shapes" / "annotations" / "instances_val2017.json") as f:
        instances = json.load(f)
    for index in range(len(data.val)):
        image, target = data.val[index]
        assert (target["sem_seg"] != 255).all()  # shapes has no void
        areas = sorted(a["area"] for a in instances["annotations"] if a["image_id"] == target["image_id"])
        assert sorted(target["masks"].sum((1, 2)).tolist()) == areas
        assert set(target["labels"].tolist()) <= {1, 2, 3}
        assert set(torch.unique(target["sem_seg"]).tolist()) - {0, 1, 2} <= {3, 4, 5}
    image, target = data.train[0]
    assert target["sem_seg"].shape == image.shape[-2:] and len(target["boxes"]) == len(target["masks"])
    evaluator = data.evaluator()
    assert set(evaluator.evaluators) == {"", "panoptic"}
