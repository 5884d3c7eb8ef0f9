"""Score an exported ONNX artifact on ground truth in standard files, where torch is not installed:
numpy, PIL, ONNX Runtime and pycocotools (runtime/; evaluate.py --artifact gives the same numbers
through the training data's own evaluator, with torch).

    python evaluate_onnx.py --artifact RUN/export/model.onnx --images VAL_IMAGES \\
        (--coco-gt instances_val.json                                    detection: COCO box AP
         | --panoptic-gt-json panoptic_val.json --panoptic-gt-folder DIR  panoptic: PQ; segmentation: mIoU
         | --masks DIR)                                                  segmentation: label PNGs, VOC style
        [--output DIR] [--limit N] [--threads N] [--trust-artifact]

The artifact is checked before it is opened (no external data outside its folder; its SHA-256
against its description unless --trust-artifact). Writes DIR/runtime_eval.json (default: the
artifact's folder): the metrics, the latency per image at batch 1, and the torch modules imported (none).
"""
import argparse

import commands.evaluate_onnx


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="an ONNX file written by export.py (its .json beside it)")
    p.add_argument("--images", required=True, help="the folder of the ground truth's images")
    p.add_argument("--coco-gt", help="COCO instances JSON (detection)")
    p.add_argument("--panoptic-gt-json", help="COCO panoptic JSON (panoptic; segmentation through label_of_category)")
    p.add_argument("--panoptic-gt-folder", help="the panoptic PNG folder")
    p.add_argument("--masks", help="segmentation: a folder of label PNGs named as the images (255: ignored)")
    p.add_argument("--output", help="where to write runtime_eval.json (default: the artifact's folder)")
    p.add_argument("--limit", type=int, help="the first N images only")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    p.add_argument("--trust-artifact", action="store_true", help="skip the SHA-256 comparison (never the safety "
                   "checks)")
    return p.parse_args(argv)


def main(argv=None):
    return commands.evaluate_onnx.main(parse_args(argv))


if __name__ == "__main__":
    main()
