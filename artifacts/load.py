"""The one loader for everything trained: a checkpoint of train.py, an ONNX model, a torch.export
.pt2 program, an int8 TorchScript .pt. Each comes back as a runner (tensors in, a tuple of tensors
out), the exporters adapter of its task (reading inputs, presenting outputs) and its description
(artifacts.spec).

This module is the only place that opens exported programs (torch.export.load, torch.jit.load):
what it takes from a file is decided here. Nothing is opened before artifacts.safety has checked
that no code from the file can run (pickled entries, compiled libraries, operators that reach files
or processes, external data outside the artifact's folder); then the SHA-256 recorded by the writer
is compared (--trust-artifact skips that comparison, never the safety checks).
"""
import contextlib
import logging
import os
import zipfile
from typing import NamedTuple

import torch

from artifacts import ArtifactError, ArtifactNotFound
from artifacts.config import config_from_checkpoint
from artifacts.quantization import eager_quantization, set_backend
from artifacts.runners import OnnxRunner, TorchRunner
from artifacts.safety import (UnsafeArtifact, check_archive, check_artifact, check_torchscript, extra_file,
                              verify_digests)
from artifacts.spec import ARTIFACT_FORMATS, SPEC_FILE, loads, parse_spec, read_spec, spec_path
from datasets.base import DataSplits
from engine.build import build_data, build_model
from engine.checkpoint import load_checkpoint, load_model_state
from engine.hooks import RecipeStack
from engine.paths import inside
from exporters import adapter_class, adapter_from_spec

log = logging.getLogger(__name__)

KINDS = ("checkpoint", *ARTIFACT_FORMATS)


class Loaded(NamedTuple):
    runner: object   # artifacts.runners: runner(*inputs) -> tuple of tensors
    adapter: object  # exporters.Adapter of the model's task
    spec: dict       # artifacts.spec description (for a checkpoint: the adapter's, plus its config)

    @property
    def batch_limit(self):
        """1 when the graph takes one image or was exported for batch 1 (a checkpoint of such a family
        too), else None."""
        return 1 if self.adapter.one_image or not self.spec.get("dynamic_batch", True) else None


def read_checkpoint(path):
    """A checkpoint of train.py, loaded as data (engine.checkpoint.load_checkpoint: weights_only). An
    exported artifact given instead is checked (artifacts.safety: a crafted one is refused, naming the
    entry) and named as such."""
    kind = artifact_kind(path) if os.path.isfile(path) else "checkpoint"
    if kind != "checkpoint":
        check_artifact(path, kind)
        raise ArtifactError(f"{path}: an exported {kind} artifact, not a checkpoint of train.py (last.pt / best.pt); "
                            f"predict.py --checkpoint and evaluate.py --artifact run artifacts")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            head = f.read(4)
        if head[:4] != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save: a zip archive, or (legacy) a pickle
            raise ArtifactError(f"{path}: not a checkpoint of train.py (not a file of torch.save: it starts with "
                                f"{head!r})")
    state = load_checkpoint(path)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ArtifactError(f"{path}: not a checkpoint of train.py (no 'model' state dict)")
    return state


def open_checkpoint(path, config=None, overrides=(), force=False):
    """(state, Config): a checkpoint of train.py read as data (read_checkpoint) and the config to use it
    with (artifacts.config.config_from_checkpoint: --config, --set and --force under its one policy)."""
    state = read_checkpoint(path)
    return state, config_from_checkpoint(state, config, overrides, force, path)


def artifact_kind(path):
    """checkpoint, onnx, torch_export or torchscript: by the extension, and for a .pt by what the zip
    archive holds (TorchScript code, or torch.save's pickled data) without loading anything. The names
    of a .pt's archive are checked (artifacts.safety.check_archive: one entry per name, inside its
    folder, a TorchScript archive in its layout) before anything reads an entry."""
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
    scripted = any("/code/" in name.lower() or name.lower().endswith("/constants.pkl") for name in names)
    kind = "torchscript" if scripted else "checkpoint"
    check_archive(path, kind)
    return kind


# ---------------------------------------------------------------- exported programs
# Every exported program is checked by artifacts.safety before torch opens it (no code from the file
# runs, no file outside its folder is read), then its SHA-256 against its description.

@contextlib.contextmanager
def weights_only_unpickling():
    """torch.load with weights_only, whatever a caller inside asks (TORCH_FORCE_WEIGHTS_ONLY_LOAD,
    read by torch 2.11's torch.load at each call): torch.export.load unpickles pickled payloads and
    retries sample inputs with weights_only=False. A second line behind artifacts.safety.check_pt2."""
    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # both set is an error in torch.load
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _open_torch_export(path):
    try:
        with weights_only_unpickling():
            return torch.export.load(path).module()
    except Exception as e:  # noqa: BLE001  (a file we did not write: any failure is "not loadable")
        raise ArtifactError(f"{path}: not a loadable torch.export program ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


def int8_description(path):
    """The description an int8 TorchScript archive holds (extra file SPEC_FILE), read from the zip."""
    text = extra_file(path, SPEC_FILE)
    if not text:
        raise ArtifactError(f"{path}: a TorchScript file without the {SPEC_FILE} description this project writes "
                            f"inside its int8 artifacts (an older or foreign file): write it again with quantize.py "
                            f"or export.py --format torchscript")
    where = f"{path} ({SPEC_FILE} inside)"
    spec = parse_spec(loads(text, where), where)
    if spec.get("artifact_format") != "torchscript":
        raise ArtifactError(f"{where}: describes a {spec.get('artifact_format')} artifact, not a TorchScript one")
    return spec, where


def load_int8(path, trust=False, checked=False):
    """(TorchScript module in eval mode, its description): an int8 artifact of the qat recipe,
    quantize.py or export.py --format torchscript, with its quantization backend selected. Its code
    is checked (artifacts.safety) and compared with the SHA-256 recorded inside (unless trust)
    before torch.jit.load compiles it."""
    if not os.path.isfile(path):
        raise ArtifactNotFound(f"int8 artifact not found: {path}")
    if not checked:
        check_torchscript(path)
    spec, where = int8_description(path)
    if "code_sha256" in spec:
        verify_digests(path, {"code_sha256": spec["code_sha256"]}, where, trust)
    elif not trust:
        log.warning("%s: no SHA-256 of its code recorded (written before they were): not verified", path)
    try:
        with eager_quantization():
            module = torch.jit.load(path, map_location="cpu")
    except RuntimeError as e:
        raise ArtifactError(f"{path}: not a TorchScript archive ({str(e).splitlines()[0] if str(e) else e})") from None
    set_backend(spec.get("backend", "x86"))
    return module.eval(), spec


def load_program(path, kind, spec, trust=False, checked=False):
    """The runner of an exported program of `kind`, described by `spec`, checked by artifacts.safety
    first (unless already `checked`)."""
    if not checked:
        check_artifact(path, kind)
    if kind == "onnx":
        return OnnxRunner(path, spec["inputs"])
    if kind == "torch_export":
        return TorchRunner(_open_torch_export(path))
    return TorchRunner(load_int8(path, trust, checked=True)[0])


def load_artifact(path, config_file=None, overrides=(), force=False, trust=False):
    """Loaded(runner, adapter, spec) of a checkpoint or an exported artifact.

    An artifact is described by `<artifact>.json` beside it (an int8 TorchScript file also by the
    copy inside it). A checkpoint is rebuilt with open_checkpoint(path, config_file, overrides,
    force); an artifact carries its pre-processing, so --config / --set do not apply to it.
    An artifact is checked by artifacts.safety before anything else (a crafted file is refused,
    naming the entry), then its files against the SHA-256 in its description unless trust
    (--trust-artifact)."""
    kind = artifact_kind(path)
    if kind == "checkpoint":
        return load_checkpoint_runner(path, config_file, overrides, force)
    check_artifact(path, kind)
    if config_file or overrides:
        raise ArtifactError(f"{path}: an exported artifact carries its pre-processing in {spec_path(path)}; "
                            f"--config and --set apply to checkpoints")
    if kind == "torchscript" and not os.path.isfile(spec_path(path)):
        module, spec = load_int8(path, trust, checked=True)  # the qat recipe's model_int8.pt: its description is inside
        runner = TorchRunner(module)
    else:
        spec = read_spec(spec_path(path), path)
        if spec.get("artifact_format", kind) != kind:
            raise ArtifactError(f"{spec_path(path)}: describes a {spec['artifact_format']} artifact, but {path} is "
                                f"{'an' if kind == 'onnx' else 'a'} {kind} file")
        if "artifact_sha256" in spec:
            verify_digests(path, spec, spec_path(path), trust)
        elif not trust:
            log.warning("%s: no SHA-256 recorded in %s (written before they were): not verified", path, spec_path(path))
        runner = load_program(path, kind, spec, trust, checked=True)
    folder = os.path.dirname(os.path.abspath(path))
    adapter = adapter_from_spec(spec, folder)
    for name in adapter.files():
        if not inside(folder, name):
            raise UnsafeArtifact(f"{spec_path(path)}: refused: names the file {name!r}, outside the artifact's folder "
                                 f"{folder}; the files of an artifact lie beside it")
    return Loaded(runner, adapter, spec)


# ---------------------------------------------------------------- checkpoints

def load_run(checkpoint, config_file=None, overrides=(), force=False, need_data=True):
    """(config dict, checkpoint state, data, model with its weights, in eval mode on CPU): a checkpoint
    with the config of open_checkpoint. need_data=False: data is None when the training data is
    not at hand (a detector still runs without it)."""
    state, cfg = open_checkpoint(checkpoint, config_file, overrides, force)
    data, model = build_with_weights(cfg, state, checkpoint, need_data)
    return cfg.model_dump(mode="json"), state, data, model


def build_with_weights(cfg, state=None, checkpoint=None, need_data=True, folder=None):
    """(data, model in eval mode on CPU) of a config, with a checkpoint's weights when given. The data
    (its evaluation pre-processing and class names) is built in the checkpoint's folder (or `folder`),
    where a run keeps files such as its tokenizer."""
    folder = folder or os.path.dirname(os.path.abspath(checkpoint))
    data = build_data(cfg, folder) if need_data else data_if_at_hand(cfg, folder)
    model = build_model(cfg, data or _no_data())
    stack = RecipeStack(cfg.recipes, cfg.recipe_args)
    stack.as_trained(model)  # e.g. inplace_abn's leaky ReLU: what the weights were trained in
    if state is not None:
        load_model_state(model, state["model"], checkpoint, cfg.checkpoint.strict)
    stack.for_inference(model)
    return data, model.cpu().eval()


def data_if_at_hand(cfg, folder):
    """The config's data, or None (with a note) when its files are not there."""
    try:
        return build_data(cfg, folder)
    except FileNotFoundError as e:
        log.warning("the training data is not at hand (%s)", str(e).splitlines()[0])
        return None


def _no_data():
    return DataSplits(None, None, None)


def runner_for(cfg, data, model, folder):
    """Loaded(runner, adapter, spec) of an eager model built from a config (model.eval())."""
    d = cfg if isinstance(cfg, dict) else cfg.model_dump(mode="json")
    adapter = adapter_class(d).create(d, data, model, folder)
    spec = dict(adapter.spec, dynamic_batch=True, config=d)
    return Loaded(TorchRunner(adapter.module(model.eval())), adapter, spec)


def load_checkpoint_runner(path, config_file=None, overrides=(), force=False):
    state, cfg = open_checkpoint(path, config_file, overrides, force)
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
