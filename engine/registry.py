"""Name -> builder registries for models, datasets, recipes and scorers (timm-style factories).

The engine imports no family: the entry points (train.py, evaluate.py, ...) import the packages
`models`, `datasets` and `recipes`, whose modules register themselves here.
"""
import difflib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

from engine.errors import UserError
from engine.transfer import Layout, load_weights, report_of


class RegistryError(UserError, KeyError):
    pass


def closest(name, choices):
    match = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric builder argument, declared at registration:
    `@MODELS.register(task=..., ranges={"dropout": Range(ge=0, lt=1)})`; engine.config checks each
    config value against it. Numbers are finite. A list value is checked item by item; `length` and
    `increasing` make the argument a list (a crop scale: `Range(gt=0, le=1, length=2, increasing=True)`)."""
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    length: Optional[int] = None
    increasing: bool = False  # each item >= the one before it

    def is_list(self):
        return self.length is not None or self.increasing

    def fits(self, x):
        return (_number(x) and math.isfinite(x) and (self.ge is None or x >= self.ge)
                and (self.gt is None or x > self.gt) and (self.le is None or x <= self.le)
                and (self.lt is None or x < self.lt))

    def __str__(self):
        bounds = " and ".join(f"{op} {b:g}" for op, b in ((">=", self.ge), (">", self.gt), ("<=", self.le),
                                                           ("<", self.lt)) if b is not None)
        if not self.is_list():
            return f"a finite number {bounds}".rstrip()
        count = f"{self.length} " if self.length is not None else ""
        order = ", each >= the one before" if self.increasing else ""
        return f"a list of {count}finite numbers {bounds}".rstrip() + order

    def problem(self, value):
        """None when value fits (null always does, as for any builder argument), else what was expected."""
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            ok = (all(self.fits(x) for x in value) and (self.length is None or len(value) == self.length)
                  and (not self.increasing or all(a <= b for a, b in zip(value, value[1:]))))
        else:
            ok = not self.is_list() and self.fits(value)
        return None if ok else str(self)


@dataclass(frozen=True)
class OneOf:
    """A declared value among `allowed` (a tuple of allowed values is read as this)."""
    allowed: tuple

    def fits(self, value):
        return any(value == v and type(value) is type(v) for v in self.allowed)

    def __str__(self):
        return f"one of {', '.join(map(str, self.allowed))}"


@dataclass(frozen=True)
class Each:
    """A declared tuple whose items are each one of `allowed` (a model's export formats); () declares none."""
    allowed: tuple

    def fits(self, value):
        return isinstance(value, tuple) and len(set(value)) == len(value) and all(v in self.allowed for v in value)

    def __str__(self):
        return f"a tuple of distinct items of {', '.join(self.allowed)}"


@dataclass(frozen=True)
class Notes:
    """A declared {key: why} mapping whose keys are among `allowed` (why a model is not exported to a format)."""
    allowed: tuple

    def fits(self, value):
        return (isinstance(value, dict) and all(k in self.allowed for k in value)
                and all(isinstance(v, str) and v for v in value.values()))

    def __str__(self):
        return f"a dict {{format: reason}} with formats among {', '.join(self.allowed)}"


@dataclass(frozen=True)
class Named:
    """A declared name of an entry of another registry (a data set's doctor source), looked up when used."""
    registry: str

    def fits(self, value):
        return isinstance(value, str) and value.isidentifier()

    def __str__(self):
        return f"the name of a {self.registry}"


@dataclass(frozen=True)
class ClassParams:
    """A model's class-dependent parameters: {module name (fnmatch patterns allowed): the layout of the
    class axis in dim 0 of its tensors (engine.transfer's Rows, Interleaved, SemanticRows)}."""

    def fits(self, value):
        return (isinstance(value, dict) and bool(value)
                and all(isinstance(k, str) and k and isinstance(v, Layout) for k, v in value.items()))

    def __str__(self):
        return "a mapping of module names to engine.transfer layouts (Rows, Interleaved, SemanticRows)"


@dataclass(frozen=True)
class Prefixes:
    """A tuple of state-dict key prefixes (what a model's weights file may lack)."""

    def fits(self, value):
        return isinstance(value, tuple) and all(isinstance(p, str) and p for p in value)

    def __str__(self):
        return "a tuple of state-dict key prefixes"


class Registry:
    """`declares`: what an entry says about itself at registration, with its allowed values (a tuple
    of them, OneOf, Each or Named): a model its task, whether it is quantizable and the formats it
    exports to; a data set the kind of input it reads and its doctor source.
    Read with `declared(name, key)`. The loop needs none of it; export, predict, quantize, benchmark
    and the doctor choose their behaviour by it."""

    def __init__(self, kind, declares=None):
        self.kind = kind
        self.declares = {k: OneOf(v) if isinstance(v, tuple) else v for k, v in (declares or {}).items()}
        self._builders, self._declared, self._ranges = {}, {}, {}

    def register(self, name=None, ranges=None, **declared):
        """`ranges`: {argument: Range} for the builder's numeric arguments, checked with the config."""
        for key, allowed in self.declares.items():
            if declared.get(key) is not None and not allowed.fits(declared[key]):
                raise ValueError(f"{self.kind} '{name}': register({key}=...) must be {allowed}, "
                                 f"got {declared.get(key)!r}")
        unknown = set(declared) - set(self.declares)
        if unknown:
            raise ValueError(f"{self.kind} '{name}': unknown declaration(s) {sorted(unknown)}")

        def wrap(fn):
            key = name or fn.__name__
            if key in self._builders:
                raise ValueError(f"{self.kind} '{key}' is registered twice")
            params = inspect.signature(fn).parameters
            for arg, bound in (ranges or {}).items():
                if arg not in params or not isinstance(bound, Range):
                    raise ValueError(f"{self.kind} '{key}': ranges[{arg!r}] must be a Range of one of its arguments")
            self._builders[key], self._declared[key] = self._entry(fn), declared
            self._ranges[key] = dict(ranges or {})
            return fn
        return wrap

    def _entry(self, fn):
        """What get() returns for a registered builder."""
        return fn

    def declared(self, name, key):
        """The declared value; a RegistryError when the entry declared none."""
        self.get(name)  # a clear error for an unknown name
        value = self._declared[name].get(key)
        if value is None:
            raise RegistryError(f"{self.kind} '{name}' declares no {key}: register it with "
                                f"@{self.kind.upper()}S.register({key}=...) ({self.declares[key]})")
        return value

    def declared_or(self, name, key, default=None):
        """The declared value, or default when the entry declared none."""
        self.get(name)
        value = self._declared[name].get(key)
        return default if value is None else value

    def ranges(self, name):
        """{argument: Range} declared at registration."""
        self.get(name)
        return self._ranges[name]

    def names(self):
        return sorted(self._builders)

    def get(self, name):
        if name not in self._builders:
            raise RegistryError(f"unknown {self.kind} '{name}'{closest(name, self._builders)} "
                                f"(known: {', '.join(self.names())})")
        return self._builders[name]

    def arguments(self, name):
        """Keyword arguments the builder accepts, or None if it takes **kwargs."""
        params = inspect.signature(self.get(name)).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def build(self, name, *args, **kwargs):
        return self.get(name)(*args, **kwargs)


# what every model accepts beyond its builder's own arguments: the weights it starts from and how
# their classes map onto the data's (engine.transfer)
MODEL_ARGUMENTS = (
    inspect.Parameter("weights", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[str]),
    inspect.Parameter("new_classes", inspect.Parameter.KEYWORD_ONLY, default="auto",
                      annotation=Union[bool, Literal["auto"]]),
    inspect.Parameter("class_map", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=Union[Literal["auto"], dict[str, str], None]))


class ModelRegistry(Registry):
    """Models: each entry also takes MODEL_ARGUMENTS (its signature shows them, so engine.config checks
    them as builder arguments). A builder gets `weights` only if it names it, to build as for trained
    weights (frozen BatchNorm, trainable layers); it does not load them: build() does, after the
    builder, with the family's declared `class_params` (engine.transfer.load_weights)."""

    def _entry(self, fn):
        signature = inspect.signature(fn)
        own = signature.parameters
        params = [p for p in own.values() if p.kind is not p.VAR_KEYWORD]
        params += [p for p in MODEL_ARGUMENTS if p.name not in own]
        params += [p for p in own.values() if p.kind is p.VAR_KEYWORD]
        common = {p.name for p in MODEL_ARGUMENTS} - set(own)

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            return fn(*args, **{k: v for k, v in kwargs.items() if k not in common})
        entry.__signature__ = signature.replace(parameters=params)
        return entry

    def build(self, name, *args, **kwargs):
        return self.build_reported(name, kwargs, args=args)[0]

    def build_reported(self, name, kwargs, classes=None, args=()):
        """(model, the weights report or None): the builder's model, with model.weights loaded into it.
        classes: the model's class names (the data's), what model.new_classes: auto compares."""
        entry = self.get(name)
        model = entry(*args, **kwargs)
        bound = inspect.signature(entry).bind_partial(*args, **kwargs)
        bound.apply_defaults()
        weights, class_map = bound.arguments.get("weights"), bound.arguments.get("class_map")
        if weights:  # new_classes and class_map say how weights load: without any, nothing to say
            load_weights(model, weights, self.declared_or(name, "class_params", {}),
                         bound.arguments.get("new_classes", "auto"), class_map, classes,
                         bound.arguments.get("num_classes"), self.declared_or(name, "may_miss", ()))
        return model, report_of(model)


TASKS = ("classification", "detection", "semantic_segmentation", "panoptic", "sequence")
INPUTS = ("image", "text", "audio")
# what export.py writes (artifacts.spec.ARTIFACT_FORMATS); torchscript is the int8 artifact
EXPORT_FORMATS = ("onnx", "torch_export", "torchscript")
# class_params: the class-dependent parameters, reset (or mapped) for weights of other classes;
# may_miss: key prefixes a model's weights file may lack (panoptic: a Mask R-CNN has no semantic head)
# not_exported: {format: why} for a format the model cannot be exported to (export.py --list shows it);
# export_adapter: the exporters.Adapter class (by name) when not its task's default (Faster R-CNN's)
MODELS = ModelRegistry("model", declares={"task": TASKS, "quantizable": (True, False), "exports": Each(EXPORT_FORMATS),
                                         "not_exported": Notes(EXPORT_FORMATS),
                                         "export_adapter": Named("export adapter"), "class_params": ClassParams(),
                                         "may_miss": Prefixes()})
DATASETS = Registry("dataset", declares={"inputs": INPUTS, "doctor": Named("doctor source")})
RECIPES = Registry("recipe")
# scoring-only modes of evaluate.py (a predictions file, no model): engine.evaluation.ResultsScorer
SCORERS = Registry("results scorer")
# how the doctor reads a data set's samples (datasets.doctor.sources.Source subclasses), by the name
# a data set declares with @DATASETS.register(doctor=...)
DOCTOR_SOURCES = Registry("doctor source")
