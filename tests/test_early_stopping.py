"""train.early_stopping (issue 23): patience counted in evaluations of train.best_metric, the stop
recorded in last.pt, best.pt the best checkpoint, a resume of a stopped run that does nothing unless
the patience or the epochs changed, and every process of a torchrun job stopping at the same step."""
import json
import os
import re
import subprocess
import sys
import types

import pytest

from engine.checkpoint import load_checkpoint
from engine.config import EarlyStoppingConfig, load_config
from engine.limits import EarlyStopping

from conftest import ROOT

TINY = os.path.join(ROOT, "tests", "configs", "tiny.yaml")
# 8 samples of batch 4: 2 steps an epoch; lr 1e-9: the metric is flat from the first evaluation on
FLAT = ["data.train_size=8", "optim.lr=1e-9", "train.epochs=20", "train.early_stopping={patience: 2}"]


def counts(values, patience, min_delta=0.0, mode="max"):
    """The evaluations after which EarlyStopping stops (1-based), fed `values` in turn."""
    es = EarlyStopping(EarlyStoppingConfig(patience=patience, min_delta=min_delta))
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(train=types.SimpleNamespace(best_mode=mode)), epoch=0, step=0)
    for i, value in enumerate(values):
        run.epoch = i
        es.update(run, {"val/top1": value}, "val/top1")
        if es.stopped:
            return i + 1, es
    return None, es


def test_patience_counts_evaluations_without_an_improvement_larger_than_min_delta():
    assert counts([0.5, 0.6, 0.6, 0.6, 0.6], patience=3)[0] == 5
    assert counts([0.5, 0.6, 0.6, 0.7, 0.7, 0.7], patience=3)[0] is None  # 0.7 reset the count
    stop, es = counts([0.5, 0.6, 0.61, 0.615, 0.62], patience=3, min_delta=0.05)  # +0.01 steps are too small
    assert stop == 5 and es.best == 0.6 and es.best_epoch == 2 and "min_delta 0.05" in es.stopped
    assert counts([3.0, 2.0, 2.5, 2.1], patience=2, mode="min")[0] == 4  # a loss: lower is better


def test_a_plateau_stops_the_run_and_a_resume_does_nothing_unless_patience_or_epochs_change(tmp_path, capsys):
    from engine.loop import train
    run = train(load_config(TINY, FLAT), str(tmp_path))
    # the first evaluation sets the best, the next two do not improve it: stopped after epoch 3
    assert run.epoch == 2 and run.step == 6
    last, best = load_checkpoint(str(tmp_path / "last.pt")), load_checkpoint(str(tmp_path / "best.pt"))
    stopped = last["limits"]["early_stopping"]["stopped"]
    assert stopped.startswith("early stopping: val/top1") and "patience 2" in stopped and "after epoch 3, step 6" in stopped
    assert best["step"] == 2 and best["best"] == last["best"] == last["limits"]["early_stopping"]["best"]
    assert "WARNING early stopping: val/top1" in capsys.readouterr().out

    again = train(load_config(TINY, FLAT), str(tmp_path), resume=str(tmp_path / "last.pt"))
    assert again.step == 6 and "the run stopped early, nothing to do" in capsys.readouterr().out
    assert load_checkpoint(str(tmp_path / "last.pt"))["step"] == 6

    more = train(load_config(TINY, FLAT[:-1] + ["train.early_stopping={patience: 3}"]), str(tmp_path),
                 resume=str(tmp_path / "last.pt"))
    assert more.step == 8  # the count (2) is kept: one more flat evaluation reaches the new patience
    assert "patience 3" in load_checkpoint(str(tmp_path / "last.pt"))["limits"]["early_stopping"]["stopped"]


def test_one_epoch_number_from_1_in_the_log_stop_message_metrics_log_report_folders_and_evaluate_py_which_names_report_html(tmp_path, capsys):
    import evaluate
    from engine.loop import train
    train(load_config(TINY, FLAT + ["train.analysis=true"]), str(tmp_path / "run"))  # stops after the third epoch
    out = capsys.readouterr().out
    assert re.findall(r"epoch (\d+): val/top1", out) == ["1", "2", "3"]
    assert "val/top1" in out and "(epoch 1)" in out and "stopped after epoch 3, step 6" in out
    assert [json.loads(line)["epoch"] for line in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path / "run" / "reports")) == ["epoch_001", "epoch_002", "epoch_003"]
    evaluate.main(["--checkpoint", str(tmp_path / "run" / "last.pt"), "--report-dir", str(tmp_path / "eval")])
    # its last line names the page to open
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"report: {tmp_path / 'eval' / 'report.html'}  (open it")
    assert json.load(open(tmp_path / "eval" / "report.json"))["checkpoint"]["epoch"] == 3
    md = open(tmp_path / "eval" / "report.md").read()
    assert md.startswith("# Evaluation report: mobilenet_v3_small on synthetic_classification, epoch 3, step 6")
    assert "| checkpoint.epoch | 3 |" in md.split("## Appendix: provenance")[1]  # where it comes from: last


@pytest.mark.distributed
def test_under_torchrun_every_process_stops_at_the_same_step(tmp_path):
    helper = os.path.join(ROOT, "tests", "dist_helper.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", helper, "train",
           "--config", TINY, "--output-dir", str(tmp_path), "--set", *FLAT, "data.train_size=16",
           "recipes=[_final_step]", f"recipe_args._final_step={{folder: {tmp_path}}}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            cwd=ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "early stopping: val/top1" in out
    last = load_checkpoint(str(tmp_path / "last.pt"))
    # patience 2: stopped 2 epochs after the best one; 16 samples over 2 processes of batch 4: 2 steps an epoch
    stopped = re.search(r"\(epoch (\d+)\).*\(patience 2\): stopped after epoch (\d+), step (\d+)",
                        last["limits"]["early_stopping"]["stopped"])
    best_epoch, stop_epoch, step = map(int, stopped.groups())
    assert stop_epoch == best_epoch + 2 and step == 2 * stop_epoch == last["step"] < 40
    assert (tmp_path / "rank0.step").read_text() == (tmp_path / "rank1.step").read_text() == str(last["step"])
