"""The synthetic shapes set is a real COCO data set on disk (acceptance 6), deterministic, cached."""
import json
import os

import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO

from evaluators.panoptic_ids import rgb_to_id
from datasets.shapes import ensure_shapes
from engine.registry import DATASETS

SMALL = dict(seed=3, num_train=12, num_val=6, image_size=96)


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    return ensure_shapes(str(tmp_path_factory.mktemp("shapes") / "s"), **SMALL)


def test_opens_with_plain_pycocotools(shapes_root):
    for split, n in (("train", 12), ("val", 6)):
        coco = COCO(os.path.join(shapes_root, "annotations", f"instances_{split}2017.json"))
        assert len(coco.getImgIds()) == n and len(coco.getCatIds()) == 3 and len(coco.anns) >= n
        for ann in coco.anns.values():
            mask = coco.annToMask(ann)  # polygons decode
            assert mask.sum() > 0 and abs(int(mask.sum()) - ann["area"]) <= 0.15 * ann["area"] + 20
            x, y, w, h = ann["bbox"]
            info = coco.imgs[ann["image_id"]]
            assert 0 <= x and 0 <= y and x + w <= info["width"] and y + h <= info["height"]
        for info in coco.imgs.values():
            with Image.open(os.path.join(shapes_root, f"{split}2017", info["file_name"])) as im:
                assert im.format == "JPEG" and im.size == (info["width"], info["height"])


def test_panoptic_png_ids_match_segments_info(shapes_root):
    with open(os.path.join(shapes_root, "annotations", "panoptic_val2017.json")) as f:
        pan = json.load(f)
    cats = {c["id"]: c for c in pan["categories"]}
    assert {c["isthing"] for c in cats.values()} == {0, 1}
    instances = COCO(os.path.join(shapes_root, "annotations", "instances_val2017.json"))
    for ann in pan["annotations"]:
        png = np.array(Image.open(os.path.join(shapes_root, "annotations", "panoptic_val2017", ann["file_name"])))
        ids, counts = np.unique(rgb_to_id(png), return_counts=True)
        assert dict(zip(ids.tolist(), counts.tolist())) == {s["id"]: s["area"] for s in ann["segments_info"]}
        stuff = [s for s in ann["segments_info"] if not cats[s["category_id"]]["isthing"]]
        things = [s for s in ann["segments_info"] if cats[s["category_id"]]["isthing"]]
        assert len(stuff) >= 1 and 0 not in ids  # every pixel belongs to a segment
        inst = instances.imgToAnns[ann["image_id"]]
        assert sorted(s["area"] for s in things) == sorted(a["area"] for a in inst)


def test_deterministic_and_generated_once_with_a_line_that_says_what_is_written_where(shapes_root, tmp_path, caplog):
    caplog.set_level("INFO", "datasets.shapes")
    other = ensure_shapes(str(tmp_path / "again"), **SMALL)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("shapes: generating the data set once: ") and said[0].endswith(other)
    assert said[1].startswith("shapes: written in ") and os.path.join(other, "annotations") in said[1]
    for rel in ("annotations/instances_train2017.json", "annotations/panoptic_val2017.json",
                "train2017/000000000001.jpg", "annotations/panoptic_train2017/000000000005.png"):
        with open(os.path.join(shapes_root, rel), "rb") as a, open(os.path.join(other, rel), "rb") as b:
            assert a.read() == b.read(), rel
    marker = os.path.join(other, "shapes.json")
    mtime = os.path.getmtime(marker)
    caplog.clear()
    assert ensure_shapes(other, **SMALL) == other and os.path.getmtime(marker) == mtime  # reused, silently
    assert not caplog.records
    with pytest.raises(ValueError, match="other settings"):
        ensure_shapes(other, **{**SMALL, "seed": 4})
    different = ensure_shapes(str(tmp_path / "seed4"), **{**SMALL, "seed": 4})
    with open(os.path.join(different, "annotations/instances_train2017.json")) as f1, \
            open(os.path.join(other, "annotations/instances_train2017.json")) as f2:
        assert json.load(f1)["annotations"] != json.load(f2)["annotations"]


def test_loaded_through_the_coco_loader(shapes_root):
    data = DATASETS.build("shapes", root=shapes_root, **SMALL)
    assert data.classes == ["__background__", "circle", "square", "triangle"]
    assert data.model_defaults == {"num_classes": 4} and len(data.val) == 6
    image, target = data.val[0]
    coco = data.val.coco
    anns = coco.imgToAnns[target["image_id"]]
    assert target["labels"].tolist() == [a["category_id"] for a in anns]
    assert image.shape[0] == 3 and len(target["boxes"]) == len(anns)
