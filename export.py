"""Export a trained model for use outside this repository, and check it against the eager model.

    python export.py --list      # the formats of every registered model (and why a format is not offered)
    python export.py --checkpoint RUN/best.pt [--format onnx|torch_export|torchscript] [--output DIR]
                     [--dynamic-batch] [--opset N] [--check-samples 16] [--config X.yaml] [--set k=v ...]
                     [--force]

Formats: `torch_export` (torch.export.export, saved as .pt2 by torch.export.save), `onnx` (torch 2.11's
exporter, torch.onnx.export(dynamo=True), checked under ONNX Runtime), `torchscript` (the int8 path of
quantizable classifiers: a QAT checkpoint is converted, an fp32 one quantized after training (PTQ)).

Beside the artifact (default RUN/export/model.{onnx,pt2} or model_int8.pt): `<artifact>.json` (the
one description of every artifact, artifacts/spec.py) with the inputs and outputs, the pre-processing
(resize, normalisation, tokenizer file, sample rate and mel settings), the class names and the check
of the exported model against the eager one on real validation samples (same top-1 and logits within
a tolerance; detections matched by IoU and score), plus the files it names (e.g. tokenizer.json).
Tasks plug in through exporters/. --config and --set follow artifacts.config: model, data and
preprocessing keys that differ from the checkpoint's config are refused unless --force.
"""
import argparse

import commands.export
from commands.cli import add_checkpoint_options

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(p, "export", "a last.pt / best.pt of train.py", required=False)
    p.add_argument("--list", action="store_true", help="the formats each registered model exports to, and why not")
    p.add_argument("--format", default="onnx", choices=sorted(commands.export.FORMATS), help="default: onnx")
    p.add_argument("--output", help="folder for the artifact (default: export/ next to the checkpoint)")
    p.add_argument("--dynamic-batch", action="store_true", help="any batch size (default: batch 1)")
    p.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    p.add_argument("--check-samples", type=int, default=16, help="validation samples compared (default 16)")
    p.add_argument("--calib-batches", type=int, default=32, help="torchscript of an fp32 checkpoint: PTQ batches")
    args = p.parse_args(argv)
    if not (args.list or args.checkpoint):
        p.error("--checkpoint is required (or --list)")
    return args


def main(argv=None):
    return commands.export.main(parse_args(argv))


if __name__ == "__main__":
    main()
