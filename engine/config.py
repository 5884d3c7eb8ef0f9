"""YAML configs: `_base_` inheritance, `--set key=value` overrides, schema validation.

Merging and overrides use OmegaConf; validation uses pydantic. Every error names the key and the
file (or command line) it came from. Model, dataset and recipe arguments are checked against the
signature of the registered builder and the ranges it declared (engine.registry.Range), so a typo or
a value out of range there is caught before anything runs.
"""
import importlib
import inspect
import os
import sys
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from omegaconf import OmegaConf
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from engine.registry import DATASETS, MODELS, RECIPES, RegistryError, closest
from engine.errors import UserError

COMMAND_LINE = "the command line (--set)"


class ConfigError(UserError, ValueError):
    pass


# no float of the schema takes inf or nan: each has a finite bound or a null for "none"
class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _OpenSection(BaseModel):
    """A section whose extra keys are builder arguments, checked against the builder."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ModelConfig(_OpenSection):
    name: str


class DataConfig(_OpenSection):
    name: str
    batch_size: int = Field(gt=0)          # per process
    eval_batch_size: Optional[int] = None  # defaults to batch_size
    workers: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"  # see engine.build.loader_workers


Fraction = Annotated[float, Field(ge=0, lt=1)]  # AdamW's betas


class LrScaling(_Section):
    base_batch: int = Field(gt=0)  # the global batch that optim.lr was tuned for


class ParamGroupConfig(_Section):
    """Parameters whose names match a pattern (fnmatch, e.g. 'net.aux_classifier.*') get their own
    lr (lr_mult x optim.lr) and, optionally, weight decay. The first matching rule wins."""
    params: list[str]
    lr_mult: float = Field(default=1.0, gt=0)
    weight_decay: Optional[float] = Field(default=None, ge=0)


class OptimConfig(_Section):
    name: Literal["sgd", "rmsprop", "adamw"] = "sgd"
    lr: float = Field(gt=0)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(default=0.0, ge=0)
    norm_weight_decay: Optional[float] = Field(default=None, ge=0)  # weight decay of norm layers; None = weight_decay
    bias_weight_decay: Optional[float] = Field(default=None, ge=0)  # weight decay of biases; None = weight_decay
    alpha: float = Field(default=0.99, gt=0, lt=1)  # RMSprop
    eps: float = Field(default=1e-8, gt=0)  # RMSprop / AdamW
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)  # AdamW
    clip_grad_norm: Optional[float] = Field(default=None, gt=0)  # max gradient norm
    fused: bool = True  # sgd, adamw: one fused kernel per step on CPU/CUDA (torch's CPU default: a per-tensor loop)
    accumulate_steps: int = Field(default=1, gt=0)  # batches per optimizer step (DDP no_sync between)
    scale_lr_with_batch: Optional[LrScaling] = None  # linear rule: lr * global batch / base_batch
    param_groups: list[ParamGroupConfig] = []  # name-pattern rules, see ParamGroupConfig
    # module-name pattern -> lr multiplier, e.g. {backbone: 0.1} (detectron2's / mmdetection's paramwise
    # options): a prefix of parameter names or an fnmatch pattern; the longest matching pattern wins
    lr_mult: dict[str, Annotated[float, Field(gt=0)]] = {}


class SchedConfig(_Section):
    # linear: decay to eta_min (zero by default) at the last iteration, best under a budget (Li et al., ICLR 2020)
    name: Literal["constant", "step", "multistep", "cosine", "poly", "linear"] = "constant"
    step_size: int = Field(default=30, gt=0)        # epochs (step)
    gamma: float = Field(default=0.1, gt=0)        # step, multistep
    milestones: list[Annotated[int, Field(ge=0)]] = []  # epochs (multistep)
    eta_min: float = Field(default=0.0, ge=0)        # cosine, linear
    power: float = Field(default=0.9, gt=0)        # poly: lr x (1 - iter / max_iter) ** power
    warmup_epochs: float = Field(default=0.0, ge=0)  # linear warm-up, may be fractional
    warmup_iters: Optional[int] = Field(default=None, ge=0)  # or its length in iterations
    warmup_start_factor: float = Field(default=0.01, gt=0, le=1)
    # chain: main schedule after the warm-up (torchvision classification); overlay: the warm-up
    # multiplies the first iterations of epoch 0, main schedule from 0 (torchvision detection)
    warmup_mode: Literal["chain", "overlay"] = "chain"


class EarlyStoppingConfig(_Section):
    patience: int = Field(gt=0)                # evaluations without an improvement of train.best_metric
    min_delta: float = Field(default=0.0, ge=0)  # what counts as an improvement


class DoctorConfig(_Section):
    """Settings of the data doctor (doctor.py, docs/doctor.md); training ignores them."""
    imbalance_ratio: float = Field(default=10.0, gt=1)   # most / fewest samples of a class in a split, flagged above
    near_duplicate_bits: int = Field(default=4, ge=0, le=32)  # of 64 perceptual-hash bits, near-duplicates differ by
    folds: int = Field(default=5, ge=2)                  # cross-validation folds of the label-error check
    label_time_limit_s: float = Field(default=600.0, gt=0)  # estimated longer: skipped unless doctor.py --labels-anyway


def duration_seconds(value):
    """A wall time: a number of seconds, or a string such as 90s, 20m, 1.5h."""
    text = str(value).strip().lower()
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1:], None)
    try:
        seconds = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"expected a wall time such as 20m, 90s or 1.5h (or a number of seconds), got {value!r}")
    return seconds


def _check_duration(value):
    if value is not None:
        duration_seconds(value)
    return value


Duration = Annotated[Union[float, str], AfterValidator(_check_duration)]


class FreezeConfig(_Section):
    """Parameters of the modules matched by `modules` (module-name prefixes or fnmatch patterns, as
    optim.lr_mult) get no gradient and their BatchNorm layers stay in eval mode for the first `epochs`
    epochs; then they train, at the schedule's lr of that point (engine.freeze)."""
    modules: list[str] = Field(min_length=1)
    epochs: int = Field(gt=0)


class TrainConfig(_Section):
    epochs: Optional[int] = Field(default=None, gt=0)  # required unless budget is set
    budget: Optional[Duration] = None  # wall time, e.g. 20m, 90s, 1.5h (seconds if a number): replaces epochs
    early_stopping: Optional[EarlyStoppingConfig] = None
    eval_every: int = Field(default=1, gt=0)     # epochs
    log_every: int = Field(default=20, gt=0)     # steps
    best_metric: Optional[str] = None            # e.g. top1; None = first metric the evaluator gives
    best_mode: Literal["max", "min"] = "max"
    max_steps_per_epoch: Optional[int] = Field(default=None, gt=0)  # optimizer steps; for smoke runs
    analysis: bool = True  # each evaluation's report with its analysis (reports/epoch_N/, TensorBoard curves)
    check_val_samples: int = Field(default=2000, ge=0)  # val splits up to this size are read once before training
    freeze: Optional[FreezeConfig] = None  # modules frozen for the first epochs, see FreezeConfig

    @model_validator(mode="after")
    def _epochs_or_budget(self):
        if self.epochs is None and self.budget is None:
            raise ValueError("set train.epochs or train.budget (a wall time such as 20m)")
        return self


class CheckpointConfig(_Section):
    every_n_steps: Optional[int] = Field(default=None, gt=0)  # last.pt also every N optimizer steps
    strict: bool = True  # weights must match the model key for key (false: load what fits, warn)
    lock_lease: float = Field(default=300.0, gt=0)  # seconds: run.lock not refreshed for this long is taken over


class Config(_Section):
    imports: list[str] = []       # modules that register a family kept outside this repository
    seed: Optional[int] = 0
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    output_dir: Optional[str] = None  # default runs/<config name>
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    sched: SchedConfig = SchedConfig()
    train: TrainConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    resume: Optional[str] = None  # auto: <run folder>/last.pt when it exists, else a fresh run; or a path
    recipes: list[str] = []
    recipe_args: dict[str, dict[str, Any]] = {}
    doctor: DoctorConfig = DoctorConfig()  # doctor.py only


# ---------------------------------------------------------------- loading

def _read_yaml(path, referrer=None):
    if not os.path.isfile(path):
        where = f" (named in _base_ of {referrer})" if referrer else ""
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:  # the message gives the line and column
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except (UnicodeDecodeError, ValueError, OSError, RecursionError) as e:  # e.g. a date like 2024-13-45
        raise ConfigError(f"{path}: cannot read the config ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def _flat_keys(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        yield key
        if isinstance(v, dict):
            yield from _flat_keys(v, key + ".")


def _load_with_bases(path, sources, referrer=None, chain=()):
    path = os.path.normpath(path)
    if path in chain:
        raise ConfigError(f"{path}: _base_ cycle: {' -> '.join(chain + (path,))}")
    data = _read_yaml(path, referrer)
    bases = data.pop("_base_", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: _base_ must be a file name or a list of file names, got {bases!r:.80}")
    merged = OmegaConf.create()
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        merged = _merge(merged, _load_with_bases(base_path, sources, path, chain + (path,)), path)
    for key in _flat_keys(data):
        sources[key] = path
    return _merge(merged, data, path)


def _merge(merged, data, source):
    """OmegaConf merge whose errors (a key that is not a string, a mapping replaced by a list) name the source."""
    try:
        return OmegaConf.merge(merged, data if OmegaConf.is_config(data) else OmegaConf.create(data))
    except Exception as e:  # omegaconf's errors (KeyValidationError, ValidationError, ...)
        raise ConfigError(f"{source}: cannot merge: {str(e).splitlines()[0]}") from None


def _parse_overrides(overrides, sources):
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or not all(part.isidentifier() for part in key.split(".")):
            raise ConfigError(f"bad override '{item}' on {COMMAND_LINE}: expected key.path=value, "
                              f"e.g. optim.lr=0.1")
        for k in _flat_keys(_nest(key, None)):
            sources[k] = COMMAND_LINE
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except Exception as e:  # OmegaConf grammar errors
        raise ConfigError(f"bad override on {COMMAND_LINE}: {e}") from None


def _nest(dotted, value):
    out = {}
    node = out
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def _source(sources, key):
    while key:
        if key in sources:
            return sources[key]
        key = key.rpartition(".")[0]
    return "the config"


def _valid_keys(model_cls, loc):
    """Dotted valid keys at the level of loc (for suggestions)."""
    cls = model_cls
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        cls = field.annotation
    return list(cls.model_fields)


def _describe(err, sources, top):
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(Config, loc)
        hint = closest(loc[-1], valid)
        hint = hint.replace("'", f"'{'.'.join(loc[:-1]) + '.' if len(loc) > 1 else ''}", 1) if hint else ""
        return f"{_source(sources, key)}: unknown key '{key}'{hint}"
    if err["type"] == "missing":
        return f"{top}: missing required key '{key}' (set it in the config or with --set {key}=...)"
    got = err.get("input")
    return f"{_source(sources, key)}: key '{key}': {err['msg'].lower()}, got {got!r} ({type(got).__name__})"


# the kinds of value a builder argument takes, read from its default when it has no annotation
_KINDS = ((bool, (bool,), "a boolean (true / false)"), (int, (int,), "an integer"),
          (float, (int, float), "a number"), (str, (str,), "a string"),
          ((list, tuple), (list, tuple), "a list"), (dict, (dict,), "a mapping"))


def _type_problem(param, value):
    """None when value fits a builder parameter (its annotation, else the type of its default; null is
    always accepted), else the expected type in words."""
    if value is None:
        return None
    if param.annotation is not param.empty and not isinstance(param.annotation, str):
        try:
            TypeAdapter(param.annotation).validate_python(value)
            return None
        except ValidationError as e:
            return f"{getattr(param.annotation, '__name__', param.annotation)} ({e.errors()[0]['msg'].lower()})"
        except Exception:  # an annotation pydantic cannot check: fall back to the default
            pass
    for kind, accepted, words in _KINDS:
        if param.default is not param.empty and param.default is not None and isinstance(param.default, kind):
            fits = isinstance(value, accepted) and (bool in accepted or not isinstance(value, bool))
            return None if fits else f"{words}, like its default {param.default!r}"
    return None


def _range_problem(registry, name, arg, value):
    """The range the builder declared for arg (engine.registry.Range), in words, when value is outside it."""
    bound = registry.ranges(name).get(arg)
    return bound.problem(value) if bound else None


def _check_builder_args(cfg, sources):
    checks = [("model", MODELS, cfg.model.name, cfg.model.model_extra, ModelConfig),
              ("data", DATASETS, cfg.data.name, cfg.data.model_extra, DataConfig)]
    for name in cfg.recipes:
        checks.append((f"recipe_args.{name}", RECIPES, name, cfg.recipe_args.get(name, {}), None))
    for extra in cfg.recipe_args:  # arguments of a recipe not in use are kept (a base may set them)
        if extra not in RECIPES.names():
            raise ConfigError(f"{_source(sources, 'recipe_args.' + extra)}: recipe_args.{extra}: unknown "
                              f"recipe '{extra}'{closest(extra, RECIPES.names())}")
    for section, registry, name, kwargs, schema in checks:
        try:
            params = inspect.signature(registry.get(name)).parameters
        except RegistryError as e:
            key = section if section.startswith("recipe_args") else f"{section}.name"
            src = _source(sources, key if not section.startswith("recipe_args") else "recipes")
            raise ConfigError(f"{src}: {e}") from None
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        accepted = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for arg, value in (kwargs or {}).items():
            key = f"{section}.{arg}"
            if arg not in accepted:
                if takes_any:
                    continue
                # the section's own keys (data.batch_size, ...) are candidates too: batchsize -> batch_size
                hint = closest(arg, accepted + (list(schema.model_fields) if schema else []))
                raise ConfigError(f"{_source(sources, key)}: unknown key '{key}' for {registry.kind} "
                                  f"'{name}'{hint.replace(chr(39), chr(39) + section + '.', 1) if hint else ''} "
                                  f"(accepted: {', '.join(accepted)})")
            expected = _type_problem(params[arg], value) or _range_problem(registry, name, arg, value)
            if expected:
                raise ConfigError(f"{_source(sources, key)}: key '{key}' of {registry.kind} '{name}': expected "
                                  f"{expected}, got {value!r:.80} ({type(value).__name__})")


def load_config(path, overrides=()):
    """Load, merge, override and validate; raises ConfigError naming the key and its file."""
    sources = {}
    merged = _load_with_bases(path, sources)
    return _validated(merged, sources, path, overrides)


def config_from_data(data, source="the config data", overrides=()):
    """A Config from a mapping (a checkpoint's saved config, an artifact's description), with --set
    overrides, checked exactly as a config file is: schema, builder arguments and their ranges. Errors
    name `source` (e.g. "the config saved in runs/x/last.pt") where a file's would name the file. The
    data is taken as it is: no `_base_` is followed (a file name in data is not read)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    sources = dict.fromkeys(_flat_keys(data), source)
    return _validated(_merge(OmegaConf.create(), data, source), sources, source, overrides)


def _validated(merged, sources, top, overrides):
    """The merged config with the overrides, validated; `top` names where it came from."""
    if overrides:
        merged = _merge(merged, _parse_overrides(overrides, sources), COMMAND_LINE)
    try:
        raw = OmegaConf.to_container(merged, resolve=True)
    except Exception as e:  # ${...} interpolations that do not resolve
        raise ConfigError(f"{top}: {str(e).splitlines()[0]}") from None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_describe(err, sources, top) for err in e.errors())) from None
    import_families(cfg, _source(sources, "imports"))
    _check_builder_args(cfg, sources)
    return cfg


def import_families(cfg, where="the config"):
    """Import the config's `imports` (a family's own modules, importable from sys.path): their
    @MODELS.register / @DATASETS.register / @EXPORTERS.register run before anything is built."""
    for name in cfg.imports:
        import_family(name, where)


def import_family(name, where):
    """Import one family module by name. A saved config or an artifact's description may come from
    anyone, so only a dotted module name is taken, never a standard-library module or a `__main__`
    (whose import may run a program); no code comes from the file itself."""
    parts = str(name).split(".")
    if not all(p.isidentifier() for p in parts) or "__main__" in parts or parts[0] in sys.stdlib_module_names:
        raise ConfigError(f"{where}: imports: {name!r} is not a model family's module (a dotted module name on the "
                          f"Python path, not a standard-library module or a __main__); refused")
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{where}: imports: cannot import '{name}' ({e}); the module must be on the "
                          f"Python path (PYTHONPATH or an installed package)") from None


def to_yaml(cfg):
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
