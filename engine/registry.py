"""Name -> builder registries for models, datasets, recipes and scorers (timm-style factories).

The engine imports no family: the entry points (train.py, evaluate.py, ...) import the packages
`models`, `datasets` and `recipes`, whose modules register themselves here.
"""
import difflib
import inspect


class RegistryError(KeyError):
    def __str__(self):
        return self.args[0]


def closest(name, choices):
    match = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


class Registry:
    def __init__(self, kind):
        self.kind = kind
        self._builders = {}

    def register(self, name=None):
        def wrap(fn):
            key = name or fn.__name__
            if key in self._builders:
                raise ValueError(f"{self.kind} '{key}' is registered twice")
            self._builders[key] = fn
            return fn
        return wrap

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


MODELS = Registry("model")
DATASETS = Registry("dataset")
RECIPES = Registry("recipe")
# scoring-only modes of evaluate.py (a predictions file, no model): engine.evaluation.ResultsScorer
SCORERS = Registry("results scorer")
