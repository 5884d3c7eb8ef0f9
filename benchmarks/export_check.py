"""Acceptance check of the detector export: ONNX under ONNX Runtime (in a process that imports neither
torch nor this project) scores the same COCO AP as evaluate.py, and latency at batch 1 of eager
PyTorch, torch.export and ONNX Runtime.

    python -m benchmarks.export_check --checkpoint RUN/best.pt [--work DIR] [--images 200]

Steps (each a separate process, as a user would run them):
  1. evaluate.py --checkpoint             -> DIR/eval/report.json (bbox AP of the eager model)
  2. export.py --format onnx / torch_export -> DIR/export/model.onnx, model.pt2 (+ .json, checks)
  3. python -m benchmarks.onnx_coco_eval   -> DIR/onnx/onnx_eval.json (AP and latency, no torch)
  4. here: latency of the eager model (model([image]), as evaluate.py runs it) and of the
     torch.export program, batch 1, median over the val images after a warm-up.
Writes DIR/export_check.json and prints a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from artifacts.load import load_artifact, load_run
from engine.files import write_json

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, **kwargs):
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True, cwd=ROOT, **kwargs)


def median_ms(fn, inputs, warmup=3):
    for x in inputs[:warmup]:
        fn(x)
    times = []
    for x in inputs:
        tick = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - tick)
    return 1000 * statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--work", default="reports/export_check")
    p.add_argument("--latency-images", type=int, default=50, help="val images timed per runtime (default 50)")
    p.add_argument("--skip-export", action="store_true", help="reuse DIR/export (steps 1 and 3-4 only)")
    args = p.parse_args(argv)
    py, work = sys.executable, os.path.abspath(args.work)
    run([py, "evaluate.py", "--checkpoint", args.checkpoint, "--report-dir", os.path.join(work, "eval")])
    export_dir = os.path.join(work, "export")
    if not args.skip_export:
        for fmt in ("onnx", "torch_export"):
            run([py, "export.py", "--checkpoint", args.checkpoint, "--format", fmt, "--output", export_dir])

    _, _, data, model = load_run(args.checkpoint)
    val = data.val
    run([py, "-m", "benchmarks.onnx_coco_eval", "--model", os.path.join(export_dir, "model.onnx"),
         "--images", val.img_folder, "--annotations", val.ann_file, "--output", os.path.join(work, "onnx")],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})

    images = [val[i][0] for i in range(min(args.latency_images, len(val)))]
    program = load_artifact(os.path.join(export_dir, "model.pt2")).runner
    with torch.inference_mode():
        eager = median_ms(lambda x: model([x]), images)
    with torch.no_grad():
        exported = median_ms(lambda x: program(x[None]), images)

    with open(os.path.join(work, "eval", "report.json")) as f:
        evaluated = json.load(f)
    with open(os.path.join(work, "onnx", "onnx_eval.json")) as f:
        onnx = json.load(f)
    ap_eval = evaluated["metrics"].get("bbox/AP")
    ap_onnx = onnx["bbox"]["AP"]
    checks = {}
    for fmt, ext in (("onnx", ".onnx"), ("torch_export", ".pt2")):
        with open(os.path.join(export_dir, "model" + ext + ".json")) as f:
            checks[fmt] = json.load(f)["check"]
    result = {"checkpoint": os.path.abspath(args.checkpoint), "val_images": onnx["images"],
              "bbox_AP": {"evaluate.py": ap_eval, "onnxruntime": ap_onnx, "abs_diff": abs(ap_eval - ap_onnx),
                          "within_0.005": abs(ap_eval - ap_onnx) <= 0.005},
              "bbox_AP50": {"evaluate.py": evaluated["metrics"].get("bbox/AP50"), "onnxruntime": onnx["bbox"]["AP50"]},
              "latency_ms_batch1_median": {"eager": eager, "torch_export": exported,
                                           "onnxruntime": onnx["latency_ms_batch1"]["median"]},
              "onnx_process_imported_torch_or_project": onnx["imported_torch_or_project"],
              "export_checks": checks, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    write_json(os.path.join(work, "export_check.json"), result)
    print(f"\nbbox AP on {onnx['images']} val images: evaluate.py {ap_eval:.4f}, ONNX Runtime {ap_onnx:.4f} "
          f"(|diff| {abs(ap_eval - ap_onnx):.4f}, {'within' if result['bbox_AP']['within_0.005'] else 'NOT within'} 0.005)")
    print("latency at batch 1 (median, ms): " + ", ".join(
        f"{k} {v:.1f}" for k, v in result["latency_ms_batch1_median"].items()))
    print(f"written: {os.path.join(work, 'export_check.json')}")
    return result


if __name__ == "__main__":
    main()
