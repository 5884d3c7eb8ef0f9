"""COCO loader on real coco6 (acceptance 1), the aspect-ratio sampler, the missing-COCO error."""
import json
import os

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from conftest import ROOT, shared_data
from evaluators.coco import CocoEvaluator
from engine.registry import DATASETS


@pytest.fixture(scope="module")
def coco6():
    root = shared_data("coco6")
    data = DATASETS.build("coco_detection", root=root, train_split="val", val_split="val")
    with open(os.path.join(root, "annotations", "instances_val2017.json")) as f:
        return root, data, json.load(f)


def test_loader_matches_json(coco6):
    _, data, js = coco6
    cat_ids = sorted(c["id"] for c in js["categories"])
    assert data.model_defaults["num_classes"] == len(cat_ids) + 1 == 81
    assert len(data.val) == len(js["images"]) == 6          # the image without annotations is kept
    assert len(data.train) == 5                              # ... and dropped for training
    assert 89 in data.val.image_ids and 89 not in data.train.image_ids
    seen = 0
    for i in range(len(data.val)):
        image, target = data.val[i]
        info = next(img for img in js["images"] if img["id"] == target["image_id"])
        assert tuple(image.shape) == (3, info["height"], info["width"]) and image.dtype == torch.float32
        anns = [a for a in js["annotations"] if a["image_id"] == info["id"] and not a["iscrowd"]]
        expected = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)]).reshape(-1, 4)
        assert torch.allclose(target["boxes"].float(), expected, atol=1e-3)
        labels = [cat_ids.index(a["category_id"]) + 1 for a in anns]
        assert target["labels"].tolist() == labels
        assert [data.val.label_to_cat[lab] for lab in labels] == [a["category_id"] for a in anns]
        seen += len(anns)
    assert seen == 35  # 36 instances, the crowd one is kept out of the targets


def test_ground_truth_as_predictions_gives_ap_1(coco6):
    _, data, _ = coco6
    evaluator = data.evaluator()
    for i in range(len(data.val)):
        _, target = data.val[i]
        n = len(target["labels"])
        evaluator.update([{"boxes": target["boxes"].float(), "labels": target["labels"], "scores": torch.ones(n)}],
                         [target])
    report = evaluator.report()
    assert report["num_images"] == 6 and report["num_gt_instances"] == 35 and report["num_detections"] == 35
    for key in ("AP", "AP50", "AP75", "AR100"):
        assert report["bbox"][key] == pytest.approx(1.0, abs=1e-9), key
    assert report["metrics"]["bbox/AP"] == pytest.approx(1.0, abs=1e-9)
    assert all(r["AP"] in (None, pytest.approx(1.0)) for r in report["per_category"]["bbox"])


def test_train_transforms_keep_boxes_valid(coco6):
    _, data, _ = coco6
    torch.manual_seed(0)
    for i in range(len(data.train)):
        image, target = data.train[i]
        boxes = target["boxes"]
        assert boxes.shape[0] == target["labels"].shape[0]
        h, w = image.shape[-2:]
        if len(boxes):
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
            assert boxes.min() >= 0 and (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
        assert target["labels"].min() >= 1 if len(boxes) else True


def test_grouped_batch_sampler(coco6):
    _, data, _ = coco6
    ratios = data.train.aspect_ratios()
    sampler = data.train_batch_sampler(data.train, RandomSampler(data.train), 2)
    assert len(sampler) == len(data.train) // 2
    batches = list(sampler)
    assert len(batches) == len(sampler)
    from datasets.coco import aspect_ratio_groups
    # 7 bins 2^(-1, -2/3, ..., 1) of width/height, as torchvision's _quantize (bisect_right):
    # 0.4 < 0.5; 0.63 <= 0.7 < 0.79; 1.0 on the edge 1 goes right; 1.26 <= 1.5 < 1.59; 3 > 2
    assert aspect_ratio_groups([0.4, 0.7, 1.0, 1.5, 3.0], 3) == [0, 2, 4, 5, 7]
    groups = aspect_ratio_groups(ratios, 3)
    for batch in batches:
        assert len(batch) == 2 and len({groups[i] for i in batch}) == 1
    # usable under DDP: wraps a DistributedSampler and keeps it reachable for set_epoch
    dsampler = DistributedSampler(data.train, num_replicas=2, rank=0, shuffle=True, seed=0)
    sampler = data.train_batch_sampler(data.train, dsampler, 1)
    assert sampler.sampler is dsampler and len(list(sampler)) == len(dsampler)


def test_missing_coco_names_layout_and_shapes(tmp_path):
    import train
    with pytest.raises(SystemExit) as e:
        train.main(["--config", os.path.join(ROOT, "configs", "ssd300.yaml"), "--output-dir", str(tmp_path),
                    "--set", f"data.root={tmp_path / 'coco'}"])
    msg = str(e.value)
    assert "annotations/instances_train2017.json" in msg and "val2017" in msg
    assert "shapes" in msg and "data.root" in msg


def test_evaluator_rejects_unknown_labels(coco6):
    _, data, _ = coco6
    ev = data.evaluator()
    assert isinstance(ev, CocoEvaluator)
    with pytest.raises(ValueError, match="num_classes"):
        ev.update([{"boxes": torch.tensor([[0., 0., 5., 5.]]), "labels": torch.tensor([85]),
                    "scores": torch.tensor([0.9])}], [{"image_id": 89}])


def test_cached_images_give_the_same_samples_and_are_read_once(tmp_path):
    """cache_images: the second epoch reads no file (the images are deleted after the first) and every
    augmented sample equals the uncached loader's with the same seed."""
    import shutil
    from datasets.coco import CocoDetectionDataset, train_preset
    root = shared_data("coco6")
    images = tmp_path / "val2017"
    shutil.copytree(os.path.join(root, "val2017"), images)
    ann = os.path.join(root, "annotations", "instances_val2017.json")
    plain = CocoDetectionDataset(str(images), ann, train_preset("ssdlite"))
    cached = CocoDetectionDataset(str(images), ann, train_preset("ssdlite"), cache_images=True)
    for i in range(len(cached)):
        cached[i]
    shutil.rmtree(images)
    with pytest.raises(Exception, match="cannot read image"):
        plain[0]
    shutil.copytree(os.path.join(root, "val2017"), images)
    for i in range(len(cached)):
        for seed in range(2):
            torch.manual_seed(seed)
            a_image, a = plain[i]
            torch.manual_seed(seed)
            b_image, b = cached[i]
            assert torch.equal(a_image, b_image)
            assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    shutil.rmtree(images)
    assert len(cached[0][0].shape) == 3  # still served from memory
