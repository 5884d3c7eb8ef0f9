"""evaluate_onnx.py's body, torch-free like runtime/ (so not commands.cli, which imports torch):
runtime.evaluate's report written (runtime_eval.json, and a detector's
detections.json in the COCO results format) and printed; a UserError ends with one `error: ...` line."""
import json
import os
import sys

from engine.errors import UserError
from engine.files import write_json
from runtime.evaluate import evaluate


def main(args):
    try:
        report = evaluate(args)
    except UserError as e:
        sys.exit(f"error: {e}")
    out = args.output or os.path.dirname(os.path.abspath(args.artifact))
    os.makedirs(out, exist_ok=True)
    results = report.pop("results", None)
    if results is not None:  # a detector's detections, COCO results format (as evaluate.py writes them)
        report["detections_file"] = os.path.join(out, "detections.json")
        write_json(report["detections_file"], results, indent=None)
    path = os.path.join(out, "runtime_eval.json")
    write_json(path, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("panoptic", "per_class_iou")}, indent=1))
    print(f"report: {path}")
    return report
