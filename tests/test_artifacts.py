"""artifacts/: one policy for a config that differs from the checkpoint's, the same in every command
that takes a checkpoint (evaluate, export, predict, quantize, benchmark); the one strict artifact
description; an exported classifier evaluated like the checkpoint."""
import json
import os

import pytest
import yaml

import benchmark
import evaluate
import export
import predict
import quantize
import tiny_runs
from artifacts import ArtifactError
from artifacts.load import artifact_kind, load_artifact
from artifacts.spec import parse_spec
from conftest import shared_data
from engine.checkpoint import load_checkpoint
from engine.errors import UserError


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """MobileNetV3-Small trained a few steps on 32 px synthetic shapes."""
    return tiny_runs.classifier(tmp_path_factory.mktemp("cls"))


def _commands(checkpoint, out):
    """Every command line that takes a checkpoint, as main(extra arguments)."""
    return {
        "evaluate": lambda *a: evaluate.main(["--checkpoint", checkpoint, "--report-dir", str(out / "eval"), *a]),
        "export": lambda *a: export.main(["--checkpoint", checkpoint, "--output", str(out / "exp"),
                                          "--check-samples", "2", *a]),
        "predict": lambda *a: predict.main(["--checkpoint", checkpoint, "--output", str(out / "pred"), *a]),
        "quantize": lambda *a: quantize.main(["--checkpoint", checkpoint, "--output", str(out / "q.pt"),
                                              "--calib-batches", "1", *a]),
        "benchmark": lambda *a: benchmark.main(["--checkpoint", checkpoint, "--variants", "fp32", "--steps", "1",
                                                "--warmup", "0", "--rounds", "1", *a]),
    }


def _refusals(checkpoint, out, *extra):
    messages = {}
    for name, command in _commands(checkpoint, out).items():
        with pytest.raises(SystemExit) as e:
            command(*extra)
        messages[name] = str(e.value.code)
    return messages


def test_the_same_refusal_of_a_set_that_changes_preprocessing_in_every_command(classifier, tmp_path):
    messages = _refusals(classifier, tmp_path, "--set", "data.image_size=48", "data.workers=0")
    first = messages["evaluate"]
    assert all(m == first for m in messages.values()), messages
    assert first.startswith("error: --set differs from the config saved in " + classifier)
    assert "data.image_size" in first and "32 -> 48" in first and "--force" in first
    assert "data.workers" not in first  # loading, not preprocessing: may differ


def test_the_same_builder_check_of_set_in_every_command(classifier, tmp_path):
    messages = _refusals(classifier, tmp_path, "--set", "data.image_sise=48")
    first = messages["evaluate"]
    assert all(m == first for m in messages.values()), messages
    assert "unknown key 'data.image_sise'" in first and "did you mean 'data.image_size'" in first


class Built(UserError):
    """Stops a command when it builds its model: the config it got is recorded."""


def test_the_same_set_gives_the_same_config_in_every_command(classifier, tmp_path, monkeypatch):
    import artifacts.load
    import engine.build
    seen = {}

    def record(cfg, data):
        seen.setdefault(current, cfg.model_dump(mode="json"))
        raise Built("model built")

    monkeypatch.setattr(engine.build, "build_model", record)
    monkeypatch.setattr(artifacts.load, "build_model", record)  # where the loader holds its own name
    for current, command in _commands(classifier, tmp_path).items():
        with pytest.raises(SystemExit, match="model built"):
            command("--set", "data.eval_batch_size=3", "data.image_size=48", "--force")
    saved = load_checkpoint(classifier)["config"]
    expected = dict(saved["data"], eval_batch_size=3, image_size=48)
    assert set(seen) == set(_commands(classifier, tmp_path))
    for name, cfg in seen.items():
        assert cfg["data"] == expected, name
        assert cfg["model"]["name"] == saved["model"]["name"], name


def _config_file(checkpoint, path, **data):
    cfg = load_checkpoint(checkpoint)["config"]
    cfg["data"].update(data)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_predict_and_export_refuse_a_config_with_other_preprocessing_unless_forced(classifier, tmp_path):
    photos = shared_data("photos")
    config = _config_file(classifier, tmp_path / "x.yaml", image_size=64)
    for name, argv, main in [
            ("predict", ["--checkpoint", classifier, photos, "--config", config, "--output", str(tmp_path / "p")],
             predict.main),
            ("export", ["--checkpoint", classifier, "--config", config, "--output", str(tmp_path / "e"),
                        "--check-samples", "2", "--format", "torch_export"], export.main)]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        message = str(e.value.code)
        assert f"--config {config} differs from the config saved in {classifier}" in message, name
        assert "data.image_size" in message and "32 -> 64" in message and "--force" in message, name
    results = predict.main(["--checkpoint", classifier, photos, "--config", config, "--output", str(tmp_path / "p"),
                            "--force"])
    assert len(results) == len(os.listdir(photos))
    path, spec = export.main(["--checkpoint", classifier, "--config", config, "--output", str(tmp_path / "e"),
                              "--check-samples", "2", "--format", "torch_export", "--force"])
    assert spec["check"]["ok"] and spec["config"]["data"]["image_size"] == 64
    # a config that only changes how the data is loaded is no difference
    same = _config_file(classifier, tmp_path / "same.yaml", workers=0, eval_batch_size=2)
    same_results = predict.main(["--checkpoint", classifier, photos, "--config", same, "--output", str(tmp_path / "s")])
    assert len(same_results) == len(os.listdir(photos))


@pytest.mark.slow
def test_an_exported_classifier_evaluates_like_its_checkpoint(classifier, tmp_path):
    checkpoint_report = evaluate.main(["--checkpoint", classifier, "--report-dir", str(tmp_path / "c")])
    path, _ = export.main(["--checkpoint", classifier, "--format", "onnx", "--output", str(tmp_path / "exp"),
                           "--check-samples", "2", "--dynamic-batch"])
    report = evaluate.main(["--artifact", path, "--report-dir", str(tmp_path / "a"), "--set", "data.workers=0"])
    assert report["metrics"]["top1"] == pytest.approx(checkpoint_report["metrics"]["top1"])
    assert report["artifact"]["artifact_format"] == "onnx" and report["num_samples"] == 8
    with pytest.raises(SystemExit, match="data.image_size"):  # the artifact's saved config, the same policy
        evaluate.main(["--artifact", path, "--report-dir", str(tmp_path / "a"), "--set", "data.image_size=48"])
    with pytest.raises(SystemExit, match="--config and --set apply to checkpoints"):
        predict.main(["--checkpoint", path, "--set", "data.workers=0"])


@pytest.mark.slow
def test_artifact_descriptions_are_parsed_strictly(classifier, tmp_path):
    path, spec = export.main(["--checkpoint", classifier, "--format", "onnx", "--output", str(tmp_path),
                              "--check-samples", "2"])
    assert artifact_kind(path) == "onnx" and artifact_kind(classifier) == "checkpoint"
    description = path + ".json"
    good = json.loads(open(description).read())
    for change, words in [({"format": "zoo-export/0"}, "not an artifact description of this project"),
                          ({"inputs": "images"}, "field 'inputs' must be a list of input names"),
                          ({"classes": [["a"]]}, "field 'classes'"),
                          ({"dynamic_batch": "yes"}, "field 'dynamic_batch' must be true or false"),
                          ({"preprocessing": {"resize": {1, 2}}}, "field 'preprocessing'"),
                          ({"loader": "os.system"}, "unknown field(s) 'loader'")]:
        with pytest.raises(ArtifactError, match="x.json") as e:
            parse_spec(dict(good, **change), "x.json")
        assert words in str(e.value)
    with open(description, "w") as f:
        f.write("{not json")
    with pytest.raises(ArtifactError, match=f"{description}: not valid JSON"):
        load_artifact(path)
    os.remove(description)
    with pytest.raises(SystemExit, match=f"{description}: the description written by export.py"):
        predict.main(["--checkpoint", path, "--output", str(tmp_path / "p")])
    with pytest.raises(SystemExit, match="no such checkpoint or artifact: .*missing.pt"):
        predict.main(["--checkpoint", str(tmp_path / "missing.pt"), "--output", str(tmp_path / "p")])
