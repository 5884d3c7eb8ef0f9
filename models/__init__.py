"""Model families. Each module registers its builders in engine.registry.MODELS.

Contract: model(inputs, targets) returns a dict of losses in training mode and predictions in
eval mode, so that one loop serves every family.
"""
from models import classification  # noqa: F401
from models import detection  # noqa: F401
from models import panoptic  # noqa: F401
from models import transformer  # noqa: F401
from models import faster_rcnn  # noqa: F401
from models import segmentation  # noqa: F401
