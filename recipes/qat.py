"""Quantization to int8: the `qat` recipe, post-training quantization (`ptq`) and the int8 artifact.

The flow is torchvision's (references/classification/train_quantization.py), eager mode:

  qat: fuse_model(is_qat=True) -> backend's default QAT qconfig -> prepare_qat -> train with fake
       quantization; observers frozen from `freeze_observers_epoch`, BatchNorm statistics from
       `freeze_bn_epoch` -> convert to int8.
  ptq: fuse_model(is_qat=False) -> backend's default qconfig -> prepare -> N calibration batches
       -> convert (quantize.py at the top level).

A model is quantizable when it (or a submodule) has `fuse_model(is_qat)` and QuantStub/DeQuantStub
around its float computation: torchvision's quantizable classifiers (`model.quantize: true`).

The int8 artifact is the converted model traced to TorchScript, with its metadata (classes,
preprocessing, config, metrics) stored inside the file; it loads in plain PyTorch, without this
project's code:

    files = {"metadata.json": ""}
    model = torch.jit.load("model_int8.pt", map_location="cpu", _extra_files=files)
    meta = json.loads(files["metadata.json"])
"""
import contextlib
import copy
import itertools
import json
import logging
import os
import warnings

import torch
from torch import nn

from engine import dist
from engine.checkpoint import file_sha256
from engine.registry import RECIPES
from engine.hooks import Recipe

log = logging.getLogger(__name__)

BACKENDS = ("x86", "fbgemm", "qnnpack")
ARTIFACT_FORMAT = "zoo-int8-torchscript/1"


# ---------------------------------------------------------------- torch.ao eager mode, in one place

@contextlib.contextmanager
def eager_quantization():
    """Every torch.ao.quantization eager-mode call of this project goes through here.

    torch.ao.quantization warns on each prepare / prepare_qat / convert that it is deprecated
    (and its default x86/fbgemm qconfigs that `reduce_range` will be). Both are silenced here and
    only here. Migration path: torchao's PT2E flow (torch.export -> torchao's prepare_pt2e /
    prepare_qat_pt2e with X86InductorQuantizer -> convert_pt2e -> torch.compile). On torch 2.11
    it produced no int8 speed-up over fp32 on this project's CPUs, while eager mode gives
    2-2.7x; move when PT2E's int8 path is faster, then only this module changes.

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


def set_backend(backend):
    """Select the int8 kernels (x86, fbgemm, qnnpack); the qconfig must match them."""
    if backend not in BACKENDS:
        raise ValueError(f"quantization backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend not in torch.backends.quantized.supported_engines:
        raise ValueError(f"quantization backend {backend!r} is not supported by this PyTorch build "
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
        raise TypeError(f"{type(model).__name__} is not quantizable: eager-mode quantization needs a model "
                        f"with fuse_model(is_qat) and QuantStub/DeQuantStub, e.g. torchvision's quantizable "
                        f"MobileNetV3: set model.quantize: true in the config")
    return found


def prepare_qat_model(model, backend="x86"):
    """In place: fuse (Conv+BN(+ReLU) become QAT modules), insert fake quantization."""
    set_backend(backend)
    model.train()
    with eager_quantization():
        for module in fusable_modules(model):
            module.fuse_model(is_qat=True)
        model.qconfig = torch.ao.quantization.get_default_qat_qconfig(backend)
        torch.ao.quantization.prepare_qat(model, inplace=True)
    return model


def prepare_ptq_model(model, backend="x86"):
    """In place: fuse (BN folded into the convolutions), insert observers for calibration."""
    set_backend(backend)
    model.eval()
    with eager_quantization():
        for module in fusable_modules(model):
            module.fuse_model(is_qat=False)
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


def freeze_bn_stats(model):
    model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)


@torch.no_grad()
def calibrate(model, batches, device="cpu"):
    """Run the observers of a PTQ-prepared model over `batches` of (inputs, targets). Returns the count."""
    model.eval()
    n = 0
    for inputs, _ in batches:
        model(inputs.to(device))
        n += 1
    if n == 0:
        raise ValueError("calibration saw no batches")
    return n


class OnCPU(nn.Module):
    """Runs a CPU-only (int8) model whatever device the loop puts the inputs on."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, inputs):
        return self.module(inputs.cpu())


# ---------------------------------------------------------------- the recipe

@RECIPES.register("qat")
class QAT(Recipe):
    """Quantization-aware training (see the module docstring). Logs val/... for the fake-quantized
    model and val_int8/... for a converted int8 copy evaluated on CPU; at the end writes
    `<output_dir>/<artifact>` (TorchScript + metadata)."""
    order = 10  # before syncbn, channels_last, amp, ema, ddp, compile: they see the prepared model

    def __init__(self, backend="x86", freeze_observers_epoch=4, freeze_bn_epoch=3, eval_int8=True,
                 artifact="model_int8.pt"):
        if backend not in BACKENDS:
            raise ValueError(f"recipe_args.qat.backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.freeze_observers_epoch, self.freeze_bn_epoch = freeze_observers_epoch, freeze_bn_epoch
        self.eval_int8, self.artifact = eval_int8, artifact
        self.observers_frozen = self.bn_frozen = False
        self.model = None
        self._int8 = (None, None)  # (step, model): converted once per evaluation

    INCOMPATIBLE = {
        "precise_bn": "precise_bn resets and recomputes BatchNorm statistics, which qat freezes from "
                      "freeze_bn_epoch on (QAT starts from an fp32 checkpoint whose statistics are converged)",
        "amp": "fake quantization runs in float32 (autocast fails in its observers)",
    }

    def setup(self, run):
        for name, why in self.INCOMPATIBLE.items():
            if name in run.cfg.recipes:
                raise ValueError(f"recipes: qat and {name} do not combine: {why}")
        run.model = prepare_qat_model(run.model, self.backend).to(run.device)
        self.model = run.model
        log.info("qat: %s backend, observers frozen from epoch %d, BatchNorm statistics from epoch %d",
                 self.backend, self.freeze_observers_epoch + 1, self.freeze_bn_epoch + 1)

    def forward_context(self, run):
        # FakeQuantize observers record whatever passes in eval mode too: keep validation data
        # out of the quantization ranges (torchvision's script lets it in for the epochs before
        # the freeze), and evaluation from changing the model.
        if self.model is None or self.model.training or self.observers_frozen:
            return contextlib.nullcontext()
        return self._observers_paused()

    @contextlib.contextmanager
    def _observers_paused(self):
        freeze_observers(self.model)
        try:
            yield
        finally:
            self.model.apply(torch.ao.quantization.enable_observer)

    def _apply_freezing(self):
        if self.observers_frozen:
            freeze_observers(self.model)
        if self.bn_frozen:
            freeze_bn_stats(self.model)

    def before_epoch(self, run):
        # Frozen after `freeze_*_epoch` epochs, i.e. from the epoch with that 0-based index on.
        # (torchvision's train_quantization.py sets its flags after training epoch index N, so its
        # observers see one more epoch: its 4/3 are 5/4 here.)
        if run.epoch >= self.freeze_observers_epoch and not self.observers_frozen:
            log.info("qat: freezing quantization observers (epoch %d)", run.epoch + 1)
            self.observers_frozen = True
        if run.epoch >= self.freeze_bn_epoch and not self.bn_frozen:
            log.info("qat: freezing BatchNorm statistics (epoch %d)", run.epoch + 1)
            self.bn_frozen = True
        self._apply_freezing()

    def int8_model(self, run):
        step, model = self._int8
        if step != run.step or model is None:
            model = convert_int8(self.model)
            self._int8 = (run.step, model)
        return model

    def eval_models(self, run):
        return {"int8": OnCPU(self.int8_model(run))} if self.eval_int8 else {}

    def finish(self, run):
        if not dist.is_main() or not self.artifact:
            return
        path = os.path.join(run.output_dir, self.artifact)
        meta = artifact_metadata(run, method="qat", backend=self.backend,
                                 metrics={k: v for k, v in run.metrics.items() if k.startswith("val_int8/")})
        export_artifact(convert_int8(self.model), path, example_inputs(run.val_loader), meta)
        log.info("qat: int8 model saved to %s", path)

    def state_dict(self):
        return {"observers_frozen": self.observers_frozen, "bn_frozen": self.bn_frozen, "backend": self.backend}

    def load_state_dict(self, state):
        if state.get("backend", self.backend) != self.backend:
            raise ValueError(f"qat: the checkpoint was trained for backend {state['backend']!r}, "
                             f"the config asks for {self.backend!r}")
        # Observer flags are buffers and come back with the model; BatchNorm freezing is a plain
        # attribute of the fused modules and does not: re-apply both.
        self.observers_frozen = bool(state.get("observers_frozen", False))
        self.bn_frozen = bool(state.get("bn_frozen", False))
        if self.model is not None:
            self._apply_freezing()


# ---------------------------------------------------------------- the artifact

def example_inputs(loader, n=2):
    inputs = next(iter(loader))[0]
    if not isinstance(inputs, torch.Tensor):
        raise TypeError("the int8 artifact is traced on tensor inputs; this dataset gives "
                        f"{type(inputs).__name__}")
    return inputs[:n].cpu()


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)  # enums (interpolation), dtypes


def describe_transform(transform):
    """The evaluation preprocessing as data: [{'name': 'Resize', 'size': [32], ...}, ...]."""
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


def artifact_metadata(run, method, backend, **extra):
    cfg = run.cfg.model_dump(mode="json")
    return {"format": ARTIFACT_FORMAT, "method": method, "backend": backend, "model": run.cfg.model.name,
            "classes": list(run.data.classes) if run.data.classes is not None else None,
            "preprocessing": describe_transform(getattr(run.data.val, "transform", None)),
            # e.g. torchvision's ImageFolder default_loader: PIL image converted to RGB before the transforms
            "dataset": {"type": type(run.data.val).__name__,
                        "loader": getattr(getattr(run.data.val, "loader", None), "__name__", None)},
            "input": "float32 tensor NCHW after the preprocessing; output: logits",
            "torch": torch.__version__, "config": cfg, **_jsonable(extra)}


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


def export_artifact(int8_model, path, example, metadata):
    """Save the converted model as TorchScript with metadata.json inside (and a copy next to it)."""
    traced = to_torchscript(int8_model, example)
    meta = dict(metadata, input_shape=list(example.shape[1:]))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with eager_quantization():
        torch.jit.save(traced, tmp, _extra_files={"metadata.json": json.dumps(meta)})
    os.replace(tmp, path)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({k: v for k, v in meta.items() if k != "config"}, f, indent=2)
    return path


def load_artifact(path):
    """(TorchScript module, metadata dict): exactly what plain PyTorch does with the file."""
    files = {"metadata.json": ""}
    with eager_quantization():
        model = torch.jit.load(path, map_location="cpu", _extra_files=files)
    meta = json.loads(files["metadata.json"] or "{}")
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"{path}: not an int8 artifact of this project (format {meta.get('format')!r})")
    return model.eval(), meta


# ---------------------------------------------------------------- PTQ and artifact evaluation

def ptq(model, batches, backend="x86"):
    """Post-training quantization of a quantizable fp32 model (in place): returns (int8 model, batches used)."""
    model = prepare_ptq_model(model.cpu(), backend)
    n = calibrate(model, batches)
    return convert_int8(model), n


def evaluate_artifact(path, config=None, overrides=(), report_dir=None):
    """evaluate.py --artifact: the TorchScript int8 model on the val split of its config (the one
    saved inside the artifact unless `config` is given), on CPU. Writes report.json / report.md."""
    from omegaconf import OmegaConf

    from engine.config import config_from_dict, load_config
    from engine.evaluation import write_report
    from engine.loop import build_data, build_loaders, evaluate

    model, meta = load_artifact(path)
    if config:
        cfg = load_config(config, overrides)
    else:
        merged = OmegaConf.merge(OmegaConf.create(meta["config"]), OmegaConf.from_dotlist(list(overrides)))
        cfg = config_from_dict(OmegaConf.to_container(merged, resolve=True))
    data = build_data(cfg, os.path.dirname(os.path.abspath(path)))
    if meta.get("classes") is not None and data.classes is not None and list(data.classes) != meta["classes"]:
        raise ValueError(f"{path}: trained for classes {meta['classes']}, the data has {data.classes}")
    _, val_loader = build_loaders(cfg, data, cfg.seed or 0)
    torch.backends.quantized.engine = meta.get("backend", torch.backends.quantized.engine)
    evaluator = evaluate(model, val_loader, data.evaluator(), torch.device("cpu"))
    report = evaluator.report()
    report.update(artifact={"path": os.path.abspath(path), "sha256": file_sha256(path),
                            **{k: v for k, v in meta.items() if k != "config"}},
                  config={"file": config, "model": cfg.model.name, "data": cfg.data.name})
    header = (f"# Evaluation report (int8 artifact)\n\n- artifact: `{path}` ({meta.get('method')}, "
              f"{meta.get('backend')} backend, TorchScript)\n- data: {cfg.data.name} val\n\n")
    write_report(report_dir or os.path.dirname(os.path.abspath(path)), report, header + evaluator.markdown(report))
    return report


def calibration_batches(loader, n):
    return itertools.islice(loader, n)


CALIBRATION_TRANSFORMS = ("eval", "train")


def calibration_loader(data, batch_size, workers=0, seed=0, transform="eval"):
    """Shuffled (seeded) training images for PTQ calibration. transform="eval" (the default) feeds
    them through the evaluation preprocessing, so the observers see the value ranges of the images
    the int8 model will get, not AutoAugment's or RandomErasing's; "train" keeps the training
    augmentation (torchvision's train_quantization.py calibrates on its training loader)."""
    if transform not in CALIBRATION_TRANSFORMS:
        raise ValueError(f"calibration transform: expected eval or train, got {transform!r}")
    dataset = data.train
    if transform == "eval":
        if not (hasattr(dataset, "transform") and hasattr(data.val, "transform")):
            raise TypeError(f"calibration with the evaluation transform needs datasets with a .transform "
                            f"attribute ({type(dataset).__name__} has none): use --calib-transform train")
        dataset = copy.copy(dataset)  # a shallow copy: the training set keeps its own transform
        dataset.transform = data.val.transform
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator,
                                       num_workers=workers, collate_fn=data.collate_fn)
