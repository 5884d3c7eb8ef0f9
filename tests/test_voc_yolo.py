"""VOC and YOLO detection labels (issue 35, item 4, item 6's label errors, acceptance 2), and
coco_detection's `categories` subset.

Acceptance 2: coco6 written by this file's own small writers as Pascal VOC XML and as YOLO text gives
the COCO JSON's metrics for the same detections (to 1e-9) and its training targets (to 1e-4 px).
COCO's size ranges (APs/m/l, ARs/m/l) read each annotation's `area`, the mask's in a COCO file; VOC
and YOLO have boxes only, so their area is the box's: the 12 numbers are compared with the COCO JSON
whose areas are its boxes', and the six numbers without a size range with the COCO JSON as it is.
YOLO has no crowd boxes (Ultralytics' converter leaves them out): its reference leaves coco6's one out.
"""
import json
import logging
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import shared_data
from datasets.base import collecting_problems
from datasets.detection_labels import parse_xml
from datasets.doctor.clean import write_clean
from datasets.doctor.run import diagnose
from engine.config import ConfigError, config_from_data
from engine.errors import DataError, UserError
from engine.registry import DATASETS

COCO_ANN = ("annotations", "instances_val2017.json")


# ---------------------------------------------------------------- writers (independent of the loaders)

def voc_xml(width, height, objects):
    """A Pascal VOC annotation; objects: (name, (x, y, w, h) in 0-based pixels, difficult), written
    one-based as the devkit does (xmin = x + 1, xmax = x + w)."""
    parts = [f"<annotation>\n  <size><width>{width}</width><height>{height}</height><depth>3</depth></size>"]
    for name, (x, y, w, h), difficult in objects:
        parts.append(f"  <object>\n    <name>{name}</name>\n    <difficult>{int(difficult)}</difficult>\n"
                     f"    <bndbox>\n      <xmin>{x + 1!r}</xmin>\n      <ymin>{y + 1!r}</ymin>\n"
                     f"      <xmax>{x + w!r}</xmax>\n      <ymax>{y + h!r}</ymax>\n    </bndbox>\n  </object>")
    return "\n".join(parts) + "\n</annotation>\n"


def write_voc(root, images, splits=("train", "val")):
    """root/{Annotations, JPEGImages, ImageSets/Main}: images {stem: (image path, xml text)}."""
    for sub in ("Annotations", "JPEGImages", os.path.join("ImageSets", "Main")):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for stem, (image, xml) in images.items():
        os.symlink(image, os.path.join(root, "JPEGImages", stem + ".jpg"))
        with open(os.path.join(root, "Annotations", stem + ".xml"), "w") as f:
            f.write(xml)
    for split in splits:
        with open(os.path.join(root, "ImageSets", "Main", f"{split}.txt"), "w") as f:
            f.write("".join(f"{stem}\n" for stem in images))
    return str(root)


def write_yolo(root, images, names, splits=("train", "val")):
    """root/{images,labels}/{split}/ and data.yaml: images {file name: (image path, label text or None)}."""
    for split in splits:
        os.makedirs(os.path.join(root, "images", split))
        os.makedirs(os.path.join(root, "labels", split))
        for name, (image, text) in images.items():
            os.symlink(image, os.path.join(root, "images", split, name))
            if text is not None:
                with open(os.path.join(root, "labels", split, os.path.splitext(name)[0] + ".txt"), "w") as f:
                    f.write(text)
    with open(os.path.join(root, "data.yaml"), "w") as f:
        f.write(names if isinstance(names, str) else "names:\n" + "".join(f"  - {n}\n" for n in names))
    return str(root)


@pytest.fixture(scope="module")
def coco6_formats(tmp_path_factory):
    """coco6 as COCO JSON (as it is, with box areas, and without crowd), as VOC and as YOLO."""
    src = shared_data("coco6")
    base = tmp_path_factory.mktemp("formats")
    with open(os.path.join(src, *COCO_ANN)) as f:
        js = json.load(f)
    cats = sorted(js["categories"], key=lambda c: c["id"])
    names = [c["name"] for c in cats]
    name_of, index_of = {c["id"]: c["name"] for c in cats}, {c["id"]: k for k, c in enumerate(cats)}
    by_image = {img["id"]: [] for img in js["images"]}
    for a in js["annotations"]:
        by_image[a["image_id"]].append(a)
    voc, yolo = {}, {}
    for img in js["images"]:
        path, stem = os.path.join(src, "val2017", img["file_name"]), os.path.splitext(img["file_name"])[0]
        W, H = img["width"], img["height"]
        anns = by_image[img["id"]]
        voc[stem] = path, voc_xml(W, H, [(name_of[a["category_id"]], a["bbox"], a["iscrowd"]) for a in anns])
        lines = [f"{index_of[a['category_id']]} {(x + w / 2) / W:.12f} {(y + h / 2) / H:.12f} {w / W:.12f} "
                 f"{h / H:.12f}\n" for a in anns if not a["iscrowd"] for x, y, w, h in [a["bbox"]]]
        yolo[img["file_name"]] = path, ("".join(lines) if anns else None)  # 000000000089: no label file
    refs = {}
    for key, keep_crowd in (("box_area", True), ("box_area_no_crowd", False)):
        ref = dict(js, annotations=[dict(a, area=a["bbox"][2] * a["bbox"][3]) for a in js["annotations"]
                                    if keep_crowd or not a["iscrowd"]])
        refs[key] = str(base / f"{key}.json")
        with open(refs[key], "w") as f:
            json.dump(ref, f)
    coco = dict(root=src, train_split="val", val_split="val")
    configs = {"coco": ("coco_detection", coco)}
    configs.update({key: ("coco_detection", dict(coco, train_annotations=path, val_annotations=path))
                    for key, path in refs.items()})
    configs["voc"] = ("voc_detection", dict(root=write_voc(base / "voc", voc), classes=names))
    configs["yolo"] = ("yolo_detection", dict(root=write_yolo(base / "yolo", yolo, names)))
    return js, configs


def build(configs, key, **extra):
    name, cfg = configs[key]
    return DATASETS.build(name, **cfg, **extra)


def file_of(dataset, image_id):
    return os.path.basename(dataset.coco.imgs[image_id]["file_name"])


def detections(js):
    """{file name: one image's detections in label space (1..80, the categories in id order)}: each
    box (the crowd one too) moved and scaled a little with a score, plus false positives."""
    rng = np.random.default_rng(0)
    label = {c["id"]: k + 1 for k, c in enumerate(sorted(js["categories"], key=lambda c: c["id"]))}
    out = {}
    for img in js["images"]:
        boxes, labels = [], []
        for a in js["annotations"]:
            if a["image_id"] == img["id"]:
                x, y, w, h = a["bbox"]
                dx, dy, sw, sh = rng.normal(0, 0.08, 4)
                boxes.append([x + dx * w, y + dy * h, x + dx * w + w * (1 + sw), y + dy * h + h * (1 + sh)])
                labels.append(label[a["category_id"]])
        for _ in range(3):
            x, y = rng.uniform(0, img["width"] - 60), rng.uniform(0, img["height"] - 60)
            boxes.append([x, y, x + rng.uniform(10, 60), y + rng.uniform(10, 60)])
            labels.append(int(rng.integers(1, 81)))
        out[img["file_name"]] = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                                 "labels": torch.tensor(labels, dtype=torch.int64),
                                 "scores": torch.tensor(rng.uniform(0.05, 1, len(boxes)), dtype=torch.float32)}
    return out


def metrics(data, dets):
    """The data set's evaluator (as evaluate.py runs it) on the fixed detections of each val image."""
    evaluator = data.evaluator()
    for i in range(len(data.val)):
        _, target = data.val[i]
        evaluator.update([dets[file_of(data.val, target["image_id"])]], [target])
    return evaluator.compute()


# ---------------------------------------------------------------- acceptance 2: parity

def test_voc_and_yolo_give_the_coco_jsons_metrics_for_the_same_detections(coco6_formats):
    js, configs = coco6_formats
    dets = detections(js)
    got = {key: metrics(build(configs, key), dets) for key in configs}
    assert got["voc"].keys() == got["box_area"].keys() and len(got["voc"]) == 12
    for key, ref in (("voc", "box_area"), ("yolo", "box_area_no_crowd")):
        for metric, value in got[ref].items():
            assert got[key][metric] == pytest.approx(value, abs=1e-9), (key, metric)
    for metric in ("bbox/AP", "bbox/AP50", "bbox/AP75", "bbox/AR1", "bbox/AR10", "bbox/AR100"):
        assert got["voc"][metric] == pytest.approx(got["coco"][metric], abs=1e-9), metric  # no size range
    assert 0.2 < got["voc"]["bbox/AP"] < 0.95  # neither trivial nor empty
    assert got["yolo"]["bbox/AP"] != got["voc"]["bbox/AP"]  # the crowd box, ignored in VOC (difficult), is missing


def test_voc_and_yolo_give_the_coco_loaders_training_targets(coco6_formats):
    js, configs = coco6_formats
    for augmentation in ("none", "ssdlite"):
        coco, voc, yolo = (build(configs, k, augmentation=augmentation) for k in ("coco", "voc", "yolo"))
        assert len(coco.train) == len(voc.train) == len(yolo.train) == 5  # 000000000089 has no object
        assert coco.classes == voc.classes == yolo.classes and voc.model_defaults == {"num_classes": 81}
        order = {name: i for i, name in enumerate(file_of(coco.train, t) for t in coco.train.image_ids)}
        for data in (voc, yolo):
            assert sorted(order) == sorted(file_of(data.train, t) for t in data.train.image_ids)
            for i, image_id in enumerate(data.train.image_ids):
                j = order[file_of(data.train, image_id)]
                torch.manual_seed(i)
                image, target = data.train[i]
                torch.manual_seed(i)
                ref_image, ref = coco.train[j]
                assert torch.equal(target["labels"], ref["labels"])
                assert target["boxes"].shape == ref["boxes"].shape and len(ref["boxes"]) > 0
                assert torch.allclose(target["boxes"], ref["boxes"], atol=1e-4, rtol=0)
                assert torch.equal(image, ref_image)
    crowd = next(a for a in js["annotations"] if a["iscrowd"])
    voc = build(configs, "voc")
    difficult = [a for a in voc.val.coco.dataset["annotations"] if a["iscrowd"]]
    assert [a["bbox"] for a in difficult] == [pytest.approx(crowd["bbox"], abs=1e-9)]  # in the ground truth, ignored


# ---------------------------------------------------------------- small label sets with faults

def picture(folder, name, size=(40, 30)):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    Image.fromarray(np.random.default_rng(len(name)).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def small_voc(tmp_path, xml_b=None):
    """Three 40x30 images with a cat and a dog box each; xml_b: image b's annotation text instead."""
    imgs = str(tmp_path / "pictures")
    images = {s: (picture(imgs, f"{s}.jpg"), voc_xml(40, 30, [("cat", [2, 3, 10, 8], 0), ("dog", [20, 10, 12, 9], 0)]))
              for s in ("a", "b", "c")}
    if xml_b is not None:
        images["b"] = images["b"][0], xml_b
    return write_voc(tmp_path / "voc", images)


def small_yolo(tmp_path, label_b="0 0.5 0.5 0.25 0.5\n", names=("cat", "dog")):
    imgs = str(tmp_path / "pictures")
    images = {f"{s}.jpg": (picture(imgs, f"{s}.jpg"), "0 0.25 0.25 0.2 0.2\n1 0.6 0.6 0.3 0.3\n") for s in "abc"}
    images["b.jpg"] = images["b.jpg"][0], label_b
    return write_yolo(tmp_path / "yolo", images, names)


VOC = dict(classes=["cat", "dog"])


def test_voc_object_not_in_the_classes_names_file_and_line(tmp_path):
    root = small_voc(tmp_path, voc_xml(40, 30, [("cat", [1, 1, 5, 5], 0), ("horse", [2, 2, 6, 6], 0)]))
    xml = os.path.join(root, "Annotations", "b.xml")
    with pytest.raises(DataError, match=rf"{re.escape(xml)}: line 13: object name 'horse' is not among the classes "
                                        rf"\(cat, dog\); set data.classes"):
        DATASETS.build("voc_detection", root=root, **VOC)


def test_xml_that_is_not_xml_and_a_doctype_are_refused_naming_file_and_line(tmp_path):
    root = small_voc(tmp_path, "<annotation>\n  <object>\n    <name>cat</name>\n  </annotation>\n")
    xml = os.path.join(root, "Annotations", "b.xml")
    with pytest.raises(DataError, match=rf"{re.escape(xml)}: line 4: not valid XML \(mismatched tag\)"):
        DATASETS.build("voc_detection", root=root, **VOC)
    laughs = ('<?xml version="1.0"?>\n<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>\n'
              '<annotation><name>&lol2;</name></annotation>\n')
    with open(xml, "w") as f:
        f.write(laughs)
    with pytest.raises(DataError, match=rf"{re.escape(xml)}: line 2: a DOCTYPE or entity declaration: refused"):
        DATASETS.build("voc_detection", root=root, **VOC)
    with open(xml, "w") as f:
        f.write("")
    with pytest.raises(DataError, match=rf"{re.escape(xml)}: line 1: not valid XML \(no element found\)"):
        parse_xml(xml)


def test_voc_box_of_zero_or_negative_size_is_dropped_and_counted(tmp_path, caplog):
    zero, negative = [5, 5, 0, 4], [20, 10, -3, 5]  # one-based: xmax = xmin - 1 is zero wide
    root = small_voc(tmp_path, voc_xml(40, 30, [("cat", zero, 0), ("dog", negative, 0), ("dog", [1, 2, 9, 9], 1)]))
    with caplog.at_level(logging.WARNING, logger="datasets.detection_labels"):
        data = DATASETS.build("voc_detection", root=root, **VOC)
    xml = os.path.join(root, "Annotations", "b.xml")
    warned = [r.getMessage() for r in caplog.records if "zero or negative size dropped" in r.getMessage()]
    assert len(warned) == 2  # once per split
    assert warned[0].startswith(f"{os.path.join(root, 'Annotations')}: 2 boxes of zero or negative size dropped: "
                                f"{xml}: line 6: object 'cat'") and f"{xml}: line 16: object 'dog'" in warned[0]
    b = next(i for i in range(len(data.val)) if file_of(data.val, data.val.image_ids[i]) == "b.jpg")
    _, target = data.val[b]
    assert len(target["boxes"]) == 0  # the two dropped, the difficult one out of the targets
    assert [a["iscrowd"] for a in data.val.coco.imgToAnns[data.val.image_ids[b]]] == [1]
    assert len(data.train) == 2  # b has no box left to train on


@pytest.mark.parametrize("line, message", [
    ("2 0.5 0.5 0.2 0.2", r"line 2: class 2 is not among the 2 names of .*data.yaml \(0..1\)"),
    ("-1 0.5 0.5 0.2 0.2", r"line 2: class -1 is not among the 2 names"),
    ("0 0.5 1.5 0.2 0.2", r"line 2: cy 1.5 is outside \[0, 1\] \(YOLO coordinates are normalised"),
    ("0 0.5 0.5 -0.2 0.2", r"line 2: w -0.2 is outside \[0, 1\]"),
    ("0 0.5 0.5 0.2", r"line 2: expected 5 fields \(class cx cy w h\), got 4: '0 0.5 0.5 0.2'"),
    ("0 0.1 0.1 0.5 0.1 0.5 0.5", r"line 2: expected 5 fields .*got 7.*\(a polygon: segment labels are not read\)"),
    ("cat 0.5 0.5 0.2 0.2", r"line 2: class 'cat' is not an integer"),
    ("0 0.5 nan 0.2 0.2", r"line 2: cx cy w h must be finite numbers"),
])
def test_bad_yolo_line_names_file_and_line(tmp_path, line, message):
    root = small_yolo(tmp_path, label_b=f"0 0.5 0.5 0.2 0.2\n{line}\n")
    label = os.path.join(root, "labels", "train", "b.txt")
    with pytest.raises(DataError, match=rf"^{re.escape(label)}: {message}"):
        DATASETS.build("yolo_detection", root=root)


def test_yolo_missing_label_file_is_an_image_without_objects_counted(tmp_path, caplog):
    root = small_yolo(tmp_path, label_b=None, names="names: {0: cat, 1: dog}\nnc: 2\n")
    with caplog.at_level(logging.WARNING, logger="datasets.detection_labels"):
        data = DATASETS.build("yolo_detection", root=root)
    warned = [r.getMessage() for r in caplog.records if "no label file" in r.getMessage()]
    assert warned == [f"{os.path.join(root, 'labels', split)}: 1 of 3 images have no label file, read as images "
                      f"without objects (Ultralytics' convention): {os.path.join(root, 'images', split, 'b.jpg')}"
                      for split in ("train", "val")]
    assert len(data.val) == 3 and len(data.train) == 2 and data.classes == ["__background__", "cat", "dog"]
    a = next(i for i in range(len(data.val)) if file_of(data.val, data.val.image_ids[i]) == "a.jpg")
    _, target = data.val[a]
    assert torch.allclose(target["boxes"], torch.tensor([[6., 4.5, 14., 10.5], [18., 13.5, 30., 22.5]]), atol=1e-5)
    assert target["labels"].tolist() == [1, 2]


def test_bad_data_yaml_and_classes_are_named(tmp_path):
    root = small_yolo(tmp_path, names="names: {0: cat, 2: dog}\n")
    with pytest.raises(DataError, match=r"data.yaml: names: the ids must be 0..1"):
        DATASETS.build("yolo_detection", root=root)
    with open(os.path.join(root, "data.yaml"), "w") as f:
        f.write("names: [cat, dog\n")
    with pytest.raises(DataError, match=r"data.yaml: line \d+: not valid YAML"):
        DATASETS.build("yolo_detection", root=root)
    with pytest.raises(ConfigError, match=r"data.classes: \['cat'\] named twice"):
        DATASETS.build("voc_detection", root=small_voc(tmp_path), classes=["cat", "cat"])


def test_voc_split_list_ids_missing_or_leading_out_name_the_line(tmp_path):
    root = small_voc(tmp_path)
    os.remove(os.path.join(root, "Annotations", "c.xml"))
    split = os.path.join(root, "ImageSets", "Main", "train.txt")
    with pytest.raises(DataError, match=rf"{re.escape(split)}: line 3: image id 'c': file not found: .*c.xml"):
        DATASETS.build("voc_detection", root=root, **VOC)
    with open(split, "w") as f:
        f.write("a\n../../secret\n")
    with pytest.raises(UserError, match=rf"{re.escape(split)}: line 2: image id: '../../secret.xml' is not a relative "
                                        r"file name inside"):
        DATASETS.build("voc_detection", root=root, **VOC)


def test_a_byte_order_mark_and_windows_line_ends_are_read(tmp_path):
    root = small_yolo(tmp_path)
    with open(os.path.join(root, "labels", "train", "b.txt"), "wb") as f:
        f.write(b"\xef\xbb\xbf0 0.5 0.5 0.25 0.5\r\n1 0.5 0.5 0.5 0.5\r\n")
    data = DATASETS.build("yolo_detection", root=root)
    b = next(t for t in data.train.image_ids if file_of(data.train, t) == "b.jpg")
    assert [a["bbox"] for a in data.train.coco.imgToAnns[b]] == [[15.0, 7.5, 10.0, 15.0], [10.0, 7.5, 20.0, 15.0]]


def test_missing_voc_and_yolo_folders_name_the_layout(tmp_path):
    with pytest.raises(DataError, match=r"voc_detection: not found: .*Annotations.*\nexpected layout:\n"
                                        r".*Annotations/\*.xml"):
        DATASETS.build("voc_detection", root=str(tmp_path / "nothing"))
    with pytest.raises(DataError, match=r"(?s)yolo_detection: not found: [^\n]*data.yaml.*\nexpected layout:\n"
                                        r".*labels/\{train,val\}/\*.txt"):
        DATASETS.build("yolo_detection", root=str(tmp_path / "nothing"))


# ---------------------------------------------------------------- the doctor

def cfg_of(name, **data):
    return config_from_data({"model": {"name": "ssdlite320_mobilenet_v3_large"},
                             "data": {"name": name, "batch_size": 2, **data},
                             "optim": {"lr": 0.1}, "train": {"epochs": 1}})


def found(report, severity="error"):
    return sorted((f["kind"], f.get("file", "")) for f in report["findings"] if f["severity"] == severity)


def test_the_doctor_names_voc_and_yolo_faults_by_file_and_line(tmp_path):
    bad = voc_xml(40, 30, [("horse", [1, 1, 5, 5], 0), ("cat", [5, 5, 0, 4], 0), ("dog", [30, 20, 15, 5], 0)])
    root = small_voc(tmp_path / "v", bad)
    with open(os.path.join(root, "Annotations", "c.xml"), "w") as f:
        f.write("<annotation>\n<object>\n")
    report = diagnose(cfg_of("voc_detection", **VOC, root=root), splits=("val",), report_dir=str(tmp_path / "rv"),
                      workers=1, checks=("integrity", "stats"))
    b, c = (os.path.join(root, "Annotations", f"{s}.xml") for s in "bc")
    assert found(report) == [("box_outside", b), ("box_zero_area", b), ("malformed_xml", c), ("unknown_class", b)]
    messages = {f["kind"]: f["message"] for f in report["findings"]}
    assert messages["box_outside"].startswith(f"{b}: line 26 (b.jpg): bbox [30.0, 20.0, 15.0, 5.0] lies 5.0 px outside")
    assert messages["box_zero_area"].startswith(f"{b}: line 16: object 'cat'")
    assert messages["unknown_class"].startswith(f"{b}: line 3: object name 'horse'")

    faults = "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0 0.2\n7 0.5 0.5 0.2 0.2\n0 2 0.5 0.2 0.2\n1 1\n"  # lines 2-5 are bad
    root = small_yolo(tmp_path / "y", label_b=faults)
    os.remove(os.path.join(root, "labels", "val", "c.txt"))
    with open(os.path.join(root, "labels", "train", "b.txt"), "w") as f:  # the faults in val only
        f.write("0 0.5 0.5 0.2 0.2\n")
    report = diagnose(cfg_of("yolo_detection", root=root), splits=("val",), report_dir=str(tmp_path / "ry"),
                      workers=1, checks=("integrity", "stats"))
    label = os.path.join(root, "labels", "val", "b.txt")
    assert found(report) == [("box_zero_area", label), ("coordinate_outside", label), ("malformed_label", label),
                             ("unknown_class", label)]
    assert [x for x in found(report, "info") if x[0] == "no_label_file"] == [
        ("no_label_file", os.path.join(root, "images", "val", "c.jpg"))]
    assert report["stats"]["val"]["instances"] == 1 + 2  # b's good line and a's two boxes
    assert any(m["message"].startswith(f"{label}: line 2: box of class 0 has zero size") for m in report["findings"])
    line = write_clean(report, str(tmp_path / "clean"))  # label folders are not rewritten: the list only
    assert line.startswith(f"no clean copy of label folders (VOC, YOLO): {tmp_path / 'clean' / 'excluded.txt'}")
    assert os.path.isfile(tmp_path / "clean" / "excluded.txt") and os.listdir(tmp_path / "clean") == ["excluded.txt"]


@pytest.mark.slow
def test_the_doctor_finds_no_fault_in_coco6_as_voc_and_yolo(coco6_formats, tmp_path):
    _, configs = coco6_formats
    for key in ("voc", "yolo"):
        name, cfg = configs[key]
        report = diagnose(cfg_of(name, **cfg), splits=("val",), report_dir=str(tmp_path / key), workers=1,
                          checks=("integrity", "stats"))
        assert found(report) == [], report["findings"]
        assert report["stats"]["val"]["instances"] == (36 if key == "voc" else 35)
    assert [x for x in found(report, "info") if x[0] == "no_label_file"] == [
        ("no_label_file", os.path.join(cfg["root"], "images", "val", "000000000089.jpg"))]


def test_collected_problems_leave_only_the_bad_record_out(tmp_path):
    """Under the doctor's collecting_problems, a bad YOLO line or VOC object is recorded and left out, the rest kept."""
    root = small_yolo(tmp_path, label_b="0 0.5 0.5 0.2 0.2\n5 0.5 0.5 0.2 0.2\n")
    with collecting_problems() as problems:
        data = DATASETS.build("yolo_detection", root=root)
    assert len(problems) == 2 and all("line 2: class 5" in str(p) for p in problems)  # train and val
    assert len(data.val.coco.dataset["annotations"]) == 5


# ---------------------------------------------------------------- coco_detection's categories

def test_coco_categories_subset(coco6_formats):
    js, configs = coco6_formats
    data = build(configs, "coco", categories=["bottle", "person"])
    assert data.classes == ["__background__", "bottle", "person"] and data.model_defaults == {"num_classes": 3}
    assert [c["name"] for c in data.val.coco.dataset["categories"]] == ["person", "bottle"]
    ids = {c["name"]: c["id"] for c in js["categories"]}
    kept = [a for a in js["annotations"] if a["category_id"] in (ids["bottle"], ids["person"])]
    assert sorted(a["id"] for a in data.val.coco.dataset["annotations"]) == sorted(a["id"] for a in kept)
    assert len(data.val) == 6 and len(data.train) == 3  # images with neither: kept for evaluation only
    for i in range(len(data.train)):
        _, target = data.train[i]
        cats = [data.train.label_to_cat[int(k)] for k in target["labels"]]
        expected = [a["category_id"] for a in kept if a["image_id"] == target["image_id"] and not a["iscrowd"]]
        assert cats == expected and set(target["labels"].tolist()) <= {1, 2}
    evaluator = data.evaluator()
    for i in range(len(data.val)):
        _, target = data.val[i]
        evaluator.update([{"boxes": target["boxes"], "labels": target["labels"],
                           "scores": torch.ones(len(target["labels"]))}], [target])
    report = evaluator.report()
    assert report["bbox"]["AP"] == pytest.approx(1.0) and report["num_gt_instances"] == len(kept) - 1  # the crowd one
    with pytest.raises(DataError, match=r"instances_val2017.json: data.categories \['unicorn'\] are not among its "
                                        r"categories \(airplane, apple"):
        build(configs, "coco", categories=["person", "unicorn"])
