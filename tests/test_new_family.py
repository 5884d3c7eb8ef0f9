"""docs/architecture.md's "Adding a model family", followed to the letter: a toy family (model, data,
evaluator and the export adapter of its task) in its own module outside the zoo's packages
(tests/plugins/toy_stripes.py), plugged in by the config's `imports` alone. No file of the zoo is
edited; the real command lines train, evaluate, export and predict with it, and, from what it declares
at registration (quantizable, exports, a doctor source), quantize, benchmark and doctor it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT

PLUGINS = os.path.join(ROOT, "tests", "plugins")
CONFIG = os.path.join(PLUGINS, "toy_stripes.yaml")


def run(script, *args, cwd):
    env = dict(os.environ, PYTHONPATH=PLUGINS)
    out = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{script} {' '.join(args)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def stripe_png(path, left):
    pixels = np.full((16, 16, 3), 40, dtype=np.uint8)
    pixels[:, left:left + 4] = 220
    Image.fromarray(pixels).save(path)


@pytest.mark.slow
def test_a_family_outside_the_zoo_trains_evaluates_exports_and_predicts(tmp_path):
    before = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                            capture_output=True, text=True).stdout

    run("train.py", "--config", CONFIG, "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    best = str(tmp_path / "run" / "best.pt")

    run("evaluate.py", "--checkpoint", best, "--report-dir", str(tmp_path / "report"), cwd=tmp_path)
    report = json.load(open(tmp_path / "report" / "report.json"))
    # held-out pixels: a stripe covers 4 of 16 columns, so "all background" scores 75%
    assert report["metrics"]["pixel_acc"] > 95

    run("export.py", "--checkpoint", best, "--format", "onnx", "--output", str(tmp_path / "export"), cwd=tmp_path)
    artifacts = [f for f in os.listdir(tmp_path / "export") if f.endswith(".onnx")]
    assert len(artifacts) == 1
    spec = json.load(open(tmp_path / "export" / (artifacts[0] + ".json")))
    assert spec["adapter"] == "StripeSegmenter" and spec["imports"] == ["toy_stripes"]

    stripe_png(tmp_path / "left.png", 2)
    stripe_png(tmp_path / "right.png", 10)
    for model in (best, str(tmp_path / "export" / artifacts[0])):  # the checkpoint and the ONNX artifact
        out_dir = tmp_path / ("pred_" + os.path.basename(model))
        run("predict.py", "--checkpoint", model, str(tmp_path / "left.png"), str(tmp_path / "right.png"),
            "--output", str(out_dir), cwd=tmp_path)
        predictions = {os.path.basename(p["input"]): p for p in json.load(open(out_dir / "predictions.json"))["predictions"]}
        assert predictions["left.png"]["stripe_columns"] == [2, 3, 4, 5]
        assert predictions["right.png"]["stripe_columns"] == [10, 11, 12, 13]

    after = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout
    assert after == before  # nothing of the zoo was edited (or written) on the way


@pytest.mark.slow
def test_a_family_that_declares_quantizable_exports_and_a_doctor_source_gets_every_command(tmp_path):
    """Acceptance 3 of issue 33: quantize.py, export.py (int8 TorchScript), benchmark.py's int8 variant and
    doctor.py work on the toy family from its declarations alone."""
    before = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                            capture_output=True, text=True).stdout
    run("train.py", "--config", CONFIG, "--output-dir", str(tmp_path / "run"), "--set", "train.epochs=1", cwd=tmp_path)
    best = str(tmp_path / "run" / "best.pt")

    out = tmp_path / "int8.pt"
    run("quantize.py", "--checkpoint", best, "--calib-batches", "2", "--output", str(out),
        cwd=tmp_path)
    spec = json.load(open(str(out) + ".json"))
    assert spec["method"] == "ptq" and spec["adapter"] == "StripeSegmenter" and spec["artifact_format"] == "torchscript"

    run("export.py", "--checkpoint", best, "--format", "torchscript", "--output", str(tmp_path / "export"), cwd=tmp_path)
    spec = json.load(open(tmp_path / "export" / "model_int8.pt.json"))
    assert spec["check"]["ok"] and spec["imports"] == ["toy_stripes"]

    results = tmp_path / "bench.json"
    run("benchmark.py", "--checkpoint", best, "--variants", "fp32,int8", "--mode", "infer", "--steps", "2",
        "--warmup", "1", "--rounds", "1", "--json", str(results), cwd=tmp_path)
    variants = json.load(open(results))["variants"]
    assert set(variants) == {"fp32", "int8"}
    assert all(v[k]["median"] > 0 for v in variants.values() for k in ("infer_batch", "infer_1"))  # each one timed

    run("doctor.py", "--config", CONFIG, "--report-dir", str(tmp_path / "doctor"), "--workers", "1", cwd=tmp_path)
    report = json.load(open(tmp_path / "doctor" / "report.json"))
    assert not report.get("not_checked") and report["speed"]["samples"] == 64 + 32
    assert report["summary"]["integrity_errors"] == 0

    after = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout
    assert after == before
