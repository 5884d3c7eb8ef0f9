"""evaluate.py's body. The passes: a checkpoint (its run's model, recipes and evaluator) or a loaded
artifact (its runner in place of the model, with the evaluator of its config's data), timed, with the
report. Then the command's modes (main): a checkpoint, an artifact, a family's scoring-only mode
(engine.registry.SCORERS), --compare; each prints its report."""
import hashlib
import logging
import os
import sys
import time

import torch

from artifacts import ArtifactError
from artifacts.config import config_from_checkpoint
from artifacts.load import artifact_kind, load_artifact, open_checkpoint, read_checkpoint
from commands.cli import exit_with_error, run_or_exit
from engine import dist
from engine.build import build_data, build_loaders, build_run
from engine.checkpoint import epoch_number, load_model_state
from engine.config import to_yaml
from engine.dist import all_gather_object, is_main, unwrap
from engine.errors import UserError
from engine.files import file_sha256
from engine.evaluation import dataset_identity, evaluate, write_report
from engine.logger import TensorBoard
from engine.registry import SCORERS
from evaluators.compare import compare_reports

log = logging.getLogger(__name__)


def timed_evaluation(model, loader, evaluator, device, recipes=None, run=None, streams=None, analysis=True):
    """The evaluation pass timed: (evaluator, report with report["speed"]). inference_s covers loading,
    the forwards and the evaluator's per-batch conversion; scoring_s the COCO (or other) scoring and,
    with `analysis`, the report's analysis sections (docs/evaluation.md)."""
    if hasattr(evaluator, "set_analysis"):
        evaluator.set_analysis(analysis)
    start = time.perf_counter()
    evaluator = evaluate(model, loader, evaluator, device, recipes, run, streams=streams)
    inferred = time.perf_counter()
    report = evaluator.report()
    done = time.perf_counter()
    images = sum(all_gather_object(len(loader.sampler)))
    report["speed"] = {"images": images, "images_per_s": images / (done - start), "total_s": done - start,
                       "inference_s": inferred - start, "scoring_s": done - inferred}
    return evaluator, report


def timed_run_evaluation(model, run, streams=None, analysis=True):
    """timed_evaluation on a run's val loader, evaluator, device and recipes."""
    return timed_evaluation(model, run.val_loader, run.data.evaluator(), run.device, run.recipes, run, streams,
                            analysis)


def speed_markdown(speed):
    return (f"- speed: {speed['images_per_s']:.1f} images/s over {speed['images']} images "
            f"({speed['total_s']:.1f} s: inference {speed['inference_s']:.1f} s, scoring {speed['scoring_s']:.1f} s)\n")


def evaluate_checkpoint(cfg, checkpoint_path, report_dir, ema=False, config_name="(saved in the checkpoint)",
                        state=None, analysis=True):
    """The checkpoint's weights (or its EMA weights) evaluated on the val split of cfg: report.json,
    report.md and TensorBoard scalars in report_dir. Under torchrun every process evaluates its shard.
    The recipes start from their saved states (amp: the stored precision and memory format, nothing
    timed). state: the checkpoint, already read (else it is read here). analysis: the report's analysis
    sections, plots and images (evaluate.py --no-analysis: off)."""
    state = read_checkpoint(checkpoint_path) if state is None else state
    # run artifacts live in its folder; the recipes get their saved states first (amp: its precision, not timed)
    run = build_run(cfg, os.path.dirname(os.path.abspath(checkpoint_path)), recipe_states=state.get("recipes"),
                    inference=True)
    model = run.model
    if ema:
        ema_recipe = next((r for r in run.recipes if hasattr(r, "ema")), None)
        if ema_recipe is None or "ema" not in state.get("recipes", {}):
            raise ArtifactError(f"{checkpoint_path}: --ema needs a run trained with the ema recipe")
        ema_recipe.load_state_dict(state["recipes"]["ema"])
        model = ema_recipe.ema.module
    else:
        load_model_state(unwrap(model), state["model"], checkpoint_path, cfg.checkpoint.strict)
    evaluator, report = timed_run_evaluation(model, run, analysis=analysis)  # gathered from every process (torchrun); rank 0 writes
    os.makedirs(report_dir, exist_ok=True)
    report["artifacts"] = evaluator.save_artifacts(report_dir)  # e.g. detections in COCO results format
    report.update(checkpoint={"path": os.path.abspath(checkpoint_path), "sha256": file_sha256(checkpoint_path),
                              "epoch": epoch_number(state), "step": state.get("step"),
                              "weights": "ema" if ema else "model"},
                  config={"file": config_name, "model": cfg.model.name, "data": cfg.data.name,
                          "sha256": hashlib.sha256(to_yaml(cfg).encode()).hexdigest(),
                          "resolved": cfg.model_dump(mode="json")},
                  dataset=dataset_identity(cfg, run.data),
                  train_logged_metrics=state.get("metrics", {}))
    # the headline first: where the checkpoint, config and data come from is the appendix (engine.report)
    header = (f"# Evaluation report: {cfg.model.name} on {cfg.data.name}, epoch {epoch_number(state)}, step "
              f"{state.get('step')} ({'EMA' if ema else 'model'} weights)\n\n")
    if is_main():
        write_report(report_dir, report, header + evaluator.markdown(report) + "\n" + speed_markdown(report["speed"]),
                     f"Evaluation: {cfg.model.name} on {cfg.data.name}, epoch {epoch_number(state)}")
    tb = TensorBoard(os.path.join(report_dir, "tensorboard"))
    tb.evaluator_extras(evaluator, state.get("step", 0), "eval")
    tb.scalars(report["metrics"], state.get("step", 0), "eval")
    tb.close()
    return report


def evaluate_artifact(path, report_dir, config_file=None, overrides=(), force=False, trust=False, analysis=True):
    """An exported artifact (int8 TorchScript, ONNX or .pt2) on the val split of the
    config saved in its description (config_from_checkpoint: --config / --set under the same policy as
    a checkpoint's), on CPU: its runner is the model of an ordinary evaluation. Writes report.json / .md."""
    if artifact_kind(path) == "checkpoint":
        raise ArtifactError(f"{path}: a checkpoint of train.py: evaluate it with --checkpoint")
    runner, adapter, spec = load_artifact(path, trust=trust)  # trust: --trust-artifact (artifacts.safety)
    cfg = config_from_checkpoint({"config": spec.get("config")}, config_file, overrides, force, path)
    data = build_data(cfg, os.path.dirname(os.path.abspath(path)))
    if spec.get("classes") is not None and data.classes is not None and list(data.classes) != spec["classes"]:
        raise ArtifactError(f"{path}: trained for classes {spec['classes']}, the data has {list(data.classes)}")
    _, val_loader = build_loaders(cfg, data, cfg.seed or 0)
    model = adapter.eval_model(runner, path)  # the val batches in, the model's eval output out
    evaluator, report = timed_evaluation(model, val_loader, data.evaluator(), torch.device("cpu"), analysis=analysis)
    os.makedirs(report_dir, exist_ok=True)
    report["artifacts"] = evaluator.save_artifacts(report_dir)  # e.g. the analysis's images
    kept = ("artifact_format", "model", "task", "method", "backend", "calibration_batches", "calibration_transform",
            "epoch", "input_shape", "metrics", "source", "torch")
    report.update(artifact={"path": os.path.abspath(path), "sha256": file_sha256(path),
                            **{k: spec[k] for k in kept if k in spec}},
                  config={"file": config_file or "(saved in the artifact)", "model": cfg.model.name,
                          "data": cfg.data.name, "resolved": cfg.model_dump(mode="json")},
                  dataset=dataset_identity(cfg, data))
    how = ", ".join(str(spec[k]) for k in ("method", "backend") if k in spec)
    header = (f"# Evaluation report: {spec['artifact_format']} artifact ({how + ', ' if how else ''}"
              f"{cfg.model.name}) on {cfg.data.name} val\n\n")
    write_report(report_dir, report, header + evaluator.markdown(report) + "\n" + speed_markdown(report["speed"]))
    return report


# ---------------------------------------------------------------- evaluate.py

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
    print(report_line(report_dir))
    return report


def scored_dataset(report):
    """The identity of a scored file's ground truth (report["files"]: the *gt* paths), for --compare."""
    files = {k: v for k, v in (report.get("files") or {}).items() if "gt" in k and os.path.isfile(str(v))}
    return {"name": "ground-truth file", "files": sorted(os.path.basename(v) for v in files.values()),
            "id": "-".join(file_sha256(v)[:16] for _, v in sorted(files.items()))} if files else None


def compare(args):
    others = [f"--{k.replace('_', '-')}" for k in ("config", "checkpoint", "artifact", "ema", "set") if getattr(args, k)]
    if others:
        sys.exit(f"error: --compare reads reports only: drop {', '.join(others)}")
    last = args.compare[-1]
    report_dir = args.report_dir or (last if os.path.isdir(last) else os.path.dirname(os.path.abspath(last)))
    report, markdown = run_or_exit(compare_reports, args.compare, report_dir)
    print(markdown)
    print(f"comparison: {os.path.abspath(os.path.join(report_dir, 'compare.html'))}  (open it in a browser; "
          f"compare.md and compare.json beside it)")
    return report


def report_line(report_dir, tensorboard=False):
    """The last line of every evaluation: the page to open first, then the rest."""
    return (f"report: {os.path.abspath(os.path.join(report_dir, 'report.html'))}  (open it in a browser: the analysis, "
            f"plots and worst images; report.md and report.json beside it{', and tensorboard/' if tensorboard else ''})")


def analysis_on(args):
    """--no-analysis (declared with the COCO scorer's options, read by every mode): numbers only."""
    return not getattr(args, "no_analysis", False)


def report_dir_of(args, path):
    return args.report_dir or os.path.dirname(os.path.abspath(path))


def artifact_command(args):
    """--artifact: evaluate_artifact, its report.md printed."""
    report_dir = report_dir_of(args, args.artifact)
    report = run_or_exit(evaluate_artifact, args.artifact, report_dir, args.config, args.set, args.force,
                         args.trust_artifact, analysis_on(args))
    print(open(os.path.join(report_dir, "report.md")).read())
    print(report_line(report_dir))
    return report


def checkpoint_command(args):
    """--checkpoint: evaluate_checkpoint, under torchrun on every process, rank 0 printing."""
    report_dir = report_dir_of(args, args.checkpoint)
    try:
        state, cfg = open_checkpoint(args.checkpoint, args.config, args.set, args.force)
        config_name = args.config or "(saved in the checkpoint)" + (f", --set {' '.join(args.set)}" if args.set else "")
        report = evaluate_checkpoint(cfg, args.checkpoint, report_dir, args.ema, config_name, state=state,
                          analysis=analysis_on(args))
    except UserError as e:
        exit_with_error(e)  # under torchrun: end now, no barrier
    except BaseException:
        dist.exit_on_failure()
        raise
    if dist.is_main():
        print(open(os.path.join(report_dir, "report.md")).read())
        print(report_line(report_dir, tensorboard=True))
    dist.cleanup()  # torchrun: every process tears the group down
    return report


def main(args):
    """evaluate.py's parsed arguments: the mode they select, run; its report."""
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
        return artifact_command(args)
    if not args.checkpoint:
        sys.exit("error: --checkpoint is required (or --artifact, or a scoring mode such as --coco-gt with --coco-results)")
    return checkpoint_command(args)
