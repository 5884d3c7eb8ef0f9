"""Helpers the tests share, in one place instead of imported from one test module into another: tiny
configs and runs, train.py in and out of a process, waiting for a process to reach a fault of
tests/dist_helper.py, the commands' one error line, data files written and edited on disk, simulated clocks,
the learning rates a schedule gives."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import dist_helper
import export
import tiny_runs
import train as train_script
from conftest import ROOT
from engine.checkpoint import load_checkpoint
from engine.config import config_from_data, load_config
from engine.optim import build_scheduler


TINY_SETS = ["data.train_size=48", "data.val_size=32", "data.image_size=32", "data.batch_size=16",
             "data.workers=0", "recipe_args.precise_bn.num_batches=2", "train.log_every=1"]


def tiny_config(*overrides):
    return load_config(os.path.join(ROOT, "configs", "demo.yaml"), TINY_SETS + list(overrides))


TINY = dist_helper.TINY
HELPER = dist_helper.__file__


@pytest.fixture(autouse=True)
def one_thread():
    """Two cores shared by many processes: torch's default threads make tiny runs 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_main(out, *overrides, flags=()):
    """train.py's main; returns the error message it exits with (None when it succeeds)."""
    argv = ["--config", TINY, "--output-dir", str(out), *flags] + (["--set", *overrides] if overrides else [])
    try:
        train_script.main(argv)
    except SystemExit as e:
        return str(e.code)
    return None


def weights(path):
    return load_checkpoint(str(path))["model"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def script(out, *overrides, flags=()):
    """train.py in a real process (through dist_helper for the test recipes)."""
    cmd = [sys.executable, HELPER, "train", "--config", TINY, "--output-dir", str(out), *flags,
           "--set", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for(path, proc, timeout=120):
    """The pid that a blocking fault of tests/dist_helper.py (_fault, kind block...) writes to `path` once
    `proc` (a Popen, its output piped) reaches it; fails with the output if the process ends first."""
    start = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() - start < timeout, f"{path} never appeared"
        time.sleep(0.05)
    return int(open(path).read())



def killed_at_step(tmp_path, common, step):
    """train.py (TINY) in a real process into tmp_path/run, blocked at `step` by dist_helper's _fault and
    killed with SIGKILL; the fault override, for the resume to pass again."""
    fault = f"recipe_args._fault={{kind: block, rank: 0, step: {step}, pid_file: {tmp_path / 'pid'}}}"
    proc = script(tmp_path / "run", *common, fault)
    os.kill(wait_for(tmp_path / "pid", proc), signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return fault

def child(code, *args, cwd):
    """Run python -c code in a child process (where the attack, if it works, does its harm)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def command(script, *args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


# Runs each [script, *args] of argv[2] as `python script args` would (its __main__, its argv, an exit status
# from SystemExit, a message exit printed to stderr), one after another in this one process, and writes
# [{returncode, stdout, stderr}] to argv[1]: the commands share one start-up (torch's import, ~3 s).
_SEQUENCE = r"""
import contextlib, io, json, os, runpy, sys, traceback
target, runs, results = sys.argv[1], json.loads(sys.argv[2]), []
for script, *args in runs:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(script)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
json.dump(results, open(target, "w"))
"""


def commands_in_one_process(runs, cwd):
    """[(script, *args)] run in one fresh process, each through its __main__ as on the command line:
    [CompletedProcess] in the same order (for tests that give one file to every command)."""
    runs = [[os.path.join(ROOT, script), *map(str, args)] for script, *args in runs]
    with tempfile.TemporaryDirectory() as folder:  # not in cwd: tests compare its files before and after
        results = os.path.join(folder, "results.json")
        proc = subprocess.run([sys.executable, "-c", _SEQUENCE, results, json.dumps(runs)], cwd=cwd,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and os.path.exists(results), (proc.returncode, proc.stdout[-2000:] + proc.stderr[-3000:])
        with open(results) as f:
            done = json.load(f)
    return [subprocess.CompletedProcess(run, r["returncode"], r["stdout"], r["stderr"]) for run, r in zip(runs, done)]


def one_error_line(out):
    """The one `error: ...` line a command ends with (exit status 1, no traceback)."""
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A classifier's checkpoint and the three artifacts export.py writes for it."""
    root = tmp_path_factory.mktemp("sec")
    checkpoint = tiny_runs.classifier(root / "run")
    paths = {}
    for fmt in ("torch_export", "onnx", "torchscript"):
        paths[fmt], _ = export.main(["--checkpoint", checkpoint, "--format", fmt, "--output", str(root / "exp"),
                                     "--check-samples", "2", "--calib-batches", "2"])
    return {"checkpoint": checkpoint, "folder": str(root / "exp"), **paths}


def panoptic_json(root, split="train"):
    return os.path.join(root, "annotations", f"panoptic_{split}2017.json")


def png_of(root, index=0, split="train"):
    """(PNG path, its annotation record) of the index-th panoptic annotation of a split."""
    with open(panoptic_json(root, split)) as f:
        ann = sorted(json.load(f)["annotations"], key=lambda a: a["image_id"])[index]
    return os.path.join(root, "annotations", f"panoptic_{split}2017", ann["file_name"]), ann


def edit_json(path, change):
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


def cli(tmp_path, script, *args, cfg=None):
    """Run train.py / evaluate.py as a user would: (exit code, stdout + stderr, the `error:` lines)."""
    if cfg is not None:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args = ("--config", str(path), *args)
    result = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, capture_output=True,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    output = result.stdout + result.stderr
    return result.returncode, output, [line for line in result.stderr.splitlines() if line.startswith("error:")]


def voc(root, bad_values=None, split_lists=(("train", "a b c"), ("val", "v"))):
    """A small Pascal VOC layout (32x40 images, a person on background, VOC's 255 borders);
    bad_values: {name: value} written into a corner of that mask."""
    voc = root / "VOCdevkit" / "VOC2012"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / d).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in ("a", "b", "c", "v"):
        Image.fromarray(rng.integers(0, 255, (32, 40, 3), dtype=np.uint8)).save(voc / "JPEGImages" / f"{name}.jpg")
        labels = np.zeros((32, 40), np.uint8)
        labels[8:20, 10:30] = 15  # person
        labels[7, 10:30] = 255    # VOC's object border
        if name in (bad_values or {}):
            labels[:4, :4] = bad_values[name]
        png = Image.fromarray(labels, mode="P")
        png.putpalette([0, 0, 0] * 256)
        png.save(voc / "SegmentationClass" / f"{name}.png")
    for split, names in split_lists:
        (voc / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{n}\n" for n in names.split()))
    return voc


EPOCHS = 3
FREEZE = 1  # observers and BatchNorm statistics frozen from epoch index 1


def qat_config(**recipe_args):
    return config_from_data({
        "seed": 0, "device": "cpu",
        "model": {"name": "mobilenet_v3_small", "quantize": True, "dropout": 0.0},
        "data": {"name": "synthetic_classification", "num_classes": 4, "train_size": 64, "val_size": 48,
                 "image_size": 32, "batch_size": 16, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5},
        "sched": {"name": "constant"},
        "train": {"epochs": EPOCHS, "log_every": 100, "best_metric": "top1"},
        "recipes": ["qat"],
        "recipe_args": {"qat": {"freeze_observers_epoch": FREEZE, "freeze_bn_epoch": FREEZE, **recipe_args}},
    })


def detection_images(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, 120, 160, generator=g), torch.rand(3, 150, 110, generator=g)]


def detection_targets():
    return [{"boxes": torch.tensor([[10., 20., 80., 90.], [50., 10., 150., 60.]]), "labels": torch.tensor([1, 3])},
            {"boxes": torch.tensor([[5., 5., 60., 100.]]), "labels": torch.tensor([2])}]


def torchrun(config, out, overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", config),
           "--output-dir", str(out), "--set", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[:3000] + result.stderr[-3000:]
    assert "(2 processes)" in result.stdout


class Clock:
    """The budget's clock in a simulated run: time passes only when a step, an evaluation or a
    checkpoint says so."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    perf_counter = time


def start(out, *overrides, flags=(), launcher=()):
    """train.py (through dist_helper for the test recipes) in a process group of its own."""
    cmd = [sys.executable, *launcher, HELPER, "train", "--config", TINY, "--output-dir", str(out), *flags,
           "--set", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def block(kind, step, pid_file, rank=0):
    return f"recipe_args._fault={{kind: {kind}, rank: {rank}, step: {step}, pid_file: {pid_file}}}"


def finish(proc, timeout=300):  # tiny runs take a minute on a loaded 2-core machine
    out = proc.communicate(timeout=timeout)[0]
    return proc.returncode, out


def image_folder(root, classes=("a", "b"), per_class=6, size=16, ext="png"):
    """A real ImageFolder of random images; returns the file paths."""
    rng = np.random.default_rng(0)
    paths = []
    for split in ("train", "val"):
        for c in classes:
            os.makedirs(os.path.join(root, split, c), exist_ok=True)
            for i in range(per_class):
                path = os.path.join(root, split, c, f"{i}.{ext}")
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path)
                paths.append(path)
    return paths


def truncate(path, keep=0.5):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


def stepped_lrs(optimizer, scheduler, n):
    """The lr of each of the first n iterations, stepping as the loop does (no gradients: the
    optimizer's step changes nothing, and keeps the scheduler's order check quiet)."""
    lrs = []
    for _ in range(n):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def schedule_lrs(sched_cfg, epochs, iters_per_epoch, lr=1.0):
    """The lr of every iteration of the schedule `sched_cfg` (engine.optim.build_scheduler) from a base lr."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr)
    scheduler = build_scheduler(optimizer, sched_cfg, epochs, iters_per_epoch)
    return stepped_lrs(optimizer, scheduler, epochs * iters_per_epoch)


def evaluate_without_torch(*args, cwd=ROOT):
    """evaluate_onnx.py's report (runtime_eval.json in --output), run in a process where importing torch
    or torchvision fails (sys.modules entries set to None before anything is imported)."""
    code = ("import runpy, sys\nsys.modules['torch'] = sys.modules['torchvision'] = None\n"
            f"sys.argv = ['evaluate_onnx.py', *{list(map(str, args))!r}]\n"
            f"runpy.run_path({os.path.join(ROOT, 'evaluate_onnx.py')!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    output = args[list(args).index("--output") + 1]
    with open(os.path.join(str(output), "runtime_eval.json")) as f:
        return json.load(f)


def crafted_onnx_is_refused(path, tmp_path):
    """Issue 36 acceptance 3, for any family's ONNX artifact written by export.py: it opens through the
    safe loaders (artifacts.load with torch, runtime.model without), and copies crafted three ways are
    refused by both, naming the file, before ONNX Runtime opens a session: a weight whose data lies
    outside the folder, session options taken from the file (metadata ort_config), and the artifact
    replaced by another file (its SHA-256 differs from the description's; --trust-artifact opens it)."""
    import onnx
    from onnx import TensorProto
    from artifacts.load import load_artifact
    from engine.errors import ArtifactError, UnsafeArtifact
    from runtime.model import OnnxArtifact
    load_artifact(path)
    OnnxArtifact(path)

    def crafted(name, edit):
        folder = tmp_path / name / "inner"
        folder.mkdir(parents=True)
        model = onnx.load(path)
        edit(model)
        out = str(folder / "model.onnx")
        onnx.save(model, out)
        with open(path + ".json") as f:
            spec = json.load(f)
        with open(out + ".json", "w") as f:
            json.dump(spec, f)
        return out

    def outside(model):
        tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
        nbytes = len(tensor.raw_data)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "../../../etc/passwd"), ("offset", "0"), ("length", str(nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value

    def ort_config(model):
        prop = model.metadata_props.add()
        prop.key, prop.value = "ort_config", json.dumps({"session_options": {"intra_op_num_threads": 1}})

    def swapped(model):
        model.producer_name = "someone else"  # another file under the first one's description

    for name, edit, error, words in (("outside", outside, UnsafeArtifact, '"../../../etc/passwd"'),
                                     ("ort_config", ort_config, UnsafeArtifact, "metadata 'ort_config'"),
                                     ("swapped", swapped, ArtifactError, "its SHA-256 is not the one recorded")):
        bad = crafted(name, edit)
        for open_it in (load_artifact, OnnxArtifact):
            with pytest.raises(error) as e:
                open_it(bad)
            assert str(e.value).startswith(bad) and words in str(e.value), (name, str(e.value))
        if name == "swapped":  # trusted, it opens
            load_artifact(bad, trust=True)
            OnnxArtifact(bad, trust=True)
