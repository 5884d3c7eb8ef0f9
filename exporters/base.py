"""The adapter base class and the registry that picks an adapter by the task a model declares.

An adapter knows, for one task: the exportable module (tensors in, a tuple of tensors out), the
pre-processing as JSON (the spec written beside an artifact, format "zoo-export/1"), how exported
outputs are compared with eager ones, and how predict.py reads inputs and presents outputs.
"""
import logging
import os
import shutil

import torch
from torch import nn

from engine.config import import_family
from engine.errors import UserError
from engine.registry import DATASETS, INPUTS, MODELS, TASKS, RegistryError
from runtime.spec import SPEC_FORMAT

log = logging.getLogger(__name__)

LOGITS_ATOL = 1e-3  # fp32 logits, exported vs eager; measured gaps: docs/performance.md
WHY_NOT = {"torchscript": "TorchScript is this project's int8 path, for a model that declares quantizable=True"}


class ExportError(UserError, ValueError):
    """A model / format combination that cannot be exported: says which, why and what to try."""


class Exporters:
    """Adapter classes by (task, inputs): the task a model declares in MODELS and the kind of input
    its data set declares in DATASETS. The data set is consulted only when the task has adapters for
    several kinds of input (sequence: text or audio). Specs name their adapter by class name."""

    def __init__(self):
        self._by_name = {}

    def register(self, task, inputs, by_name=False):
        """by_name: chosen only for a model that declares it (@MODELS.register(export_adapter=...)),
        never as its task's default."""
        if task not in TASKS:
            raise ValueError(f"export adapter: task must be one of {', '.join(TASKS)}, got {task!r}")
        if inputs not in INPUTS:
            raise ValueError(f"export adapter: inputs must be one of {', '.join(INPUTS)}, got {inputs!r}")

        def wrap(cls):
            if cls.__name__ in self._by_name:
                raise ValueError(f"export adapter '{cls.__name__}' is registered twice")
            for other in self._by_name.values():
                if not by_name and not other.by_name and (other.model_task, other.input_kind) == (task, inputs):
                    raise ValueError(f"export adapter '{cls.__name__}': '{other.__name__}' already serves "
                                     f"task {task} with {inputs} inputs")
            cls.model_task, cls.input_kind, cls.by_name = task, inputs, by_name
            self._by_name[cls.__name__] = cls
            return cls
        return wrap

    def names(self):
        return sorted(self._by_name)

    def tasks(self):
        return sorted({cls.model_task for cls in self._by_name.values()})

    def get(self, name):
        if name not in self._by_name:
            raise ExportError(f"unknown export adapter '{name}' (known: {', '.join(self.names())})")
        return self._by_name[name]

    def for_config(self, cfg):
        """The adapter class for a config as a dict: by the model's task, then the data's inputs."""
        model, data = cfg["model"]["name"], cfg["data"]["name"]

        def unknown(why):
            return ExportError(f"model {model} (data {data}): no export adapter knows it: {why} (adapters serve the "
                               f"tasks {', '.join(self.tasks())}; a family plugs in with a subclass of "
                               f"exporters.Adapter registered with @EXPORTERS.register(task=..., inputs=...))")
        try:
            task = MODELS.declared(model, "task")
        except RegistryError as e:
            raise unknown(e) from None
        named = MODELS.declared_or(model, "export_adapter")
        if named:
            cls = self.get(named)
            if cls.model_task != task:
                raise unknown(f"it declares the adapter {named}, which serves task {cls.model_task}, not {task}")
            return cls
        candidates = [cls for cls in self._by_name.values() if cls.model_task == task and not cls.by_name]
        if len(candidates) > 1:
            try:
                inputs = DATASETS.declared(data, "inputs")
            except RegistryError as e:
                raise unknown(e) from None
            candidates = [cls for cls in candidates if cls.input_kind == inputs]
            task = f"{task} on {inputs} inputs"
        if not candidates:
            raise unknown(f"none serves task {task}")
        return candidates[0]


EXPORTERS = Exporters()


def adapter_class(cfg, fmt=None):
    """The adapter class for a config (as a dict); with fmt, first an ExportError unless the model
    declares fmt among its exports (before any data or model is built)."""
    why = fmt and undeclared_export(cfg["model"]["name"], fmt)
    if why:
        raise ExportError(why)
    return EXPORTERS.for_config(cfg)


def undeclared_export(model, fmt):
    """None when model declares fmt in @MODELS.register(exports=...), else why not: what it declares
    and which models of its task export fmt."""
    try:
        exports = MODELS.declared(model, "exports")
    except RegistryError as e:
        return f"model {model}, format {fmt}: {e}"
    if fmt in exports:
        return None
    task = MODELS.declared_or(model, "task")
    others = [m for m in MODELS.names() if m != model and fmt in MODELS.declared_or(m, "exports", ())
              and MODELS.declared_or(m, "task") == task]
    note = MODELS.declared_or(model, "not_exported", {}).get(fmt) or WHY_NOT.get(fmt)
    why = f" ({note})" if note else ""
    if exports:
        return (f"model {model}, format {fmt}: not among the formats it declares{why}; export {model} with "
                + " or ".join(f"--format {f}" for f in exports))
    return (f"model {model}, format {fmt}: the model declares no export format (@MODELS.register(exports=())), "
            f"so it cannot be exported{why}; "
            + (f"{task} models that export {fmt}: {', '.join(others)}" if others else
               "a family that can be exported declares its formats with @MODELS.register(exports=(...)) and has "
               "an exporters.Adapter for its task"))


def adapter_from_spec(spec, folder):
    """The adapter of an artifact's spec; folder: where the spec's files (tokenizer, ...) are.

    A spec's `imports` (its config's: a family kept outside this repository) are imported only when
    the adapter it names is not registered yet, and only as the names of modules on the Python path:
    no code comes from the file. Since an artifact may come from anyone, a name is refused when it is
    not a family's module: a standard-library module or a `__main__` (whose import may run a
    program), or anything but a dotted name (artifacts.spec checks the form)."""
    if spec.get("format") != SPEC_FORMAT:
        raise ExportError(f"{folder}: not an export description of this project (format {spec.get('format')!r}, "
                          f"expected {SPEC_FORMAT})")
    if spec.get("adapter") not in EXPORTERS.names():
        for name in spec.get("imports") or []:  # a family kept outside this repository (the config's imports)
            import_family(name, f"{folder}: the artifact's description")
    return EXPORTERS.get(spec["adapter"])(spec, folder)


class Adapter:
    """Subclass per task and register with @EXPORTERS.register(task=..., inputs=...), which sets
    model_task and input_kind ("image", "text" or "audio": what predict.py reads)."""
    model_task = input_kind = None
    by_name = False
    task = None                  # what the artifact does, written to the spec (e.g. "text_classification")
    input_names = ("images",)
    output_names = ("logits",)
    # "dynamo": torch.onnx.export(dynamo=True); "torchscript": the TorchScript-based exporter
    # (dynamo=False), torchvision's way for graphs whose sizes depend on the data (two-stage detectors)
    onnx_exporter = "dynamo"
    one_image = False  # the graph takes one sample without a batch axis (predict and evaluate feed one at a time)

    def __init__(self, spec, folder):
        self.spec, self.folder = spec, folder

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        """Task keys of the spec (classes, pre-processing) from the training config, its data
        (DataSplits, or None when the data is not at hand) and the model."""
        raise NotImplementedError

    @classmethod
    def create(cls, cfg, data, model, folder):
        spec = {"format": SPEC_FORMAT, "adapter": cls.__name__, "task": cls.task, "model": cfg["model"]["name"],
                "imports": list(cfg.get("imports") or []), "inputs": list(cls.input_names),
                "outputs": list(cls.output_names),
                **cls.build_spec(cfg, data, model, folder)}
        return cls(spec, folder)

    @property
    def classes(self):
        return self.spec.get("classes")

    def class_name(self, k):
        classes = self.classes
        return classes[k] if classes and 0 <= k < len(classes) else str(k)

    def files(self):
        """Files next to the spec a consumer needs (e.g. the tokenizer), relative to the folder."""
        return []

    def copy_files(self, out_dir):
        for name in self.files():
            if os.path.abspath(os.path.join(self.folder, name)) != os.path.abspath(os.path.join(out_dir, name)):
                shutil.copyfile(os.path.join(self.folder, name), os.path.join(out_dir, name))

    # ---- export
    def module(self, model):
        """The eval path with tensors in (input_names) and a tuple of tensors out (output_names)."""
        return TupleOutput(model).eval()

    def dynamic_shapes(self, dynamic_batch):
        batch = torch.export.Dim.DYNAMIC if dynamic_batch else torch.export.Dim.STATIC
        return tuple({0: batch} for _ in self.input_names)

    def dynamic_axes(self, dynamic_batch):
        """The TorchScript-based ONNX exporter's dynamic axes (onnx_exporter = "torchscript")."""
        return {name: {0: "batch"} for name in self.input_names} if dynamic_batch else None

    def join(self, outputs):
        """The outputs of several batches as one (what compare() reads): concatenated, or for a
        one-image graph the list of each image's outputs."""
        if self.one_image:
            return list(outputs)
        return tuple(torch.cat(parts) for parts in zip(*outputs))

    def eval_model(self, runner, where):
        """What evaluate.py --artifact evaluates in the model's place: the val loader's batches in,
        the model's eval output out (default: one tensor in, one out)."""
        return RunnerAsModel(runner, where)

    def sample_from_dataset(self, item):
        """A val data set item -> what load() returns for a user's input."""
        return item[0]

    def compare(self, ref, got, atol=LOGITS_ATOL):
        """Eager (ref) against exported (got) outputs of one batch: a JSON-able dict with at least
        "samples", "ok" (within tolerance) and "tolerance" (what was allowed), shown by export.py."""
        raise NotImplementedError

    def transform(self):
        """The evaluation transform (a PIL image -> tensor) the spec's preprocessing describes, or None
        when the task's inputs are read otherwise (the int8 artifact's metadata.json writes it as steps)."""
        return None

    # ---- predict
    def load(self, item):
        raise NotImplementedError

    def collate(self, samples):
        if self.one_image:
            if len(samples) != 1:  # batch_key keeps images apart; a caller that batches anyway is a bug
                raise ValueError(f"{type(self).__name__}: its graph takes one image, got {len(samples)}")
            return (samples[0],)
        return (torch.stack(samples),)

    def batch_key(self, sample):
        """Samples with equal keys can share a batch (a one-image graph: none do)."""
        return id(sample) if self.one_image else None

    def present(self, outputs, items, samples, out_dir, args):
        """The predictions of one batch (items: the inputs' names, samples: what load() returned), with
        what they draw written to out_dir: one JSON-able dict per item."""
        raise NotImplementedError

    def summary(self, result):
        """The console line predict.py prints for one of present()'s results (None: no line)."""
        return None

    def after_predictions(self, results, out_dir, args):
        """After the last batch (predict.py writes predictions.json itself)."""


class TupleOutput(nn.Module):
    """A model whose eval output is one tensor, as a tuple (exported graphs return tuples)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs):
        return (self.model(inputs),)


class RunnerAsModel(nn.Module):
    """A runner where the engine expects a model (engine.evaluation.evaluate): the val loader's batch of
    inputs in, the model's eval output out. Artifacts of one tensor in and one out (a classifier's
    images -> logits) evaluate this way; runners are safe to call from several threads."""

    def __init__(self, runner, where):
        super().__init__()
        self.runner, self.where = runner, where

    def forward(self, inputs):
        if not isinstance(inputs, torch.Tensor):
            raise ExportError(f"{self.where}: evaluating an artifact needs batches of one tensor (a classifier's "
                                f"images); this data set gives {type(inputs).__name__}: evaluate the checkpoint")
        outputs = self.runner(inputs.cpu())
        if len(outputs) != 1:
            raise ExportError(f"{self.where}: evaluating an artifact needs one output (logits), it has "
                                f"{len(outputs)}: evaluate the checkpoint")
        return outputs[0]
