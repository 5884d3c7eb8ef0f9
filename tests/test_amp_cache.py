"""The amp recipe's dtype: auto (issue 25): the cache key holds what changes the choice (a detector's
model.size among it), and a run built for a checkpoint (evaluate.py, resume) applies the precision
stored in it without timing anything; without a stored choice, evaluation times inference only."""
import json
import os
import sys

import pytest
import torch

import recipes.amp_autotune as autotune
from commands.evaluate import evaluate_checkpoint
from engine.build import build_run
from engine.config import config_from_data
from engine.loop import train
from helpers import tiny_config
import platform

FAKE_TIMES = {"float32": 0.03, "float32+channels_last": 0.02, "bfloat16": 0.3, "bfloat16+channels_last": 0.2,
              "bfloat16+fp32_depthwise": 0.05, "bfloat16+channels_last+fp32_depthwise": 0.04}


@pytest.fixture
def timings(tmp_path, monkeypatch):
    """Every call of the timing function ({train, candidates}), which answers fixed times at once."""
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake(model, batch, device, candidates, steps=3, train=True, limit=None):
        calls.append({"train": train, "candidates": list(candidates), "limit": limit})
        return {autotune.candidate_name(*c): FAKE_TIMES[autotune.candidate_name(*c)] for c in candidates}

    monkeypatch.setattr(autotune, "time_candidates", fake)
    return calls


def cache_entries(tmp_path):
    return json.loads((tmp_path / "cache" / "amp_auto.json").read_text())


def ssdlite_config(tmp_path, size):
    """SSDlite at model.size `size` on 96 px shapes: the images (the example batch) do not change with it."""
    return config_from_data({
        "seed": 0, "device": "cpu", "optim": {"name": "adamw", "lr": 0.003}, "sched": {"name": "constant"},
        "model": {"name": "ssdlite320_mobilenet_v3_large", "size": size, "detections_per_img": 20},
        "data": {"name": "shapes", "root": os.path.join(str(tmp_path), "shapes"), "num_train": 8, "num_val": 4,
                 "image_size": 96, "batch_size": 2, "workers": 0},
        "train": {"epochs": 1, "max_steps_per_epoch": 1}, "recipes": ["amp"]})


def test_two_model_sizes_give_two_cache_entries(tmp_path, timings):
    for size in (96, 128):
        build_run(ssdlite_config(tmp_path, size), str(tmp_path / f"run{size}"))
    entries = cache_entries(tmp_path)
    assert len(entries) == 2 and len(timings) == 2
    assert all(e["dtype"] == "float32" and e["channels_last"] for e in entries.values())
    run = build_run(ssdlite_config(tmp_path, 128), str(tmp_path / "again"))  # a hit: one re-timing step only
    amp = next(iter(run.recipes))
    assert amp.choice["cached"] and len(cache_entries(tmp_path)) == 2
    assert [len(c["candidates"]) for c in timings] == [6, 6, 1]


def test_cache_key_holds_shapes_threads_and_training_or_inference():
    model = torch.nn.Conv2d(3, 4, 3)
    x = torch.zeros(2, 3, 8, 8)
    key = autotune.cache_key({"name": "m", "size": 96}, model, x, False)
    assert key != autotune.cache_key({"name": "m", "size": 128}, model, x, False)
    assert key != autotune.cache_key({"name": "m", "size": 96}, model, torch.zeros(4, 3, 8, 8), False)  # batch
    assert key != autotune.cache_key({"name": "m", "size": 96}, model, x, False, train=False)
    assert key != autotune.cache_key({"name": "m", "size": 96}, torch.nn.Conv2d(3, 8, 3), x, False)
    assert key != autotune.cache_key({"name": "m", "size": 96}, model, x, True)  # the forced layout
    threads = torch.get_num_threads()
    try:  # another thread count: another key ("1" or "2" alone is in any key, e.g. in the torch version)
        torch.set_num_threads(threads + 1)
        assert key != autotune.cache_key({"name": "m", "size": 96}, model, x, False)
    finally:
        torch.set_num_threads(threads)
    assert torch.__version__ in key and autotune.cpu_name() in key


@pytest.mark.slow
def test_evaluated_and_resumed_checkpoints_time_nothing(tmp_path, timings, capsys, monkeypatch):
    cfg = tiny_config("train.epochs=1", "recipes=[amp,precise_bn]")
    train(cfg, str(tmp_path / "run"))
    assert len(timings) == 1 and timings[0]["train"]  # training measured training steps, once
    stored = json.loads(torch.load(tmp_path / "run" / "last.pt", weights_only=True)["recipes"]["amp"]["choice"])
    assert (stored["dtype"], stored["channels_last"]) == ("float32", True)
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "empty_cache"))  # no cache to lean on either
    capsys.readouterr()
    report = evaluate_checkpoint(cfg, str(tmp_path / "run" / "last.pt"), str(tmp_path / "report"))
    assert report["num_samples"] == 32
    assert len(timings) == 1, "evaluate.py timed candidates although the checkpoint stores its choice"
    assert "float32+channels_last, stored in the checkpoint" in capsys.readouterr().out
    train(tiny_config("train.epochs=2", "recipes=[amp,precise_bn]"), str(tmp_path / "run"),
          resume=str(tmp_path / "run" / "last.pt"))
    assert len(timings) == 1, "the resumed run timed candidates although the checkpoint stores its choice"
    assert not (tmp_path / "empty_cache" / "amp_auto.json").exists()


def test_a_checkpoint_without_a_choice_is_timed_on_inference_only(tmp_path, timings):
    train(tiny_config("train.epochs=1", "recipes=[precise_bn]"), str(tmp_path / "run"))
    assert not timings
    evaluate_checkpoint(tiny_config("recipes=[amp]"), str(tmp_path / "run" / "last.pt"), str(tmp_path / "report"))
    assert len(timings) == 1 and timings[0]["train"] is False
    (key,) = cache_entries(tmp_path)
    assert key.endswith("|infer")


class SimClock(list):
    """[seconds], shared by the copies the timing makes of a model."""

    def __deepcopy__(self, memo):
        return self


class Ticking(torch.nn.Module):
    """A model whose every forward takes one second of a simulated clock (`clock[0]`)."""

    def __init__(self, clock):
        super().__init__()
        self.w, self.clock = torch.nn.Parameter(torch.ones(1)), clock

    def forward(self, x, targets=None):
        self.clock[0] += 1.0
        return {"loss": self.w * x.float().mean()}


def test_a_capped_timing_chooses_among_what_it_timed_says_so_and_caches_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path / "cache"))
    clock = SimClock([0.0])
    monkeypatch.setattr(autotune, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    batch, cpu = (torch.ones(2, 3, 4, 4), None), torch.device("cpu")
    # 4 candidates of 4 forwards (a warm-up and 3 timed) each: 5 s reach the first and one timed step of the second
    choice = autotune.measure(Ticking(clock), batch, cpu, "ticking", steps=3, limit=5)
    assert choice["capped"] and set(choice["times"]) == {"float32", "float32+channels_last"}
    assert choice["dtype"] == "float32" and not (tmp_path / "cache" / "amp_auto.json").exists()
    assert "timing capped at 5 s" in caplog.text and "bfloat16, bfloat16+channels_last not timed" in caplog.text
    clock[0] = 0.0
    choice = autotune.measure(Ticking(clock), batch, cpu, "ticking", steps=3)  # no budget: all four, cached
    assert "capped" not in choice and len(choice["times"]) == 4 and clock[0] == 16
    assert (tmp_path / "cache" / "amp_auto.json").exists()


def test_a_budget_run_gives_the_timing_a_tenth_of_its_budget(tmp_path, timings):
    build_run(tiny_config("train.budget=90s", "train.epochs=null"), str(tmp_path / "run"))
    build_run(tiny_config(), str(tmp_path / "plain"))
    assert [c["limit"] for c in timings] == [9.0, None]


def test_inference_timing_runs_no_backward():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.zeros(2, 3, 8, 8))
    before = model[1].running_mean.clone()
    times = autotune.time_candidates(model, (torch.randn(2, 3, 8, 8), None), torch.device("cpu"),
                                     [("float32", False, False), ("float32", True, False)], steps=1, train=False)
    assert set(times) == {"float32", "float32+channels_last"} and all(t > 0 for t in times.values())
    assert all(p.grad is None for p in model.parameters()) and torch.equal(model[1].running_mean, before)


FAULTS = """
import resource, sys, torch
from engine.build import keep_freed_memory
applied = keep_freed_memory()
for _ in range(2):  # 64 MB: a block over glibc's 32 MB mmap ceiling (the heap grows to hold it once)
    torch.empty(2**24).fill_(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(2**24).fill_(1)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_runs_keep_freed_memory_instead_of_faulting_it_in_again():
    """SSDlite at 512 px spent 43% of a step in page faults: blocks over 32 MB were unmapped when freed."""
    import subprocess
    from conftest import ROOT

    def faults(**env):
        out = subprocess.run([sys.executable, "-c", FAULTS], cwd=ROOT, env={**os.environ, **env},
                             capture_output=True, text=True, check=True).stdout.split()
        return out[0] == "True", int(out[1])
    if platform.libc_ver()[0] != "glibc":  # decided apart from the code under test, which must apply it on glibc
        pytest.skip(f"not glibc ({platform.libc_ver()})")
    system_applied, system = faults(ZOO_MALLOC="system")
    applied, kept = faults()
    assert applied, "keep_freed_memory was not applied on glibc"
    assert not system_applied and system >= 20 * 32  # every 64 MB block faulted in again (4 KB or 2 MB pages)
    assert kept < system / 5  # a block's worth or two while the heap settles, then none
