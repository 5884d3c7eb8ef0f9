"""Issue 32, items 6-12: work lost to failed --overwrite runs, max_steps_per_epoch and
skip_bad_samples, a CSV row that swallows the next, SIGTERM at start-up, pickled model.weights and a
budget overrun, each with real processes and real crafted files."""
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import dist_helper  # noqa: F401  (registers the test-only recipes and models)
from conftest import ROOT, shared_data
from datasets import text
from engine import checkpoint
from engine.build import build_run
from engine.checkpoint import load_checkpoint
from engine.config import load_config
from engine.epoch import check_step
from engine.limits import Limits
from engine.registry import DATASETS
from engine.seeding import start_epoch_data
from helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from helpers import Clock, block, finish, image_folder, run_main, start, truncate, wait_for

RUN = ("last.pt", "best.pt", "config.yaml")


def files(folder, names=RUN):
    return {f: (folder / f).read_bytes() for f in names if (folder / f).exists()}


def killed(out, *overrides, pid_file, flags=("--overwrite",)):
    """A train.py process stopped with kill -9 after its first optimizer step, before its first checkpoint."""
    proc = start(out, "train.epochs=1", "recipes=[_fault]", block("block", 1, pid_file), *overrides, flags=flags)
    wait_for(pid_file, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


# ---------------------------------------------------------------- 6: two failed --overwrite runs in a row

@pytest.mark.process
def test_two_failed_overwrite_runs_in_a_row_keep_the_finished_run(tmp_path):
    run = tmp_path / "run"
    assert run_main(run, "train.epochs=1") is None
    finished = files(run)
    assert set(finished) == set(RUN)
    # the probe's case: --overwrite killed before its first checkpoint leaves the finished run aside
    killed(run, pid_file=tmp_path / "pid1")
    assert files(run / ".replaced") == finished and not (run / "last.pt").exists()
    # a second --overwrite killed before its first checkpoint: the finished run is never removed
    killed(run, pid_file=tmp_path / "pid2")
    assert files(run / ".replaced") == finished
    # a third fails its pre-flight check (a real process): the finished run is back in its folder
    code, out = finish(start(run, "train.epochs=1", "data.train_size=3", flags=["--overwrite"]))
    assert code == 1 and "3 samples" in out and "the previous run is back" in out, out[-3000:]
    assert files(run) == finished and not any((run / d).exists() for d in (".replaced", ".replacing", ".restoring"))
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # the killed runs' logs went with them
    # killed again, then resumed: --resume continues the finished run, not the killed one
    killed(run, pid_file=tmp_path / "pid3")
    code, out = finish(start(run, "train.epochs=2", flags=["--resume"]))
    assert code == 0 and "the previous run is back" in out, out[-3000:]
    assert load_checkpoint(str(run / "last.pt"))["step"] == 16 and (run / "best.pt").exists()
    assert not (run / ".replaced").exists()


@pytest.mark.parametrize("stage", ["set_aside", "restore"])
def test_a_kill_at_any_move_of_an_overwrite_loses_nothing(tmp_path, monkeypatch, stage):
    """kill -9 between any two of the file moves (os.replace) of setting the old run aside or putting it
    back: the next run that takes the lock (recover_run_folder) has the finished run whole. The moves
    are interrupted by an exception at the n-th os.replace, as a kill would stop them."""
    base = tmp_path / "base"
    assert run_main(base, "train.epochs=1") is None
    finished = files(base)
    real_replace, n = os.replace, 0
    while True:
        run = tmp_path / f"{stage}{n}"
        shutil.copytree(base, run)
        if stage == "restore":  # a new run's leftovers beside the old run aside
            checkpoint.set_aside_run(str(run))
            (run / "config.yaml").write_text("the killed run's config")
            (run / "events.out.tfevents.1.host.2").write_text("the killed run's log")
        calls = []

        def replace(src, dst):
            if len(calls) == n:
                raise KeyboardInterrupt("killed")
            calls.append(src)
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        try:
            (checkpoint.set_aside_run if stage == "set_aside" else checkpoint.restore_replaced_run)(str(run))
            done = True
        except KeyboardInterrupt:
            done = False
        monkeypatch.setattr(os, "replace", real_replace)
        checkpoint.recover_run_folder(str(run))
        assert files(run) == finished, (stage, n)
        assert not any((run / d).exists() for d in (".replaced", ".replacing", ".restoring"))
        if done:
            break
        n += 1
    assert n >= 4  # every move of the run's files and the renames of the folder


# ---------------------------------------------------------------- 7: max_steps_per_epoch reads no batch past its steps

def imagefolder_config(tmp_path, per_class, batch_size, crop=16, data="", **train):
    """A real ImageFolder (test_reliability_data.image_folder) and a tiny config of it."""
    paths = image_folder(tmp_path / "data", per_class=per_class)
    config = tmp_path / "run.yaml"
    config.write_text(f"""model: {{name: mobilenet_v3_small, width_mult: 0.25, reduced_tail: true}}
data: {{name: imagefolder, root: {tmp_path / 'data'}, batch_size: {batch_size}, workers: 0, train_crop_size: {crop},
        val_crop_size: {crop}, val_resize_size: {crop}{data}}}
optim: {{name: adamw, lr: 0.01}}
train: {{epochs: 1, log_every: 1, analysis: false, {', '.join(f'{k}: {v}' for k, v in train.items())}}}
""")
    return str(config), paths


def train_process(config, out, *overrides, timeout=300):
    """python train.py (the command line) to its end: (exit code, output)."""
    cmd = [sys.executable, "train.py", "--config", config, "--output-dir", str(out)]
    proc = subprocess.run(cmd + (["--set", *overrides] if overrides else []), cwd=ROOT, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc.returncode, proc.stdout


@pytest.mark.slow
def test_max_steps_per_epoch_reads_no_batch_past_its_last_step(tmp_path):
    config, paths = imagefolder_config(tmp_path, per_class=6, batch_size=4, max_steps_per_epoch=1)
    run = build_run(load_config(config), str(tmp_path / "probe"))
    start_epoch_data(run, 0)  # the epoch's shuffle, as the run draws it (indices only)
    first = {run.data.train.samples[i][0] for _, i in next(iter(run.train_loader.batch_sampler))}
    corrupt = [p for p in paths if f"{os.sep}train{os.sep}" in p and p not in first]
    for path in corrupt:  # every training image but the first step's: the next batch is all corrupt
        truncate(path, 0.3)
    code, out = train_process(config, tmp_path / "run")
    assert code == 0, out[-3000:]
    assert not any(p in out for p in corrupt)
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == 1


# ---------------------------------------------------------------- 8: skip_bad_samples at batch size 1

@pytest.mark.slow
def test_skip_bad_samples_at_batch_size_1_leaves_the_step_out_and_trains_on(tmp_path):
    # 64 px: at batch size 1 MobileNetV3's last BatchNorm needs more than one value a channel
    config, paths = imagefolder_config(tmp_path, per_class=3, batch_size=1, crop=64, data=", skip_bad_samples: true")
    bad_train, bad_val = paths[1], paths[7]  # 6 training images, then 6 validation images
    truncate(bad_train, 0.3)
    truncate(bad_val, 0.3)
    code, out = train_process(config, tmp_path / "run")
    assert code == 0, out[-3000:]
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == 5  # 6 steps, 1 left out
    report = [line for line in out.splitlines() if "unreadable training samples skipped" in line]
    assert len(report) == 1 and "1 unreadable" in report[0] and "1 step(s) left out" in report[0], out[-3000:]
    assert bad_train in report[0]
    assert f"skipped bad sample {bad_val}" in out  # the evaluation leaves it out too, logged where it is read
    # unless every sample of the epoch is bad: then it is an error naming them, not an empty run
    for path in paths[:6]:
        truncate(path, 0.3)
    code, out = train_process(config, tmp_path / "run2")
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "nothing was trained" in errors[0] and paths[5] in errors[0], out[-3000:]
    assert "Traceback" not in out


# ---------------------------------------------------------------- 9: a CSV row that swallows the next

def test_a_csv_row_whose_closing_quote_is_lost_is_named_in_a_warning(tmp_path, caplog):
    lines = open(os.path.join(shared_data("ag_news"), "test.csv"), newline="").read().splitlines(True)[:400]
    good, bad = tmp_path / "good.csv", tmp_path / "train.csv"
    good.write_text("".join(lines), newline="")
    assert lines[57].rstrip("\r\n").endswith('"')
    lines[57] = lines[57].rstrip("\r\n")[:-1] + "\n"  # line 58 loses its closing quote
    bad.write_text("".join(lines), newline="")
    with caplog.at_level(logging.WARNING):
        assert len(text.read_csv(str(good))[0]) == 400
    assert not caplog.records  # the real file: no row spans lines
    texts, _ = text.read_csv(str(bad))
    assert len(texts) == 399  # row 59 merged into row 58's text: fewer rows, no error
    warnings = [r.getMessage() for r in caplog.records if "span several lines" in r.getMessage()]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "row 58: lines 58-59" in warnings[0], warnings
    # the data set builder reads it the same way (what train.py and the doctor run)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        DATASETS.build("csv_text", root=str(tmp_path), train_file="train.csv", val_fraction=0.25, classes="ag_news",
                       vocab_size=200, max_length=16)
    assert any("row 58: lines 58-59" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- 10: SIGTERM in the first seconds

def proc_file(pid, name):
    try:
        return open(f"/proc/{pid}/{name}").read()
    except OSError:
        return ""


def catches_sigterm(pid):
    caught = [line.split()[1] for line in proc_file(pid, "status").splitlines() if line.startswith("SigCgt:")]
    return bool(caught) and int(caught[0], 16) & (1 << (signal.SIGTERM - 1))


@pytest.mark.process
@pytest.mark.parametrize("when", ["handler installed", "importing torch", "importing torch + 0.5 s"])
def test_sigterm_in_the_first_seconds_exits_75_with_one_line(tmp_path, when):
    """The signal arrives as soon as the process catches SIGTERM at all, or while train.py imports torch
    (libtorch mapped into the process, seconds before the loop's handlers), or a little later."""
    config = os.path.join(ROOT, "configs", "demo.yaml")
    proc = subprocess.Popen([sys.executable, "train.py", "--config", config, "--output-dir", str(tmp_path / "run")],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    ready = catches_sigterm if when == "handler installed" else lambda pid: "libtorch" in proc_file(pid, "maps")
    while not ready(proc.pid):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.01)
    if when.endswith("+ 0.5 s"):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75 and "Traceback" not in out, (proc.returncode, out[-3000:])
    stops = [line for line in out.splitlines() if line.startswith("stopped:")]
    assert stops == ["stopped: SIGTERM during start-up: nothing was trained yet"], out[-3000:]
    if not when.endswith("+ 0.5 s"):  # (a fast machine may be in the loop's start-up by then: the same line)
        assert out.strip() == stops[0] and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- 11: a pickle given as model.weights

@pytest.mark.slow
def test_a_pickle_given_as_model_weights_is_one_error_line_naming_the_file(tmp_path):
    marker, evil = tmp_path / "marker", tmp_path / "evil.pt"
    # a crafted weights file: unpickling its 'model' entry would call open(marker, "w")
    subprocess.run([sys.executable, "-c", f"""
import torch
class Evil:
    def __reduce__(self):
        return (open, ({str(marker)!r}, "w"))
torch.save({{"model": Evil()}}, {str(evil)!r})
"""], check=True)
    assert not marker.exists()
    code, out = train_process(os.path.join(ROOT, "tests", "configs", "tiny.yaml"), tmp_path / "run",
                              f"model.weights={evil}")
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert str(evil) in errors[0] and re.search(r"pickled Python object \([\w.]*open\)", errors[0]), errors[0]
    assert not marker.exists()


# ---------------------------------------------------------------- 12: a budget spent by the start-up

def test_a_budget_spent_by_the_start_up_is_logged_as_overrun_and_why(monkeypatch, caplog):
    """The probe's --budget 1s after 38 s of start-up, on the budget's simulated clock (test_budget.Clock),
    with the loop's calls into the budget (as test_budget.simulate makes them)."""
    clock = Clock()
    monkeypatch.setattr("engine.budget.time", clock)
    monkeypatch.setattr("engine.budget._count_from", clock.now)  # the process starts
    cfg = load_config(os.path.join(ROOT, "tests", "configs", "tiny.yaml"), ["train.budget=1s"])
    clock.now += 38.0  # imports, data, model
    model = torch.nn.Linear(2, 2)
    run = types.SimpleNamespace(cfg=cfg, step=0, epoch=0, stop_signal=None, stop=False, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1), val_loader=[None] * 2,
                                eval_pending=False, scaler=types.SimpleNamespace(is_enabled=lambda: False))
    run.limits = Limits(cfg)
    run.limits.scheduler(run, 8)
    with caplog.at_level(logging.INFO, logger="engine.budget"):
        for epoch in run.limits.epochs(run):
            for _ in range(8):
                check_step(run, {"loss": torch.tensor(1.0)})
                clock.now += 0.05
                run.step += 1
                if run.limits.after_step(run):
                    break
            if run.limits.last_epoch(run, epoch):
                clock.now += 0.3
                run.limits.after_eval(run, {})
            clock.now += 0.1  # the checkpoint
    messages = [r.getMessage() for r in caplog.records]
    assert run.step == 1 and not any("before the budget" in m for m in messages), messages
    overrun = [m for m in messages if "overrun" in m]
    assert len(overrun) == 2, messages
    assert re.match(r"budget 1\.0 s overrun by 37\.\d s when planning \(step 1\)", overrun[0]) and \
        "no more steps" in overrun[0]
    assert re.match(r"budget 1\.0 s overrun by 37\.\d s at the end of the run \(step 1\)", overrun[1])
    assert all("the start-up alone (imports, data, model, the recipes' set-up) took 38.0 s" in m for m in overrun)
