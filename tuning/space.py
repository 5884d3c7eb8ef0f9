"""The search space: a YAML mapping of config keys to distributions, checked like a config before the
first trial.

    optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}
    optim.weight_decay: {uniform: [0, 0.1]}
    model.label_smoothing: {uniform: [0, 0.2]}
    train.eval_every: {int: [1, 3]}
    recipes: {choice: [[amp], [amp, ema]]}

Every key must be a key of the config (a schema key or an argument of the model's, data set's or a
recipe's builder); both ends of a range and every choice are validated as the config would be, so a
value outside a key's range is refused before anything runs, and every sampled config is checked again
(engine.config.config_from_data) before its trial starts."""
import copy
import json

import yaml

from engine.config import ConfigError, config_from_data

KINDS = ("uniform", "log_uniform", "int", "log_int", "choice")


class SpaceError(ConfigError):
    pass


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Param:
    """One key's distribution: kind (KINDS) and its arguments (low, high) or choices."""

    def __init__(self, key, kind, args, where):
        self.key, self.kind = key, kind
        if kind == "choice":
            if not isinstance(args, list) or not args:
                raise SpaceError(f"{where}: {key}: choice takes a non-empty list of values, got {args!r:.80}")
            self.choices = args
            return
        if not (isinstance(args, list) and len(args) == 2 and all(map(_number, args))):
            raise SpaceError(f"{where}: {key}: {kind} takes [low, high] (two numbers), got {args!r:.80}")
        self.low, self.high = args
        if kind in ("int", "log_int") and not all(float(v).is_integer() for v in args):
            raise SpaceError(f"{where}: {key}: {kind} takes integer ends, got {args!r}")
        if not self.low < self.high:
            raise SpaceError(f"{where}: {key}: {kind} [{self.low}, {self.high}]: low must be below high")
        if kind.startswith("log_") and self.low <= 0:
            raise SpaceError(f"{where}: {key}: {kind} [{self.low}, {self.high}]: a log range must be above 0 "
                             f"(use uniform for a range that includes 0)")

    def ends(self):
        """The values that bound what this parameter can take: both ends, or every choice."""
        return list(self.choices) if self.kind == "choice" else [self.low, self.high]

    def suggest(self, trial):
        """The value Optuna's trial samples (a retried trial gets its recorded value back)."""
        name = self.key
        if self.kind == "choice":
            return self.decode(trial.suggest_categorical(name, self.options()))
        if self.kind in ("int", "log_int"):
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.kind == "log_int")
        return trial.suggest_float(name, float(self.low), float(self.high), log=self.kind == "log_uniform")

    def options(self):
        """The choices as Optuna stores them (str, int, float, bool or None): a list or mapping as JSON."""
        return [json.dumps(c) if isinstance(c, (list, dict)) else c for c in self.choices]

    def decode(self, value):
        """A value Optuna stored back to the config's value."""
        return self.choices[self.options().index(value)] if self.kind == "choice" else value

    def describe(self):
        return f"choice {self.choices}" if self.kind == "choice" else f"{self.kind} [{self.low}, {self.high}]"


def set_key(data, key, value):
    """data with key (dotted) set to value, the sections on the way created."""
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise SpaceError(f"{key}: '{p}' is not a section of the config")
    node[parts[-1]] = value
    return data


def sampled_config(base, values, source):
    """The config of one point of the space: base (a config as data) with `values` {key: value}, validated
    as a config file is; its errors name `source`."""
    data = copy.deepcopy(base)
    for key, value in values.items():
        set_key(data, key, value)
    return config_from_data(data, source)


class Space:
    """The parameters of a space file, in its order; `text` is the file as read (for the study's identity)."""

    def __init__(self, params, text):
        self.params, self.text = params, text

    def __iter__(self):
        return iter(self.params)

    def sample(self, trial):
        return {p.key: p.suggest(trial) for p in self.params}

    def values(self, params):
        """{key: config value} of a trial's stored params."""
        return {p.key: p.decode(params[p.key]) for p in self.params if p.key in params}

    def grid(self):
        """{key: [choices]} for Optuna's GridSampler: a grid takes choices only."""
        bad = [p.key for p in self.params if p.kind != "choice"]
        if bad:
            raise SpaceError(f"--sampler grid takes choice keys only; {', '.join(bad)} are ranges")
        return {p.key: p.options() for p in self.params}

    def grid_size(self):
        size = 1
        for p in self.params:
            size *= len(p.choices)
        return size


def load_space(path, base):
    """The space file at path, each key checked against `base` (the config as data): a key that is not a
    config key, or an end or choice the config refuses, raises SpaceError naming the file and the key."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = yaml.safe_load(text)
    except OSError as e:
        raise SpaceError(f"--space {path}: cannot read the file ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise SpaceError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or not data:
        raise SpaceError(f"{path}: expected a mapping of config keys to distributions, e.g. "
                         f"optim.lr: {{log_uniform: [1.0e-4, 1.0e-1]}}")
    params = []
    for key, spec in data.items():
        if not isinstance(key, str) or not all(part.isidentifier() for part in key.split(".")):
            raise SpaceError(f"{path}: {key!r} is not a config key (expected a dotted key such as optim.lr)")
        if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in KINDS):
            raise SpaceError(f"{path}: {key}: expected one of {', '.join(KINDS)} with its values, e.g. "
                             f"{{uniform: [0, 0.1]}}, got {spec!r:.80}")
        (kind, args), = spec.items()
        param = Param(key, kind, args, path)
        for value in param.ends():
            try:
                sampled_config(base, {key: value}, f"{path}")
            except ConfigError as e:  # its lines name this file already: said once
                why = "; ".join(line.strip().replace(f"{path}: ", "") for line in str(e).splitlines()
                                if line.strip() != "invalid config:")
                raise SpaceError(f"{path}: {key} = {value!r} (of {param.describe()}) is refused by the config: "
                                 f"{why}") from None
        params.append(param)
    return Space(params, text)
