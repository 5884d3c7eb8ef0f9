"""Export adapters: how a trained model leaves the repository (export.py) and runs on files (predict.py).

One module per task; each registers its adapter with @EXPORTERS.register(task=..., inputs=...), and
export/predict pick it by the task the model declares in MODELS (and, where a task has adapters for
several kinds of input, by the inputs its data set declares). A new family whose task has no adapter
registers one in its own module: nothing here is edited.
"""
from engine.files import write_json  # noqa: F401
from exporters.base import (EXPORTERS, LOGITS_ATOL, SPEC_FORMAT, Adapter, ExportError, TupleOutput,  # noqa: F401
                            adapter_class, adapter_from_spec, undeclared_export)
from exporters.inputs import AUDIO_EXTENSIONS, IMAGE_EXTENSIONS, read_image  # noqa: F401
from exporters import classification, detection, sequence  # noqa: F401,E402  (they register their adapters)
from exporters.classification import (ImageClassifier, LogitsAdapter, preprocessing_spec,  # noqa: F401
                                      transform_from_spec)
from exporters.detection import Detector  # noqa: F401
from exporters.panoptic import PanopticSegmenter  # noqa: F401,E402  (registers the panoptic task's adapter)
from exporters.rcnn import RCNNDetector  # noqa: F401,E402  (registers the adapter Faster R-CNN declares by name)
from exporters.segmentation import Segmenter  # noqa: F401,E402  (registers the semantic segmentation adapter)
from exporters.sequence import AudioClassifier, TextClassifier  # noqa: F401
from exporters.ssd_static import SSDExport, detections, match_detections  # noqa: F401
