"""Name -> builder registries for models, datasets, recipes and scorers (timm-style factories).

The engine imports no family: the entry points (train.py, evaluate.py, ...) import the packages
`models`, `datasets` and `recipes`, whose modules register themselves here.
"""
import difflib
import inspect
from engine.errors import UserError


class RegistryError(UserError, KeyError):
    pass


def closest(name, choices):
    match = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


class Registry:
    """`declares`: what an entry says about itself at registration, with the allowed values (a model
    its task, a data set the kind of input it reads), read with `declared(name, key)`. The loop needs
    none of it; export, predict, quantize and benchmark choose their behaviour by it."""

    def __init__(self, kind, declares=None):
        self.kind, self.declares = kind, declares or {}
        self._builders, self._declared = {}, {}

    def register(self, name=None, **declared):
        for key, allowed in self.declares.items():
            if declared.get(key) not in (None, *allowed):
                raise ValueError(f"{self.kind} '{name}': register({key}=...) must be one of {', '.join(allowed)}, "
                                 f"got {declared.get(key)!r}")
        unknown = set(declared) - set(self.declares)
        if unknown:
            raise ValueError(f"{self.kind} '{name}': unknown declaration(s) {sorted(unknown)}")

        def wrap(fn):
            key = name or fn.__name__
            if key in self._builders:
                raise ValueError(f"{self.kind} '{key}' is registered twice")
            self._builders[key], self._declared[key] = fn, declared
            return fn
        return wrap

    def declared(self, name, key):
        """The declared value; a RegistryError when the entry declared none."""
        self.get(name)  # a clear error for an unknown name
        value = self._declared[name].get(key)
        if value is None:
            raise RegistryError(f"{self.kind} '{name}' declares no {key}: register it with "
                                f"@{self.kind.upper()}S.register({key}=...) (one of {', '.join(self.declares[key])})")
        return value

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


TASKS = ("classification", "detection", "semantic_segmentation", "panoptic", "sequence")
INPUTS = ("image", "text", "audio")
MODELS = Registry("model", declares={"task": TASKS})
DATASETS = Registry("dataset", declares={"inputs": INPUTS})
RECIPES = Registry("recipe")
# scoring-only modes of evaluate.py (a predictions file, no model): engine.evaluation.ResultsScorer
SCORERS = Registry("results scorer")
