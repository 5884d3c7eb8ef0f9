"""Fault table of issue 14, data rows: missing or mis-laid data, corrupt samples (error naming the file,
or with data.skip_bad_samples a counted, logged skip), broken COCO annotations and results files."""
import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import datasets.base
import engine.errors
import evaluate
from conftest import shared_data
from datasets import text
from datasets.coco import CocoDetectionDataset
from evaluators.coco import CocoEvaluator, load_gt
from engine.config import load_config
from engine.registry import DATASETS
from helpers import image_folder, truncate

# ---------------------------------------------------------------- helpers


def build_imagefolder(root, **kw):
    return DATASETS.build("imagefolder", root=str(root), train_crop_size=16, val_crop_size=16, val_resize_size=16,
                          **kw)


def wav(path, seconds=0.2, rate=8000):
    import soundfile as sf
    sf.write(path, (0.3 * np.sin(np.arange(int(seconds * rate)) * 0.05)).astype(np.float32), rate, subtype="PCM_16")


def audio_folder(root, per_class=5):
    for c in ("yes", "no"):
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(per_class):
            wav(os.path.join(root, c, f"spk{i}_{i}.wav"))


# ---------------------------------------------------------------- layout


def test_imagefolder_wrong_layout_empty_class_and_empty_split_name_path_and_layout(tmp_path):
    image_folder(tmp_path)
    os.makedirs(tmp_path / "train" / "c")                      # an empty class folder
    with pytest.raises(FileNotFoundError) as e:
        build_imagefolder(tmp_path)
    assert str(tmp_path / "train" / "c") in str(e.value) and "expected layout" in str(e.value)
    shutil.rmtree(tmp_path / "train")                          # images straight in the split folder
    os.makedirs(tmp_path / "train")
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "x.png")
    with pytest.raises(FileNotFoundError, match="(?s)no class folders in .*train.*expected layout"):
        build_imagefolder(tmp_path)
    (tmp_path / "train" / "x.png").unlink()                    # an empty split
    with pytest.raises(FileNotFoundError, match="no class folders in .*train"):
        build_imagefolder(tmp_path)
    with pytest.raises(FileNotFoundError, match="(?s)nowhere.*expected layout"):
        build_imagefolder(tmp_path / "nowhere")


def test_audio_empty_class_folder_is_named(tmp_path):
    audio_folder(tmp_path)
    os.makedirs(tmp_path / "maybe")
    with pytest.raises(FileNotFoundError, match=r"(?s)maybe.*expected layout"):
        DATASETS.build("audio_folder", root=str(tmp_path), sample_rate=8000, duration=0.2)


def test_csv_wrong_layout_names_file_and_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"(?s)train\.csv.*expected layout"):
        DATASETS.build("csv_text", root=str(tmp_path), vocab_size=50)


# ---------------------------------------------------------------- corrupt samples


def test_truncated_jpeg_names_the_file_also_from_a_worker(tmp_path):
    """Issue 14: a truncated JPEG ended training with PIL's `image file is truncated`, no file named."""
    paths = image_folder(tmp_path, ext="jpg")
    bad = paths[3]
    truncate(bad, 0.6)
    data = build_imagefolder(tmp_path)
    with pytest.raises(ValueError) as e:  # engine.errors.BadSample; PIL's OSError before
        [data.train[i] for i in range(len(data.train))]
    assert bad in str(e.value) and "cannot read image" in str(e.value)
    with pytest.raises(engine.errors.DataError, match=bad):  # the DataLoader re-raises the worker's error
        list(DataLoader(data.train, batch_size=4, num_workers=2))


@pytest.mark.slow
def test_skip_bad_samples_with_workers_counts_and_names_every_file(tmp_path):
    paths = image_folder(tmp_path, per_class=8)
    bad = [paths[1], paths[10]]
    truncate(bad[0], 0.3)
    with open(bad[1], "wb") as f:
        f.write(b"not an image at all")
    data = build_imagefolder(tmp_path, skip_bad_samples=True)
    assert isinstance(data.train[data.train.samples.index((bad[0], 0))], datasets.base.Skipped)
    loader = DataLoader(data.train, batch_size=4, num_workers=2, collate_fn=data.collate_fn)
    batches = list(loader)
    skipped = [s.where for b in batches for s in b.skipped]
    assert sorted(skipped) == sorted(bad)
    assert sum(len(b[1]) for b in batches) == len(data.train) - 2
    inputs, targets = batches[0]
    assert inputs.shape[1:] == (3, 16, 16) and targets.dtype == torch.long


def test_skipped_samples_are_reported_at_the_end_of_the_epoch(tmp_path, capsys):
    from engine.loop import train
    paths = image_folder(tmp_path / "data", per_class=3)  # 6 train images: 2 batches of 3, every one used
    truncate(paths[2], 0.3)
    config = tmp_path / "skip.yaml"
    config.write_text(f"""
model: {{name: mobilenet_v3_small}}
data: {{name: imagefolder, root: {tmp_path / 'data'}, skip_bad_samples: true, batch_size: 3, workers: 2,
        train_crop_size: 16, val_crop_size: 16, val_resize_size: 16}}
optim: {{lr: 0.01}}
train: {{epochs: 1}}
""")
    cfg = load_config(str(config))
    train(cfg, str(tmp_path / "run"))  # its console logging goes to stdout
    report = [line for line in capsys.readouterr().out.splitlines() if "unreadable training samples skipped" in line]
    assert len(report) == 1 and "1 unreadable" in report[0] and paths[2] in report[0]


def test_unreadable_and_non_audio_wav(tmp_path):
    audio_folder(tmp_path)
    not_audio = tmp_path / "yes" / "spk0_0.wav"
    not_audio.write_text("RIFF but really a text file")
    truncated = tmp_path / "no" / "spk1_1.wav"
    truncate(str(truncated), 0.01)  # header cut: not a WAV any more
    data = DATASETS.build("audio_folder", root=str(tmp_path), sample_rate=8000, duration=0.2, split="stratified",
                          val_fraction=0.2)
    files = data.train.files + data.val.files
    errors = []
    for ds in (data.train, data.val):
        for i in range(len(ds)):
            try:
                ds[i]
            except engine.errors.BadSample as e:
                errors.append(str(e))
    assert len(errors) == 2 and all(any(str(p) in e for p in (not_audio, truncated)) for e in errors)
    skipping = DATASETS.build("audio_folder", root=str(tmp_path), sample_rate=8000, duration=0.2,
                              skip_bad_samples=True)
    batches = list(DataLoader(skipping.train, batch_size=3, num_workers=2, collate_fn=skipping.collate_fn))
    batches += list(DataLoader(skipping.val, batch_size=3, collate_fn=skipping.collate_fn))
    assert sorted(s.where for b in batches for s in b.skipped) == sorted([str(not_audio), str(truncated)])
    assert sum(len(b[1]) for b in batches) == len(files) - 2
    preloaded = DATASETS.build("audio_folder", root=str(tmp_path), sample_rate=8000, duration=0.2, preload=True,
                               skip_bad_samples=True)
    assert len(preloaded.train) + len(preloaded.val) == len(files) - 2


@pytest.mark.parametrize("row, problem", [(",,\n", "empty row"), ('"2",""\n', "empty text"),
                                          (b'"1","caf\xe9 latin-1"\n', "not valid UTF-8"),
                                          ('"x"\n', "expected a label and at least one text column")])
def test_empty_or_malformed_csv_row_names_file_and_row(tmp_path, row, problem):
    """Issue 14 row: an empty row was dropped silently; a non-UTF-8 byte gave a raw UnicodeDecodeError."""
    path = tmp_path / "train.csv"
    good = "".join(f'"{1 + i % 2}","text number {i}"\n' for i in range(6)).encode()
    path.write_bytes(good + (row if isinstance(row, bytes) else row.encode()) + b'"1","last"\n')
    with pytest.raises(engine.errors.BadSample, match=rf"train\.csv, row 7: {problem}"):
        text.read_csv(str(path))


def test_skip_bad_csv_rows_counts_and_names_them(tmp_path, caplog):
    path = tmp_path / "train.csv"
    path.write_bytes(b'"1","a"\n,,\n"2","b"\n"zz","c"\n"1","d"\n')
    with caplog.at_level(logging.WARNING):
        texts, labels = text.read_csv(str(path), skip_bad_samples=True)
    assert texts == ["a", "b", "d"] and labels == [0, 1, 0]
    summary = [r.getMessage() for r in caplog.records if "bad rows skipped" in r.getMessage()]
    assert summary and "2 bad rows skipped" in summary[0] and "rows 2, 4" in summary[0] and "train.csv" in summary[0]


# ---------------------------------------------------------------- COCO annotations


@pytest.fixture
def coco_copy(tmp_path):
    """coco6 with its images linked and its annotations editable: (image folder, annotations dict, writer)."""
    src = shared_data("coco6")
    images = tmp_path / "val2017"
    images.mkdir()
    for name in os.listdir(os.path.join(src, "val2017")):
        os.symlink(os.path.join(src, "val2017", name), images / name)
    with open(os.path.join(src, "annotations", "instances_val2017.json")) as f:
        data = json.load(f)

    def write(d):
        path = tmp_path / "instances.json"
        path.write_text(json.dumps(d))
        return str(path)
    return str(images), data, write


def test_annotation_file_that_is_not_json_names_the_file(coco_copy, tmp_path):
    """Issue 14: a raw JSONDecodeError traceback."""
    images, _, _ = coco_copy
    bad = tmp_path / "instances.json"
    bad.write_text('{"images": [{"id": 1,')
    with pytest.raises(ValueError, match=r"instances\.json: not valid JSON .*line 1"):  # engine.errors.DataError
        CocoDetectionDataset(images, str(bad))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["annotations"][0].__setitem__("image_id", 999), r"annotation {ann} \(image 999\): image_id 999 is not"),
    (lambda d: d["annotations"][0].__setitem__("category_id", 4242), r"annotation {ann} .*unknown category id 4242"),
    (lambda d: d["annotations"][0].__setitem__("bbox", [1, 2, "x", 4]), r"annotation {ann} .*bbox must be"),
    (lambda d: d["images"][0].__setitem__("file_name", "gone.jpg"), r"image {img}: file not found: .*gone\.jpg"),
])
def test_annotation_records_that_do_not_fit_name_file_and_record(coco_copy, change, message):
    images, data, write = coco_copy
    change(data)
    ann, img = data["annotations"][0]["id"], data["images"][0]["id"]
    with pytest.raises(engine.errors.DataError, match=r"instances\.json: " + message.format(ann=ann, img=img)):
        CocoDetectionDataset(images, write(data))


def test_negative_and_outside_boxes_are_counted_clamped_and_dropped(coco_copy):
    images, data, write = coco_copy
    anns = [a for a in data["annotations"] if not a["iscrowd"]]
    img = {i["id"]: i for i in data["images"]}
    neg, out, gone = anns[0], anns[1], anns[2]
    neg["bbox"] = [50, 50, -20, 30]
    w = img[out["image_id"]]["width"]
    out["bbox"] = [w - 10, 5, 40, 20]                          # 30 px past the right border
    gone["bbox"] = [img[gone["image_id"]]["width"] + 5, 5, 10, 10]  # wholly outside
    ds = CocoDetectionDataset(images, write(data))
    assert ds.box_issues == {"negative size (dropped)": [neg["id"]], "outside the image (clamped)": [out["id"]],
                             "empty after clamping (dropped)": [gone["id"]]}
    index = ds.image_ids.index(out["image_id"])
    _, target = ds[index]
    boxes = target["boxes"]
    assert (boxes[:, 2] <= w).all() and (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
    assert [w - 10, 5, w, 25] in boxes.tolist()  # x0 y0 x1 y1: cut at the right border, the rest kept
    expected = sum(1 for a in anns if a["image_id"] == out["image_id"] and a is not gone and a is not neg)
    assert len(boxes) == expected


def test_truncated_coco_image_names_the_file_or_is_skipped(coco_copy, tmp_path):
    images, data, write = coco_copy
    name = data["images"][0]["file_name"]
    path = os.path.join(images, name)
    real = os.path.realpath(path)
    os.unlink(path)
    shutil.copy(real, path)
    truncate(path, 0.4)
    ds = CocoDetectionDataset(images, write(data))
    index = ds.image_ids.index(data["images"][0]["id"])
    with pytest.raises(engine.errors.BadSample, match=name):
        ds[index]
    skipping = CocoDetectionDataset(images, write(data), skip_bad_samples=True)
    assert isinstance(skipping[index], datasets.base.Skipped) and skipping[index].where == path


def test_negative_size_gt_box_does_not_crash_tensorboard_drawing(coco_copy):
    """Issue 14: a negative-size COCO box crashed inside draw_bounding_boxes."""
    images, data, _ = coco_copy
    ann = next(a for a in data["annotations"] if not a["iscrowd"])
    ann["bbox"] = [60, 60, -25, 40]
    ev = CocoEvaluator(load_gt(data), {1: ann["category_id"]}, backend="pycocotools", img_folder=images)
    ev.update([{"boxes": torch.tensor([[10., 10., 50., 60.]]), "labels": torch.tensor([1]),
                "scores": torch.tensor([0.9])}], [{"image_id": ann["image_id"]}])
    drawn = ev.draw()
    assert len(drawn) == 1 and drawn[0][1].dtype == torch.uint8


# ---------------------------------------------------------------- evaluate.py --coco-results


def score(tmp_path, content):
    gt = os.path.join(shared_data("coco6"), "annotations", "instances_val2017.json")
    path = tmp_path / "results.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return evaluate.main(["--coco-gt", gt, "--coco-results", str(path), "--report-dir", str(tmp_path)])


@pytest.mark.parametrize("content, message", [
    (b'[{"image_id": 89, "categ', "not valid JSON"),
    (b"\xff\xfe\x00\x01", "not valid JSON"),
    ([{"image_id": 89, "category_id": 1, "bbox": [1, 2, 3, 4], "score": 0.5},
      {"image_id": 5, "category_id": 1, "bbox": [1, 2, 3, 4], "score": 0.5}], r"first: detection 1, image_id 5"),
    ([{"image_id": 89, "category_id": 777, "bbox": [1, 2, 3, 4], "score": 0.5}], r"first: detection 0, category_id 777"),
    (b'[{"image_id": 89, "category_id": 1, "bbox": [1, NaN, 3, 4], "score": 0.5}]', r"detection 0: 'bbox'.*finite"),
    ([{"image_id": [89], "category_id": 1, "bbox": [1, 2, 3, 4], "score": 0.5}], r"detection 0: 'image_id'"),
])
def test_coco_results_file_errors_name_the_record(tmp_path, content, message):
    with pytest.raises(SystemExit) as e:
        score(tmp_path, content)
    assert "results.json" in str(e.value)
    assert __import__("re").search(message, str(e.value)), str(e.value)


def test_empty_coco_results_list_scores_zero(tmp_path):
    report = score(tmp_path, [])
    assert report["num_detections"] == 0 and report["bbox"]["AP"] == 0.0


def test_load_annotations_counts_nothing_on_clean_data():
    root = shared_data("coco6")
    data, issues = datasets.coco.load_annotations(os.path.join(root, "annotations", "instances_val2017.json"),
                                                  os.path.join(root, "val2017"))
    assert issues == {} and len(data["images"]) == 6
