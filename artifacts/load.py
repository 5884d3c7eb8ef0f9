"""The one loader for everything trained: a checkpoint of train.py, an ONNX model, a torch.export
.pt2 program, an int8 TorchScript .pt. Each comes back as a runner (tensors in, a tuple of tensors
out), the exporters adapter of its task (reading inputs, presenting outputs) and its description
(artifacts.spec).

This module is the only place that opens exported programs (torch.export.load, torch.jit.load):
what it takes from a file is decided here.
"""
import logging
import os
import sys
import zipfile
from typing import NamedTuple

from artifacts import ArtifactError, ArtifactNotFound
from artifacts.config import config_from_checkpoint
from artifacts.runners import OnnxRunner, TorchRunner
from artifacts.spec import ARTIFACT_FORMATS, SPEC_FILE, loads, parse_spec, read_spec, spec_path

log = logging.getLogger(__name__)

KINDS = ("checkpoint", *ARTIFACT_FORMATS)


class Loaded(NamedTuple):
    runner: object   # artifacts.runners: runner(*inputs) -> tuple of tensors
    adapter: object  # exporters.Adapter of the model's task
    spec: dict       # artifacts.spec description (for a checkpoint: the adapter's, plus its config)

    @property
    def batch_limit(self):
        """The batch size the model was exported for when it is fixed (1), else None."""
        return None if self.spec.get("dynamic_batch", True) else 1


def read_checkpoint(path):
    """A checkpoint of train.py, loaded as data (engine.checkpoint.load_checkpoint: weights_only)."""
    from engine.checkpoint import load_checkpoint
    state = load_checkpoint(path)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ArtifactError(f"{path}: not a checkpoint of train.py (no 'model' state dict)")
    return state


def artifact_kind(path):
    """checkpoint, onnx, torch_export or torchscript: by the extension, and for a .pt by what the zip
    archive holds (TorchScript code, or torch.save's pickled data) without loading anything."""
    if not os.path.isfile(path):
        raise ArtifactNotFound(f"no such checkpoint or artifact: {path}")
    for kind, extension in ARTIFACT_FORMATS.items():
        if kind != "torchscript" and path.endswith(extension):
            return kind
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return "checkpoint"  # the legacy torch.save format, or not a checkpoint: load_checkpoint says which
    scripted = any("/code/" in name or name.endswith("/constants.pkl") for name in names)
    return "torchscript" if scripted else "checkpoint"


# ---------------------------------------------------------------- exported programs

def load_int8(path):
    """(TorchScript module in eval mode, its description): an int8 artifact of the qat recipe,
    quantize.py or export.py --format torchscript, with its quantization backend selected."""
    import torch
    from artifacts.quantization import eager_quantization, set_backend
    if not os.path.isfile(path):
        raise ArtifactNotFound(f"int8 artifact not found: {path}")
    files = {SPEC_FILE: ""}
    try:
        with eager_quantization():
            module = torch.jit.load(path, map_location="cpu", _extra_files=files)
    except RuntimeError as e:
        raise ArtifactError(f"{path}: not a TorchScript archive ({str(e).splitlines()[0] if str(e) else e})") from None
    if not files[SPEC_FILE]:
        raise ArtifactError(f"{path}: a TorchScript file without the {SPEC_FILE} description this project writes "
                            f"inside its int8 artifacts (an older or foreign file): write it again with quantize.py "
                            f"or export.py --format torchscript")
    where = f"{path} ({SPEC_FILE} inside)"
    spec = parse_spec(loads(files[SPEC_FILE], where), where)
    if spec.get("artifact_format") != "torchscript":
        raise ArtifactError(f"{where}: describes a {spec.get('artifact_format')} artifact, not a TorchScript one")
    set_backend(spec.get("backend", "x86"))
    return module.eval(), spec


def load_program(path, kind, spec):
    """The runner of an exported program of `kind`, described by `spec`."""
    import torch
    if kind == "onnx":
        return OnnxRunner(path, spec["inputs"])
    if kind == "torch_export":
        try:
            return TorchRunner(torch.export.load(path).module())
        except (RuntimeError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise ArtifactError(f"{path}: not a loadable torch.export program ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return TorchRunner(load_int8(path)[0])


def load_artifact(path, config_file=None, overrides=(), force=False):
    """Loaded(runner, adapter, spec) of a checkpoint or an exported artifact.

    An artifact is described by `<artifact>.json` beside it (an int8 TorchScript file also by the
    copy inside it). A checkpoint is rebuilt with config_from_checkpoint(..., config_file, overrides,
    force); an artifact carries its pre-processing, so --config / --set do not apply to it."""
    from exporters import adapter_from_spec
    kind = artifact_kind(path)
    if kind == "checkpoint":
        return load_checkpoint_runner(path, config_file, overrides, force)
    if config_file or overrides:
        raise ArtifactError(f"{path}: an exported artifact carries its pre-processing in {spec_path(path)}; "
                            f"--config and --set apply to checkpoints")
    if kind == "torchscript" and not os.path.isfile(spec_path(path)):
        module, spec = load_int8(path)  # the qat recipe's model_int8.pt: its description is inside
        runner = TorchRunner(module)
    else:
        spec = read_spec(spec_path(path), path)
        if spec.get("artifact_format", kind) != kind:
            raise ArtifactError(f"{spec_path(path)}: describes a {spec['artifact_format']} artifact, but {path} is "
                                f"{'an' if kind == 'onnx' else 'a'} {kind} file")
        runner = load_program(path, kind, spec)
    return Loaded(runner, adapter_from_spec(spec, os.path.dirname(os.path.abspath(path))), spec)


# ---------------------------------------------------------------- checkpoints

def load_run(checkpoint, config_file=None, overrides=(), force=False, need_data=True):
    """(config dict, checkpoint state, data, model with its weights, in eval mode on CPU): a checkpoint
    with the config of config_from_checkpoint. need_data=False: data is None when the training data is
    not at hand (a detector still runs without it)."""
    state = read_checkpoint(checkpoint)
    cfg = config_from_checkpoint(state, config_file, overrides, force, checkpoint)
    data, model = build_with_weights(cfg, state, checkpoint, need_data)
    return cfg.model_dump(mode="json"), state, data, model


def build_with_weights(cfg, state=None, checkpoint=None, need_data=True, folder=None):
    """(data, model in eval mode on CPU) of a config, with a checkpoint's weights when given. The data
    (its evaluation pre-processing and class names) is built in the checkpoint's folder (or `folder`),
    where a run keeps files such as its tokenizer."""
    from engine.build import build_data, build_model
    from engine.checkpoint import load_model_state
    folder = folder or os.path.dirname(os.path.abspath(checkpoint))
    data = build_data(cfg, folder) if need_data else data_if_at_hand(cfg, folder)
    model = build_model(cfg, data or _no_data())
    if state is not None:
        load_model_state(model, state["model"], checkpoint, cfg.checkpoint.strict)
    return data, model.cpu().eval()


def data_if_at_hand(cfg, folder):
    """The config's data, or None (with a note) when its files are not there."""
    from engine.build import build_data
    try:
        return build_data(cfg, folder)
    except FileNotFoundError as e:
        print(f"note: the training data is not at hand ({str(e).splitlines()[0]})", file=sys.stderr)
        return None


def _no_data():
    from datasets.base import DataSplits
    return DataSplits(None, None, None)


def runner_for(cfg, data, model, folder):
    """Loaded(runner, adapter, spec) of an eager model built from a config (model.eval())."""
    from exporters import adapter_class
    d = cfg if isinstance(cfg, dict) else cfg.model_dump(mode="json")
    adapter = adapter_class(d).create(d, data, model, folder)
    spec = dict(adapter.spec, dynamic_batch=True, config=d)
    return Loaded(TorchRunner(adapter.module(model.eval())), adapter, spec)


def load_checkpoint_runner(path, config_file=None, overrides=(), force=False):
    state = read_checkpoint(path)
    cfg = config_from_checkpoint(state, config_file, overrides, force, path)
    if cfg.model.model_dump().get("quantize"):
        raise ArtifactError(f"{path}: a quantizable (QAT) checkpoint; run its int8 artifact (model_int8.pt of the "
                            f"run, or python export.py --checkpoint {path} --format torchscript)")
    data, model = build_with_weights(cfg, state, path, need_data=False)
    return runner_for(cfg, data, model, os.path.dirname(os.path.abspath(path)))


def load_config_runner(cfg, folder):
    """Loaded(runner, adapter, spec) of a config alone (its model.weights, no checkpoint); the data, if
    at hand, is built in `folder`."""
    data, model = build_with_weights(cfg, need_data=False, folder=folder)
    return runner_for(cfg, data, model, folder)
