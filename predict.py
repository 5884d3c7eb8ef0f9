"""Run a trained model on your own files: images, text lines, WAVs.

    python predict.py --checkpoint RUN/best.pt INPUT... [--output DIR] [--score-thresh X] [--topk K]
                      [--config X.yaml] [--set k=v ...] [--force]
    python predict.py --checkpoint RUN/export/model.onnx INPUT...       (an artifact of export.py: .onnx,
                                                                         .pt2, or the int8 TorchScript .pt)
    python predict.py --config configs/ssdlite320.yaml \\
        --set model.weights=SSDLite320_MobileNet_V3_Large_Weights.COCO_V1 INPUT...   (weights, no checkpoint)

INPUT: image or audio files, folders, globs ("photos/*.jpg", "photos/**/*.png"; directory symlinks
inside them are entered only with --follow-symlinks, loops skipped); for a text model, text files (one input
per line) or - for standard input (the default). A classifier prints the top-k labels with their
probabilities; a detector writes each image with its boxes drawn (DIR/<name>_boxes.png),
DIR/detections.json (COCO style) and DIR/results.json (COCO results); a segmenter DIR/<name>_seg.png (the
classes blended over the image, with a legend) and DIR/<name>_mask.png (the class index of every pixel, at
the image's size); a panoptic model DIR/<name>_panoptic.png (segments coloured and labelled), its COCO
panoptic PNGs in DIR/panoptic/ and DIR/panoptic.json; every model writes DIR/predictions.json. The pre-processing is the
evaluation pre-processing of the training config (or the one written beside the artifact). An input
that cannot be read is named and skipped; the run ends with a summary and exit status 1. --config and
--set on a checkpoint follow artifacts.config: model, data and preprocessing keys that differ from
the checkpoint's config are refused unless --force. An artifact is checked before it is opened
(artifacts.safety: nothing in it may run code or read other files) and compared with the SHA-256
recorded by export.py (--trust-artifact skips the comparison, for a file you know).
"""
import argparse

import commands.predict
from commands.cli import add_checkpoint_options

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files, folders, globs; text: files or - (stdin)")
    add_checkpoint_options(p, "predict", "a checkpoint of train.py, or an artifact of export.py", required=False)
    p.add_argument("--output", default="predictions", help="folder for drawn images and JSON (default: predictions)")
    p.add_argument("--score-thresh", type=float, default=0.3, help="detections: lowest score kept (default 0.3)")
    p.add_argument("--topk", type=int, default=5, help="classifiers: labels shown per input (default 5)")
    p.add_argument("--batch-size", type=int, default=8, help="inputs per forward pass (default 8)")
    p.add_argument("--follow-symlinks", action="store_true", help="enter directory symlinks in input folders and "
                   "globs (loops are skipped, each file read once; default: not entered, and named)")
    p.add_argument("--trust-artifact", action="store_true", help="run an exported artifact whose files differ from "
                   "the SHA-256 in its description (corrupted or replaced); the safety checks still apply")
    return p.parse_args(argv)


def main(argv=None):
    return commands.predict.main(parse_args(argv))


if __name__ == "__main__":
    main()
