"""Dataset loaders. Each module registers builders in engine.registry.DATASETS.

A builder takes its config keys and returns a `DataSplits`.
"""
from datasets import classification  # noqa: F401
from datasets import coco  # noqa: F401
from datasets import coco_panoptic  # noqa: F401
from datasets import detection_labels  # noqa: F401
from datasets import segmentation  # noqa: F401
from datasets import audio, text  # noqa: F401
from datasets.base import DataSplits  # noqa: F401
