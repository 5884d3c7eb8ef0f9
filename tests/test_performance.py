"""benchmark.py end to end on a tiny config, and the amp recipe's dtype: auto (measured, cached, resumable)."""
import json

import pytest
import torch

import benchmark
import recipes.amp_autotune as autotune
from engine.seeding import rng_state
from engine.build import build_run
from helpers import tiny_config


@pytest.mark.slow
def test_benchmark_measures_every_variant_and_the_loop(tmp_path, capsys):
    out = tmp_path / "bench.json"
    benchmark.main(["--config", "configs/demo.yaml", "--set", "data.train_size=64", "data.val_size=16",
                    "data.image_size=32", "data.batch_size=8", "data.workers=0", "--variants",
                    "fp32,bf16+channels_last,int8", "--steps", "2", "--warmup", "1",
                    "--rounds", "2", "--loop", "--json", str(out)])
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["fp32", "bf16+channels_last", "int8"]
    for name, r in result["variants"].items():
        assert r["infer_1"]["min"] > 0 and r["batch"] == 8  # data.batch_size reached the timed batches
        assert r["peak_mb"]["infer"] > 0
        assert ("train" in r) == (name != "int8")  # int8 is inference only
    loop = result["loop"]
    assert loop["steps"] == 64 // 8 and 0 < loop["loop_over_bare"]["median"]  # one whole epoch
    assert loop["loader_over_training"] > 0
    assert "| int8 |" in table and "loop / bare" in table
    # a round shorter than the epoch: one bare step per trained batch (the loop fetches one more)
    benchmark.main(["--config", "configs/demo.yaml", "--set", "data.train_size=64", "data.val_size=16",
                    "data.image_size=32", "data.batch_size=8", "--variants", "fp32", "--mode", "train",
                    "--steps", "1", "--warmup", "1", "--rounds", "1", "--loop", "--loop-steps", "3",
                    "--json", str(out)])
    loop = json.loads(out.read_text())["loop"]
    assert loop["steps"] == loop["bare_steps_per_round"] == 3


def test_amp_auto_picks_the_fastest_measured_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config("recipes=[amp]", "recipe_args.amp.steps=1")
    run = build_run(cfg, str(tmp_path / "a"))
    amp = next(iter(run.recipes))
    times = amp.choice["times"]
    assert set(times) == {"float32", "float32+channels_last", "bfloat16", "bfloat16+channels_last",
                          "bfloat16+fp32_depthwise", "bfloat16+channels_last+fp32_depthwise"}  # MobileNetV3
    best = min(times, key=times.get)
    assert (amp.choice["dtype"], amp.choice["channels_last"], amp.choice["fp32_depthwise"]) == (
        best.split("+")[0], "channels_last" in best, "fp32_depthwise" in best)
    assert run.model.net.features[0][0].weight.is_contiguous(
        memory_format=torch.channels_last) == amp.choice["channels_last"]
    cache = json.loads((tmp_path / "cache" / "amp_auto.json").read_text())
    assert len(cache) == 1
    # the cache lookup, not the re-timing of the cached choice (on a loaded machine it may be 2x off and
    # measured again: test_amp_auto_remeasures_a_cached_choice_that_no_longer_holds)
    monkeypatch.setattr(autotune, "still_holds", lambda *args, **kwargs: True)
    again = next(iter(build_run(cfg, str(tmp_path / "b")).recipes))
    assert again.choice["cached"] and again.choice["times"] == times
    # resume: the checkpoint's choice wins over this machine's
    state = amp.state_dict()
    amp.choice = dict(amp.choice, dtype="bfloat16" if amp.choice["dtype"] == "float32" else "float32")
    amp.load_state_dict(state)
    assert amp.choice["dtype"] == json.loads(state["choice"])["dtype"]
    assert amp.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[amp.choice["dtype"]]


def test_amp_auto_leaves_the_runs_random_state_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    fixed = build_run(tiny_config("recipes=[amp]", "recipe_args.amp.dtype=bfloat16"), str(tmp_path / "a"))
    state_fixed = rng_state()["torch"]
    auto = build_run(tiny_config("recipes=[amp]", "recipe_args.amp.steps=1"), str(tmp_path / "b"))
    assert torch.equal(rng_state()["torch"], state_fixed)
    for a, b in zip(fixed.model.state_dict().values(), auto.model.state_dict().values()):
        assert torch.equal(a, b)  # the measurement trained a copy: weights and BN statistics untouched


def test_fp32_depthwise_keeps_grouped_convolutions_in_float32_under_bf16_autocast():
    """The per-module policy: depthwise convolutions leave autocast (float32 in and out, the values of
    the float32 convolution), the other layers stay bf16, and autocast is back on after them."""
    from torch import nn
    from recipes.amp import keep_depthwise_fp32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 4, 1), nn.Conv2d(4, 4, 3, groups=2))
    x = torch.randn(2, 8, 16, 16)
    keep_depthwise_fp32(model, "cpu")
    seen = []
    for m in model:
        m.register_forward_hook(lambda m, i, o: seen.append((o.dtype, torch.is_autocast_enabled("cpu"))))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
        assert torch.is_autocast_enabled("cpu")
    # the test's hooks run after the policy's: autocast is back on when the depthwise layer returns
    assert seen == [(torch.float32, True), (torch.bfloat16, True), (torch.float32, True)]
    reference = nn.functional.conv2d(x, model[0].weight, model[0].bias, padding=1, groups=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model[0](x), reference, rtol=0, atol=0)


def test_resume_applies_the_checkpoints_fp32_depthwise_choice(tmp_path, monkeypatch):
    """The checkpoint's precision wins on resume, the depthwise policy included (hooks added or removed)."""
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    run = build_run(tiny_config("recipes=[amp]", "recipe_args.amp.dtype=bfloat16"), str(tmp_path / "a"))
    amp = next(iter(run.recipes))
    grouped = [m for m in run.model.modules() if isinstance(m, torch.nn.Conv2d) and m.groups > 1]
    assert grouped and not any(m._forward_pre_hooks for m in grouped)
    amp.load_state_dict({"choice": json.dumps({"dtype": "bfloat16", "fp32_depthwise": True})})
    assert all(m._forward_pre_hooks for m in grouped)
    amp.load_state_dict({"choice": json.dumps({"dtype": "bfloat16", "fp32_depthwise": False})})
    assert not any(m._forward_pre_hooks for m in grouped)


def test_amp_auto_remeasures_a_cached_choice_that_no_longer_holds(tmp_path, monkeypatch, capsys):
    """A choice cached while the machine was busy (here: times 100x too slow, bf16 'winning') is
    re-timed at start-up, found off, and measured again."""
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config("recipes=[amp]", "recipe_args.amp.steps=1")
    first = next(iter(build_run(cfg, str(tmp_path / "a")).recipes)).choice
    path = tmp_path / "cache" / "amp_auto.json"
    cache = json.loads(path.read_text())
    (key, entry), = cache.items()
    stale = dict(entry, dtype="bfloat16", channels_last=False, fp32_depthwise=False,
                 times={name: t * 100 for name, t in entry["times"].items()})
    path.write_text(json.dumps({key: stale}))
    again = next(iter(build_run(cfg, str(tmp_path / "b")).recipes)).choice
    assert "measuring again" in capsys.readouterr().out and not again.get("cached")
    assert again["times"] != stale["times"] and json.loads(path.read_text())[key]["times"] == again["times"]
    assert first["times"].keys() == again["times"].keys()


def test_sgd_and_adamw_use_the_fused_kernel_with_the_per_tensor_loops_update():
    from engine.config import OptimConfig
    from engine.optim import build_optimizer
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=6)
    for cfg in (OptimConfig(name="adamw", lr=1e-3, weight_decay=0.05, norm_weight_decay=0.0),
                OptimConfig(name="sgd", lr=0.1, nesterov=True, weight_decay=1e-4)):
        fused, loop = model, torchvision.models.mobilenet_v3_small(num_classes=6)
        loop.load_state_dict(model.state_dict())
        a = build_optimizer(fused, cfg)
        b = build_optimizer(loop, cfg.model_copy(update={"fused": False}))
        assert a.defaults["fused"] and not b.defaults.get("fused")
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p, q in zip(fused.parameters(), loop.parameters()):
                p.grad = torch.randn(p.shape, generator=g)
                q.grad = p.grad.clone()
            a.step()
            b.step()
        for p, q in zip(fused.parameters(), loop.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
