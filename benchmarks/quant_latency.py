"""fp32 eager vs int8 latency of MobileNetV3-Large at 224x224 on CPU, batch 1 and 8, in one run.

    flock /tmp/zoo-cpu.lock python benchmarks/quant_latency.py [--batch-sizes 1 8] [--repeats 30]
        [--threads N] [--backend x86] [--json out.json]

fp32: the plain torchvision-style model in eval mode. int8: its quantizable variant fused, observed
on a few random batches (post-training quantization; QAT gives the same graph, so the same speed)
and converted; timed both eager and as the TorchScript artifact the qat recipe / quantize.py save
(written to a temporary file and loaded back).
Random weights: latency does not depend on them. Each figure is the median over --repeats timed
forward passes after --warmup untimed ones, under torch.inference_mode. A frozen TorchScript fp32
row separates the gain of int8 from that of leaving Python.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.classification import mobilenet_v3_large  # noqa: E402
from recipes import qat as Q  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=50, help="timed runs per figure (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    p.add_argument("--backend", default="x86", choices=Q.BACKENDS)
    p.add_argument("--calib-batches", type=int, default=4)
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


@torch.inference_mode()
def median_ms(model, x, repeats, warmup):
    for _ in range(warmup):
        model(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(x)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), min(times)


def build_models(args):
    torch.manual_seed(0)
    fp32 = mobilenet_v3_large(num_classes=1000).eval()
    q = mobilenet_v3_large(num_classes=1000, quantize=True)
    q.load_state_dict(fp32.state_dict())
    calib = [(torch.randn(8, 3, args.size, args.size), None) for _ in range(args.calib_batches)]
    int8, _ = Q.ptq(q, calib, args.backend)
    # the artifact exactly as the qat recipe / quantize.py write it, loaded back from disk
    with tempfile.TemporaryDirectory() as tmp:
        path = Q.export_artifact(int8, os.path.join(tmp, "int8.pt"), torch.randn(2, 3, args.size, args.size),
                                 {"format": Q.ARTIFACT_FORMAT, "backend": args.backend})
        artifact, _ = Q.load_artifact(path)
    # control: how much of the artifact's gain is TorchScript (no Python per module) rather than int8
    with torch.no_grad():
        fp32_ts = torch.jit.freeze(torch.jit.trace(fp32, torch.randn(2, 3, args.size, args.size)))
    return {"fp32 eager": fp32, "fp32 torchscript": fp32_ts, "int8 eager": int8, "int8 artifact": artifact}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = build_models(args)
    results = {}
    print(f"MobileNetV3-Large {args.size}x{args.size}, {args.backend} backend, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}; median of {args.repeats}")
    print(f"{'batch':>5}  {'model':<18}{'median ms':>10}{'min ms':>9}{'img/s':>9}{'speed-up':>10}")
    for bs in args.batch_sizes:
        x = torch.randn(bs, 3, args.size, args.size)
        row = {}
        for name, model in models.items():
            med, best = median_ms(model, x, args.repeats, args.warmup)
            row[name] = {"median_ms": med, "min_ms": best}
        base = row["fp32 eager"]["median_ms"]
        for name, r in row.items():
            r["speedup_vs_fp32"] = base / r["median_ms"]
            print(f"{bs:>5}  {name:<18}{r['median_ms']:>10.2f}{r['min_ms']:>9.2f}{bs * 1000 / r['median_ms']:>9.1f}"
                  f"{r['speedup_vs_fp32']:>9.2f}x")
        results[bs] = row
    for bs, row in results.items():
        print(f"batch {bs}: speed-up over fp32 eager: int8 eager {row['int8 eager']['speedup_vs_fp32']:.2f}x, "
              f"int8 artifact {row['int8 artifact']['speedup_vs_fp32']:.2f}x; int8 artifact over fp32 "
              f"TorchScript {row['fp32 torchscript']['median_ms'] / row['int8 artifact']['median_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
