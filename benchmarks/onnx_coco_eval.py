"""COCO AP of an exported detector under ONNX Runtime, with neither PyTorch nor this repository.

    python -m benchmarks.onnx_coco_eval --model RUN/export/model.onnx --images VAL_DIR \\
        --annotations instances_val2017.json [--output DIR]

Reads only what export.py wrote beside the model (model.onnx.json: pre-processing, label ->
category id) and the COCO files: PIL, numpy, onnxruntime, pycocotools. Prints the 12 COCO numbers
and the latency per image at batch 1, writes DIR/onnx_results.json and DIR/onnx_eval.json, and
checks at the end that torch and this project were never imported.
"""
import argparse
import contextlib
import io
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
PROJECT = ("engine", "models", "datasets", "recipes", "export", "predict", "train", "evaluate")


def preprocess(path, spec):
    p = spec["preprocessing"]
    image = np.asarray(Image.open(path).convert(p["image_mode"]), dtype=np.float32) * np.float32(p["scale"])
    return image.transpose(2, 0, 1)[None]  # NCHW, batch 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--annotations", required=True)
    ap.add_argument("--output", default=".")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    args = ap.parse_args(argv)
    with open(args.model + ".json") as f:
        spec = json.load(f)
    to_cat = {int(k): v for k, v in spec["label_to_category_id"].items()}
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(args.annotations)
    results, times = [], []
    for image_id in sorted(gt.getImgIds()):
        x = preprocess(os.path.join(args.images, gt.imgs[image_id]["file_name"]), spec)
        tick = time.perf_counter()
        boxes, scores, labels = session.run(None, {name: x})
        times.append(time.perf_counter() - tick)
        for (x0, y0, x1, y1), s, k in zip(boxes[0].tolist(), scores[0].tolist(), labels[0].tolist()):
            if k > 0:  # label 0: padding
                results.append({"image_id": image_id, "category_id": to_cat.get(k, k),
                                "bbox": [x0, y0, x1 - x0, y1 - y0], "score": s})
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "onnx_results.json"), "w") as f:
        json.dump(results, f)
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator = COCOeval(gt, gt.loadRes(results) if results else COCO(), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = dict(zip(STATS, (float(v) for v in evaluator.stats)))
    latency = sorted(times[1:] or times)  # the first run includes ONNX Runtime's warm-up
    imported = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision") + PROJECT)
    report = {"images": len(times), "detections": len(results), "bbox": stats,
              "latency_ms_batch1": {"median": 1000 * latency[len(latency) // 2], "mean": 1000 * sum(latency) / len(latency)},
              "onnxruntime": ort.__version__, "imported_torch_or_project": imported}
    with open(os.path.join(args.output, "onnx_eval.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    if imported:
        sys.exit(f"error: torch or this project was imported: {imported}")
    return report


if __name__ == "__main__":
    main()
