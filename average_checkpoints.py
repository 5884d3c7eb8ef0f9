"""Average the weights of several checkpoints of one run into a new, loadable checkpoint.

torchvision's published MobileNetV3 weights average the last 3 checkpoints that improved acc@1
(references/classification/README.md; its utils.average_checkpoints, after fairseq's). As there:
floating-point tensors (weights, BatchNorm running_mean / running_var) are averaged, integer
buffers (BatchNorm num_batches_tracked) get the floor of their mean, and every checkpoint must
hold the same keys.

    python average_checkpoints.py runs/X/best_e180.pt runs/X/best_e190.pt runs/X/best_e200.pt \\
        --output runs/X/averaged.pt
    python evaluate.py --checkpoint runs/X/averaged.pt

The output keeps the config, epoch and step of the last input and lists its sources under
`averaged_from`; it holds no optimizer, scheduler or RNG state, so it is for evaluate.py,
quantize.py and model.weights, not for --resume. An EMA state (recipe `ema`) present in every
input is averaged the same way. The inputs are read as data (torch.load with weights_only): a file
that is not a checkpoint of train.py, or that holds pickled objects, stops with one error naming it.
"""
import argparse

import commands.average_checkpoints


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="checkpoints of one run (same model and keys)")
    p.add_argument("--output", required=True, help="path of the averaged checkpoint")
    return p.parse_args(argv)


def main(argv=None):
    return commands.average_checkpoints.main(parse_args(argv))


if __name__ == "__main__":
    main()
