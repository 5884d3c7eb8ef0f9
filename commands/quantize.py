"""quantize.py's body: an int8 artifact from a checkpoint (PTQ of an fp32 one, conversion of a QAT
one), evaluated on the val split, written with its description, and the metrics printed."""
import os

import torch

from artifacts.load import open_checkpoint
from artifacts.quantization import example_inputs, int8_from_checkpoint, int8_spec, write_int8_artifact
from commands.cli import run_or_exit
from engine.evaluation import evaluate
from engine.checkpoint import epoch_number
from engine.files import file_sha256


def quantize(args):
    state, cfg = open_checkpoint(args.checkpoint, args.config, args.set, args.force)
    q = int8_from_checkpoint(args.checkpoint, state, cfg, args.backend, args.calib_batches, args.calib_transform,
                             args.eval_fp32)
    results = {"fp32": q.fp32_metrics} if q.fp32_metrics is not None else {}
    results["int8"] = evaluate(q.model, q.run.val_loader, q.run.data.evaluator(), torch.device("cpu")).compute()
    out_dir = os.path.dirname(os.path.abspath(args.checkpoint))
    output = args.output or os.path.join(out_dir, "model_int8.pt" if q.method == "qat" else "model_int8_ptq.pt")
    source = {"checkpoint": os.path.abspath(args.checkpoint), "sha256": file_sha256(args.checkpoint),
              "epoch": epoch_number(state)}
    spec = int8_spec(q.run, q.method, q.backend, source=source, **q.fields,
                     metrics={f"val_int8/{k}": v for k, v in results["int8"].items()})
    write_int8_artifact(q.model, output, example_inputs(q.run.val_loader), spec, q.run.data)
    for name, metrics in results.items():
        print(f"{name}: " + "  ".join(f"{k} {v:.2f}" for k, v in metrics.items()))
    print(f"int8 artifact ({q.method}, {q.backend}): {output}  description: {output}.json")
    return results, output


def main(args):
    """quantize.py's parsed arguments: (metrics by precision, the artifact's path)."""
    return run_or_exit(quantize, args)
