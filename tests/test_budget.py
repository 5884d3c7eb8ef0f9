"""train.budget (issue 23): the number of steps fitted to the time left, the lr schedule fitted to
the plan in closed form (continuous across corrections), and a train.py run that ends on time and
continues its plan after a stop and --resume."""
import os
import re
import signal
import subprocess
import sys
import types

import pytest
import torch

from engine.budget import BudgetPlan, cost, steps_that_fit
from engine.checkpoint import load_checkpoint
from engine.config import ConfigError, load_config

from conftest import ROOT
from helpers import Clock

TINY = os.path.join(ROOT, "tests", "configs", "tiny.yaml")


def test_the_plan_is_the_most_steps_whose_steps_evaluations_and_checkpoints_fit():
    times = (0.5, 3.0, 0.2)  # step, evaluation, checkpoint
    n = steps_that_fit(100, 0, 22, 5, None, times)
    assert cost(n, 0, 22, 5, None, times) <= 100 < cost(n + 1, 0, 22, 5, None, times)
    # 184 steps: 9 epochs of 22 (the last partial), evaluated after epochs 5 and 9, 9 checkpoints
    assert n == 184 and cost(n, 0, 22, 5, None, times) == pytest.approx(92 + 2 * 3.0 + 9 * 0.2)
    # step checkpoints cost too; an epoch end still to be evaluated and saved is counted
    assert steps_that_fit(100, 0, 22, 5, 10, times) < n
    assert cost(44, 44, 22, 2, None, times, pending_end=True) == pytest.approx(3.0 + 0.2)
    assert steps_that_fit(1.0, 50, 22, 5, None, times) == 50  # no time left: no more steps
    # an evaluation not timed yet is timed at the next epoch end: one more evaluation in the plan
    assert cost(184, 0, 22, 5, None, times, eval_next=True) == pytest.approx(92 + 3 * 3.0 + 9 * 0.2)


def plan_for(overrides, ipe=10):
    cfg = load_config(TINY, ["train.budget=60"] + overrides)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    plan = BudgetPlan(cfg)
    scheduler = plan.scheduler(types.SimpleNamespace(optimizer=optimizer), ipe)
    return plan, scheduler.lr_lambdas[0]


def test_the_plan_line_says_how_train_epochs_schedule_was_fitted_with_its_step_counts():
    from engine.budget import scaled_schedule
    words = scaled_schedule(15, 330, 4)  # the "scaled x0.0": 4 of 330 steps
    assert words == "the schedule of train.epochs 15 (330 steps) fitted to 4 steps (x0.0121)"


def test_the_schedule_of_train_epochs_is_scaled_to_the_plan_and_stays_continuous_across_corrections():
    plan, lr = plan_for(["train.epochs=10", "sched={name: cosine, warmup_epochs: 1}"])  # 100 steps nominal
    _, nominal = plan_for(["sched={name: cosine, warmup_epochs: 1}", "train.epochs=10"])
    plan.refit(0, 50)  # the budget fits 50 steps: warm-up, decay, everything at twice the pace
    for it in (0, 3, 5, 20, 25, 49):
        assert lr(it) == pytest.approx(nominal(2 * it))
    before = lr(30)
    plan.refit(30, 90)  # slower machine? no: faster, 60 more steps instead of 20
    assert lr(30) == pytest.approx(before) and lr(31) > nominal(62)  # the same lr, then a slower decay
    assert plan.clock(90) == 100 and lr(89) < 0.01


def test_without_train_epochs_the_decay_spans_the_plan_and_warm_up_counts_real_epochs():
    plan, lr = plan_for(["train.epochs=null", "sched={name: linear, warmup_epochs: 1}"])
    plan.refit(0, 80)  # the first plan sets the schedule's length
    assert lr(5) == pytest.approx(0.01 + 0.99 * 5 / 10)  # warm-up: 1 epoch of 10 steps
    assert lr(10) == pytest.approx(1.0) and lr(45) == pytest.approx(0.5) and lr(80) == 0.0  # linear to zero


def test_budget_replaces_epochs_and_is_checked():
    assert load_config(TINY, ["train.budget=20m", "train.epochs=null"]).train.budget == "20m"
    with pytest.raises(ConfigError, match=r"train.budget.*expected a wall time such as 20m"):
        load_config(TINY, ["train.budget=20 minutes"])
    with pytest.raises(ConfigError, match="set train.epochs or train.budget"):
        load_config(TINY, ["train.epochs=null"])


HELPER = os.path.join(ROOT, "tests", "dist_helper.py")


def budget_run(cmd):
    """Runs a train.py process (one compute thread); its output."""
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    return out


def ends_on_its_plan(last, budget):
    """last.pt of a run on tests/dist_helper.py's simulated clock (_sim_clock): it ended at its plan's last
    step, within 5% of the budget on that clock (what the load of the machine cannot change)."""
    state = last["limits"]["budget"]
    assert state["total"] == last["step"] > 0, state  # the plan, corrected, was carried out
    assert 0.95 * budget <= state["elapsed"] <= budget, state  # start-ups and an earlier process included


@pytest.mark.process
def test_a_budget_run_stopped_and_resumed_ends_on_time_and_finishes_its_plan(tmp_path):
    """train.py --budget 40s, SIGTERM once planned (exit 75), --resume: the resumed run ends the same
    plan, and both processes' times (the start-up of each counts) add up to the budget. The budget's
    clock is simulated (tests/dist_helper.py's _sim_clock: 2 s start-up, 0.2 s a step), so that a
    loaded machine's slow start-up does not spend it: the real processes, signal and resume remain."""
    budget, cmd = 40.0, [sys.executable, HELPER, "train", "--config", TINY, "--output-dir", str(tmp_path),
                         "--budget", "40s", "--set", "train.epochs=null", "sched.name=linear", "data.train_size=64",
                         "recipes=[_sim_clock]", f"recipe_args={{_sim_clock: {{step: 0.2, folder: {tmp_path}}}}}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "budget 40.0 s: plan at step" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    stopped = load_checkpoint(str(tmp_path / "last.pt"))
    assert 0 < stopped["step"] < stopped["limits"]["budget"]["total"], stopped["limits"]  # stopped inside its plan
    out = budget_run(cmd + ["--resume"])
    assert "spent before the resume" in out
    last = load_checkpoint(str(tmp_path / "last.pt"))
    ends_on_its_plan(last, budget)
    # why it ended, said once in the log and kept in last.pt
    ended = f"budget 40.0 s reached: the plan's {last['limits']['budget']['total']} steps"
    assert last["limits"]["ended"].startswith(ended) and f"step {last['step']}, epoch" in last["limits"]["ended"]
    assert out.count(ended) == 1, out[-2000:]
    both = stopped["limits"]["budget"]["elapsed"] + float((tmp_path / "clock0.seconds").read_text())
    assert 0.95 * budget <= both <= budget, both  # the first process's time counted in the second's plan


def simulate(monkeypatch, budget, step_seconds, eval_seconds=3.0, save_seconds=0.15, ipe=22, val_batches=4):
    """The loop's calls into the budget (engine/loop.py, engine.epoch.check_step) with simulated
    durations: step_seconds(elapsed) is the step time at that point (save_seconds may be a function of
    it too); the evaluation slows down as much as the steps do. Returns the run's end (seconds after
    its start) and the run (run.limits.budget the plan, run.evaluated_at the evaluated steps)."""
    from engine.epoch import check_step
    from engine.limits import Limits
    clock = Clock()
    monkeypatch.setattr("engine.budget.time", clock)
    monkeypatch.setattr("engine.budget._count_from", None)  # a train.py run earlier in this process set it
    cfg = load_config(TINY, [f"train.budget={budget}", "train.epochs=null", "sched.name=linear"])
    model = torch.nn.Linear(2, 2)
    run = types.SimpleNamespace(cfg=cfg, step=0, epoch=0, stop_signal=None, stop=False, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1), val_loader=[None] * val_batches,
                                scaler=types.SimpleNamespace(is_enabled=lambda: False))
    run.limits = Limits(cfg)
    run.limits.scheduler(run, ipe)
    start, quick, run.eval_pending, run.evaluated_at = clock.now, step_seconds(0.0), False, []
    save_time = save_seconds if callable(save_seconds) else lambda t: save_seconds
    for epoch in run.limits.epochs(run):
        for _ in range(0 if run.eval_pending else ipe):
            check_step(run, {"loss": torch.tensor(1.0)})
            clock.now += step_seconds(clock.now - start)
            run.step += 1
            if run.limits.after_step(run):
                break
        if run.limits.last_epoch(run, epoch) or (epoch + 1) % cfg.train.eval_every == 0:
            clock.now += eval_seconds * step_seconds(clock.now - start) / quick
            run.limits.after_eval(run, {})
            run.evaluated_at.append(run.step)
        run.eval_pending = False
        run.saved_plan = run.limits.budget.total  # what last.pt records
        clock.now += save_time(clock.now - start)
    return clock.now - start, run


@pytest.mark.parametrize("slowdown", [4.0, 15.0])
def test_a_machine_that_slows_down_halfway_still_ends_within_5_percent_of_the_budget(monkeypatch, slowdown):
    """The measured case of issue 23: digits at 0.25 s a step, two competing processes from the
    middle of a 2-minute budget make every step (and the evaluation) up to 15x slower. The plan is
    checked on the wall clock, not every N steps, and follows the slower pace at once."""
    end, run = simulate(monkeypatch, 120, lambda t: 0.25 if t < 60 else 0.25 * slowdown)
    assert 0.95 * 120 <= end <= 1.05 * 120, end  # ends at 117 s (4x) and 124.5 s (15x)
    assert run.limits.budget.total < 400  # corrected down from the quick pace's plan


def test_a_machine_that_gets_faster_uses_the_time_it_gains(monkeypatch):
    end, run = simulate(monkeypatch, 120, lambda t: 1.0 if t < 40 else 0.25)
    assert 0.95 * 120 <= end <= 1.05 * 120, end


def test_a_checkpoint_slower_than_planned_at_the_end_does_not_move_the_plan_after_last_pt_recorded_it(monkeypatch):
    """The CI failure of stop 29: the epoch end planned 6 more steps, its checkpoint took 0.5 s instead of
    0.15 s, and the top of the next epoch re-planned to 0 more: the run ended at step 432 while its last.pt
    said 438 (and the linear decay never reached its end). The epoch end's plan, made with measured
    times, stands; the checks on the wall clock follow the pace."""
    slow_once = []

    def save_seconds(elapsed):
        if elapsed < 37.0 or slow_once:
            return 0.15
        slow_once.append(elapsed)
        return 0.5

    end, run = simulate(monkeypatch, 40, lambda t: 0.06, eval_seconds=0.3, ipe=16, save_seconds=save_seconds)
    assert slow_once and run.saved_plan == run.limits.budget.total == run.step == run.evaluated_at[-1]
    assert 0.95 * 40 <= end <= 40, end


def test_a_run_resumed_after_a_stop_in_its_last_evaluation_evaluates_before_it_ends(monkeypatch):
    """Stopped during the last evaluation of its plan (last.pt: evaluated False) and resumed with the time
    nearly spent: the loop is given that epoch to evaluate, then the run ends."""
    from engine.limits import Limits
    monkeypatch.setattr("engine.budget._count_from", None)
    cfg = load_config(TINY, ["train.budget=60", "train.epochs=null", "sched.name=linear"])
    model = torch.nn.Linear(2, 2)
    run = types.SimpleNamespace(cfg=cfg, step=48, epoch=2, eval_pending=True, model=model, val_loader=[None] * 2,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    run.limits = Limits(cfg)
    run.limits.scheduler(run, 16)
    state = {"seconds": 60.0, "elapsed": 59.9, "nominal": 48.0, "segments": [[0, 0.0, 48]], "total": 48,
             "planned": True, "step_time": 0.05, "eval_time": 0.3, "eval_pace": 0.05, "save_time": 0.1,
             "evaluated_step": 32}
    run.limits.load_state_dict({"budget": state}, run, set())
    epochs = []
    for epoch in run.limits.epochs(run):
        epochs.append((epoch, run.eval_pending, run.limits.last_epoch(run, epoch)))
        run.limits.after_eval(run, {})
        run.eval_pending = False
    assert epochs == [(2, True, True)]
    assert list(run.limits.epochs(run)) == []  # evaluated at its last step: nothing more


@pytest.mark.distributed
def test_under_torchrun_a_budget_slowed_on_one_process_ends_on_time_at_the_same_step_everywhere(tmp_path):
    """2 processes (gloo), --budget 30s; process 1 slows down (4x) 8 s after its start. The checks of the plan
    are due on each process's clock and agreed in the step's all-reduce: every process corrects the plan
    at the same step and ends at the plan's last step, within 5% of the budget. On the simulated clock
    (_sim_clock: 0.1 s a step, 0.3 s more on process 1; the processes wait for each other at each step), so
    that the start-up of a loaded machine cannot spend the budget before the slow-down."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", HELPER, "train",
           "--config", TINY, "--output-dir", str(tmp_path), "--budget", "30s", "--set", "train.epochs=null",
           "sched.name=linear", "data.train_size=64", "recipes=[_final_step, _sim_clock]",
           f"recipe_args={{_final_step: {{folder: {tmp_path}}}, "
           "_sim_clock: {step: 0.1, slow_rank: 1, after: 8, extra: 0.3}}"]
    out = budget_run(cmd)
    paces = [float(m) for m in re.findall(r"budget 30.0 s: correction \(check\) at step \d+.*?step (\d+\.\d+) s", out)]
    assert paces and max(paces) >= 0.4, out[-3000:]  # process 0 saw process 1's slow-down
    last = load_checkpoint(str(tmp_path / "last.pt"))
    assert (tmp_path / "rank0.step").read_text() == (tmp_path / "rank1.step").read_text() == str(last["step"])
    ends_on_its_plan(last, 30)


@pytest.mark.slow
def test_steps_slowed_but_not_the_evaluation_the_plan_times_the_evaluation_again(tmp_path):
    """Steps 7x slower from 10 s on (0.05 s, then 0.35 s: a competing load that hits the training step's team
    of threads; the evaluation, a batch per thread, is not slowed here at all), evaluated after the first
    epoch and at the end only (eval_every 100). Scaled by the steps' slowdown, the 1.3-s evaluation would
    be planned at ~9 s: the run would end early, evaluate, find the time left and start again (a third
    evaluation), as the slowed digits run of issue 23 ended 8.7% early. The plan times a few validation
    batches again instead: two evaluations, and the run ends within 5% of the budget (on the simulated
    clock, _sim_clock: the same at any load)."""
    budget = 40.0
    cmd = [sys.executable, HELPER, "train", "--config", TINY, "--output-dir", str(tmp_path), "--budget",
           f"{budget:.0f}s", "--set", "train.epochs=null", "sched.name=linear", "data.train_size=64",
           "data.val_size=512", "train.eval_every=100", "recipes=[_sim_clock]",
           "recipe_args={_sim_clock: {step: 0.05, eval_batch: 0.01, after: 10, extra: 0.3}}"]
    out = budget_run(cmd)
    paces = [float(m) for m in re.findall(r"correction \(check\).*?step (\d+\.\d+) s, evaluation", out)]
    assert paces and max(paces) > 0.25, out[-3000:]  # the slowdown was seen
    evaluations = re.findall(r"INFO epoch (\d+): val/top1", out)
    assert len(evaluations) == 2, (evaluations, out[-3000:])  # the first epoch (timed) and the last
    ends_on_its_plan(load_checkpoint(str(tmp_path / "last.pt")), budget)


@pytest.mark.slow
def test_train_main_inside_a_longer_process_counts_its_budget_from_its_call(tmp_path, monkeypatch):
    """Only the process entry (train.command, `python train.py`) counts from the process start: a
    main() called later in a process (a notebook, a test) must not plan as if its budget had been
    spent since then."""
    import engine.budget
    import train
    monkeypatch.setattr("engine.budget._count_from", None)
    train.main(["--config", TINY, "--output-dir", str(tmp_path), "--set", "train.epochs=1", "data.train_size=8"])
    assert engine.budget._count_from is None
