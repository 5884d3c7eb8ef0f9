"""issue 35 item 3: train.freeze (modules frozen for the first epochs, then trained) and optim.lr_mult
(per-module learning rates), on the shared tiny run (tests/configs/tiny.yaml: AdamW, weight decay 0.05,
cosine with half an epoch of warm-up, 8 steps an epoch, 2 epochs)."""
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import dist_helper  # noqa: F401  (registers the test-only recipes)
import freeze_probe  # noqa: F401  (registers _freeze_probe)
from conftest import ROOT
from engine.checkpoint import load_checkpoint
from engine.config import ConfigError, OptimConfig, SchedConfig, load_config
from engine.loop import train
from engine.optim import build_optimizer, build_scheduler
from helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from helpers import HELPER, TINY, assert_same_weights, killed_at_step, run_main, weights

FROZEN = ("net.features.0", "net.features.1.*")  # a prefix and an fnmatch pattern: the stem and the first block
FREEZE = "train.freeze={modules: [net.features.0, 'net.features.1.*'], epochs: 1}"
STEPS = 8  # an epoch of the tiny run


def frozen_key(key):
    return key.startswith(("net.features.0.", "net.features.1."))


def probe(folder, rank=0):
    return torch.load(os.path.join(str(folder), f"probe{rank}.pt"), weights_only=True)


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    """Frozen for epoch 1 of 2, the stem at lr_mult 0.1, with precise_bn and EMA; what the probe saw."""
    out = tmp_path_factory.mktemp("frozen") / "run"
    cfg = load_config(TINY, [FREEZE, "optim.lr_mult={net.features.0: 0.1}", "recipes=[precise_bn, ema, _freeze_probe]",
                             "recipe_args.precise_bn.num_batches=2", "recipe_args.ema.decay=0.9",
                             "recipe_args._freeze_probe={param: net.features.0.0.weight, trained_statistics: true}"])
    train(cfg, str(out))
    return probe(out)


def test_frozen_weights_and_batchnorm_statistics_are_bit_identical_through_the_frozen_epoch_then_change(frozen_run):
    start, unfrozen = frozen_run["epochs"][0]["state"], frozen_run["epochs"][1]["state"]
    final = frozen_run["final"]
    frozen = [k for k in start if frozen_key(k)]
    assert any(k.endswith("running_mean") for k in frozen) and any(k.endswith(".weight") for k in frozen)
    for k in frozen:  # weights, BatchNorm statistics and counts: after 8 AdamW steps with weight decay, precise_bn
        assert torch.equal(start[k], unfrozen[k]), k
    assert frozen_run["epochs"][0]["weight_decay"]["net.features.0.0.weight"] == 0.05  # decay that did not apply
    changed = {k for k in start if start[k].is_floating_point() and not torch.equal(start[k], unfrozen[k])}
    assert "net.classifier.3.weight" in changed and "net.features.2.block.0.1.running_mean" in changed  # the rest trained
    after = {k for k in frozen if final[k].is_floating_point() and not torch.equal(unfrozen[k], final[k])}
    assert {"net.features.0.0.weight", "net.features.0.1.running_mean", "net.features.1.block.0.0.weight"} <= after
    ema = [e["extra"]["ema"] for e in frozen_run["epochs"]]
    assert all(torch.equal(ema[0][k], ema[1][k]) for k in frozen if k.endswith(("weight", "bias")))


def test_frozen_parameters_have_no_gradient_no_optimizer_state_and_their_batchnorm_stays_in_eval(frozen_run):
    epoch0, epoch1 = frozen_run["epochs"]
    names = list(epoch0["requires_grad"])
    assert not any(epoch0["requires_grad"][n] for n in names if frozen_key(n))
    assert all(epoch0["requires_grad"][n] for n in names if not frozen_key(n))
    assert all(epoch1["requires_grad"].values())
    assert not any(epoch1["optimizer_state"][n] for n in names if frozen_key(n))  # never stepped: no AdamW moments
    assert all(epoch1["optimizer_state"][n] for n in names if not frozen_key(n))
    for entry in frozen_run["steps"]:  # after model.train() of each epoch
        for name, training in entry["bn_training"].items():
            assert training == (entry["epoch"] == 1 or not frozen_key(name + ".")), (entry["step"], name)


def test_unfrozen_parameters_step_at_the_schedules_lr_times_their_lr_mult(frozen_run):
    """The lr from the schedule's formula, written out: cosine over 16 - 4 iterations after a 4-iteration
    chained warm-up; at the unfreeze (iteration 8) 0.01 x 0.1 x (1 + cos(pi 4 / 12)) / 2. AdamW's first step of
    a weight moves each element by lr (g / |g|) after the decay: its largest move is that lr."""
    epoch1 = frozen_run["epochs"][1]
    factor = (1 + math.cos(math.pi * (STEPS - 4) / (2 * STEPS - 4))) / 2
    lr = 0.01 * 0.1 * factor
    assert epoch1["lr"]["net.features.0.0.weight"] == pytest.approx(lr, rel=1e-12)
    assert epoch1["lr"]["net.classifier.3.weight"] == pytest.approx(0.01 * factor, rel=1e-12)
    assert epoch1["lr"]["net.features.1.block.0.0.weight"] == pytest.approx(0.01 * factor, rel=1e-12)
    before, after = next(s["param"] for s in frozen_run["steps"] if s["step"] == STEPS + 1)
    move = before * (1 - lr * epoch1["weight_decay"]["net.features.0.0.weight"]) - after
    assert move.abs().max().item() == pytest.approx(lr, rel=1e-3)


def test_sgd_with_momentum_unfreezes_parameters_that_share_their_settings_with_trained_ones(tmp_path):
    """Fused SGD creates a group's momentum buffers together at its first step: the frozen parameters get groups
    of their own (same lr and decay), else the unfreeze would step a group where some have buffers and some not."""
    out = tmp_path / "run"
    assert run_main(out, "optim.name=sgd", "optim.lr=0.05", FREEZE, "recipes=[_freeze_probe]") is None
    seen = probe(out)
    unfrozen, final = seen["epochs"][1], seen["final"]
    assert not any(unfrozen["optimizer_state"][n] for n in unfrozen["optimizer_state"] if frozen_key(n))
    assert not torch.equal(unfrozen["state"]["net.features.0.0.weight"], final["net.features.0.0.weight"])
    assert unfrozen["lr"]["net.features.0.0.weight"] == unfrozen["lr"]["net.features.2.block.0.0.weight"]


def test_lr_mult_groups_follow_a_step_schedule():
    """The longest matching pattern wins (backbone.1 over backbone); each group's lr is lr x its multiplier x
    the step schedule's gamma ** epoch, computed here from the formula."""
    net = nn.ModuleDict({"backbone": nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), "head": nn.Linear(2, 2)})
    cfg = OptimConfig(name="sgd", lr=0.1, weight_decay=1e-4, norm_weight_decay=0.0,
                      lr_mult={"backbone": 0.1, "backbone.1": 0.5})
    optimizer = build_optimizer(net, cfg)
    scheduler = build_scheduler(optimizer, SchedConfig(name="step", step_size=1, gamma=0.5), 3, 2)
    mult = {"backbone.0": 0.1, "backbone.1": 0.5, "head": 1.0}
    group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for it in range(6):
        for name, p in net.named_parameters():
            expected = 0.1 * mult[name.rsplit(".", 1)[0]] * 0.5 ** (it // 2)
            assert group[id(p)]["lr"] == pytest.approx(expected, rel=1e-12), (it, name)
        assert group[id(net["backbone"][1].weight)]["weight_decay"] == 0.0  # the norm rule kept under the multiplier
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("sets, expected", [
    (["optim.lr_mult={backbone: 0.1}"], ["tiny.yaml: optim.lr_mult: 'backbone' matches no trainable parameter",
                                          "top-level modules: net"]),
    (["train.freeze={modules: [net.featurs], epochs: 1}"],
     ["tiny.yaml: train.freeze.modules: 'net.featurs' matches no", "did you mean 'net.features'"]),
    (["train.freeze={modules: [net], epochs: 1}"], ["train.freeze.modules ['net']: every trainable parameter"]),
    (["train.freeze={modules: [], epochs: 1}"], ["key 'train.freeze.modules'"]),
    (["train.freeze={modules: [net.features], epochs: 0}"], ["key 'train.freeze.epochs'"]),
    (["optim.lr_mult={net.features: 0}"], ["key 'optim.lr_mult.net.features'", "greater than 0"]),
], ids=["lr-mult-unmatched", "freeze-unmatched", "freeze-everything", "freeze-no-modules", "freeze-zero-epochs",
        "lr-mult-zero"])
def test_bad_freeze_and_lr_mult_settings_are_one_error_naming_the_key(tmp_path, sets, expected):
    message = run_main(tmp_path / "run", *sets)
    assert message is not None
    for part in expected:
        assert part in message, message
    assert not (tmp_path / "run" / "last.pt").exists()


def test_resume_with_another_lr_mult_regroups_with_a_fresh_optimizer_state(tmp_path, capsys):
    """The groups differ from the checkpoint's: a warning and a fresh optimizer state, its lrs the new config's
    (torch's load_state_dict would refuse the groups' sizes)."""
    out = tmp_path / "run"
    assert run_main(out, "train.epochs=1") is None
    assert run_main(out, "train.epochs=2", "optim.lr_mult={net.features: 0.5}", flags=["--resume"]) is None
    assert "the optimizer starts from a fresh state" in capsys.readouterr().out
    state = load_checkpoint(str(out / "last.pt"))
    assert state["step"] == 2 * STEPS
    assert sorted({g["initial_lr"] for g in state["optimizer"]["param_groups"]}) == [0.005, 0.01]


def test_patterns_are_checked_against_the_model_not_the_wrapper():
    """Names under DDP / torch.compile are the model's own: a pattern that matches nothing is refused either way."""
    net = nn.ModuleDict({"backbone": nn.Linear(2, 2), "head": nn.Linear(2, 2)})
    compiled = torch.compile(net)
    assert len(build_optimizer(compiled, OptimConfig(lr=0.1, lr_mult={"backbone": 0.1})).param_groups) == 2
    with pytest.raises(ConfigError, match="'_orig_mod' matches no"):
        build_optimizer(compiled, OptimConfig(lr=0.1, lr_mult={"_orig_mod": 0.1}))


@pytest.mark.process
def test_kill9_in_the_frozen_epoch_then_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    """A real process killed with SIGKILL after step 5 (step checkpoints every 2: last.pt at step 4, frozen),
    resumed: it crosses the unfreeze at step 8 and ends on the uninterrupted run's weights, bit for bit."""
    common = ["recipes=[_fault]", "checkpoint.every_n_steps=2", FREEZE, "optim.lr_mult={net.features: 0.5}"]
    assert run_main(tmp_path / "straight", *common, "recipe_args._fault={kind: none}") is None
    fault = killed_at_step(tmp_path, common, 5)
    killed = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert killed["step"] == 4 and killed["epoch"] == 0
    assert run_main(tmp_path / "run", *common, fault, flags=["--resume"]) is None
    straight = load_checkpoint(str(tmp_path / "straight" / "last.pt"))
    assert_same_weights(straight["model"], weights(tmp_path / "run" / "last.pt"))
    frozen = [k for k in straight["model"] if frozen_key(k)]
    assert not all(torch.equal(killed["model"][k], straight["model"][k]) for k in frozen)  # they trained after


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_freezes_then_unfreezes_on_two_processes(tmp_path):
    """torchrun, 2 CPU processes: DDP is built again at the freeze (the frozen weights out of its buckets: no
    wait for their gradients) and at the unfreeze (their gradients averaged again: both processes end with the
    same weights)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", HELPER, "train",
           "--config", TINY, "--output-dir", str(out), "--set", "imports=[freeze_probe]", "recipes=[_freeze_probe]",
           "data.batch_size=2", FREEZE]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    ranks = [probe(out, r) for r in (0, 1)]
    for seen in ranks:
        start, unfrozen = seen["epochs"][0]["state"], seen["epochs"][1]["state"]
        assert all(torch.equal(start[k], unfrozen[k]) for k in start if frozen_key(k))
        assert not all(torch.equal(unfrozen[k], seen["final"][k]) for k in start if frozen_key(k))
    names = ranks[0]["epochs"][0]["requires_grad"]  # the parameters (BatchNorm statistics are each process's own)
    assert all(torch.equal(ranks[0]["final"][n], ranks[1]["final"][n]) for n in names)
