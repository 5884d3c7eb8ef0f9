"""YAML configs: `_base_` inheritance, `--set key=value` overrides, schema validation.

Merging and overrides use OmegaConf; validation uses pydantic. Every error names the key and the
file (or command line) it came from. Model, dataset and recipe arguments are checked against the
signature of the registered builder, so a typo there is caught before anything runs.
"""
import os
from typing import Any, Literal, Optional

import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.registry import DATASETS, MODELS, RECIPES, RegistryError, closest

COMMAND_LINE = "the command line (--set)"


class ConfigError(ValueError):
    pass


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _OpenSection(BaseModel):
    """A section whose extra keys are builder arguments, checked against the builder."""
    model_config = ConfigDict(extra="allow")


class ModelConfig(_OpenSection):
    name: str


class DataConfig(_OpenSection):
    name: str
    batch_size: int = Field(gt=0)          # per process
    eval_batch_size: Optional[int] = None  # defaults to batch_size
    workers: int = Field(default=2, ge=0)


class ParamGroupConfig(_Section):
    """Parameters whose names match a pattern (fnmatch, e.g. 'net.aux_classifier.*') get their own
    lr (lr_mult x optim.lr) and, optionally, weight decay. The first matching rule wins."""
    params: list[str]
    lr_mult: float = Field(default=1.0, gt=0)
    weight_decay: Optional[float] = None


class OptimConfig(_Section):
    name: Literal["sgd", "rmsprop", "adamw"] = "sgd"
    lr: float = Field(gt=0)
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    norm_weight_decay: Optional[float] = None  # weight decay of norm layers; None = weight_decay
    bias_weight_decay: Optional[float] = None  # weight decay of biases; None = weight_decay
    alpha: float = 0.99                        # RMSprop
    eps: float = 1e-8                          # RMSprop / AdamW
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    clip_grad_norm: Optional[float] = None
    param_groups: list[ParamGroupConfig] = []  # name-pattern rules, see ParamGroupConfig


class SchedConfig(_Section):
    name: Literal["constant", "step", "multistep", "cosine", "poly"] = "constant"
    step_size: int = 30           # epochs (step)
    gamma: float = 0.1            # step, multistep
    milestones: list[int] = []    # epochs (multistep)
    eta_min: float = 0.0          # cosine
    power: float = 0.9            # poly: lr x (1 - iter / max_iter) ** power
    warmup_epochs: float = 0.0    # linear warm-up, may be fractional
    warmup_start_factor: float = 0.01


class TrainConfig(_Section):
    epochs: int = Field(gt=0)
    eval_every: int = Field(default=1, gt=0)     # epochs
    log_every: int = Field(default=20, gt=0)     # steps
    best_metric: Optional[str] = None            # e.g. top1; None = first metric the evaluator gives
    best_mode: Literal["max", "min"] = "max"
    max_steps_per_epoch: Optional[int] = None    # for smoke runs


class Config(_Section):
    seed: Optional[int] = 0
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    output_dir: Optional[str] = None  # default runs/<config name>
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    sched: SchedConfig = SchedConfig()
    train: TrainConfig
    recipes: list[str] = []
    recipe_args: dict[str, dict[str, Any]] = {}


# ---------------------------------------------------------------- loading

def _read_yaml(path, referrer=None):
    if not os.path.isfile(path):
        where = f" (named in _base_ of {referrer})" if referrer else ""
        raise ConfigError(f"config file not found: {path}{where}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
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
    if not isinstance(bases, list):
        raise ConfigError(f"{path}: _base_ must be a file name or a list of file names")
    merged = OmegaConf.create()
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        merged = OmegaConf.merge(merged, _load_with_bases(base_path, sources, path, chain + (path,)))
    for key in _flat_keys(data):
        sources[key] = path
    return OmegaConf.merge(merged, OmegaConf.create(data))


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


def _check_builder_args(cfg, sources):
    checks = [("model", MODELS, cfg.model.name, cfg.model.model_extra),
              ("data", DATASETS, cfg.data.name, cfg.data.model_extra)]
    for name in cfg.recipes:
        checks.append((f"recipe_args.{name}", RECIPES, name, cfg.recipe_args.get(name, {})))
    for extra in cfg.recipe_args:  # arguments of a recipe not in use are kept (a base may set them)
        if extra not in RECIPES.names():
            raise ConfigError(f"{_source(sources, 'recipe_args.' + extra)}: recipe_args.{extra}: unknown "
                              f"recipe '{extra}'{closest(extra, RECIPES.names())}")
    for section, registry, name, kwargs in checks:
        try:
            accepted = registry.arguments(name)
        except RegistryError as e:
            key = section if section.startswith("recipe_args") else f"{section}.name"
            src = _source(sources, key if not section.startswith("recipe_args") else "recipes")
            raise ConfigError(f"{src}: {e}") from None
        for arg in kwargs or {}:
            if accepted is not None and arg not in accepted:
                key = f"{section}.{arg}"
                hint = closest(arg, accepted)
                raise ConfigError(f"{_source(sources, key)}: unknown key '{key}' for {registry.kind} "
                                  f"'{name}'{hint.replace(chr(39), chr(39) + section + '.', 1) if hint else ''} "
                                  f"(accepted: {', '.join(accepted)})")


def load_config(path, overrides=()):
    """Load, merge, override and validate; raises ConfigError naming the key and its file."""
    sources = {}
    merged = _load_with_bases(path, sources)
    if overrides:
        merged = OmegaConf.merge(merged, _parse_overrides(overrides, sources))
    raw = OmegaConf.to_container(merged, resolve=True)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_describe(err, sources, path) for err in e.errors())) from None
    _check_builder_args(cfg, sources)
    return cfg


def to_yaml(cfg):
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_from_dict(data):
    """Rebuild a Config from the dict saved in a checkpoint."""
    return Config.model_validate(data)
