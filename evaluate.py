"""Evaluate a checkpoint and write report.json + report.md.

    python evaluate.py --checkpoint runs/X/best.pt [--set data.eval_batch_size=4 ...] [--report-dir DIR]
    python evaluate.py --config configs/X.yaml --checkpoint runs/X/best.pt [--set ...] [--report-dir DIR]
    python evaluate.py --artifact runs/X/model_int8.pt [--set data.root=...]   (an exported classifier:
                       int8 TorchScript, .onnx or .pt2, on CPU)
    python evaluate.py --coco-gt annotations.json --coco-results detections.json [--iou-types bbox segm]
                       [--report-dir DIR]   (score any tool's COCO results file, no model)
    python evaluate.py --compare A/report.json B/report.json [...] [--report-dir DIR]
                       (what changed: every metric, TIDE error types, per class; compare.md / .html)

Every mode writes report.html (open it in a browser: the headline, the analysis's tables, plots and worst
images, all in one file), report.md and report.json, and names report.html in its last line
(what the pages show: docs/evaluation.md).

Scoring-only modes like --coco-gt come from the families (engine.registry.SCORERS). A checkpoint's
report gives the speed too: images/s over the whole pass (inference + scoring), and the scoring time
apart (report.json "speed"). --config and --set against a checkpoint (or an artifact's saved config)
follow artifacts.config: model, data and preprocessing keys that differ from training's are refused
unless --force.
"""
import argparse

import commands.evaluate
from commands.cli import add_checkpoint_options
from engine.registry import SCORERS

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders and scorers)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(p, "evaluate", "a last.pt / best.pt of train.py", required=False)
    p.add_argument("--report-dir", help="where to write report.html, report.md and report.json (default: next to the checkpoint)")
    p.add_argument("--ema", action="store_true", help="evaluate the EMA weights stored by the ema recipe")
    p.add_argument("--artifact", help="an exported classifier (int8 TorchScript of the qat recipe / quantize.py, "
                   ".onnx, .pt2), evaluated on CPU with the config saved in its description unless --config is given")
    p.add_argument("--compare", nargs="+", metavar="REPORT", help="compare evaluation reports (report.json files or "
                   "their folders) of the same data: compare.md, compare.html and compare.json in --report-dir "
                   "(default: the last report's folder)")
    p.add_argument("--trust-artifact", action="store_true", help="with --artifact: evaluate it although its files "
                   "differ from the SHA-256 in its description (corrupted or replaced); the safety checks still apply")
    for name in SCORERS.names():
        SCORERS.build(name).add_arguments(p.add_argument_group(f"scoring a {name} predictions file (no model)"))
    return p.parse_args(argv)


def main(argv=None):
    return commands.evaluate.main(parse_args(argv))


if __name__ == "__main__":
    main()
