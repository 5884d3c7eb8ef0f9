"""Fault table of issue 24, the newer loaders: bad panoptic PNGs and JSON, semantic masks with values
outside the classes, annotation files with nothing to learn from. Each case builds the bad input from
real files (a small shapes data set written as COCO, a small VOC layout) and checks the one error names
the file and the record; problems the annotation files show are caught when the data set is built."""
import os
import re

import numpy as np
import pytest
from PIL import Image

from datasets.base import Skipped
from engine.errors import BadSample, DataError
from datasets.shapes import ensure_shapes
from engine.build import build_data
from engine.config import config_from_data
from helpers import cli, edit_json, panoptic_json, png_of, voc

MODELS = {"coco_panoptic": "panoptic_fpn_mobilenet_v3_large", "shapes_semantic": "lraspp_mobilenet_v3_large",
          "coco_segmentation": "lraspp_mobilenet_v3_large", "voc_segmentation": "lraspp_mobilenet_v3_large",
          "coco_detection": "ssdlite320_mobilenet_v3_large"}

# ---------------------------------------------------------------- helpers


@pytest.fixture
def shapes(tmp_path):
    """A small shapes data set: COCO instances and COCO panoptic files (4 train, 2 val images)."""
    return ensure_shapes(str(tmp_path / "shapes"), seed=0, num_train=4, num_val=2, image_size=48)


def edit_segments(root, image_id, change, split="train"):
    def apply(data):
        ann = next(a for a in data["annotations"] if a["image_id"] == image_id)
        change(ann["segments_info"])
    edit_json(panoptic_json(root, split), apply)


def truncate(path, keep=0.5):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


def config(name, **data):
    return {"seed": 0, "device": "cpu", "model": {"name": MODELS[name]},
            "data": {"name": name, "batch_size": 2, "workers": 0, **data},
            "optim": {"name": "adamw", "lr": 0.001}, "sched": {"name": "constant"},
            "train": {"epochs": 1, "log_every": 100}}


def build(name, tmp_path, **data):
    """The data set of a config, as train.py builds it before the model."""
    return build_data(config_from_data(config(name, **data)), str(tmp_path / "run"))


def index_of(dataset, image_id):
    return dataset.image_ids.index(image_id)


# ---------------------------------------------------------------- panoptic PNGs and JSON


def test_truncated_panoptic_png_is_a_bad_sample_naming_it_before_training_or_when_read(shapes, tmp_path):
    # before: `OSError: image file is truncated` from PIL in the middle of the epoch, no file named
    png, ann = png_of(shapes)
    truncate(png)
    with pytest.raises(BadSample) as e:  # a small split: its PNGs are checked when the data set is built
        build("coco_panoptic", tmp_path, root=shapes)
    message = str(e.value)
    assert png in message and "cannot read panoptic PNG" in message and "skip_bad_samples" in message
    assert "\n" not in message
    # a split over data.png_check_limit: the sample, when read
    data = build("coco_panoptic", tmp_path, root=shapes, png_check_limit=0)
    with pytest.raises(BadSample, match="cannot read panoptic PNG") as e:
        data.train[index_of(data.train, ann["image_id"])]
    assert e.value.where == png
    # data.skip_bad_samples: built, the sample is a Skipped marker that the batch leaves out
    data = build("coco_panoptic", tmp_path, root=shapes, skip_bad_samples=True)
    items = [data.train[i] for i in range(len(data.train))]
    skipped = [x for x in items if isinstance(x, Skipped)]
    assert [s.where for s in skipped] == [png]
    batch = data.collate_fn(items)
    assert len(batch[0]) == len(items) - 1 and [s.where for s in batch.skipped] == [png]


@pytest.mark.slow
def test_truncated_panoptic_png_is_one_error_line_from_train_py(shapes, tmp_path):
    png, _ = png_of(shapes)
    truncate(png)
    code, output, errors = cli(tmp_path, "train.py", "--output-dir", str(tmp_path / "run"),
                               cfg=config("coco_panoptic", root=shapes))
    assert code == 1 and len(errors) == 1, output
    assert png in errors[0] and "cannot read panoptic PNG" in errors[0]
    assert "Traceback" not in output and "training " not in output  # stopped before training


@pytest.mark.parametrize("builder", ["coco_panoptic", "shapes_semantic"])
def test_panoptic_json_that_is_not_json_names_the_file_line_and_column(shapes, tmp_path, builder):
    # before: a raw json.decoder.JSONDecodeError traceback, no file named
    path = panoptic_json(shapes)
    with open(path, "w") as f:
        f.write('{"images": [],\n  "annotations": [oops]}')
    with pytest.raises(DataError) as e:
        build(builder, tmp_path, root=shapes, **({"num_train": 4, "num_val": 2, "image_size": 48}
                                                  if builder == "shapes_semantic" else {}))
    assert f"{path}: not valid JSON" in str(e.value) and "line 2 column 19" in str(e.value)


@pytest.mark.slow
def test_png_id_missing_from_the_json_is_caught_before_training(shapes, tmp_path):
    # before: a ValueError traceback while reading the first batch of the epoch
    png, ann = png_of(shapes)
    dropped = ann["segments_info"][-1]["id"]
    edit_segments(shapes, ann["image_id"], lambda segments: segments.pop())
    with pytest.raises(BadSample) as e:
        build("coco_panoptic", tmp_path, root=shapes)
    message = str(e.value)
    assert png in message and f"image {ann['image_id']} has segment id(s) [{dropped}] in the PNG" in message
    assert panoptic_json(shapes) in message
    code, output, errors = cli(tmp_path, "train.py", "--output-dir", str(tmp_path / "run"),
                               cfg=config("coco_panoptic", root=shapes))
    assert code == 1 and len(errors) == 1 and png in errors[0] and f"[{dropped}]" in errors[0], output
    assert "training " not in output and not os.path.exists(tmp_path / "run" / "last.pt")


def test_unknown_category_id_is_caught_before_training(shapes, tmp_path):
    # before: a ValueError traceback while reading the first batch of the epoch
    _, ann = png_of(shapes)
    segment = ann["segments_info"][0]["id"]
    edit_segments(shapes, ann["image_id"], lambda segments: segments[0].update(category_id=999))
    for builder, extra in (("coco_panoptic", {}), ("shapes_semantic", {"num_train": 4, "num_val": 2,
                                                                        "image_size": 48})):
        with pytest.raises(DataError) as e:
            build(builder, tmp_path, root=shapes, **extra)
        assert (f"{panoptic_json(shapes)}: image {ann['image_id']}, segment {segment}: unknown category_id 999"
                in str(e.value))


def test_json_segment_missing_from_its_png_is_an_error(shapes, tmp_path):
    # before: the segment was silently dropped from the targets; the run trained and exited 0
    png, ann = png_of(shapes)
    edit_segments(shapes, ann["image_id"], lambda segments: segments.append(
        {"id": 4242, "category_id": 1, "iscrowd": 0, "area": 10, "bbox": [0, 0, 2, 5]}))
    with pytest.raises(BadSample) as e:  # a small split: before training
        build("coco_panoptic", tmp_path, root=shapes)
    assert png in str(e.value) and "segment id(s) [4242] of" in str(e.value) and "are not in the PNG" in str(e.value)
    for builder, extra in (("coco_panoptic", {}), ("shapes_semantic", {"num_train": 4, "num_val": 2,
                                                                        "image_size": 48})):
        data = build(builder, tmp_path, root=shapes, png_check_limit=0, **extra)  # a large split: when read
        index = next(i for i, a in enumerate(data.train.annotations) if a["image_id"] == ann["image_id"])
        with pytest.raises(BadSample, match=r"segment id\(s\) \[4242\]") as e:
            data.train[index]
        assert e.value.where == png
        data = build(builder, tmp_path, root=shapes, skip_bad_samples=True, **extra)
        assert data.train[index] == Skipped(png, e.value.reason.split("; data.skip")[0])


# ---------------------------------------------------------------- semantic masks


def test_mask_value_outside_the_classes_is_a_bad_sample_naming_file_and_values(tmp_path):
    # before: `IndexError: Target 50 is out of bounds` from the loss, no file named
    root = tmp_path / "voc"
    folder = voc(root, bad_values={"a": 50})
    mask = str(folder / "SegmentationClass" / "a.png")
    data = build("voc_segmentation", tmp_path, root=str(root), base_size=32, crop_size=32)
    with pytest.raises(BadSample) as e:
        data.train[0]
    assert e.value.where == mask and "mask values [50] are outside the classes 0..20 (255 = ignore)" in str(e.value)
    data.train[1], data.val[0]  # VOC's 255 borders are no problem
    data = build("voc_segmentation", tmp_path, root=str(root), base_size=32, crop_size=32, skip_bad_samples=True)
    assert isinstance(data.train[0], Skipped) and data.train[0].where == mask
    batch = data.collate_fn([data.train[i] for i in range(3)])
    assert batch[0].shape[0] == 2 and [s.where for s in batch.skipped] == [mask]


@pytest.mark.slow
def test_mask_value_outside_the_classes_in_train_py_and_evaluate_py(tmp_path):
    root = tmp_path / "voc"
    folder = voc(root, bad_values={"a": 50})
    cfg = config("voc_segmentation", root=str(root), base_size=32, crop_size=32)
    code, output, errors = cli(tmp_path, "train.py", "--output-dir", str(tmp_path / "run1"), cfg=cfg)
    assert code == 1 and len(errors) == 1, output
    assert str(folder / "SegmentationClass" / "a.png") in errors[0] and "mask values [50]" in errors[0]
    assert "Traceback" not in output
    # skipped, logged and counted with data.skip_bad_samples
    code, output, errors = cli(tmp_path, "train.py", "--output-dir", str(tmp_path / "run2"), "--set",
                               "data.skip_bad_samples=true", cfg=cfg)
    assert code == 0 and not errors, output
    assert "1 unreadable training samples skipped" in output and "a.png (mask values [50]" in output
    # evaluation (before: a DataError traceback from the evaluator, no file named): one line naming the file
    labels = np.array(Image.open(folder / "SegmentationClass" / "v.png"))
    labels[0, 0] = 60
    png = Image.fromarray(labels, mode="P")
    png.putpalette([0, 0, 0] * 256)
    png.save(folder / "SegmentationClass" / "v.png")
    code, output, errors = cli(tmp_path, "evaluate.py", "--checkpoint", str(tmp_path / "run2" / "last.pt"))
    assert code == 1 and len(errors) == 1, output
    assert str(folder / "SegmentationClass" / "v.png") in errors[0] and "mask values [60]" in errors[0]
    assert "Traceback" not in output


# ---------------------------------------------------------------- empty splits


@pytest.mark.slow
def test_empty_coco_annotations_list_names_the_file(shapes, tmp_path):
    # before: `ValueError: num_samples should be a positive integer value, but got num_samples=0`
    instances = os.path.join(shapes, "annotations", "instances_train2017.json")
    edit_json(instances, lambda data: data.update(annotations=[]))
    with pytest.raises(DataError, match=f"^{re.escape(instances)}: holds no usable annotation for training"):
        build("coco_detection", tmp_path, root=shapes)
    code, output, errors = cli(tmp_path, "train.py", "--output-dir", str(tmp_path / "run"),
                               cfg=config("coco_detection", root=shapes))
    assert code == 1 and errors == [f"error: {instances}: holds no usable annotation for training "
                                    f"(0 annotations, 4 images): an empty split"], output
    # the same for the semantic-segmentation loader, and for the evaluation split
    with pytest.raises(DataError, match=f"^{re.escape(instances)}: holds no usable annotation"):
        build("coco_segmentation", tmp_path, root=shapes, categories=[1, 2, 3], base_size=48, crop_size=48)
    val = os.path.join(shapes, "annotations", "instances_val2017.json")
    edit_json(val, lambda data: data.update(annotations=[]))
    with pytest.raises(DataError, match=f"^{re.escape(val)}: holds no usable annotation for evaluation"):
        build("coco_detection", tmp_path, root=shapes)


def test_empty_panoptic_and_voc_splits_name_the_file(shapes, tmp_path):
    path = panoptic_json(shapes)
    edit_json(path, lambda data: data.update(annotations=[]))
    for builder, extra in (("coco_panoptic", {}), ("shapes_semantic", {"num_train": 4, "num_val": 2,
                                                                        "image_size": 48})):
        with pytest.raises(DataError, match=f"^{re.escape(path)}: holds no usable annotation"):
            build(builder, tmp_path, root=shapes, **extra)
    root = tmp_path / "voc"
    split_list = voc(root, split_lists=(("train", ""), ("val", "v"))) / "ImageSets" / "Segmentation" / "train.txt"
    with pytest.raises(DataError, match=f"^{re.escape(str(split_list))}: holds no usable annotation"):
        build("voc_segmentation", tmp_path, root=str(root))


def test_crowd_only_training_annotations_name_the_file(shapes, tmp_path):
    instances = os.path.join(shapes, "annotations", "instances_train2017.json")
    edit_json(instances, lambda data: [a.update(iscrowd=1) for a in data["annotations"]])
    with pytest.raises(DataError, match=f"^{re.escape(instances)}: holds no usable annotation for training: none of its .* "
                                        f"annotations is a non-crowd box over 1 px, and data.drop_empty_train"):
        build("coco_detection", tmp_path, root=shapes)
