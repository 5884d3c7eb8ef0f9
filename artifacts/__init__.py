"""Opening a trained thing: a checkpoint of train.py or an artifact of export.py / quantize.py / the
qat recipe, with the config it is used with, its pre-processing spec and a runner. This package
returns values and logs; the command bodies that print live in commands/.

  artifacts.config        config_from_checkpoint: the one policy for --config / --set against a checkpoint
  artifacts.spec          the one JSON description of every exported artifact ("zoo-export/1")
  artifacts.load          the one loader for every kind (checkpoint, .onnx, .pt2, int8 TorchScript .pt);
                          open_checkpoint: a checkpoint of train.py and the config to use it with
  artifacts.safety        what a file may hold before it is opened (no pickled code, no paths outside)
  artifacts.runners       what runs a loaded model: tensors in, a tuple of tensors out
  (runtime/               the torch-free part: the description's parser, ONNX checks, numpy post-processing)
  artifacts.quantization  torch.ao eager-mode int8: QAT / PTQ preparation, calibration, the int8 artifact
"""
from engine.errors import ArtifactError, ArtifactNotFound, UnsafeArtifact  # noqa: F401  (torch-free: runtime/ raises them too)
