"""predict.py on real files: photos through a detector trained on shapes and through COCO weights when
present, AG_NEWS lines (file and standard input), FSDD WAVs; checkpoint and exported artifact give
the same predictions; an unreadable input is named, the rest still run, the exit status is 1."""
import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest

import evaluate
import export
import predict
import tiny_runs
from artifacts.load import open_checkpoint
from conftest import shared_data
from engine.build import build_data
import torch


def _run(*argv):
    """predict.main's results, or the SystemExit code with the results file."""
    try:
        return 0, predict.main(list(argv))
    except SystemExit as e:
        return e.code, None


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    return tiny_runs.detector(tmp_path_factory.mktemp("det"))


@pytest.mark.slow
def test_detector_on_photos_draws_boxes_and_names_the_unreadable_file(detector, tmp_path, capsys):
    from PIL import Image
    from pycocotools.coco import COCO
    photos = shared_data("photos")
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not an image")
    out = tmp_path / "out"
    code, _ = _run("--checkpoint", detector, photos, str(broken), str(tmp_path / "missing.png"),
                   "--output", str(out), "--score-thresh", "0.0", "--batch-size", "2")
    assert code == 1
    err = capsys.readouterr()
    assert "broken.jpg: cannot read image" in err.err and "2 failed" in err.out and "missing.png" in err.out
    names = sorted(os.listdir(photos))
    with open(out / "predictions.json") as f:
        saved = json.load(f)
    found = {os.path.basename(r["input"]): r["detections"] for r in saved["predictions"]}
    assert any(found.values())  # score 0.0: boxes to draw
    for name in names:  # every photo drawn, at its own size, its boxes drawn over it
        drawn = out / (os.path.splitext(name)[0] + "_boxes.png")
        with Image.open(drawn) as a, Image.open(os.path.join(photos, name)) as b:
            assert a.size == b.size
            if found[name]:
                assert not np.array_equal(np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB"))), name
    assert len(saved["predictions"]) == len(names)
    assert sorted(f["input"] for f in saved["failed"]) == sorted([str(broken), str(tmp_path / "missing.png")])
    coco = COCO(str(out / "detections.json"))  # COCO style: loads with pycocotools
    assert len(coco.getImgIds()) == len(names) and len(coco.anns) == sum(map(len, found.values()))
    assert sorted(c["name"] for c in coco.loadCats(coco.getCatIds())) == ["circle", "square", "triangle"]
    assert all(a["score"] >= 0.0 and len(a["bbox"]) == 4 for a in coco.anns.values())


COCO_WEIGHTS = ("SSDLite320_MobileNet_V3_Large_Weights.COCO_V1", "ssdlite320.yaml",
                "ssdlite320_mobilenet_v3_large_coco-a79551df.pth"), \
               ("SSD300_VGG16_Weights.COCO_V1", "ssd300.yaml", "ssd300_vgg16_coco-b556d3b4.pth")


def _coco_weights():
    """The first COCO weights file on disk (looked for here, not through the code under test)."""
    for name, config, file in COCO_WEIGHTS:
        if os.path.isfile(os.path.join(torch.hub.get_dir(), "checkpoints", file)):
            return name, config
    pytest.skip("no COCO-trained SSD weights offline (put ssdlite320_mobilenet_v3_large_coco-a79551df.pth or "
                "ssd300_vgg16_coco-b556d3b4.pth in $TORCH_HOME/hub/checkpoints)")


def test_coco_weights_give_sensible_labels(tmp_path):
    weights, config = _coco_weights()
    photos = shared_data("photos")
    results = predict.main(["--config", os.path.join("configs", config), "--set", f"model.weights={weights}",
                            "data.contiguous_labels=false", "--output", str(tmp_path), "--score-thresh", "0.4",
                            photos])
    found = {os.path.basename(r["input"]): {d["label"] for d in r["detections"]} for r in results}
    assert "person" in found["astronaut.png"] and "cat" in found["chelsea.png"] and "cup" in found["coffee.png"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return tiny_runs.classifier(tmp_path_factory.mktemp("cls"))


@pytest.mark.slow
def test_classifier_checkpoint_and_exported_artifact_agree(classifier, tmp_path, capsys):
    photos = shared_data("photos")
    from_checkpoint = predict.main(["--checkpoint", classifier, photos, "--topk", "3", "--output", str(tmp_path / "a")])
    assert "astronaut.png: " in capsys.readouterr().out
    path, _ = export.main(["--checkpoint", classifier, "--format", "torch_export", "--output", str(tmp_path / "exp"),
                           "--check-samples", "2"])
    from_artifact = predict.main(["--checkpoint", path, os.path.join(photos, "*.png"), "--topk", "3",
                                  "--output", str(tmp_path / "b")])
    assert len(from_checkpoint) == 4 and len(from_artifact) == 3  # the glob: the three PNGs
    by_name = {r["input"]: r["top"] for r in from_checkpoint}
    for r in from_artifact:
        expected = by_name[r["input"]]
        assert [t["label"] for t in r["top"]] == [t["label"] for t in expected]
        assert [t["probability"] for t in r["top"]] == pytest.approx([t["probability"] for t in expected], abs=1e-3)
        assert len(r["top"]) == 3 and sum(t["probability"] for t in r["top"]) <= 1.0 + 1e-3


@pytest.mark.slow
def test_text_lines_from_file_and_stdin_and_exported_onnx(tmp_path, monkeypatch):
    checkpoint = tiny_runs.text_agnews(tmp_path / "run")
    news = ["Shares of the company rose after the quarterly earnings report",
            "The striker scored twice as the home team won the cup final",
            "Scientists released new software for the space telescope"]
    lines = tmp_path / "lines.txt"
    lines.write_text(news[0] + "\n\n" + news[1] + "\n")
    from_file = predict.main(["--checkpoint", checkpoint, str(lines), "--output", str(tmp_path / "a")])
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(news)))
    from_stdin = predict.main(["--checkpoint", checkpoint, "--output", str(tmp_path / "b")])
    assert [r["input"] for r in from_file] == news[:2] and [r["input"] for r in from_stdin] == news
    classes = {"World", "Sports", "Business", "Sci/Tech"}
    assert all(r["top"][0]["label"] in classes for r in from_stdin)
    assert [r["top"] for r in from_file] == [r["top"] for r in from_stdin[:2]]
    # the ONNX artifact and its folder alone (moved away from the run folder and its tokenizer)
    path, _ = export.main(["--checkpoint", checkpoint, "--format", "onnx", "--output", str(tmp_path / "exp"),
                           "--check-samples", "2"])
    shutil.copytree(tmp_path / "exp", tmp_path / "moved")
    shutil.rmtree(tmp_path / "run")
    from_onnx = predict.main(["--checkpoint", str(tmp_path / "moved" / "model.onnx"), str(lines),
                              "--output", str(tmp_path / "c")])
    for a, b in zip(from_onnx, from_file):
        assert a["top"][0]["label"] == b["top"][0]["label"]
        assert a["top"][0]["probability"] == pytest.approx(b["top"][0]["probability"], abs=1e-3)


def test_fsdd_wavs(tmp_path):
    checkpoint = tiny_runs.audio_fsdd(tmp_path / "run", steps=34)  # one epoch: 30% top-1 on the 30 held-out clips
    fsdd = shared_data("fsdd")
    results = predict.main(["--checkpoint", checkpoint, os.path.join(fsdd, "7"), os.path.join(fsdd, "3", "*_1.wav"),
                            "--output", str(tmp_path / "p")])
    sevens = [f for f in os.listdir(os.path.join(fsdd, "7")) if f.endswith(".wav")]
    assert len(results) == len(sevens) + len([f for f in os.listdir(os.path.join(fsdd, "3")) if f.endswith("_1.wav")])
    # predict's reading of the WAVs and naming of the classes against evaluate.py's loader and evaluator:
    # the held-out files predicted one by one give evaluate's confusion matrix, cell for cell
    _, cfg = open_checkpoint(checkpoint)
    val = build_data(cfg, str(tmp_path / "run")).val
    with contextlib.redirect_stdout(io.StringIO()):
        report = evaluate.main(["--checkpoint", checkpoint, "--report-dir", str(tmp_path / "report")])
        predicted = predict.main(["--checkpoint", checkpoint, *map(str, val.files), "--output", str(tmp_path / "v")])
    classes = report["classes"]
    confusion = [[0] * len(classes) for _ in classes]
    for r in predicted:
        confusion[classes.index(os.path.basename(os.path.dirname(r["input"])))][classes.index(r["top"][0]["label"])] += 1
    assert [r["input"] for r in predicted] == list(map(str, val.files)) and len(predicted) == 30
    assert confusion == report["confusion_matrix"]
    correct = sum(row[i] for i, row in enumerate(confusion))
    assert correct >= 6, confusion  # twice chance (3 of 30): the files are heard, not one class for all
