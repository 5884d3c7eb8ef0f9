"""Real outputs of the project's own commands, for the tests of their readers (evaluate.py --compare of
checkpoints' and exports' reports, the doctor's HTML): made once per pytest process (the
session fixture `real_outputs` in conftest.py; with xdist, once per worker), each kind on first use.

Each task's pair of reports comes from one tiny training run on built-in data: evaluate.py on the
checkpoint after one epoch (A) and after a second (B, resumed), so that A and B score other weights
on the same data. Seconds each: the assertions need real structure, not learned accuracy."""
import contextlib
import io
import json
import os
import shutil

import doctor
import evaluate
import export
from benchmarks.doctor_speed import inject_faults
from datasets.shapes import ensure_shapes
from engine.config import config_from_data
from engine.loop import train
from tiny_runs import COMMON

# (model, data) per task; detection scores every box (score 0, 300 per image) so that
# its per-class AP is not 0 after two steps
RUNS = {
    "classification": ({"name": "mobilenet_v3_small", "width_mult": 0.25, "reduced_tail": True, "dropout": 0.0},
                       {"name": "synthetic_classification", "num_classes": 4, "train_size": 16, "val_size": 16,
                        "image_size": 32}),
    "detection": ({"name": "ssdlite320_mobilenet_v3_large", "size": 96, "score_thresh": 0.0,
                   "detections_per_img": 300},
                  {"name": "shapes", "num_train": 16, "num_val": 4, "image_size": 96}),
    "segmentation": ({"name": "lraspp_mobilenet_v3_large"},
                     {"name": "shapes_semantic", "num_train": 8, "num_val": 3, "image_size": 48}),
    "panoptic": ({"name": "panoptic_fpn_mobilenet_v3_large", "min_size": 64, "max_size": 80, "fpn_channels": 32,
                  "sem_channels": 32, "mask_head": [32], "box_head_dim": 64, "instance_score_thresh": 0.0},
                 {"name": "shapes_panoptic", "num_train": 4, "num_val": 3, "image_size": 64, "batch_size": 2}),
}
# BatchNorm statistics recomputed after the few steps: predictions that are not one class for every input
RECIPES = {"classification": ["precise_bn"]}


def quiet(command, argv):
    """A command's main(argv), its console output swallowed; what main returns."""
    with contextlib.redirect_stdout(io.StringIO()):
        return command.main(argv)


class RealOutputs:
    """Lazily built, cached outputs under `folder` (one per kind)."""

    def __init__(self, folder):
        self.folder = str(folder)
        self._made = {}

    def _once(self, key, build):
        if key not in self._made:
            self._made[key] = build(os.path.join(self.folder, key))
        return self._made[key]

    def run(self, task):
        """(first.pt, last.pt) of a tiny train run of `task`: one epoch, then one more resumed."""
        return self._once(f"run-{task}", lambda out: _two_epochs(out, task))

    def reports(self, task):
        """(A, B): report.json written by evaluate.py --checkpoint for the run's two checkpoints."""
        def build(out):
            paths = []
            for name, checkpoint in zip("AB", self.run(task)):
                quiet(evaluate, ["--checkpoint", checkpoint, "--report-dir", os.path.join(out, name)])
                paths.append(os.path.join(out, name, "report.json"))
            return tuple(paths)
        return self._once(f"reports-{task}", build)

    def checkpoint(self, task="classification"):
        """The run's last checkpoint (train.py's last.pt)."""
        return self.run(task)[1]

    def export(self, task="classification", fmt="torch_export"):
        """(artifact, its description) written by export.py for the run's last checkpoint."""
        def build(out):
            path, _ = quiet(export, ["--checkpoint", self.checkpoint(task), "--format", fmt, "--output", out,
                                     "--check-samples", "2", "--dynamic-batch"])
            return path, path + ".json"
        return self._once(f"export-{task}-{fmt}", build)

    def artifact_report(self, task="classification", fmt="torch_export"):
        """report.json written by evaluate.py --artifact for the export."""
        def build(out):
            quiet(evaluate, ["--artifact", self.export(task, fmt)[0], "--report-dir", out])
            return os.path.join(out, "report.json")
        return self._once(f"artifact-report-{task}-{fmt}", build)

    def doctor_report(self):
        """(report folder, the faults injected): doctor.py on a small shapes copy with the faults of
        benchmarks/doctor_speed.py (unreadable image, boxes outside, unknown category, leaks)."""
        def build(out):
            root = ensure_shapes(os.path.join(out, "shapes"), num_train=30, num_val=10, image_size=64)
            faults = inject_faults(root, leaks=3)
            config = os.path.join(out, "config.yaml")
            with open(config, "w") as f:  # JSON is YAML
                json.dump({"model": {"name": "mobilenet_v3_small"}, "optim": {"lr": 0.1}, "train": {"epochs": 1},
                           "data": {"name": "shapes", "root": root, "num_train": 30, "num_val": 10,
                                    "image_size": 64, "batch_size": 2}}, f)
            status = quiet(doctor, ["--config", config, "--report-dir", os.path.join(out, "report"),
                                    "--workers", "1"])
            assert status == 2, f"doctor.py exited {status} on data with integrity errors"
            return os.path.join(out, "report"), faults
        return self._once("doctor", build)


def _two_epochs(out, task):
    model, data = RUNS[task]
    data = {"workers": 0, "batch_size": 8, "root": os.path.join(out, "data"), **data}
    if task == "classification":
        del data["root"]
    config = {**COMMON, "model": model, "data": data, "recipes": RECIPES.get(task, []),
              "train": {"epochs": 1, "max_steps_per_epoch": 2, "log_every": 100, "analysis": False}}
    run = os.path.join(out, "run")
    train(config_from_data(config), run)
    first = os.path.join(out, "first.pt")
    shutil.copy(os.path.join(run, "last.pt"), first)
    config["train"]["epochs"] = 2
    train(config_from_data(config), run, resume=os.path.join(run, "last.pt"))
    return first, os.path.join(run, "last.pt")
