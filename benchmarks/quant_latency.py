"""fp32 vs int8 inference latency of MobileNetV3-Large at 224x224 on CPU, batch 1 and 8, in one run:
a mode of benchmark.py.

    python -m benchmarks.quant_latency [--batch-size 8] [--size 224] [--steps 30] [--rounds 3]
        [--threads N] [--json out.json]

runs

    python benchmark.py --config configs/demo.yaml --mode infer --variants fp32,fp32+script,int8,int8+script
        --set model.name=mobilenet_v3_large data.image_size=224 model.num_classes=1000 data.batch_size=8 ...

fp32: the plain model in eval mode. int8: its quantizable variant fused, observed on a few batches
(post-training quantization; QAT gives the same graph, so the same speed) and converted; +script:
as TorchScript, the int8 one exactly as the qat recipe / quantize.py save the artifact (written and
loaded back), the fp32 one traced and frozen, which separates the gain of int8 from that of leaving
Python. Latency does not depend on the weights (random here) nor on the images (the built-in
synthetic ones). benchmark.py prints ms per batch and per image at batch 1, median over rounds.
"""
import argparse
import os

import torch

import commands.benchmark

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8, help="the batch timed besides batch 1")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=30, help="timed forwards per variant and round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: PyTorch's)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    samples = max(2 * args.batch_size, 8)  # benchmark.py takes a few batches of the data
    argv = ["--config", os.path.join(ROOT, "configs", "demo.yaml"), "--mode", "infer",
            "--variants", "fp32,fp32+script,int8,int8+script", "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--set", "model.name=mobilenet_v3_large", "model.dropout=0.2", f"data.image_size={args.size}",
            "model.num_classes=1000", f"data.batch_size={args.batch_size}", f"data.train_size={samples}",
            f"data.val_size={samples}", "data.workers=0", "recipes=[]"]
    argv += ["--json", args.json] if args.json else []
    return commands.benchmark.main(commands.benchmark.add_arguments(argparse.ArgumentParser()).parse_args(argv))


if __name__ == "__main__":
    main()
