"""COCO panoptic segment ids and their PNGs: id = R + 256 G + 256^2 B (0 = void). Shared by the
panoptic loaders and writers (datasets/) and the PQ evaluator (evaluators/panoptic.py)."""
import io
import os

import numpy as np
from PIL import Image

from engine.errors import BadSample, MissingData


def id_to_rgb(ids):
    ids = ids.astype(np.uint32)
    return np.stack([ids % 256, ids // 256 % 256, ids // 65536 % 256], -1).astype(np.uint8)


def rgb_to_id(rgb):
    rgb = np.asarray(rgb, dtype=np.uint32)
    return rgb[..., 0] + 256 * rgb[..., 1] + 65536 * rgb[..., 2]


def read_ids(path):
    """Segment ids of a COCO panoptic PNG; a PNG that cannot be decoded (truncated, corrupt) is a
    BadSample naming it."""
    if not os.path.isfile(path):
        raise MissingData(f"panoptic PNG not found: {path}")
    try:
        with open(path, "rb") as f:
            rgb = np.array(Image.open(f).convert("RGB"))
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ...
        raise BadSample(path, f"cannot read panoptic PNG ({type(e).__name__}: {e})") from None
    return rgb_to_id(rgb)


def png_bytes(ids):
    """A segment id map as COCO panoptic PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(id_to_rgb(np.asarray(ids))).save(buffer, format="PNG")
    return buffer.getvalue()
