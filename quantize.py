"""Export an int8 artifact from a checkpoint: post-training quantization (PTQ) of an fp32 checkpoint,
or conversion of a QAT checkpoint (one trained with the `qat` recipe, e.g. its best.pt).

    python quantize.py --checkpoint runs/X/best.pt [--config configs/X.yaml] [--set k=v ...] [--force]
                       [--calib-batches 32] [--backend x86] [--output runs/X/model_int8_ptq.pt]
                       [--calib-transform eval|train] [--eval-fp32]

PTQ: the model is rebuilt as its quantizable variant (model.quantize: true), loaded with the fp32
weights, fused, observed on --calib-batches batches of training images (as torchvision, which
calibrates on training data) and converted. The calibration images go through the evaluation
transform by default (--calib-transform eval), so AutoAugment or RandomErasing of the training
preset do not reach the observers; --calib-transform train feeds the training loader instead. The
artifact (TorchScript with its description inside and beside it as <artifact>.json, see
artifacts/quantization.py) is evaluated on the val split and can be evaluated again with
`python evaluate.py --artifact PATH`. --config / --set follow artifacts.config (model, data and
preprocessing keys that differ from the checkpoint's are refused unless --force).
"""
import argparse

import commands.quantize
from commands.cli import add_checkpoint_options

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(p, "quantize", "fp32 (PTQ) or qat-recipe checkpoint of train.py")
    p.add_argument("--calib-batches", type=int, default=32, help="PTQ calibration batches (default 32)")
    p.add_argument("--calib-transform", default="eval", choices=["eval", "train"],
                   help="PTQ calibration on training images with the evaluation transform (default) "
                        "or with the training augmentation")
    p.add_argument("--backend", default=None, help="x86 (default), fbgemm or qnnpack; a QAT checkpoint keeps its own")
    p.add_argument("--output", help="artifact path (default: model_int8_ptq.pt / model_int8.pt next to the checkpoint)")
    p.add_argument("--eval-fp32", action="store_true", help="also evaluate the fp32 model (PTQ) for comparison")
    return p.parse_args(argv)


def main(argv=None):
    return commands.quantize.main(parse_args(argv))


if __name__ == "__main__":
    main()
