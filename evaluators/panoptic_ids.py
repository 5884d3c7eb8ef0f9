"""COCO panoptic segment ids and their PNGs: id = R + 256 G + 256^2 B (0 = void). Shared by the
panoptic loaders and writers (datasets/) and the PQ evaluator (evaluators/panoptic.py); the codec
itself lives torch-free in runtime/panoptic.py (a consumer of an ONNX artifact writes the same PNGs)."""
from runtime.panoptic import id_to_rgb, png_bytes, read_ids, rgb_to_id  # noqa: F401
