"""benchmark.py end to end on a tiny config, and the amp recipe's dtype: auto (measured, cached, resumable)."""
import json

import torch

import benchmark
from engine.checkpoint import rng_state
from engine.loop import build_run
from test_engine import tiny_config


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
        assert r["infer_1"]["min"] > 0 and r["infer_batch"]["median"] >= r["infer_batch"]["min"]
        assert r["peak_mb"]["infer"] > 0
        assert ("train" in r) == (name != "int8")  # int8 is inference only
    loop = result["loop"]
    assert loop["steps"] == 2 and 0 < loop["loop_over_bare"]["median"]
    assert loop["loader_over_training"] > 0
    assert "| int8 |" in table and "loop / bare" in table


def test_amp_auto_picks_the_fastest_measured_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config("recipes=[amp]", "recipe_args.amp.steps=1")
    run = build_run(cfg, str(tmp_path / "a"))
    amp = next(iter(run.recipes))
    times = amp.choice["times"]
    assert set(times) == {"float32", "float32+channels_last", "bfloat16", "bfloat16+channels_last"}
    best = min(times, key=times.get)
    assert (amp.choice["dtype"], amp.choice["channels_last"]) == (best.split("+")[0], "channels_last" in best)
    assert run.model.net.features[0][0].weight.is_contiguous(
        memory_format=torch.channels_last) == amp.choice["channels_last"]
    cache = json.loads((tmp_path / "cache" / "amp_auto.json").read_text())
    assert len(cache) == 1
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

