"""A run's life on one process, as a user meets it: faults, interruptions, resume, run folders,
untrusted checkpoints. Uses the shared tiny config (tests/configs/tiny.yaml) and tests/dist_helper.py."""
import errno
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import dist_helper  # noqa: F401  (registers the test-only recipes and models)
from engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from engine.checkpoint import load_model_state as load_weights
from engine.config import load_config
from engine.loop import train

from conftest import ROOT
from helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from helpers import TINY, assert_same_weights, killed_at_step, run_main, script, wait_for, weights


def tiny(*overrides):
    return load_config(TINY, list(overrides))


# ---------------------------------------------------------------- faults in the loop

def test_nan_loss_stops_naming_step_and_terms_and_keeps_the_last_good_checkpoint(tmp_path):
    overrides = ["recipes=[_fault]", "recipe_args._fault={kind: nan, rank: 0, step: 3}", "checkpoint.every_n_steps=1"]
    with pytest.raises(FloatingPointError, match=r"step 3 .*loss_cls not finite"):
        train(tiny(*overrides), str(tmp_path))
    last = load_checkpoint(str(tmp_path / "last.pt"))
    assert last["step"] == 2 and all(torch.isfinite(v).all() for v in last["model"].values()
                                     if v.is_floating_point())


def test_fp16_grad_scaler_skips_a_nonfinite_step_instead_of_stopping(tmp_path):
    # a model without BatchNorm, whose running statistics NaN inputs would spoil whatever the scaler does
    run = train(tiny("model={name: _linear}", "recipes=[_fault,_fp16_scaler]", "recipe_args._fault={kind: nan, rank: 0, step: 3}"),
                str(tmp_path))
    assert run.step == 16 and run.scaler.get_scale() == 2.0 ** 16 / 2  # one step skipped, scale halved
    assert all(torch.isfinite(v).all() for v in weights(tmp_path / "last.pt").values() if v.is_floating_point())


def test_training_split_smaller_than_one_batch_stops_before_training(tmp_path):
    msg = run_main(tmp_path, "data.train_size=3")
    assert "3 samples" in msg and "data.batch_size 4" in msg and "1 process" in msg
    assert not (tmp_path / "last.pt").exists()


def test_best_metric_typo_is_caught_before_the_first_step(tmp_path):
    msg = run_main(tmp_path, "train.best_metric=top_1")
    assert "train.best_metric" in msg and "top_1" in msg and "top1, top5" in msg and TINY in msg
    assert not (tmp_path / "last.pt").exists() and not list(tmp_path.glob("events.out.tfevents.*"))  # nothing trained


# ---------------------------------------------------------------- interruptions and resume

@pytest.mark.process
def test_sigterm_mid_epoch_checkpoints_exits_and_resumes_to_the_same_weights(tmp_path):
    """issue 9 acceptance 3: a real SIGTERM to a real process."""
    common = ["recipes=[_fault]"]
    assert run_main(tmp_path / "straight", *common, "recipe_args._fault={kind: none}") is None
    pid_file = tmp_path / "pid"
    proc = script(tmp_path / "run", *common, f"recipe_args._fault={{kind: block, rank: 0, step: 6, pid_file: {pid_file}}}")
    os.kill(wait_for(pid_file, proc), signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    assert "SIGTERM" in out and "--resume" in out
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == 7  # the step in flight completed
    assert run_main(tmp_path / "run", *common, f"recipe_args._fault={{kind: block, rank: 0, step: 6, pid_file: {pid_file}}}",
                    flags=["--resume"]) is None
    assert_same_weights(weights(tmp_path / "straight" / "last.pt"), weights(tmp_path / "run" / "last.pt"))


@pytest.mark.process
def test_kill9_mid_epoch_then_resume_is_bit_identical_and_stale_temporaries_go(tmp_path):
    """issue 14: kill -9 (a real process), step checkpoints every 2 steps: at most 2 steps lost."""
    common = ["recipes=[_fault]", "checkpoint.every_n_steps=2"]
    assert run_main(tmp_path / "straight", *common, "recipe_args._fault={kind: none}") is None
    fault = killed_at_step(tmp_path, common, 11)
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == 10  # in the middle of epoch 2
    (tmp_path / "run" / ".tmp-crashed.pt").write_bytes(b"half a checkpoint")  # what a writer killed mid-write leaves
    assert run_main(tmp_path / "run", *common, fault, flags=["--resume"]) is None
    assert not (tmp_path / "run" / ".tmp-crashed.pt").exists()
    assert_same_weights(weights(tmp_path / "straight" / "last.pt"), weights(tmp_path / "run" / "last.pt"))


def test_tensorboard_after_resume_holds_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    crash = ["recipes=[_fault]", "recipe_args._fault={kind: raise, rank: 0, step: 4}", "checkpoint.every_n_steps=2",
             "train.epochs=1"]
    with pytest.raises(RuntimeError, match="injected"):
        train(tiny(*crash), str(tmp_path))  # step 3 was logged after the checkpoint at step 2
    train(tiny(*crash[:1], "recipe_args._fault={kind: none}", *crash[2:]), str(tmp_path), resume="auto", force=True)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))


def test_an_event_file_opened_in_the_same_second_is_read_after_the_older_one(tmp_path):
    # CI read a resumed run's steps before the crashed run's when the writers' counter went 9 -> 10
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer
    from engine.logger import TensorBoard
    while event_file_writer._global_uid.get() % 10 != 8:
        pass  # the next file gets a counter ending in 9, the one after it 10
    crashed = TensorBoard(str(tmp_path))
    crashed.scalars({"loss": 1.0}, 1, "train")
    crashed.scalars({"loss": 2.0}, 2, "train")
    crashed.close()
    resumed = TensorBoard(str(tmp_path), purge_step=2)
    resumed.scalars({"loss": 3.0}, 2, "train")
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 3.0)]


def logged(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def test_resume_auto_starts_fresh_then_resumes(tmp_path):
    train(tiny("train.epochs=1"), str(tmp_path), resume="auto")
    run = train(tiny(), str(tmp_path), resume="auto")
    assert run.step == 16 and load_checkpoint(str(tmp_path / "last.pt"))["epoch"] == 1


def test_resume_with_changed_config_lists_applies_and_refuses(tmp_path, capsys):
    train(tiny("train.epochs=1"), str(tmp_path / "a"))
    train(tiny("train.epochs=1"), str(tmp_path / "b"))
    # applied: lr ten times larger really takes effect (the cosine schedule continues from it)
    straight = train(tiny(), str(tmp_path / "a"), resume="auto")
    changed = train(tiny("optim.lr=0.1"), str(tmp_path / "b"), resume="auto")
    out = capsys.readouterr().out
    assert "optim.lr" in out and "0.01 -> 0.1" in out
    lr_a, lr_b = (logged(tmp_path / run, "train/lr") for run in "ab")
    assert lr_a[:8] == lr_b[:8] and len(lr_a) == len(lr_b) == 16
    assert lr_b[8:15] == pytest.approx([10 * lr for lr in lr_a[8:15]]) and min(lr_a[8:15]) > 0
    # breaking: listed key by key and refused without --force
    msg = run_main(tmp_path / "b", "optim.name=sgd", "model.width_mult=0.5", "train.epochs=3", flags=["--resume"])
    assert "optim.name" in msg and "'adamw' -> 'sgd'" in msg and "model.width_mult" in msg and "--force" in msg
    assert "train.epochs" in msg  # listed too, though it alone would be applied
    assert run_main(tmp_path / "b", "optim.name=sgd", "optim.lr=0.1", "train.epochs=3",
                    flags=["--resume", "--force"]) is None


# ---------------------------------------------------------------- run folders

def test_fresh_run_on_an_existing_run_is_refused_unless_resume_or_overwrite(tmp_path):
    assert run_main(tmp_path, "train.epochs=1") is None
    best = (tmp_path / "best.pt").read_bytes()
    msg = run_main(tmp_path, "train.epochs=1", "optim.lr=0.5")
    assert str(tmp_path) in msg and "already holds a run" in msg and "--overwrite" in msg
    assert (tmp_path / "best.pt").read_bytes() == best  # never replaced by another run's
    assert run_main(tmp_path, "train.epochs=1", "optim.lr=0.5", flags=["--overwrite"]) is None
    assert load_checkpoint(str(tmp_path / "best.pt"))["config"]["optim"]["lr"] == 0.5


@pytest.mark.process
def test_second_run_on_a_folder_in_use_refuses_unless_it_resumes_a_dead_run(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / "run.lock").write_text(f"{os.uname().nodename} {alive.pid}\n")
        msg = run_main(tmp_path, "train.epochs=1", flags=["--resume", "auto"])
        assert f"in use by process {alive.pid}" in msg and "run.lock" in msg
    finally:
        alive.kill()
        alive.wait()
    assert run_main(tmp_path, "train.epochs=1", flags=["--resume", "auto"]) is None  # its pid is dead now
    assert not (tmp_path / "run.lock").exists()


def test_checkpoint_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        save_checkpoint({"x": torch.ones(1)}, str(tmp_path / "a.pt"))
        os.umask(0o002)
        save_checkpoint({"x": torch.ones(1)}, str(tmp_path / "b.pt"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.pt").stat().st_mode & 0o777 == 0o664


def _mount(*args):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a real read-only or full file system")
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")


@pytest.mark.slow
def test_read_only_run_folder_is_refused_before_training_naming_the_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: a read-only bind mount
        _mount("--bind", "-o", "ro", str(folder), str(folder))
        cause, undo = "Read-only file system", ["umount", str(folder)]
    else:
        folder.chmod(0o555)
        cause, undo = "Permission denied", ["chmod", "755", str(folder)]
    try:
        msg = run_main(folder)
    finally:
        subprocess.run(undo, check=True)
    assert str(folder) in msg and msg.splitlines()[-1] == cause


@pytest.mark.slow
def test_full_disk_is_refused_before_training_naming_the_folder(tmp_path):
    folder = tmp_path / "full"
    folder.mkdir()
    _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder))  # a real, tiny file system
    try:
        msg = run_main(folder)
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    assert str(folder) in msg and msg.splitlines()[-1] == "No space left on device"


def test_disk_full_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The write itself failing with ENOSPC is faked (as torch.save reports it: a RuntimeError whose
    context is the OSError); the check before training uses a real tiny file system above."""
    assert run_main(tmp_path, "train.epochs=1") is None
    before = (tmp_path / "last.pt").read_bytes()
    from engine import checkpoint

    def full(state, f):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(checkpoint.torch, "save", full)
    msg = run_main(tmp_path, flags=["--resume"])
    assert str(tmp_path) in msg and msg.splitlines()[-1] == "No space left on device"
    assert (tmp_path / "last.pt").read_bytes() == before
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


# ---------------------------------------------------------------- checkpoints from elsewhere

def test_weights_of_another_model_list_missing_and_unexpected_keys():
    a, b = nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3))
    with pytest.raises(CheckpointError, match=r"(?s)2 missing.*missing: 2.weight, 2.bias") as e:
        load_weights(b, a.state_dict(), "a.pt")
    assert "checkpoint.strict" in str(e.value)
    with pytest.raises(CheckpointError, match=r"unexpected: 2.weight, 2.bias"):
        load_weights(a, b.state_dict(), "b.pt")
    load_weights(b, a.state_dict(), "a.pt", strict=False)  # loads what fits
    assert torch.equal(b[0].weight, a[0].weight)


class Payload:
    def __reduce__(self):
        return os.system, ("touch PWNED",)


def test_truncated_and_malicious_checkpoints_are_refused_naming_the_file(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint({"model": {"w": torch.ones(1000)}}, str(good))
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:500])
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'cut.pt'}: not a loadable checkpoint"):
        load_checkpoint(str(tmp_path / "cut.pt"))
    torch.save({"model": Payload()}, str(tmp_path / "evil.pt"))
    with pytest.raises(CheckpointError, match=r"evil.pt: refused: .*pickled Python object \((posix|os)\.system\)"
                                              r".*weights_only=True"):
        load_checkpoint(str(tmp_path / "evil.pt"))
    assert not (tmp_path / "PWNED").exists() and not os.path.exists(os.path.join(ROOT, "PWNED"))


def test_evaluate_with_a_config_that_differs_from_training_is_refused(tmp_path):
    import evaluate
    assert run_main(tmp_path, "train.epochs=1") is None
    args = ["--checkpoint", str(tmp_path / "last.pt"), "--config", TINY, "--report-dir", str(tmp_path / "r")]
    with pytest.raises(SystemExit) as e:
        evaluate.main(args + ["--set", "data.image_size=24", "data.train_size=32"])
    msg = str(e.value.code)
    assert "data.image_size" in msg and "16 -> 24" in msg and "--force" in msg and "data.train_size" not in msg
    assert evaluate.main(args + ["--set", "data.image_size=24", "--force"])["num_samples"] == 8
    assert evaluate.main(args + ["--set", "data.workers=1"])["num_samples"] == 8  # not preprocessing


# ---------------------------------------------------------------- accumulation, lr scaling, syncbn

def test_accumulating_two_batches_of_b_equals_one_batch_of_2b(tmp_path):
    """issue 9 acceptance 4 (fp32, a model without dropout or BatchNorm)."""
    common = ["model={name: _linear}", "train.epochs=1", "sched.warmup_epochs=0"]
    a = train(tiny(*common, "data.batch_size=8"), str(tmp_path / "a"))
    b = train(tiny(*common, "data.batch_size=4", "optim.accumulate_steps=2"), str(tmp_path / "b"))
    assert a.step == b.step == 4
    wa, wb = weights(tmp_path / "a" / "last.pt"), weights(tmp_path / "b" / "last.pt")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    assert not torch.equal(wa["fc.weight"], dist_helper.Linear(6, False).fc.weight)


def test_linear_lr_scaling_is_applied_and_logged(tmp_path, capsys):
    run = train(tiny("train.epochs=1", "sched.name=constant", "sched.warmup_epochs=0", "optim.accumulate_steps=2",
                     "optim.scale_lr_with_batch={base_batch: 4}"), str(tmp_path))
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.02)  # 0.01 x 8 / 4
    out = capsys.readouterr().out
    assert "global batch 8 = 4 per process x 1 process(es) x 2 accumulation step(s)" in out
    assert "lr 0.02 = optim.lr 0.01 x global batch 8 / base_batch 4" in out


def test_syncbn_converts_every_batchnorm_and_keeps_the_outputs():
    from recipes.batchnorm import convert_to_syncbn
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    model[1].running_mean += 0.5
    x = torch.randn(2, 3, 8, 8)
    expected = model.eval()(x)
    synced = convert_to_syncbn(model)
    kinds = [type(m) for m in synced.modules()]
    assert kinds.count(nn.SyncBatchNorm) == 2 and nn.BatchNorm2d not in kinds
    torch.testing.assert_close(synced.eval()(x), expected)


def test_no_torch_load_without_weights_only():
    """issue 14 acceptance 3: every torch.load in the repository passes weights_only=True."""
    import re
    offenders = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "data", "__pycache__")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                text = open(path).read()
                for m in re.finditer(r"torch\.load\(", text):
                    call = text[m.start():text.find("\n\n", m.start())][:300]
                    depth, end = 0, None
                    for i, ch in enumerate(call):
                        depth += ch == "("
                        depth -= ch == ")"
                        if depth == 0 and ch == ")":
                            end = i
                            break
                    if "weights_only=True" not in call[:end]:
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{text[:m.start()].count(chr(10)) + 1}")
    assert not offenders, offenders


@pytest.mark.slow
def test_augmentations_do_not_depend_on_workers_and_mid_epoch_resume_with_workers_is_exact(tmp_path):
    """Each sample draws its augmentation from its own seed (seed, epoch, index): no workers and two
    (persistent) workers train the same weights, and a resume in the middle of an epoch with workers
    continues with the same samples and augmentations. Before, the workers' random streams restarted,
    and the batches already done were trained again: DataLoader's worker iterator calls the batch
    sampler's iter() twice, and the first call used up the skip."""
    ok = ["recipes=[_fault]", "recipe_args._fault={kind: none}", "checkpoint.every_n_steps=2"]
    train(tiny(*ok, "data.workers=0"), str(tmp_path / "w0"))
    train(tiny(*ok, "data.workers=2"), str(tmp_path / "w2"))
    assert_same_weights(weights(tmp_path / "w0" / "last.pt"), weights(tmp_path / "w2" / "last.pt"))
    crash = ["recipes=[_fault]", "recipe_args._fault={kind: raise, rank: 0, step: 11}", "checkpoint.every_n_steps=2"]
    with pytest.raises(RuntimeError, match="injected"):
        train(tiny(*crash, "data.workers=2"), str(tmp_path / "resumed"))
    assert load_checkpoint(str(tmp_path / "resumed" / "last.pt"))["batches_done"] == 2  # 8 batches an epoch
    train(tiny(*ok, "data.workers=2"), str(tmp_path / "resumed"), resume="auto", force=True)
    assert_same_weights(weights(tmp_path / "w0" / "last.pt"), weights(tmp_path / "resumed" / "last.pt"))
