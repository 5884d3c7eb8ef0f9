"""Opening a trained thing: a checkpoint of train.py or an artifact of export.py / quantize.py / the
qat recipe, with the config it is used with, its pre-processing spec and a runner.

  artifacts.config        config_from_checkpoint: the one policy for --config / --set against a checkpoint
  artifacts.spec          the one JSON description of every exported artifact ("zoo-export/1")
  artifacts.load          the one loader for every kind (checkpoint, .onnx, .pt2, int8 TorchScript .pt)
  artifacts.runners       what runs a loaded model: tensors in, a tuple of tensors out
  artifacts.quantization  torch.ao eager-mode int8: QAT / PTQ preparation, calibration, the int8 artifact
  artifacts.evaluation    evaluate.py's passes: a checkpoint, or a loaded artifact, timed, with its report
  artifacts.export        export.py's: a checkpoint written as ONNX / .pt2 / int8 TorchScript and checked
  artifacts.benchmark     benchmark.py's: a model's precision / compile / int8 / TorchScript variants measured

The command lines (evaluate.py, export.py, predict.py, quantize.py, benchmark.py) are thin layers
over this package and the engine; none imports another.
"""
from engine.errors import UserError


class ArtifactError(UserError, ValueError):
    """A checkpoint or artifact that cannot be used as asked: the message names the file."""


class ArtifactNotFound(ArtifactError, FileNotFoundError):
    """A checkpoint or artifact file (or its description) that is not there."""
