"""int8 by torch.ao eager-mode quantization, in one place: shared by the qat recipe, quantize.py,
export.py --format torchscript and benchmark.py's int8 variants.

The flow is torchvision's (references/classification/train_quantization.py):

  qat: fuse_model(is_qat=True) -> backend's default QAT qconfig -> prepare_qat -> train with fake
       quantization (recipes/qat.py) -> convert to int8.
  ptq: fuse_model(is_qat=False) -> backend's default qconfig -> prepare -> N calibration batches
       -> convert.

A model is quantizable when it (or a submodule) has `fuse_model(is_qat)` and QuantStub/DeQuantStub
around its float computation: torchvision's quantizable classifiers (`model.quantize: true`).

The int8 artifact is the converted model traced to TorchScript, with its description inside the
file (artifacts.spec, extra file "spec.json") and beside it (`<artifact>.json`); this project opens
it through artifacts.load. For a consumer with plain PyTorch and nothing of this project,
"metadata.json" inside holds the same description with the pre-processing as the torchvision steps
of the evaluation transform (docs/quantization.md shows how to read it).
"""
import contextlib
import copy
import dataclasses
import io
import itertools
import json
import logging
import os
import warnings
from typing import Any, Optional

import torch
from torch import nn

from artifacts.safety import code_digests
from artifacts.spec import SPEC_FILE, describe, parse_spec, write_spec
from engine import dist
from engine.build import build_run
from engine.checkpoint import epoch_number, load_model_state
from engine.config import ConfigError, config_from_data
from engine.errors import UserError
from engine.evaluation import evaluate
from engine.files import atomic_write
from engine.registry import MODELS, RECIPES
from exporters import EXPORTERS, adapter_class

log = logging.getLogger(__name__)

BACKENDS = ("x86", "fbgemm", "qnnpack")
PLAIN_TORCH_FILE = "metadata.json"  # the description for plain PyTorch, inside the int8 archive
PLAIN_TORCH_FORMAT = "zoo-int8-torchscript/1"
CALIBRATION_TRANSFORMS = ("eval", "train")


class QuantizationError(UserError, ValueError):
    """A model, backend or data set that int8 quantization cannot work with, as configured."""


class NotQuantizable(QuantizationError, TypeError):
    """A model (or its inputs) that eager-mode quantization cannot handle."""


# ---------------------------------------------------------------- torch.ao eager mode

@contextlib.contextmanager
def eager_quantization():
    """Every torch.ao.quantization eager-mode call of this project goes through here.

    torch.ao.quantization warns on each prepare / prepare_qat / convert that it is deprecated
    (and its default x86/fbgemm qconfigs that `reduce_range` will be). Both are silenced here and
    only here. Migration path: torchao's PT2E flow (torch.export -> torchao's prepare_pt2e /
    prepare_qat_pt2e with X86InductorQuantizer -> convert_pt2e -> torch.compile); move when PT2E's
    int8 path is faster than eager mode's on CPU (docs/performance.md), then only this module changes.

    The artifact is TorchScript for the same reason (an eager int8 model does not go through
    torch.export): torch.jit.trace's TracerWarnings on quantized modules (scale and zero point
    are constants of a converted model, as intended) and torch.jit's deprecation
    notices are silenced here too. With PT2E the artifact becomes a torch.export .pt2 file.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated")
        warnings.filterwarnings("ignore", message=r"Please use quant_min and quant_max")
        # convert: FloatFunctional.add of blocks without a residual connection never runs, so its
        # observer never sees data (harmless: the op is unused); accuracy is checked by tests.
        warnings.filterwarnings("ignore", message=r"must run observer before calling calculate_qparams")
        yield


def check_backend(backend, where="quantization backend"):
    if backend not in BACKENDS:
        raise ConfigError(f"{where}: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def set_backend(backend):
    """Select the int8 kernels (x86, fbgemm, qnnpack); the qconfig must match them."""
    check_backend(backend)
    if backend not in torch.backends.quantized.supported_engines:
        raise QuantizationError(f"quantization backend {backend!r} is not supported by this PyTorch build "
                                f"(supported: {torch.backends.quantized.supported_engines})")
    torch.backends.quantized.engine = backend


def fusable_modules(model):
    """Outermost submodules with fuse_model(is_qat); a clear error if the model has none."""
    found = []

    def visit(module):
        if callable(getattr(module, "fuse_model", None)):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    if not found or not any(isinstance(m, torch.ao.quantization.QuantStub) for m in model.modules()):
        raise NotQuantizable(f"{type(model).__name__} is not quantizable: eager-mode quantization needs a model "
                             f"with fuse_model(is_qat) and QuantStub/DeQuantStub, e.g. torchvision's quantizable "
                             f"MobileNetV3: set model.quantize: true in the config")
    return found


def prepare_int8(model, backend="x86", qat=False):
    """In place: fuse and insert the backend's quantization. qat: Conv+BN(+ReLU) become QAT modules
    with fake quantization (training mode); else BatchNorm is folded and observers wait for
    calibration (eval mode)."""
    set_backend(backend)
    model.train(qat)
    with eager_quantization():
        for module in fusable_modules(model):
            module.fuse_model(is_qat=qat)
        if qat:
            model.qconfig = torch.ao.quantization.get_default_qat_qconfig(backend)
            torch.ao.quantization.prepare_qat(model, inplace=True)
        else:
            model.qconfig = torch.ao.quantization.get_default_qconfig(backend)
            torch.ao.quantization.prepare(model, inplace=True)
    return model


def convert_int8(model):
    """An int8 copy of a prepared (QAT or calibrated) model, on CPU, in eval mode."""
    int8 = copy.deepcopy(dist.unwrap(model)).cpu().eval()
    with eager_quantization():
        return torch.ao.quantization.convert(int8, inplace=True)


def freeze_observers(model):
    model.apply(torch.ao.quantization.disable_observer)


def enable_observers(model):
    model.apply(torch.ao.quantization.enable_observer)


def freeze_bn_stats(model):
    model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)


class OnCPU(nn.Module):
    """Runs a CPU-only (int8) model whatever device the loop puts the inputs on."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, inputs):
        return self.module(inputs.cpu())


# ---------------------------------------------------------------- post-training quantization

@torch.no_grad()
def calibrate(model, batches, device="cpu"):
    """Run the observers of a PTQ-prepared model over `batches` of (inputs, targets). Returns the count."""
    model.eval()
    n = 0
    for inputs, _ in batches:
        model(inputs.to(device))
        n += 1
    if n == 0:
        raise QuantizationError("calibration saw no batches: the training split is empty")
    return n


def ptq(model, batches, backend="x86"):
    """Post-training quantization of a quantizable fp32 model (in place): returns (int8 model, batches used)."""
    model = prepare_int8(model.cpu(), backend, qat=False)
    n = calibrate(model, batches)
    return convert_int8(model), n


def calibration_batches(loader, n):
    return itertools.islice(loader, n)


def calibration_loader(data, batch_size, workers=0, seed=0, transform="eval"):
    """Shuffled (seeded) training images for PTQ calibration. transform="eval" (the default) feeds
    them through the evaluation preprocessing, so the observers see the value ranges of the images
    the int8 model will get, not AutoAugment's or RandomErasing's; "train" keeps the training
    augmentation (torchvision's train_quantization.py calibrates on its training loader)."""
    if transform not in CALIBRATION_TRANSFORMS:
        raise QuantizationError(f"calibration transform: expected eval or train, got {transform!r}")
    dataset = data.train
    if transform == "eval":
        if not (hasattr(dataset, "transform") and hasattr(data.val, "transform")):
            raise NotQuantizable(f"calibration with the evaluation transform needs datasets with a .transform "
                                 f"attribute ({type(dataset).__name__} has none): use --calib-transform train")
        dataset = copy.copy(dataset)  # a shallow copy: the training set keeps its own transform
        dataset.transform = data.val.transform
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator,
                                       num_workers=workers, collate_fn=data.collate_fn)


def check_quantizable(model, what="int8"):
    """A NotQuantizable unless the model declares quantizable=True at registration: its builder then
    takes quantize=True and returns the eager-mode quantizable variant (fuse_model, QuantStub)."""
    declared = MODELS.declared_or(model, "quantizable")
    if declared is not True:
        raise NotQuantizable(f"{what}: model {model} declares quantizable={declared} (@MODELS.register(quantizable="
                             f"...)): it has no int8 variant; quantize a model that declares quantizable=True")


# ---------------------------------------------------------------- a checkpoint to int8

def int8_config(cfg, backend=None):
    """(config, is_qat, backend): the checkpoint's model rebuilt as its quantizable variant, on CPU,
    with the qat recipe only for a QAT checkpoint (which keeps the backend it was trained for)."""
    d = cfg.model_dump(mode="json")
    is_qat = "qat" in d["recipes"]
    check_quantizable(d["model"]["name"])
    d["model"]["quantize"] = True
    d["model"].pop("weights", None)  # the checkpoint's weights are loaded instead
    d["device"] = "cpu"
    qat_args = d["recipe_args"].get("qat", {})
    d["recipes"], d["recipe_args"] = (["qat"], {"qat": qat_args}) if is_qat else ([], {})
    if is_qat:
        trained = qat_args.get("backend", "x86")
        if backend and backend != trained:
            raise QuantizationError(f"a QAT checkpoint converts with the backend it was trained for ({trained})")
        backend = trained
    # checked as a config file is (the builder's arguments and ranges with quantize=True)
    cfg = config_from_data(d, f"the int8 config of {d['model']['name']} (the checkpoint's, with model.quantize=true)")
    return cfg, is_qat, check_backend(backend or "x86", "--backend")


@dataclasses.dataclass
class Int8Model:
    """A checkpoint made int8: its run (data, loaders, config), the converted model, and the spec fields."""
    run: Any
    model: nn.Module
    method: str                     # qat or ptq
    backend: str
    fields: dict                    # spec fields: epoch (qat) or calibration_batches / _transform (ptq)
    fp32_metrics: Optional[dict] = None


def int8_from_checkpoint(checkpoint, state, cfg, backend=None, calib_batches=32, calib_transform="eval",
                         eval_fp32=False):
    """A QAT checkpoint converted, or an fp32 one quantized after training (PTQ) on `calib_batches`
    training batches (evaluation transform unless calib_transform="train"). state: the loaded
    checkpoint; cfg: the config to use it with (artifacts.config.config_from_checkpoint)."""
    cfg, is_qat, backend = int8_config(cfg, backend)
    run = build_run(cfg, os.path.dirname(os.path.abspath(checkpoint)))  # qat: the recipe prepares the model
    load_model_state(run.model, state["model"], checkpoint)
    if is_qat:
        recipe = next(r for r in run.recipes if isinstance(r, RECIPES.get("qat")))
        recipe.load_state_dict(state.get("recipes", {}).get("qat", {}))
        return Int8Model(run, convert_int8(run.model), "qat", backend, {"epoch": epoch_number(state)})
    fp32 = None
    if eval_fp32:
        fp32 = evaluate(run.model, run.val_loader, run.data.evaluator(), run.device).compute()
    loader = run.train_loader if calib_transform == "train" else calibration_loader(
        run.data, cfg.data.batch_size, run.train_loader.num_workers, cfg.seed or 0, calib_transform)
    int8, n = ptq(run.model, calibration_batches(loader, calib_batches), backend)
    return Int8Model(run, int8, "ptq", backend, {"calibration_batches": n, "calibration_transform": calib_transform},
                     fp32)


# ---------------------------------------------------------------- the int8 artifact

def example_inputs(loader, n=2):
    inputs = next(iter(loader))[0]
    if not isinstance(inputs, torch.Tensor):
        raise NotQuantizable("the int8 artifact is traced on tensor inputs; this dataset gives "
                             f"{type(inputs).__name__}")
    return inputs[:n].cpu()


def int8_spec(run, method, backend, dynamic_batch=True, **fields):
    """The artifact description (artifacts.spec) of a run's int8 model."""
    cfg = run.cfg.model_dump(mode="json")
    adapter = adapter_class(cfg).create(cfg, run.data, dist.unwrap(run.model), run.output_dir)
    return describe(adapter.spec, "torchscript", cfg, dynamic_batch=dynamic_batch, method=method, backend=backend,
                    **fields)


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)  # enums (interpolation), dtypes


def describe_transform(transform):
    """The evaluation preprocessing as torchvision steps: [{'name': 'Resize', 'size': [32], ...}, ...]."""
    if transform is None:
        return []
    steps = getattr(transform, "transforms", None)
    if steps is None:
        return [{"name": type(transform).__name__, "repr": repr(transform)}]
    out = []
    for step in steps:
        params = {k: _jsonable(v) for k, v in vars(step).items()
                  if not k.startswith("_") and k != "training" and not callable(v)}
        out.append({"name": type(step).__name__, **params})
    return out


def plain_torch_metadata(spec, data):
    """metadata.json for plain PyTorch: the spec with its pre-processing as torchvision steps (the
    transform its adapter builds from the spec's description: one description, two formats) and how
    the data set reads a file (e.g. ImageFolder's loader: PIL image converted to RGB)."""
    val = getattr(data, "val", None)
    transform = EXPORTERS.get(spec["adapter"])(spec, "").transform()
    return {**{k: v for k, v in spec.items() if k not in ("format", "adapter", "preprocessing")},
            "format": PLAIN_TORCH_FORMAT, "preprocessing": describe_transform(transform),
            "dataset": {"type": type(val).__name__, "loader": getattr(getattr(val, "loader", None), "__name__", None)},
            "input": "float32 tensor NCHW after the preprocessing; output: logits"}


def to_torchscript(int8_model, example, freeze=True):
    """Trace the eval path of a converted model (scripting fails on the loss-dict contract of
    training mode); freeze: inline weights and quantization parameters as constants. Checked to
    give exactly the eager model's outputs on `example`."""
    int8_model = int8_model.eval()
    with torch.no_grad(), eager_quantization():
        traced = torch.jit.trace(int8_model, example, check_trace=False)
        if freeze:
            traced = torch.jit.freeze(traced)
        expected, got = int8_model(example), traced(example)
    if not torch.equal(expected, got):
        raise RuntimeError("the TorchScript int8 model disagrees with the eager one")
    return traced


def write_int8_artifact(int8_model, path, example, spec, data=None):
    """The converted model as TorchScript with its description inside and beside it (`<path>.json`),
    both with the SHA-256 of the archive's code entries (artifacts.safety.verify_digests compares
    them before torch.jit.load compiles the code); the one beside it also has the archive's SHA-256.
    Returns the spec written."""
    traced = to_torchscript(int8_model, example)
    spec = parse_spec(dict(spec, artifact=os.path.basename(path), input_shape=list(example.shape[1:])), path)

    def save(f, spec):
        files = {SPEC_FILE: json.dumps(spec), PLAIN_TORCH_FILE: json.dumps(plain_torch_metadata(spec, data))}
        torch.jit.save(traced, f, _extra_files=files)

    with eager_quantization():
        first = io.BytesIO()
        save(first, spec)  # the code entries do not depend on the extra files: hashed from a first save
        spec = parse_spec(dict(spec, code_sha256=code_digests(first)), path)
        atomic_write(path, lambda f: save(f, spec), binary=True)
    if code_digests(path) != spec["code_sha256"]:
        raise RuntimeError(f"{path}: torch.jit.save wrote other code entries than the first time")
    return write_spec(path, spec)
