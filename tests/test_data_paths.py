"""Issue 32, item 2: nothing a data set says can read or write outside its folder. A record's file name
(an image's or a panoptic PNG's `file_name`, a VOC split list's names) that is absolute, has '..' or
leads out (a write: also through a symlink) is refused when the data set is built, naming the file and the record;
evaluation never writes into the data set's folders. The data sets are the project's own shapes set
(datasets/shapes.py) and VOC layout helper, edited as an attacker would."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import train
from conftest import ROOT
from datasets.base import collecting_problems
from datasets.coco import CocoDetectionDataset
from datasets.coco_panoptic import load_panoptic
from evaluators.panoptic import PanopticEvaluator, score_panoptic_files
from evaluators.panoptic_ids import read_ids
from datasets.segmentation import CocoSegmentation, VOCSegmentationDataset
from datasets.shapes import ensure_shapes
from engine.evaluation import write_report
from engine.paths import OutsideFolder
from helpers import cli, edit_json, panoptic_json, png_of, voc

REFUSED = "is not a relative file name inside"


@pytest.fixture
def shapes(tmp_path):
    """A small shapes data set (COCO instances and panoptic files) under tmp_path/data."""
    return ensure_shapes(str(tmp_path / "data"), seed=0, num_train=2, num_val=2, image_size=48)


def instances_json(root):
    return os.path.join(root, "annotations", "instances_val2017.json")


def set_record(path, key, index, field, value):
    def change(data):
        sorted(data[key], key=lambda r: r.get("image_id", r.get("id")))[index][field] = value
    edit_json(path, change)


def leading_out(how, tmp_path, folder, original):
    """(victim path outside the data set, the file name that reaches it from `folder`): a copy of
    `original` elsewhere in tmp_path, named by absolute path, by '..' or through a symlink in `folder`."""
    victim = tmp_path / "elsewhere" / f"victim{os.path.splitext(original)[1]}"
    victim.parent.mkdir(exist_ok=True)
    shutil.copyfile(original, victim)
    if how == "absolute":
        return victim, str(victim)
    if how == "dotdot":
        return victim, os.path.relpath(victim, folder)
    os.symlink(victim, os.path.join(folder, "link" + victim.suffix))
    return victim, "link" + victim.suffix


# ---------------------------------------------------------------- the probe's case, a real evaluate.py

@pytest.fixture(scope="module")
def panoptic_checkpoint(tmp_path_factory):
    """A tiny Panoptic FPN trained one step on 2 shapes images: (its data root, last.pt)."""
    tmp = tmp_path_factory.mktemp("panoptic")
    train.main(["--config", os.path.join(ROOT, "configs", "shapes_panoptic.yaml"), "--output-dir", str(tmp / "run"),
                "--set", f"data.root={tmp / 'shapes'}", "data.num_train=2", "data.num_val=1", "data.image_size=64",
                "model.min_size=64", "model.max_size=80", "data.batch_size=2", "data.workers=0", "train.epochs=1",
                "train.max_steps_per_epoch=1", "recipes=[]", "train.analysis=false",
                "model.instance_score_thresh=0.0"])
    return tmp / "shapes", tmp / "run" / "last.pt"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_evaluate_refuses_a_panoptic_file_name_that_leads_out_and_writes_nothing(panoptic_checkpoint, tmp_path, how):
    """The probe: a panoptic annotation whose file_name reaches a PNG elsewhere. Before the fix,
    evaluate.py read it as ground truth and wrote its prediction over it, exit 0."""
    shapes, checkpoint = panoptic_checkpoint
    data = tmp_path / "data"
    shutil.copytree(shapes, data)
    png, ann = png_of(str(data), 0, "val")
    victim, name = leading_out(how, tmp_path, os.path.dirname(png), png)
    set_record(panoptic_json(str(data), "val"), "annotations", 0, "file_name", name)
    os.utime(victim, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = victim.read_bytes()
    report = tmp_path / "out" / "report"  # report/panoptic_predictions/<name> was the victim with either name
    code, output, errors = cli(tmp_path, "evaluate.py", "--checkpoint", str(checkpoint), "--set",
                               f"data.root={data}", "--report-dir", str(report))
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert errors[0].startswith(f"error: {panoptic_json(str(data), 'val')}: annotation of image {ann['image_id']}: "
                                f"file_name: {name!r} {REFUSED}"), errors[0]
    assert victim.read_bytes() == before and os.stat(victim).st_mtime_ns == 1_000_000_000_000_000_000
    assert not (report / "panoptic_predictions").exists()


def test_panoptic_outputs_are_never_written_into_the_data_set(shapes, tmp_path):
    """A report folder whose panoptic_predictions/ is, or lies in, the ground truth's PNG or image
    folder is refused before a file is written (before the fix the PNGs overwrote the ground truth)."""
    gt_folder = tmp_path / "annotations" / "panoptic_predictions"  # what a report in annotations/ writes to
    shutil.copytree(os.path.join(shapes, "annotations", "panoptic_val2017"), gt_folder)
    data = load_panoptic(panoptic_json(shapes, "val"), str(gt_folder))
    img_folder = os.path.join(shapes, "val2017")
    evaluator = PanopticEvaluator(data, str(gt_folder), {c["id"]: c["id"] for c in data["categories"]},
                                  img_folder=img_folder)
    for ann in data["annotations"]:  # a prediction of each image: its ground truth, one segment less
        segments = [{"id": s["id"], "category_id": s["category_id"], "isthing": 0, "score": 1.0, "area": s["area"]}
                    for s in ann["segments_info"]]
        ids = read_ids(str(gt_folder / ann["file_name"]))
        ids[ids == segments[-1]["id"]] = segments[0]["id"]
        evaluator.update([{"panoptic": torch.from_numpy(ids), "segments_info": segments[:-1]}],
                         [{"image_id": ann["image_id"]}])
    before = {p.name: p.read_bytes() for p in gt_folder.iterdir()}
    for folder in (tmp_path / "annotations", gt_folder, img_folder):
        with pytest.raises(OutsideFolder, match="inside the data set's folder"):
            evaluator.save_artifacts(str(folder))
    assert {p.name: p.read_bytes() for p in gt_folder.iterdir()} == before
    # elsewhere the same predictions are written, each inside panoptic_predictions/
    files = evaluator.save_artifacts(str(tmp_path / "report"))
    assert sorted(os.listdir(files["panoptic_folder"])) == sorted(before)


def test_panoptic_scorer_refuses_a_prediction_file_name_that_leads_out(shapes, tmp_path):
    """evaluate.py --panoptic-*: a predictions JSON naming a PNG outside its folder is not read."""
    gt_json, gt_folder = panoptic_json(shapes, "val"), os.path.join(shapes, "annotations", "panoptic_val2017")
    png, ann = png_of(shapes, 0, "val")
    _, name = leading_out("absolute", tmp_path, gt_folder, png)
    pred = tmp_path / "pred.json"
    shutil.copyfile(gt_json, pred)
    set_record(str(pred), "annotations", 0, "file_name", name)
    with pytest.raises(OutsideFolder, match=re.escape(f"{pred}: annotation of image {ann['image_id']}: "
                                                      f"file_name: {name!r}")):
        score_panoptic_files(gt_json, gt_folder, str(pred), gt_folder)


# ---------------------------------------------------------------- loaders: refused when the data set is built

@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_coco_detection_image_file_name_that_leads_out_is_refused(shapes, tmp_path, how):
    img_folder, ann_file = os.path.join(shapes, "val2017"), instances_json(shapes)
    image = sorted(json.load(open(ann_file))["images"], key=lambda r: r["id"])[0]
    _, name = leading_out(how, tmp_path, img_folder, os.path.join(img_folder, image["file_name"]))
    set_record(ann_file, "images", 0, "file_name", name)
    with pytest.raises(OutsideFolder, match=re.escape(f"{ann_file}: image {image['id']}: file_name: {name!r} "
                                                      f"{REFUSED}")):
        CocoDetectionDataset(img_folder, ann_file)
    with collecting_problems() as found:  # the doctor: listed, and the record left out
        dataset = CocoDetectionDataset(img_folder, ann_file)
    assert [type(e) for e in found] == [OutsideFolder] and image["id"] not in dataset.coco.imgs
    assert len(dataset.coco.imgs) == 1


def test_a_symlinked_image_file_in_the_folder_is_its_owners_layout_and_loads(shapes, tmp_path):
    """DVC, git-annex or a folder of links to a shared copy: the link lies in the folder and the record
    names it plainly; no record can make a link, so reading through it is allowed (writes resolve)."""
    img_folder, ann_file = os.path.join(shapes, "val2017"), instances_json(shapes)
    image = sorted(json.load(open(ann_file))["images"], key=lambda r: r["id"])[0]
    original = os.path.join(img_folder, image["file_name"])
    _, name = leading_out("symlink", tmp_path, img_folder, original)
    set_record(ann_file, "images", 0, "file_name", name)
    dataset = CocoDetectionDataset(img_folder, ann_file)
    assert len(dataset.coco.imgs) == 2
    read = dataset[dataset.image_ids.index(image["id"])][0]
    assert np.array_equal(np.asarray(read.convert("RGB")), np.asarray(Image.open(original).convert("RGB")))


def test_coco_segmentation_image_file_name_that_leads_out_is_refused(shapes, tmp_path):
    img_folder, ann_file = os.path.join(shapes, "val2017"), instances_json(shapes)
    image = sorted(json.load(open(ann_file))["images"], key=lambda r: r["id"])[1]
    _, name = leading_out("dotdot", tmp_path, img_folder, os.path.join(img_folder, image["file_name"]))
    set_record(ann_file, "images", 1, "file_name", name)
    with pytest.raises(OutsideFolder, match=re.escape(f"{ann_file}: image {image['id']}: file_name: {name!r}")):
        CocoSegmentation(img_folder, ann_file, categories=[1, 2, 3])


@pytest.mark.parametrize("field", ["png", "image"])
def test_panoptic_loader_refuses_a_file_name_leading_out(shapes, tmp_path, field):
    """The panoptic and shapes_semantic loaders (load_panoptic): the annotation's PNG, the image's file."""
    png_folder, img_folder = os.path.join(shapes, "annotations", "panoptic_val2017"), os.path.join(shapes, "val2017")
    png, ann = png_of(shapes, 0, "val")
    if field == "png":
        _, name = leading_out("absolute", tmp_path, png_folder, png)
        set_record(panoptic_json(shapes, "val"), "annotations", 0, "file_name", name)
        where = f"annotation of image {ann['image_id']}: file_name"
    else:
        image = next(r for r in json.load(open(panoptic_json(shapes, "val")))["images"] if r["id"] == ann["image_id"])
        _, name = leading_out("absolute", tmp_path, img_folder, os.path.join(img_folder, image["file_name"]))
        set_record(panoptic_json(shapes, "val"), "images", 0, "file_name", name)
        where = f"image {ann['image_id']}: file_name"
    with pytest.raises(OutsideFolder, match=re.escape(f"{panoptic_json(shapes, 'val')}: {where}: {name!r} "
                                                      f"{REFUSED}")):
        load_panoptic(panoptic_json(shapes, "val"), png_folder, img_folder)


def test_voc_split_list_name_that_leads_out_is_refused(tmp_path):
    root = tmp_path / "voc"
    folder = voc(root, split_lists=(("train", "a b"), ("val", "v")))
    (tmp_path / "victim.jpg").write_bytes((folder / "JPEGImages" / "a.jpg").read_bytes())
    (tmp_path / "victim.png").write_bytes((folder / "SegmentationClass" / "a.png").read_bytes())
    split = folder / "ImageSets" / "Segmentation" / "train.txt"
    split.write_text("a\n../../../../victim\n")
    with pytest.raises(OutsideFolder, match=re.escape(f"{split}: line 2: image name: '../../../../victim.jpg' "
                                                      f"{REFUSED}")):
        VOCSegmentationDataset(str(root), "2012", "train")
    with collecting_problems() as found:
        dataset = VOCSegmentationDataset(str(root), "2012", "train")
    assert len(found) == 1 and len(dataset) == 1 and dataset.base.images[0].endswith("a.jpg")


def test_report_html_embeds_no_image_outside_its_folder(shapes, tmp_path):
    """A report's image path (report.json can come from anyone: --compare) is embedded only from inside
    the report folder."""
    png, _ = png_of(shapes, 0, "val")
    report = {"metrics": {"x": 1.0}, "analysis": [{"title": "worst images", "images": [
        {"path": png, "title": "t", "caption": "c"}, {"path": "../" + os.path.basename(png), "title": "u"}]}]}
    shutil.copyfile(png, tmp_path / os.path.basename(png))
    write_report(str(tmp_path / "report"), report, "# x\n")
    html = (tmp_path / "report" / "report.html").read_text()
    assert "data:image" not in html and html.count("missing image") == 2
