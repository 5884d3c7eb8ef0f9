"""Evaluate a checkpoint and write report.json + report.md.

    python evaluate.py --checkpoint runs/X/best.pt [--set data.eval_batch_size=4 ...] [--report-dir DIR]
    python evaluate.py --config configs/X.yaml --checkpoint runs/X/best.pt [--set ...] [--report-dir DIR]
    python evaluate.py --artifact runs/X/model_int8.pt [--set data.root=...]   (an exported classifier:
                       int8 TorchScript, .onnx or .pt2, on CPU)
    python evaluate.py --coco-gt annotations.json --coco-results detections.json [--iou-types bbox segm]
                       [--report-dir DIR]   (score any tool's COCO results file, no model)
    python evaluate.py --compare A/report.json B/report.json [...] [--report-dir DIR]
                       (what changed: every metric, TIDE error types, per class; compare.md / .html)

Every mode writes report.json, report.md and report.html (the analysis: docs/evaluation.md).

Scoring-only modes like --coco-gt come from the families (engine.registry.SCORERS). A checkpoint's
report gives the speed too: images/s over the whole pass (inference + scoring), and the scoring time
apart (report.json "speed"). --config and --set against a checkpoint (or an artifact's saved config)
follow artifacts.config: model, data and preprocessing keys that differ from training's are refused
unless --force.
"""
import argparse
import os
import sys

from commands.cli import add_checkpoint_options, run_or_exit
from engine.errors import UserError
from engine.evaluation import write_report
from engine.registry import SCORERS

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders and scorers)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(p, "evaluate", "a last.pt / best.pt of train.py", required=False)
    p.add_argument("--report-dir", help="where to write report.json and report.md (default: next to the checkpoint)")
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


def score_results(args, scorer):
    """A family's scoring-only mode: report.json + report.md from an existing predictions file."""
    others = [f"--{k.replace('_', '-')}" for k in ("config", "checkpoint", "artifact", "ema", "set", "force",
                                                   "trust_artifact")
              if getattr(args, k)]
    if others:
        sys.exit(f"error: a predictions file is scored without a model: drop {', '.join(others)}")
    report, markdown, default_dir = run_or_exit(scorer.score, args)
    report_dir = args.report_dir or default_dir
    report.setdefault("dataset", scored_dataset(report))
    run_or_exit(write_report, report_dir, report, markdown)
    print(markdown)
    print(f"report: {os.path.join(report_dir, 'report.json')}  report.md")
    return report


def scored_dataset(report):
    """The identity of a scored file's ground truth (report["files"]: the *gt* paths), for --compare."""
    from engine.checkpoint import file_sha256
    files = {k: v for k, v in (report.get("files") or {}).items() if "gt" in k and os.path.isfile(str(v))}
    return {"name": "ground-truth file", "files": sorted(os.path.basename(v) for v in files.values()),
            "id": "-".join(file_sha256(v)[:16] for _, v in sorted(files.items()))} if files else None


def compare(args):
    from analysis.compare import compare_reports
    others = [f"--{k.replace('_', '-')}" for k in ("config", "checkpoint", "artifact", "ema", "set") if getattr(args, k)]
    if others:
        sys.exit(f"error: --compare reads reports only: drop {', '.join(others)}")
    last = args.compare[-1]
    report_dir = args.report_dir or (last if os.path.isdir(last) else os.path.dirname(os.path.abspath(last)))
    report, markdown = run_or_exit(compare_reports, args.compare, report_dir)
    print(markdown)
    print(f"comparison: {os.path.join(report_dir, 'compare.md')}  compare.html  compare.json")
    return report


def analysis_on(args):
    """--no-analysis (declared with the COCO scorer's options, read by every mode): numbers only."""
    return not getattr(args, "no_analysis", False)


def report_dir_of(args, path):
    return args.report_dir or os.path.dirname(os.path.abspath(path))


def evaluate_artifact(args):
    from commands.evaluate import evaluate_artifact as evaluate
    report_dir = report_dir_of(args, args.artifact)
    report = run_or_exit(evaluate, args.artifact, report_dir, args.config, args.set, args.force,
                         args.trust_artifact, analysis_on(args))
    print(open(os.path.join(report_dir, "report.md")).read())
    return report


def evaluate_checkpoint(args):
    from artifacts.config import config_from_checkpoint
    from commands.evaluate import evaluate_checkpoint as evaluate
    from artifacts.load import read_checkpoint
    from engine import dist
    report_dir = report_dir_of(args, args.checkpoint)
    try:
        state = read_checkpoint(args.checkpoint)
        cfg = config_from_checkpoint(state, args.config, args.set, args.force, args.checkpoint)
        config_name = args.config or "(saved in the checkpoint)" + (f", --set {' '.join(args.set)}" if args.set else "")
        report = evaluate(cfg, args.checkpoint, report_dir, args.ema, config_name, state=state,
                          analysis=analysis_on(args))
    except UserError as e:
        dist.exit_on_failure(f"error: {e}")  # under torchrun: end now, no barrier
        sys.exit(f"error: {e}")
    except BaseException:
        dist.exit_on_failure()
        raise
    if dist.is_main():
        print(open(os.path.join(report_dir, "report.md")).read())
        print(f"report: {os.path.join(report_dir, 'report.json')}  report.md  tensorboard/")
    dist.cleanup()  # torchrun: every process tears the group down
    return report


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        return compare(args)
    scorers = [s for s in map(SCORERS.build, SCORERS.names()) if s.selected(args)]
    if len(scorers) > 1:
        sys.exit("error: options of several scoring modes were given; use one")
    if scorers:
        return score_results(args, scorers[0])
    if args.artifact:
        if args.checkpoint or args.ema:
            sys.exit("error: --artifact is evaluated alone: drop --checkpoint and --ema")
        return evaluate_artifact(args)
    if not args.checkpoint:
        sys.exit("error: --checkpoint is required (or --artifact, or a scoring mode such as --coco-gt with --coco-results)")
    return evaluate_checkpoint(args)


if __name__ == "__main__":
    main()
