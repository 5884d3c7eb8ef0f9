"""What runs a loaded model: tensors in (the spec's inputs), a tuple of tensors out (its outputs)."""
import torch


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
