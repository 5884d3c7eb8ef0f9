"""The loop end to end on the built-in data: resume, logging, recipes, checkpoints, evaluate.py."""
import os

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.build import build_run, training_forward
from engine.loop import train
from engine.registry import RECIPES
from engine.hooks import Recipe

from conftest import ROOT
from helpers import tiny_config
from engine.config import load_config


class StopAfterFirstEpoch(Exception):
    pass


@RECIPES.register("_test_interrupt")
class Interrupt(Recipe):
    """Simulates a job killed between epochs 1 and 2."""

    def before_epoch(self, run):
        if run.epoch == 1:
            raise StopAfterFirstEpoch


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    common = ["train.epochs=2", "data.workers=1", "recipes=[precise_bn,ema]"]
    train(tiny_config(*common), str(tmp_path / "straight"))
    with pytest.raises(StopAfterFirstEpoch):
        train(tiny_config(*common, "recipes=[precise_bn,ema,_test_interrupt]"), str(tmp_path / "resumed"))
    assert load_checkpoint(str(tmp_path / "resumed" / "last.pt"))["epoch"] == 0
    train(tiny_config(*common), str(tmp_path / "resumed"), resume=str(tmp_path / "resumed" / "last.pt"),
          force=True)  # the resumed config drops the test-only interrupting recipe

    a = load_checkpoint(str(tmp_path / "straight" / "last.pt"))
    b = load_checkpoint(str(tmp_path / "resumed" / "last.pt"))
    assert a["epoch"] == b["epoch"] == 1 and a["step"] == b["step"] == 6
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key in a["recipes"]["ema"]:
        assert torch.equal(a["recipes"]["ema"][key], b["recipes"]["ema"][key]), key
    assert a["scheduler"] == b["scheduler"] and a["metrics"] == b["metrics"]
    # and training did change the weights
    fresh = build_run(tiny_config(), str(tmp_path)).model.state_dict()
    assert any(not torch.equal(fresh[k], a["model"][k]) for k in fresh if fresh[k].is_floating_point())


def test_tensorboard_holds_losses_lr_speed_and_eval_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = tiny_config("train.epochs=1", "recipes=[ema]")
    train(cfg, str(tmp_path))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/loss_cls", "train/lr", "train/samples_per_s", "train/data_time",
                "train/step_time", "val/top1", "val/top5", "val_ema/top1"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    assert len(events.Scalars("train/loss")) == 3  # log_every=1, 48/16 steps
    assert "val/confusion_matrix" in events.Tags()["images"]
    assert load_config(str(tmp_path / "config.yaml")) == cfg  # the run's config, reloadable as it ran


def test_amp_and_channels_last_on_cpu_give_bf16_activations_and_nhwc_weights(tmp_path):
    run = build_run(tiny_config("recipes=[amp,channels_last]", "recipe_args.amp.dtype=bfloat16"), str(tmp_path))
    seen = {}
    conv = run.model.net.features[0][0]
    conv.register_forward_hook(lambda m, i, o: seen.update(dtype=o.dtype, nhwc=o.is_contiguous(
        memory_format=torch.channels_last)))
    losses = training_forward(run.model, next(iter(run.train_loader)), run)
    assert seen == {"dtype": torch.bfloat16, "nhwc": True}
    assert conv.weight.dtype == torch.float32  # autocast keeps fp32 master weights
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    losses["loss_cls"].backward()
    assert conv.weight.grad is not None and torch.isfinite(conv.weight.grad).all()


def test_checkpoints_are_atomic_and_load_weights_only(tmp_path, monkeypatch):
    from engine import checkpoint
    path = tmp_path / "last.pt"
    checkpoint.save_checkpoint({"x": torch.ones(2)}, str(path))

    def crash(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint({"x": torch.zeros(2)}, str(path))
    assert torch.equal(checkpoint.load_checkpoint(str(path))["x"], torch.ones(2))  # old file intact
    assert os.listdir(tmp_path) == ["last.pt"]  # no temporary left behind
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt"):
        checkpoint.load_checkpoint(str(tmp_path / "bad.pt"))


def test_evaluate_reports_the_top1_train_logged(tmp_path):
    from commands.evaluate import evaluate_checkpoint
    cfg = tiny_config("train.epochs=1")
    train(cfg, str(tmp_path / "run"))
    report = evaluate_checkpoint(cfg, str(tmp_path / "run" / "best.pt"), str(tmp_path / "report"))
    assert report["metrics"]["top1"] == report["train_logged_metrics"]["val/top1"]
    assert report["num_samples"] == 32 and sum(map(sum, report["confusion_matrix"])) == 32
    assert set(report["per_class_accuracy"]) == set(report["classes"])
    assert (tmp_path / "report" / "report.md").read_text().count("|") > 20


def test_missing_data_root_names_path_and_layout(tmp_path):
    import train as train_script
    with pytest.raises(SystemExit) as e:
        train_script.main(["--config", os.path.join(ROOT, "configs", "mobilenet_v3_small_digits.yaml"),
                           "--set", f"data.root={tmp_path}/nope", "--output-dir", str(tmp_path / "run")])
    msg = str(e.value)
    assert f"{tmp_path}/nope/train" in msg and "ROOT/train/<class>/" in msg and "data.root" in msg


@pytest.mark.slow
def test_last_checkpoint_carries_the_best_value_for_resume(tmp_path):
    train(tiny_config("train.epochs=2"), str(tmp_path))
    last, best = load_checkpoint(str(tmp_path / "last.pt")), load_checkpoint(str(tmp_path / "best.pt"))
    top1 = [best["metrics"]["val/top1"], last["metrics"]["val/top1"]]
    assert last["best"] == best["best"] == best["metrics"]["val/top1"] == max(top1)


@pytest.mark.slow
def test_resume_from_a_checkpoint_of_the_older_schedulers_replays_the_schedule(tmp_path):
    """Checkpoints written before the closed-form schedule hold a SequentialLR state; they resume,
    and end where an uninterrupted run ends."""
    from engine.checkpoint import save_checkpoint
    common = ["train.epochs=2", "data.workers=0", "recipes=[]"]
    train(tiny_config(*common), str(tmp_path / "straight"))
    with pytest.raises(StopAfterFirstEpoch):
        train(tiny_config(*common, "recipes=[_test_interrupt]"), str(tmp_path / "old"))
    last = str(tmp_path / "old" / "last.pt")
    state = load_checkpoint(last)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.002)
    ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=1)
    state["scheduler"] = torch.optim.lr_scheduler.SequentialLR(
        opt, [ramp, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)], milestones=[1]).state_dict()
    save_checkpoint(state, last)
    train(tiny_config(*common), str(tmp_path / "old"), resume=last, force=True)
    a = load_checkpoint(str(tmp_path / "straight" / "last.pt"))
    b = load_checkpoint(last)
    assert a["step"] == b["step"] == 6
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_data_workers_auto_loads_in_the_main_process_on_small_cpus(monkeypatch):
    """On CPU a worker process preempts the spinning intra-op threads (measured on 2 cores: the loop
    at 0.55 of the bare loop with one worker, 0.77 with none): auto gives none up to 4 cores."""
    from engine.build import loader_workers
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for cores, on_cpu, on_cuda in ((2, 0, 1), (4, 0, 3), (16, 2, 8), (64, 4, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert (loader_workers("auto", cpu), loader_workers("auto", cuda)) == (on_cpu, on_cuda), cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 processes share the 64 cores
    assert loader_workers("auto", cuda) == 7 and loader_workers(3, cpu) == 3


@pytest.mark.slow
def test_compile_recipe_compiles_in_place_before_ddp_and_trains_as_eager(tmp_path, capsys):
    """The compile recipe: in place (checkpoint keys without `_orig_mod.`), before ddp in the recipe
    order (torch's advice for DDP), the same losses as eager (the aot_eager backend: the traced
    graphs without inductor's code generation, so the test takes seconds), compile time logged."""
    from engine.hooks import RecipeStack
    assert [r.order for r in RecipeStack(["ddp", "compile", "ema"], {})] == sorted(
        [r.order for r in RecipeStack(["ddp", "compile", "ema"], {})])
    names = [type(r).__name__ for r in RecipeStack(["ddp", "compile", "ema"], {})]
    assert names.index("Compile") < names.index("DDP") and names.index("EMA") < names.index("Compile")
    common = ["train.epochs=1", "recipes=[]", "model.dropout=0.0"]
    eager = train(tiny_config(*common), str(tmp_path / "eager"))
    compiled = train(tiny_config(*common[:1], "model.dropout=0.0", "recipes=[compile]",
                                 "recipe_args.compile.backend=aot_eager"), str(tmp_path / "compiled"))
    assert "compile: first step" in capsys.readouterr().out
    a = load_checkpoint(str(tmp_path / "eager" / "last.pt"))["model"]
    b = load_checkpoint(str(tmp_path / "compiled" / "last.pt"))["model"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert eager.metrics == pytest.approx(compiled.metrics, abs=1e-6)


def test_a_run_starts_its_device_and_tensorboard_once(tmp_path, monkeypatch):
    """train(): the device picked and the process group joined once (engine.build.start_device, before
    the run folder is prepared), and one TensorBoard, opened in the run folder once it is ready."""
    import engine.build
    import engine.dist
    import engine.logger
    calls = {"pick_device": 0, "init_distributed": 0, "TensorBoard": 0, "SummaryWriter": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    pick = counted("pick_device", engine.build.pick_device)
    monkeypatch.setattr(engine.build, "pick_device", pick)
    monkeypatch.setattr("engine.loop.pick_device", pick, raising=False)  # where a caller holds its own name
    monkeypatch.setattr(engine.dist, "init_distributed", counted("init_distributed", engine.dist.init_distributed))
    monkeypatch.setattr(engine.logger.TensorBoard, "__init__",
                        counted("TensorBoard", engine.logger.TensorBoard.__init__))
    monkeypatch.setattr(engine.logger, "SummaryWriter", counted("SummaryWriter", engine.logger.SummaryWriter))
    train(tiny_config("recipes=[]", "train.epochs=1", "train.max_steps_per_epoch=1"), str(tmp_path))
    assert calls == {"pick_device": 1, "init_distributed": 1, "TensorBoard": 1, "SummaryWriter": 1}
