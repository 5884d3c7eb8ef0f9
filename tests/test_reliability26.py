"""Issue 26: nothing lost and nothing silently wrong, with real processes and real signals where a
scheduler would send them (SLURM and Kubernetes signal the whole process group)."""
import os
import re
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image

import dist_helper  # noqa: F401  (registers the test-only recipes and models)
import train as train_script
from conftest import ROOT, shared_data
from engine.checkpoint import load_checkpoint
from engine.errors import UserError
from helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from helpers import assert_same_weights, block, finish, run_main, start, wait_for, weights


# ---------------------------------------------------------------- 1: SIGTERM to the group, with loader workers

@pytest.mark.process
def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_and_resumes(tmp_path):
    common = ["recipes=[_fault]", "data.workers=2"]
    assert run_main(tmp_path / "straight", "recipes=[_fault]", "recipe_args._fault={kind: none}") is None
    pid_file = tmp_path / "pid"
    proc = start(tmp_path / "run", *common, block("block", 6, pid_file))
    wait_for(pid_file, proc)
    os.killpg(proc.pid, signal.SIGTERM)  # the main process and its two loader workers
    code, out = finish(proc)
    assert code == 75, out[-3000:]  # at once: the next assertion's step
    assert "killed by signal" not in out and "exited unexpectedly" not in out
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == 7  # only the step in flight
    assert run_main(tmp_path / "run", *common, block("block", 6, pid_file), flags=["--resume"]) is None
    # the workers' draws do not depend on data.workers: the same weights as a run without workers
    assert_same_weights(weights(tmp_path / "straight" / "last.pt"), weights(tmp_path / "run" / "last.pt"))


# ---------------------------------------------------------------- 2: --overwrite

@pytest.mark.slow
def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tmp_path):
    assert run_main(tmp_path, "train.epochs=1") is None
    old = {f: (tmp_path / f).read_bytes() for f in ("last.pt", "best.pt", "config.yaml")}
    # a typo that the pre-flight checks catch: the old run is untouched
    msg = run_main(tmp_path, "train.epochs=1", "data.train_size=3", flags=["--overwrite"])
    assert "3 samples" in msg
    assert {f: (tmp_path / f).read_bytes() for f in old} == old
    # a failure after the checks, before the first checkpoint (a real process): the old run comes back
    code, out = finish(start(tmp_path, "train.epochs=1", "recipes=[_fault]",
                             "recipe_args._fault={kind: raise, rank: 0, step: 2}", flags=["--overwrite"]))
    assert code == 1 and "injected fault" in out and "the previous run is back" in out, out[-3000:]
    assert {f: (tmp_path / f).read_bytes() for f in old} == old and not (tmp_path / ".replaced").exists()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # the failed run's log went with it
    # a run that writes its checkpoint replaces it
    assert run_main(tmp_path, "train.epochs=1", "optim.lr=0.5", flags=["--overwrite"]) is None
    assert load_checkpoint(str(tmp_path / "last.pt"))["config"]["optim"]["lr"] == 0.5
    assert not (tmp_path / ".replaced").exists() and len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


# ---------------------------------------------------------------- 3: a stop during evaluation

@pytest.mark.process
def test_sigterm_during_evaluation_exits_at_once_with_the_epochs_checkpoint_and_resumes(tmp_path):
    common = ["recipes=[_fault]"]
    assert run_main(tmp_path / "straight", *common, "recipe_args._fault={kind: none}") is None
    pid_file = tmp_path / "pid"
    proc = start(tmp_path / "run", *common, block("block_eval", 8, pid_file))  # the evaluation after epoch 1
    pid = wait_for(pid_file, proc)
    # the epoch's training is on disk before the evaluation: a scheduler's SIGKILL at any moment keeps it
    state = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert (state["step"], state["epoch_complete"], state["evaluated"]) == (8, True, False)
    os.kill(pid, signal.SIGTERM)
    code, out = finish(proc)
    assert code == 75, out[-3000:]
    assert "SIGTERM during evaluation" in out and "--resume" in out
    assert "epoch 1: val/top1" not in out  # honoured at the next batch, not after the evaluation
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == 8
    assert run_main(tmp_path / "run", *common, block("block_eval", 8, pid_file), flags=["--resume"]) is None
    straight, resumed = (load_checkpoint(str(tmp_path / d / "last.pt")) for d in ("straight", "run"))
    assert_same_weights(straight["model"], resumed["model"])
    assert resumed["metrics"] == straight["metrics"] and resumed["best"] == straight["best"]
    # best.pt: the same checkpoint as the uninterrupted run's (weights, step, metrics)
    best_straight, best_resumed = (load_checkpoint(str(tmp_path / d / "best.pt")) for d in ("straight", "run"))
    assert_same_weights(best_straight["model"], best_resumed["model"])
    assert (best_resumed["step"], best_resumed["metrics"]) == (best_straight["step"], best_straight["metrics"])


# ---------------------------------------------------------------- 4: validation data, checked before training

def voc(root, bad_val=True):
    """A VOC layout: 8 training and 2 validation images; one validation mask holds class 50."""
    base = root / "VOCdevkit" / "VOC2012"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / d).mkdir(parents=True)
    names = [f"im{i}" for i in range(10)]
    for i, name in enumerate(names):
        Image.fromarray(np.full((24, 24, 3), 20 * i, np.uint8)).save(base / "JPEGImages" / f"{name}.jpg")
        labels = np.zeros((24, 24), np.uint8)
        labels[6:18, 6:18] = 50 if bad_val and name == "im9" else 1 + i % 20
        png = Image.fromarray(labels, mode="P")
        png.putpalette([0, 0, 0] * 256)
        png.save(base / "SegmentationClass" / f"{name}.png")
    (base / "ImageSets" / "Segmentation" / "train.txt").write_text("\n".join(names[:8]) + "\n")
    (base / "ImageSets" / "Segmentation" / "val.txt").write_text("\n".join(names[8:]) + "\n")


def voc_run(tmp_path, *overrides):
    """train.py's main on a VOC layout with LR-ASPP: the error message, or None."""
    config = tmp_path / "voc.yaml"
    config.write_text(f"""model: {{name: lraspp_mobilenet_v3_large}}
data: {{name: voc_segmentation, root: {tmp_path / 'data'}, base_size: 24, crop_size: 24, batch_size: 4, workers: 0}}
optim: {{name: adamw, lr: 0.001}}
train: {{epochs: 1, best_metric: mIoU}}
""")
    argv = ["--config", str(config), "--output-dir", str(tmp_path / "run")] + (["--set", *overrides] if overrides else [])
    try:
        train_script.main(argv)
    except SystemExit as e:
        return str(e.code)


def test_a_bad_validation_mask_stops_before_training_naming_it(tmp_path):
    voc(tmp_path / "data")
    msg = voc_run(tmp_path)
    assert "im9.png" in msg and "50" in msg
    assert not (tmp_path / "run" / "config.yaml").exists()  # before the run started: nothing trained


def test_a_sample_that_fails_only_in_evaluation_keeps_the_epochs_training(tmp_path):
    """With the check off (a split too large to read twice), the checkpoint precedes the evaluation."""
    voc(tmp_path / "data")
    msg = voc_run(tmp_path, "train.check_val_samples=0")
    assert "im9.png" in msg
    state = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert (state["step"], state["evaluated"]) == (2, False)


# ---------------------------------------------------------------- 5: stale locks

@pytest.mark.process
def test_a_lock_left_by_a_hard_killed_run_on_another_host_is_taken_over_after_its_lease(tmp_path):
    run, lease = tmp_path / "run", "checkpoint.lock_lease=1"
    common = ["recipes=[_fault]", lease, "train.epochs=1"]
    pid_file = tmp_path / "pid"
    proc = start(run, *common, block("block", 3, pid_file))
    pid = wait_for(pid_file, proc)
    lock = run / "run.lock"
    lock.write_text(f"node-b {pid}\n")  # as seen from another host: its pid cannot be checked
    time.sleep(1.5)  # longer than the lease: the live run keeps refreshing it
    msg = run_main(run, *common, block("block", 3, pid_file), flags=["--resume", "auto"])
    assert msg and "in use by process" in msg and "node-b" in msg and "lock_lease" in msg
    os.killpg(proc.pid, signal.SIGKILL)  # hard-killed: the lock stays behind
    proc.communicate()
    assert lock.read_text() == f"node-b {pid}\n"
    time.sleep(1.5)
    proc = start(run, *common, block("block", 3, pid_file), flags=["--resume", "auto"])
    code, out = finish(proc)
    assert code == 0, out[-3000:]
    assert re.search(r"taking over .*run\.lock from process \d+ on node-b: its lock was last refreshed", out)
    assert not lock.exists()


# ---------------------------------------------------------------- 10: an empty validation set

def test_an_empty_coco_validation_set_is_an_error_not_ap_minus_one(tmp_path):
    import json
    from engine.evaluation import evaluate
    from engine.registry import DATASETS
    coco6 = shared_data("coco6")
    ann = json.load(open(os.path.join(coco6, "annotations", "instances_val2017.json")))
    ann["images"], ann["annotations"] = [], []
    empty = tmp_path / "instances_empty.json"
    empty.write_text(json.dumps(ann))
    with pytest.raises(UserError, match=r"instances_empty.json: holds no usable annotation .*0 images"):
        DATASETS.build("coco_detection", root=coco6, train_split="val", val_annotations=str(empty))
    # any family's evaluation of nothing is an error too, not a metric of nothing
    data = DATASETS.build("synthetic_classification", num_classes=3, train_size=8, val_size=4, image_size=8)
    with pytest.raises(UserError, match="evaluation split has no samples"):
        evaluate(torch.nn.Identity(), torch.utils.data.DataLoader([]), data.evaluator(), torch.device("cpu"))


# ---------------------------------------------------------------- 11, 12: exit 75 at every stage, torchrun too

@pytest.mark.process
def test_sigterm_during_start_up_exits_75(tmp_path):
    pid_file = tmp_path / "pid"
    proc = start(tmp_path / "run", "recipes=[_fault]", block("block_setup", 0, pid_file))
    os.kill(wait_for(pid_file, proc), signal.SIGTERM)
    code, out = finish(proc)
    assert code == 75 and "during start-up" in out, out[-3000:]
    assert not (tmp_path / "run" / "run.lock").exists()


@pytest.mark.process
@pytest.mark.distributed
def test_launcher_exits_75_when_torchrun_is_stopped_by_sigterm(tmp_path):
    pid_file = tmp_path / "pid"
    launcher = [os.path.join(ROOT, "launch.py"), "--standalone", "--nproc_per_node=2"]
    proc = start(tmp_path / "run", "recipes=[_fault]", block("block", 3, pid_file, rank=1), launcher=launcher)
    wait_for(pid_file, proc)
    os.kill(proc.pid, signal.SIGTERM)  # the agent: torchrun passes it on to its processes
    code, out = finish(proc, timeout=120)
    assert code == 75, out[-3000:]
    assert "checkpoint written at step 4" in out
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == 4
