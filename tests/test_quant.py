"""Quantization: the qat recipe (freezing, resume, int8 evaluation), the int8 artifact, PTQ.

One tiny QAT run (MobileNetV3-Small on 32x32 synthetic shapes, 3 epochs of 4 steps, observers and
BatchNorm frozen from epoch index 1) is shared by the tests of this module.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from engine.config import config_from_data
from helpers import FREEZE, qat_config


def qat_recipe(run):
    from recipes.qat import QAT
    return next(r for r in run.recipes if isinstance(r, QAT))


def fake_quantizers(model):
    return [m for m in model.modules() if isinstance(m, torch.ao.quantization.FakeQuantizeBase)]


def fused_bn_modules(model):
    return [m for m in model.modules() if hasattr(m, "freeze_bn") and hasattr(m, "bn")]


def frozen_state(state):
    """Entries that frozen observers and BatchNorm must leave untouched."""
    return {k: v for k, v in state.items()
            if k.endswith((".scale", ".zero_point", ".min_val", ".max_val", "running_mean", "running_var",
                           "num_batches_tracked", "observer_enabled"))}


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    """The uninterrupted run, keeping a copy of last.pt after every epoch."""
    import engine.loop as loop
    out = str(tmp_path_factory.mktemp("qat"))
    save = loop.save

    def save_and_keep(run, metrics, **kwargs):  # kwargs: the checkpoint before an evaluation (evaluated=False)
        save(run, metrics, **kwargs)
        shutil.copy(os.path.join(run.output_dir, "last.pt"), os.path.join(run.output_dir, f"epoch{run.epoch}.pt"))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "save", save_and_keep)
        run = loop.train(qat_config(), out)
    return run, out


@pytest.mark.slow
def test_qat_logs_fake_quant_and_int8_metrics_and_freezes(qat_run):
    run, out = qat_run
    assert {"val/top1", "val_int8/top1"} <= set(run.metrics)
    recipe = qat_recipe(run)
    assert recipe.observers_frozen and recipe.bn_frozen
    run.model.train()  # what the next epoch would do: frozen BatchNorm stays in eval mode
    assert fake_quantizers(run.model) and all(int(m.observer_enabled) == 0 for m in fake_quantizers(run.model))
    assert fused_bn_modules(run.model) and all(m.freeze_bn and not m.bn.training for m in fused_bn_modules(run.model))
    # before the freeze epoch, observers were live and statistics moved between epoch 0 and 1...
    from engine.checkpoint import load_checkpoint
    e0, e1, e2 = (load_checkpoint(os.path.join(out, f"epoch{i}.pt")) for i in range(3))
    assert e0["recipes"]["qat"] == {"observers_frozen": False, "bn_frozen": False, "backend": "x86"}
    assert any(not torch.equal(v, e1["model"][k]) for k, v in frozen_state(e0["model"]).items())
    # ...and after it they do not move any more, while the weights still train
    assert all(torch.equal(v, e2["model"][k]) for k, v in frozen_state(e1["model"]).items())
    assert any(not torch.equal(v, e2["model"][k]) for k, v in e1["model"].items() if k.endswith(".weight"))


@pytest.mark.slow
def test_resume_after_observers_froze_keeps_them_frozen(qat_run, tmp_path):
    from engine.loop import train
    run_a, out_a = qat_run
    resumed_from = os.path.join(out_a, f"epoch{FREEZE}.pt")  # observers and BatchNorm already frozen
    run_b = train(qat_config(), str(tmp_path), resume=resumed_from)
    recipe = qat_recipe(run_b)
    assert recipe.observers_frozen and recipe.bn_frozen
    run_b.model.train()
    assert all(int(m.observer_enabled) == 0 for m in fake_quantizers(run_b.model))
    assert all(m.freeze_bn and not m.bn.training for m in fused_bn_modules(run_b.model))
    from engine.checkpoint import load_checkpoint
    start = load_checkpoint(resumed_from)["model"]
    end = run_b.model.state_dict()
    assert all(torch.equal(v, end[k]) for k, v in frozen_state(start).items()), "frozen state moved after resume"
    # the resumed run continues the uninterrupted one exactly (CPU, same seeds and data order)
    final_a = run_a.model.state_dict()
    assert all(torch.equal(v, final_a[k]) for k, v in end.items())
    assert run_b.metrics == run_a.metrics


def test_load_state_dict_refreezes_batchnorm(tmp_path):
    """BatchNorm freezing is a plain attribute, not in the model's state dict: the recipe restores it."""
    from engine.build import build_run
    run = build_run(qat_config(), str(tmp_path))
    recipe = qat_recipe(run)
    run.model.train()
    assert not any(m.freeze_bn for m in fused_bn_modules(run.model))
    recipe.load_state_dict({"observers_frozen": True, "bn_frozen": True, "backend": "x86"})
    run.model.train()
    assert all(m.freeze_bn and not m.bn.training for m in fused_bn_modules(run.model))
    assert all(int(m.observer_enabled) == 0 for m in fake_quantizers(run.model))
    with pytest.raises(ValueError, match="backend"):
        recipe.load_state_dict({"observers_frozen": True, "bn_frozen": True, "backend": "qnnpack"})


def test_evaluation_leaves_live_observers_untouched(tmp_path):
    """Observers record in eval mode too: validation data must not enter the quantization ranges."""
    from engine.build import build_run
    from engine.epoch import train_one_epoch
    from engine.evaluation import evaluate
    run = build_run(qat_config(), str(tmp_path))
    run.optimizer = torch.optim.SGD(run.model.parameters(), lr=0.0)
    run.scheduler = torch.optim.lr_scheduler.ConstantLR(run.optimizer, factor=1.0, total_iters=0)
    train_one_epoch(run)  # training forwards do update them (lr 0: only observers and BN move)
    trained = {k: v.clone() for k, v in frozen_state(run.model.state_dict()).items()}
    assert any(int(m.observer_enabled) == 1 for m in fake_quantizers(run.model))
    evaluate(run.model, run.val_loader, run.data.evaluator(), run.device, run.recipes, run)
    after = frozen_state(run.model.state_dict())
    assert all(torch.equal(v, after[k]) for k, v in trained.items())
    assert all(int(m.observer_enabled) == 1 for m in fake_quantizers(run.model)), "observers left disabled"


CHILD = r"""
import json, sys, torch
files = {"metadata.json": ""}
model = torch.jit.load(sys.argv[1], map_location="cpu", _extra_files=files)
meta = json.loads(files["metadata.json"])
torch.backends.quantized.engine = meta["backend"]
with torch.no_grad():
    logits = model(torch.load(sys.argv[2], weights_only=True))
project = sorted(m for m in sys.modules if m.split(".")[0] in ("engine", "models", "recipes", "datasets", "torchvision"))
torch.save({"logits": logits, "meta": meta, "project_modules": project}, sys.argv[3])
"""


@pytest.mark.slow
def test_int8_artifact_runs_in_plain_torch_with_same_predictions(qat_run, tmp_path):
    from artifacts.quantization import convert_int8
    run, out = qat_run
    artifact = os.path.join(out, "model_int8.pt")
    inputs = torch.stack([run.data.val[i][0] for i in range(len(run.data.val))])
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = convert_int8(run.model)(inputs)
    # -I: isolated, neither the project folder nor PYTHONPATH on sys.path: only torch is importable
    subprocess.run([sys.executable, "-I", "-c", CHILD, artifact, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                   cwd=tmp_path, check=True, timeout=120)
    child = torch.load(tmp_path / "out.pt", weights_only=True)
    assert child["project_modules"] == []
    assert torch.equal(child["logits"].argmax(1), expected.argmax(1))
    torch.testing.assert_close(child["logits"], expected)
    meta = child["meta"]
    assert meta["classes"] == list(run.data.classes) and meta["method"] == "qat" and meta["backend"] == "x86"
    names = [step["name"] for step in meta["preprocessing"]]
    assert names[-1] == "Normalize" and meta["preprocessing"][-1]["mean"] == [0.5, 0.5, 0.5]
    assert meta["input_shape"] == [3, 32, 32]
    assert meta["metrics"]["val_int8/top1"] == run.metrics["val_int8/top1"]


def test_evaluate_py_artifact_matches_logged_int8_metric(qat_run, tmp_path):
    import evaluate
    run, out = qat_run
    report = evaluate.main(["--artifact", os.path.join(out, "model_int8.pt"), "--report-dir", str(tmp_path)])
    assert report["metrics"]["top1"] == pytest.approx(run.metrics["val_int8/top1"])
    assert report["num_samples"] == 48
    top1 = run.metrics["val_int8/top1"]  # the report.md shown to the user names the logged figure
    assert f"**top-1** {top1:.2f}%" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_ptq_from_fp32_checkpoint(tmp_path):
    from engine.loop import train
    import quantize
    from artifacts.load import load_int8 as load_artifact
    d = qat_config().model_dump(mode="json")
    d["model"]["quantize"] = False
    d["recipes"], d["recipe_args"], d["train"]["epochs"] = [], {}, 1
    train(config_from_data(d), str(tmp_path))
    results, path = quantize.main(["--checkpoint", str(tmp_path / "last.pt"), "--calib-batches", "2", "--eval-fp32"])
    model, meta = load_artifact(path)
    assert meta["method"] == "ptq" and meta["calibration_batches"] == 2
    assert meta["model"] == "mobilenet_v3_small" and len(meta["classes"]) == 4
    assert set(results) == {"fp32", "int8"}
    assert any(n.endswith("quantized::conv2d") or "quantized" in str(n) for n in
               [node.kind() for node in model.inlined_graph.nodes()])


def test_qat_refuses_what_it_cannot_do(tmp_path):
    from engine.build import build_run
    from recipes.qat import QAT
    with pytest.raises(ValueError, match="backend"):
        QAT(backend="avx512")
    d = qat_config().model_dump(mode="json")
    d["model"]["quantize"] = False
    with pytest.raises(TypeError, match="model.quantize: true"):
        build_run(config_from_data(d), str(tmp_path))
    d = qat_config().model_dump(mode="json")
    d["recipes"], d["recipe_args"]["precise_bn"] = ["qat", "precise_bn"], {"num_batches": 2}
    with pytest.raises(ValueError, match="precise_bn"):
        build_run(config_from_data(d), str(tmp_path))
    d = qat_config().model_dump(mode="json")
    d["recipes"] = ["amp", "qat"]
    with pytest.raises(ValueError, match="qat and amp"):
        build_run(config_from_data(d), str(tmp_path))


def test_int8_config_checks_builder_arguments_and_their_ranges_as_a_config_file():
    """The int8 config (the checkpoint's, with model.quantize=true) goes through engine.config's full
    check: a builder argument outside its declared range is a ConfigError naming the key and the
    config, before a model is built with it."""
    from artifacts.quantization import int8_config
    from engine.config import Config, ConfigError
    d = qat_config().model_dump(mode="json")
    d["model"]["width_mult"] = -1.0  # MobileNetV3's declared Range(gt=0)
    cfg = Config.model_validate(d)  # the schema alone passes it
    with pytest.raises(ConfigError, match=r"the int8 config of mobilenet_v3_small.*'model\.width_mult'.*> 0"):
        int8_config(cfg)
    d["model"]["width_mult"], d["model"]["widht_mult"] = 1.0, 1.0  # an argument the builder does not take
    with pytest.raises(ConfigError, match=r"unknown key 'model\.widht_mult'.*did you mean 'model\.width_mult'"):
        int8_config(Config.model_validate(d))
