"""Fuzz test of the loaders (issues 14 and 24): random byte corruption of real image, WAV, CSV and COCO
JSON files, and of the newer loaders' files: COCO panoptic PNGs and JSON, VOC mask PNGs. Every case either still loads, or gives the project's own error (engine.errors.DataError) naming
the file, or, with skip_bad_samples, a Skipped marker for that file. Nothing else may escape."""
import io
import json
import os

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from datasets import text
from datasets.audio import AudioFiles
from datasets.base import Skipped
from engine.errors import DataError
from datasets.coco import CocoDetectionDataset
from datasets.shapes import ensure_shapes
from engine.registry import DATASETS

CASES = 8  # per kind: 8 kinds x 8 = 64 corrupted files


def corrupt(data, rng):
    """One of: flip bytes, truncate, insert junk, zero a run; never the identity for a non-empty file."""
    data = bytearray(data)
    mode = rng.integers(4)
    if mode == 0:
        for i in rng.integers(0, len(data), size=int(rng.integers(1, 9))):
            data[i] ^= int(rng.integers(1, 256))
    elif mode == 1:
        data = data[: int(rng.integers(0, len(data)))]
    elif mode == 2:
        at = int(rng.integers(0, len(data)))
        data[at:at] = rng.integers(0, 256, size=int(rng.integers(1, 32)), dtype=np.uint8).tobytes()
    else:
        at = int(rng.integers(0, len(data)))
        data[at:at + int(rng.integers(1, 64))] = bytes(64)[: len(data[at:at + 64])]
    return bytes(data)


def check(load, path):
    """'ok' | 'error' | 'skipped'; any other exception fails the test."""
    try:
        result = load()
    except DataError as e:
        assert path in str(e), f"the error does not name {path}: {e}"
        return "error"
    if isinstance(result, Skipped):
        assert result.where == path
        return "skipped"
    return "ok"


def fuzz(tmp_path, name, good, load):
    path = str(tmp_path / name)
    outcomes = []
    for seed in range(CASES):
        with open(path, "wb") as f:
            f.write(corrupt(good, np.random.default_rng(seed)))
        outcomes.append(check(lambda: load(path, seed % 2 == 1), path))
    assert set(outcomes) - {"ok"}, "no corruption was noticed: the fuzz cases are too weak"
    return outcomes


def encoded(save):
    buf = io.BytesIO()
    save(buf)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_fuzz_images(tmp_path, fmt):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8))
    good = encoded(lambda f: image.save(f, format=fmt))
    root = tmp_path / "data"
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        (root / split / "a" / f"good.{fmt.lower()}").write_bytes(good)
    name = f"data/train/a/bad.{fmt.lower()}"

    def load(path, skip):
        data = DATASETS.build("imagefolder", root=str(root), train_crop_size=16, val_crop_size=16,
                              val_resize_size=16, skip_bad_samples=skip)
        index = [p for p, _ in data.train.samples].index(path)
        return data.train[index]
    fuzz(tmp_path, name, good, load)


def test_fuzz_wav(tmp_path):
    wave = (0.3 * np.sin(np.arange(800) * 0.1)).astype(np.float32)
    good = encoded(lambda f: sf.write(f, wave, 8000, format="WAV", subtype="FLOAT"))
    fuzz(tmp_path, "clip.wav", good,
         lambda path, skip: AudioFiles([path], [0], 8000, 0.1, skip_bad_samples=skip)[0])


def test_fuzz_csv(tmp_path):
    good = "".join(f'"{1 + i % 3}","title {i}","some text, with a comma ""{i}"""\n' for i in range(12)).encode()
    fuzz(tmp_path, "train.csv", good, lambda path, skip: text.read_csv(path, skip_bad_samples=skip))


def test_fuzz_coco_annotations(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for i in (1, 2):
        Image.new("RGB", (40, 30), (i * 60, 90, 30)).save(images / f"{i}.png")
    good = json.dumps({
        "images": [{"id": i, "file_name": f"{i}.png", "width": 40, "height": 30} for i in (1, 2)],
        "categories": [{"id": 1, "name": "box"}, {"id": 3, "name": "ball"}],
        "annotations": [{"id": 10 + k, "image_id": 1 + k % 2, "category_id": (1, 3)[k % 2], "iscrowd": 0,
                         "bbox": [2 + k, 3, 10, 8], "area": 80} for k in range(4)]}).encode()

    def load(path, skip):
        ds = CocoDetectionDataset(str(images), path, skip_bad_samples=skip)
        return [ds[i] for i in range(len(ds))]
    fuzz(tmp_path, "instances.json", good, load)


# ---------------------------------------------------------------- issue 24: panoptic and segmentation loaders

def panoptic_files(tmp_path):
    """A small shapes data set (COCO panoptic files); (root, first train PNG path, its annotation)."""
    root = ensure_shapes(str(tmp_path / "shapes"), seed=0, num_train=3, num_val=2, image_size=40)
    with open(os.path.join(root, "annotations", "panoptic_train2017.json")) as f:
        ann = min(json.load(f)["annotations"], key=lambda a: a["image_id"])
    return root, os.path.join(root, "annotations", "panoptic_train2017", ann["file_name"]), ann


def test_fuzz_panoptic_png(tmp_path):
    root, png, ann = panoptic_files(tmp_path)
    good = open(png, "rb").read()

    def load(path, skip):
        data = DATASETS.build("coco_panoptic", root=root, augmentation="none", skip_bad_samples=skip)
        return data.train[data.train.image_ids.index(ann["image_id"])]
    fuzz(tmp_path, os.path.relpath(png, tmp_path), good, load)


def test_fuzz_panoptic_json(tmp_path):
    root, _, _ = panoptic_files(tmp_path)
    good = open(os.path.join(root, "annotations", "panoptic_train2017.json"), "rb").read()

    def load(path, skip):
        for name in ("coco_panoptic", "shapes_semantic"):
            kw = {"num_train": 3, "num_val": 2, "image_size": 40} if name == "shapes_semantic" else {}
            data = DATASETS.build(name, root=root, skip_bad_samples=skip, **kw)
            items = [data.train[i] for i in range(len(data.train))]
        return items
    fuzz(tmp_path, "shapes/annotations/panoptic_train2017.json", good, load)


def test_fuzz_voc_mask(tmp_path):
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / d).mkdir(parents=True)
    labels = np.zeros((24, 30), np.uint8)
    labels[5:15, 8:20] = 15
    labels[4, 8:20] = 255
    mask = Image.fromarray(labels, mode="P")
    mask.putpalette([0, 0, 0] * 256)
    good = encoded(lambda f: mask.save(f, format="PNG"))
    for name in ("a", "b"):
        Image.new("RGB", (30, 24), (90, 60, 30)).save(voc / "JPEGImages" / f"{name}.jpg")
        (voc / "SegmentationClass" / f"{name}.png").write_bytes(good)
        (voc / "ImageSets" / "Segmentation" / f"{'train' if name == 'a' else 'val'}.txt").write_text(f"{name}\n")

    def load(path, skip):
        return DATASETS.build("voc_segmentation", root=str(tmp_path), base_size=24, crop_size=24,
                              skip_bad_samples=skip).train[0]
    fuzz(tmp_path, "VOCdevkit/VOC2012/SegmentationClass/a.png", good, load)
