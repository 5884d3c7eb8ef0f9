"""Export an int8 artifact from a checkpoint: post-training quantization (PTQ) of an fp32 checkpoint,
or conversion of a QAT checkpoint (one trained with the `qat` recipe, e.g. its best.pt).

    python quantize.py --checkpoint runs/X/best.pt [--config configs/X.yaml] [--set k=v ...]
                       [--calib-batches 32] [--backend x86] [--output runs/X/model_int8_ptq.pt]
                       [--calib-transform eval|train] [--eval-fp32]

PTQ: the model is rebuilt as its quantizable variant (model.quantize: true), loaded with the fp32
weights, fused, observed on --calib-batches batches of training images (as torchvision, which
calibrates on training data) and converted. The calibration images go through the evaluation
transform by default (--calib-transform eval), so AutoAugment or RandomErasing of the training
preset do not reach the observers; --calib-transform train feeds the training loader instead. The artifact (TorchScript + metadata, see recipes/qat.py) is evaluated on the
val split and can be evaluated again with `python evaluate.py --artifact PATH`.
"""
import argparse
import os
import sys

import torch

from engine.config import ConfigError, config_from_dict, load_config
from engine.registry import MODELS, RegistryError

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="fp32 (PTQ) or qat-recipe checkpoint of train.py")
    p.add_argument("--config", help="YAML config (default: the config saved in the checkpoint)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    p.add_argument("--calib-batches", type=int, default=32, help="PTQ calibration batches (default 32)")
    p.add_argument("--calib-transform", default="eval", choices=["eval", "train"],
                   help="PTQ calibration on training images with the evaluation transform (default) "
                        "or with the training augmentation")
    p.add_argument("--backend", default=None, help="x86 (default), fbgemm or qnnpack; a QAT checkpoint keeps its own")
    p.add_argument("--output", help="artifact path (default: model_int8_ptq.pt / model_int8.pt next to the checkpoint)")
    p.add_argument("--eval-fp32", action="store_true", help="also evaluate the fp32 model (PTQ) for comparison")
    return p.parse_args(argv)


def int8_from_checkpoint(args):
    """(run, int8 model, method, backend, extra metadata, fp32 results): the QAT checkpoint converted,
    or the fp32 checkpoint quantized after training (PTQ). Shared with export.py --format torchscript."""
    from engine.checkpoint import load_checkpoint
    from engine.loop import build_run, evaluate
    from recipes import qat as Q

    state = load_checkpoint(args.checkpoint)
    cfg = load_config(args.config, args.set) if args.config else config_from_dict(state["config"])
    if args.set and not args.config:
        from omegaconf import OmegaConf
        merged = OmegaConf.merge(OmegaConf.create(cfg.model_dump(mode="json")), OmegaConf.from_dotlist(args.set))
        cfg = config_from_dict(OmegaConf.to_container(merged, resolve=True))
    d = cfg.model_dump(mode="json")
    is_qat = "qat" in d["recipes"]
    if "quantize" not in (MODELS.arguments(d["model"]["name"]) or []):
        raise ValueError(f"model {d['model']['name']} has no quantizable variant (no quantize= argument)")
    d["model"]["quantize"] = True
    d["model"].pop("weights", None)  # the checkpoint's weights are loaded below
    d["device"] = "cpu"
    qat_args = d["recipe_args"].get("qat", {})
    d["recipes"], d["recipe_args"] = (["qat"], {"qat": qat_args}) if is_qat else ([], {})
    cfg = config_from_dict(d)
    backend = qat_args.get("backend", "x86") if is_qat else (args.backend or "x86")
    if is_qat and args.backend and args.backend != backend:
        raise ValueError(f"a QAT checkpoint converts with the backend it was trained for ({backend})")

    out_dir = os.path.dirname(os.path.abspath(args.checkpoint))
    run = build_run(cfg, out_dir)  # qat checkpoints: the recipe prepares the model in setup
    run.model.load_state_dict(state["model"])
    results = {}
    if is_qat:
        recipe = next(r for r in run.recipes if isinstance(r, Q.QAT))
        recipe.load_state_dict(state["recipes"].get("qat", {}))
        int8, method, extra = Q.convert_int8(run.model), "qat", {"epoch": state.get("epoch")}
    else:
        if args.eval_fp32:
            results["fp32"] = evaluate(run.model, run.val_loader, run.data.evaluator(), run.device).compute()
        loader = run.train_loader if args.calib_transform == "train" else Q.calibration_loader(
            run.data, cfg.data.batch_size, run.train_loader.num_workers, cfg.seed or 0)
        int8, n = Q.ptq(run.model, Q.calibration_batches(loader, args.calib_batches), backend)
        method, extra = "ptq", {"calibration_batches": n, "calibration_transform": args.calib_transform}
    return run, int8, method, backend, extra, results


def quantize(args):
    from engine.loop import evaluate
    from recipes import qat as Q

    run, int8, method, backend, extra, results = int8_from_checkpoint(args)
    is_qat = method == "qat"
    out_dir = os.path.dirname(os.path.abspath(args.checkpoint))
    results["int8"] = evaluate(int8, run.val_loader, run.data.evaluator(), torch.device("cpu")).compute()
    output = args.output or os.path.join(out_dir, "model_int8.pt" if is_qat else "model_int8_ptq.pt")
    meta = Q.artifact_metadata(run, method=method, backend=backend, source_checkpoint=os.path.abspath(args.checkpoint),
                               metrics={f"val_int8/{k}": v for k, v in results["int8"].items()}, **extra)
    Q.export_artifact(int8, output, Q.example_inputs(run.val_loader), meta)
    for name, metrics in results.items():
        print(f"{name}: " + "  ".join(f"{k} {v:.2f}" for k, v in metrics.items()))
    print(f"int8 artifact ({method}, {backend}): {output}")
    return results, output


def main(argv=None):
    args = parse_args(argv)
    try:
        return quantize(args)
    except (ConfigError, RegistryError, FileNotFoundError, ValueError, TypeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
