"""Evaluate a checkpoint and write report.json + report.md.

    python evaluate.py --checkpoint runs/X/best.pt [--set data.eval_batch_size=4 ...] [--report-dir DIR]
    python evaluate.py --config configs/X.yaml --checkpoint runs/X/best.pt [--set ...] [--report-dir DIR]
    python evaluate.py --artifact runs/X/model_int8.pt [--set data.root=...]   (int8 TorchScript, on CPU)
    python evaluate.py --coco-gt annotations.json --coco-results detections.json [--iou-types bbox segm]
                       [--report-dir DIR]   (score any tool's COCO results file, no model)

Scoring-only modes like --coco-gt come from the families (engine.registry.SCORERS). A checkpoint's
report gives the speed too: images/s over the whole pass (inference + scoring), and the scoring time
apart (report.json "speed").
"""
import argparse
import hashlib
import os
import sys
import time

from engine.checkpoint import file_sha256
from engine.config import ConfigError, config_from_dict, load_config
from engine.evaluation import write_report
from engine.registry import SCORERS, RegistryError

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders and scorers)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (default: the config saved in the checkpoint)")
    p.add_argument("--checkpoint", help="a last.pt / best.pt of train.py")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys (of --config, "
                   "or of the checkpoint's config: then only keys that leave the model, data and preprocessing "
                   "as trained, such as data.eval_batch_size, data.workers, data.root, unless --force)")
    p.add_argument("--report-dir", help="where to write report.json and report.md (default: next to the checkpoint)")
    p.add_argument("--ema", action="store_true", help="evaluate the EMA weights stored by the ema recipe")
    p.add_argument("--force", action="store_true", help="evaluate although --config differs from the checkpoint's "
                   "config in model, data or preprocessing")
    p.add_argument("--artifact", help="an int8 TorchScript artifact (qat recipe / quantize.py), evaluated on CPU "
                   "with the config saved inside it unless --config is given")
    for name in SCORERS.names():
        SCORERS.build(name).add_arguments(p.add_argument_group(f"scoring a {name} predictions file (no model)"))
    return p.parse_args(argv)


def score_results(args, scorer):
    """A family's scoring-only mode: report.json + report.md from an existing predictions file."""
    others = [f"--{k.replace('_', '-')}" for k in ("config", "checkpoint", "artifact", "ema", "set", "force")
              if getattr(args, k)]
    if others:
        sys.exit(f"error: a predictions file is scored without a model: drop {', '.join(others)}")
    try:
        report, markdown, default_dir = scorer.score(args)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    report_dir = args.report_dir or default_dir
    write_report(report_dir, report, markdown)
    print(markdown)
    print(f"report: {os.path.join(report_dir, 'report.json')}  report.md")
    return report


def timed_evaluation(model, run, streams=None):
    """The evaluation pass timed: (evaluator, report with report["speed"]). inference_s covers loading,
    the forwards and the evaluator's per-batch conversion; scoring_s the COCO (or other) scoring."""
    from engine.dist import all_gather_object
    from engine.loop import evaluate
    start = time.perf_counter()
    evaluator = evaluate(model, run.val_loader, run.data.evaluator(), run.device, run.recipes, run, streams=streams)
    inferred = time.perf_counter()
    report = evaluator.report()
    done = time.perf_counter()
    images = sum(all_gather_object(len(run.val_loader.sampler)))
    report["speed"] = {"images": images, "images_per_s": images / (done - start), "total_s": done - start,
                       "inference_s": inferred - start, "scoring_s": done - inferred}
    return evaluator, report


def speed_markdown(speed):
    return (f"- speed: {speed['images_per_s']:.1f} images/s over {speed['images']} images "
            f"({speed['total_s']:.1f} s: inference {speed['inference_s']:.1f} s, scoring {speed['scoring_s']:.1f} s)\n")


def evaluate_checkpoint(cfg, checkpoint_path, report_dir, ema=False, config_name="(saved in the checkpoint)"):
    from engine.checkpoint import load_checkpoint, load_weights
    from engine.config import to_yaml
    from engine.dist import is_main, unwrap
    from engine.logger import TensorBoard
    from engine.loop import build_run

    state = load_checkpoint(checkpoint_path)
    run = build_run(cfg, os.path.dirname(os.path.abspath(checkpoint_path)))  # run artifacts live there
    model = run.model
    if ema:
        ema_recipe = next((r for r in run.recipes if hasattr(r, "ema")), None)
        if ema_recipe is None or "ema" not in state["recipes"]:
            raise ValueError(f"{checkpoint_path}: --ema needs a run trained with the ema recipe")
        ema_recipe.load_state_dict(state["recipes"]["ema"])
        model = ema_recipe.ema.module
    else:
        load_weights(unwrap(model), state["model"], checkpoint_path, cfg.checkpoint.strict)
    evaluator, report = timed_evaluation(model, run)  # gathered from every process (torchrun); rank 0 writes
    os.makedirs(report_dir, exist_ok=True)
    report["artifacts"] = evaluator.save_artifacts(report_dir)  # e.g. detections in COCO results format
    report.update(checkpoint={"path": os.path.abspath(checkpoint_path), "sha256": file_sha256(checkpoint_path),
                              "epoch": state.get("epoch"), "step": state.get("step"),
                              "weights": "ema" if ema else "model"},
                  config={"file": config_name, "model": cfg.model.name, "data": cfg.data.name,
                          "sha256": hashlib.sha256(to_yaml(cfg).encode()).hexdigest()},
                  train_logged_metrics=state.get("metrics", {}))
    header = (f"# Evaluation report\n\n- checkpoint: `{checkpoint_path}` (epoch {state.get('epoch')}, "
              f"step {state.get('step')}, {'EMA' if ema else 'model'} weights)\n- config: `{config_name}` "
              f"({cfg.model.name} on {cfg.data.name})\n" + speed_markdown(report["speed"]) + "\n")
    if is_main():
        write_report(report_dir, report, header + evaluator.markdown(report))
    tb = TensorBoard(os.path.join(report_dir, "tensorboard"))
    tb.evaluator_extras(evaluator, state.get("step", 0), "eval")
    tb.scalars(report["metrics"], state.get("step", 0), "eval")
    tb.close()
    return report


def saved_config_with(cfg, overrides):
    """The checkpoint's config with --set overrides, validated as a config file's would be."""
    import tempfile
    from engine.config import to_yaml
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config_saved_in_the_checkpoint.yaml")
        with open(path, "w") as f:
            f.write(to_yaml(cfg))
        return load_config(path, overrides)


def check_config_against_checkpoint(cfg, state, args):
    """A --config whose model, data or preprocessing differ from training's would silently score
    other weights or other inputs: list the differences and refuse unless --force."""
    from engine.checkpoint import EVAL_COMPARED, EVAL_IGNORED, _under, config_changes, describe_changes
    changes = [c for c in config_changes(state.get("config"), cfg.model_dump(mode="json"))
               if _under(c[0], EVAL_COMPARED) and not _under(c[0], EVAL_IGNORED)]
    if not changes or not state.get("config"):
        return
    text = describe_changes(changes, set() if args.force else {k for k, _, _ in changes})
    if not args.force:
        given = f"--config {args.config}" if args.config else "--set"
        raise ValueError(f"{given} differs from the config saved in {args.checkpoint} in model, "
                         f"data or preprocessing:\n{text}\nthe scores would not be those of the trained run: "
                         f"drop --config to use the checkpoint's, or pass --force")
    print(f"warning: {'--config' if args.config else '--set'} differs from the checkpoint's (--force):\n{text}", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    scorers = [s for s in map(SCORERS.build, SCORERS.names()) if s.selected(args)]
    if len(scorers) > 1:
        sys.exit("error: options of several scoring modes were given; use one")
    if scorers:
        return score_results(args, scorers[0])
    if args.artifact:  # int8 artifact: recipes/qat.py writes report.json / report.md
        from recipes.qat import evaluate_artifact
        try:
            report = evaluate_artifact(args.artifact, args.config, args.set, args.report_dir)
        except (ConfigError, RegistryError, FileNotFoundError, ValueError, RuntimeError) as e:
            sys.exit(f"error: {e}")
        print(open(os.path.join(args.report_dir or os.path.dirname(os.path.abspath(args.artifact)), "report.md")).read())
        return report
    if not args.checkpoint:
        sys.exit("error: --checkpoint is required (or --artifact, or a scoring mode such as --coco-gt with --coco-results)")
    from engine import dist
    from engine.checkpoint import load_checkpoint
    try:
        state = load_checkpoint(args.checkpoint)
        if args.config:
            cfg = load_config(args.config, args.set)
            check_config_against_checkpoint(cfg, state, args)
        else:
            cfg = config_from_dict(state["config"])
            if args.set:  # e.g. data.eval_batch_size=4 or data.root=...: what may differ from training's
                cfg = saved_config_with(cfg, args.set)
                check_config_against_checkpoint(cfg, state, args)
        report_dir = args.report_dir or os.path.dirname(os.path.abspath(args.checkpoint))
        report = evaluate_checkpoint(cfg, args.checkpoint, report_dir, args.ema,
                                     args.config or "(saved in the checkpoint)" + (f", --set {' '.join(args.set)}"
                                                                                   if args.set else ""))
    except (ConfigError, RegistryError, FileNotFoundError, ValueError) as e:
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


if __name__ == "__main__":
    main()
