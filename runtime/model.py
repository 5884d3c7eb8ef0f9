"""An exported ONNX artifact opened and run without torch: checked first (runtime.integrity: no
external data outside its folder, the SHA-256 its writer recorded), described by `<artifact>.json`
(runtime.spec), run by ONNX Runtime on CPU, fed images prepared as its description says.

Inputs by the description's `preprocessing` (exporters/ write it):
  - "layout" "CHW float32, one image": one image [3, H, W] in [0, 1] (Faster R-CNN, Panoptic FPN:
    resized and normalised inside the graph); "NCHW ...": a batch axis first (SSD, segmentation);
  - "resize_shorter": N: the shorter side resized to N (bilinear, as torchvision's Resize(N));
  - "scale", and "mean" / "std" at the top of preprocessing: normalised outside the graph
    ("in_model" settings are the graph's own and need nothing here).
"""
import os

import numpy as np
from PIL import Image

from engine.errors import ArtifactError, ArtifactNotFound, BadSample
from runtime.integrity import onnx_external_files, verify_files
from runtime.spec import read_spec, spec_path


class OnnxArtifact:
    """model.onnx and its description: `run(*arrays)` -> list of numpy outputs; `image(path)` -> the
    graph's input for an image file (and the prepared size)."""

    def __init__(self, path, trust=False, threads=0):
        if not os.path.isfile(path):
            raise ArtifactNotFound(f"no such ONNX artifact: {path}")
        if not path.endswith(".onnx"):
            raise ArtifactError(f"{path}: not an ONNX artifact (.onnx); the other formats need torch (evaluate.py "
                                f"--artifact)")
        onnx_external_files(path)  # refused before anything reads its data (UnsafeArtifact names the tensor)
        self.spec = read_spec(spec_path(path), path)
        if self.spec.get("artifact_format") != "onnx":
            raise ArtifactError(f"{spec_path(path)}: describes a {self.spec.get('artifact_format')} artifact, not an "
                                f"ONNX one")
        if not trust:
            if "artifact_sha256" not in self.spec:
                raise ArtifactError(f"{spec_path(path)}: no SHA-256 of the artifact recorded: export it again, or "
                                    f"pass --trust-artifact")
            verify_files(path, self.spec, spec_path(path))
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.path, self.task = path, self.spec["task"]
        self.pre = self.spec["preprocessing"]

    def run(self, *arrays):
        return self.session.run(None, dict(zip(self.spec["inputs"], arrays)))

    @property
    def one_image(self):
        return str(self.pre.get("layout", "")).startswith("CHW")

    def image(self, path):
        """(input array, (height, width) of the image the graph sees) for an image file."""
        try:
            with Image.open(path) as f:
                image = f.convert(self.pre.get("image_mode", "RGB"))
        except (OSError, SyntaxError, ValueError) as e:
            raise BadSample(path, f"cannot read image ({type(e).__name__}: {e})") from None
        size = self.pre.get("resize_shorter")
        if size:
            image = image.resize(resized(image.size, int(size)), Image.BILINEAR)
        x = np.asarray(image, dtype=np.float32) * np.float32(self.pre.get("scale", 1 / 255))
        if "mean" in self.pre:
            x = (x - np.asarray(self.pre["mean"], np.float32)) / np.asarray(self.pre["std"], np.float32)
        x = np.ascontiguousarray(x.transpose(2, 0, 1))
        return (x if self.one_image else x[None]), (image.height, image.width)


def resized(size, shorter):
    """(width, height) with the shorter side `shorter`, as torchvision's Resize(int) computes it."""
    w, h = size
    short, long = (w, h) if w <= h else (h, w)
    if short == shorter:
        return w, h
    new_long = int(shorter * long / short)
    return (shorter, new_long) if w <= h else (new_long, shorter)


def nearest(labels, height, width):
    """A label map resized with torch's "nearest" rule (source index floor(i * in / out)), as
    torchvision's Resize resizes a mask."""
    h, w = labels.shape[:2]
    if (h, w) == (height, width):
        return labels
    rows = np.minimum(np.floor(np.arange(height) * (h / height)).astype(np.int64), h - 1)
    cols = np.minimum(np.floor(np.arange(width) * (w / width)).astype(np.int64), w - 1)
    return labels[rows[:, None], cols[None, :]]
