"""What runs a loaded model: tensors in (the spec's inputs), a tuple of tensors out (its outputs)."""
import torch
from torch import nn

from artifacts import ArtifactError


class TorchRunner:
    """An eager, torch.export or TorchScript module; outputs as a tuple of tensors."""

    def __init__(self, module):
        self.module = module

    @torch.no_grad()
    def __call__(self, *inputs):
        out = self.module(*inputs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class OnnxRunner:
    """An ONNX model under ONNX Runtime (CPU), fed by input name."""

    def __init__(self, path, input_names):
        import onnxruntime as ort
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.input_names = input_names

    def __call__(self, *inputs):
        feed = {name: x.cpu().numpy() for name, x in zip(self.input_names, inputs)}
        return tuple(torch.from_numpy(o) for o in self.session.run(None, feed))


class RunnerAsModel(nn.Module):
    """A runner where the engine expects a model (engine.evaluation.evaluate): the val loader's batch of
    inputs in, the model's eval output out. Artifacts of one tensor in and one out (a classifier's
    images -> logits) evaluate this way; runners are safe to call from several threads."""

    def __init__(self, runner, where):
        super().__init__()
        self.runner, self.where = runner, where

    def forward(self, inputs):
        if not isinstance(inputs, torch.Tensor):
            raise ArtifactError(f"{self.where}: evaluating an artifact needs batches of one tensor (a classifier's "
                                f"images); this data set gives {type(inputs).__name__}: evaluate the checkpoint")
        outputs = self.runner(inputs.cpu())
        if len(outputs) != 1:
            raise ArtifactError(f"{self.where}: evaluating an artifact needs one output (logits), it has "
                                f"{len(outputs)}: evaluate the checkpoint")
        return outputs[0]
