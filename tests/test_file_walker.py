"""Issue 32, item 3: one file walker (engine.paths.walk_files) for the image and audio folders, the
doctor and predict's folders and globs. A directory symlink loop (`train/1/uploop -> ..`) made
train.py train on 328 samples instead of 8, the doctor count them, and predict read one image 41
times; symlinked class folders at the top of a split stay classes."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import commands.predict
from conftest import ROOT
from engine.paths import walk_files
from engine.registry import DATASETS
from helpers import image_folder

CONFIG = """\
model: {name: mobilenet_v3_small, width_mult: 0.25, reduced_tail: true, dropout: 0.0}
data: {name: imagefolder, root: %s, train_crop_size: 16, val_crop_size: 16, val_resize_size: 16,
       batch_size: 4, workers: 0}
optim: {name: adamw, lr: 0.01}
sched: {name: constant}
train: {epochs: 1, log_every: 1, best_metric: top1, analysis: false}
device: cpu
recipes: []
"""


def looped_folder(root, per_class=4):
    """The probe's ImageFolder: 2 classes of `per_class` images in train and val, `1/uploop -> ..` in both."""
    image_folder(root, classes=("0", "1"), per_class=per_class)
    for split in ("train", "val"):
        os.symlink("..", root / split / "1" / "uploop")
    return root


def run(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_a_loop_trains_checks_and_predicts_each_image_once_and_the_log_names_it(tmp_path):
    """Acceptance 3, with real train.py, doctor.py and predict.py processes."""
    data = looped_folder(tmp_path / "d")
    loop = str(data / "train" / "1" / "uploop")
    assert len(glob.glob(f"{data}/train/**/*.png", recursive=True)) > 8  # what torchvision and glob followed
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG % data)
    for extra in ([], ["--set", "data.follow_symlinks=true"]):
        out = tmp_path / f"run{len(extra)}"
        trained = run("train.py", "--config", str(config), "--output", str(out), *extra)
        assert trained.returncode == 0, trained.stderr[-3000:]
        log = trained.stdout + trained.stderr
        assert "8 train / 8 val samples" in log, log[-3000:]
        assert loop in log and ("a loop" if extra else "not followed") in log
    doctor = run("doctor.py", "--config", str(config), "--report-dir", str(tmp_path / "r"), "--workers", "1")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr[-3000:]
    assert "samples: train 8, val 8" in doctor.stdout and loop in doctor.stdout
    report = json.load(open(tmp_path / "r" / "report.json"))
    assert report["stats"]["train"]["samples_per_class"] == {"0": 4, "1": 4}
    assert any(f["kind"] == "symlink_not_followed" and loop in f["message"] for f in report["findings"])
    predicted = run("predict.py", "--checkpoint", str(tmp_path / "run0" / "last.pt"), f"{data}/train/**/*.png",
                    "--output", str(tmp_path / "p"))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    inputs = [p["input"] for p in json.load(open(tmp_path / "p" / "predictions.json"))["predictions"]]
    assert sorted(inputs) == sorted(str(p) for p in data.glob("train/[01]/*.png")) and len(inputs) == 8


def test_followed_links_keep_each_folder_at_its_real_path_and_a_link_above_the_root_is_a_loop(tmp_path):
    for c in ("0", "1"):
        os.makedirs(tmp_path / "t" / c)
        for k in range(2):
            (tmp_path / "t" / c / f"{k}.png").write_bytes(b"x")
    os.symlink("../1", tmp_path / "t" / "0" / "side")  # class 0 linking into class 1, walked first
    found = walk_files(str(tmp_path / "t"), follow_symlinks=True)
    assert [os.path.relpath(p, tmp_path / "t") for p in found] == ["0/0.png", "0/1.png", "1/0.png", "1/1.png"]
    assert found.loops == [str(tmp_path / "t" / "0" / "side")]
    os.symlink("..", tmp_path / "t" / "1" / "up")  # walked from t/1: a link to a folder holding the root
    below = walk_files(str(tmp_path / "t" / "1"), follow_symlinks=True)
    assert [os.path.basename(p) for p in below] == ["0.png", "1.png"] and below.loops == [str(tmp_path / "t" / "1" / "up")]
    assert len(walk_files(str(tmp_path / "t"), max_depth=0)) == 0 and len(walk_files(str(tmp_path / "t"), max_depth=1)) == 4


def test_symlinked_class_folders_at_the_top_of_a_split_are_classes_and_links_into_the_split_are_not(tmp_path, caplog):
    data = looped_folder(tmp_path / "d", per_class=2)
    elsewhere = tmp_path / "disk2" / "cats"
    os.makedirs(elsewhere)
    for k in range(3):
        Image.new("RGB", (16, 16), (k, 0, 0)).save(elsewhere / f"c{k}.png")
    for split in ("train", "val"):
        os.symlink(elsewhere, data / split / "2")         # a class kept on another disk: common, followed
        os.symlink(".", data / split / "again")           # the split itself: a loop, no class
        os.symlink("0", data / split / "zero")            # a second name for a class folder: no class
    for follow in (False, True):
        built = DATASETS.build("imagefolder", root=str(data), train_crop_size=16, val_crop_size=16,
                               val_resize_size=16, follow_symlinks=follow)
        assert built.classes == ["0", "1", "2"]
        assert sorted(np.bincount(built.train.targets).tolist()) == [2, 2, 3]
        assert all(os.path.basename(os.path.dirname(p)) == built.classes[y] for p, y in built.train.samples)
    assert str(data / "train" / "again") in caplog.text and str(data / "train" / "zero") in caplog.text


def wav(path, rate=8000):
    import soundfile as sf
    sf.write(path, (0.3 * np.sin(np.arange(1600) * 0.05)).astype(np.float32), rate, subtype="PCM_16")


def test_audio_folder_reads_each_clip_once_through_loops_and_keeps_symlinked_classes(tmp_path, caplog):
    for c in ("no", "yes"):
        os.makedirs(tmp_path / "a" / c)
        for k in range(5):
            wav(tmp_path / "a" / c / f"s{k}_{k}.wav")
    os.symlink("..", tmp_path / "a" / "yes" / "uploop")
    os.symlink(".", tmp_path / "a" / "again")  # the root itself as a class folder: a loop
    os.makedirs(tmp_path / "other" / "maybe")
    for k in range(5):
        wav(tmp_path / "other" / "maybe" / f"s{k}_{k}.wav")
    os.symlink(tmp_path / "other" / "maybe", tmp_path / "a" / "maybe")
    for follow in (False, True):
        built = DATASETS.build("audio_folder", root=str(tmp_path / "a"), sample_rate=8000, duration=0.2,
                               follow_symlinks=follow)
        files = built.train.files + built.val.files
        assert built.classes == ["maybe", "no", "yes"] and len(files) == len(set(files)) == 15
    assert str(tmp_path / "a" / "again") in caplog.text and str(tmp_path / "a" / "yes" / "uploop") in caplog.text


def test_predict_globs_match_as_glob_does_without_entering_directory_symlinks(tmp_path, monkeypatch):
    for folder in ("d/a", "d/a/deep", "d/.hidden", "d/b"):
        os.makedirs(tmp_path / folder)
    for name in ("d/x.png", "d/.x.png", "d/a/y.png", "d/a/deep/z.png", "d/.hidden/h.png", "d/b/w.jpg"):
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    for pattern in ("d/*.png", "d/*/*.png", "d/**/*.png", "d/**", "*/a/*.png", "d/.*", "d/[ab]/*", "d/**/deep/*",
                    f"{tmp_path}/d/**/*.png", "**/*.jpg"):
        assert commands.predict.glob_files(pattern) == sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)), pattern
    os.symlink("..", tmp_path / "d" / "a" / "up")
    assert commands.predict.glob_files("d/**/*.png") == ["d/a/deep/z.png", "d/a/y.png", "d/x.png"]
    assert commands.predict.glob_files("d/**/*.png", follow_symlinks=True) == ["d/a/deep/z.png", "d/a/y.png", "d/x.png"]
