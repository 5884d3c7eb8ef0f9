"""Builder arguments are range-checked with the config (issue 32, item 5): every registered model and
data set builder declares the valid range of each numeric argument at registration
(engine.registry.Range), and a value outside it is refused at config load with the key, its source and
the bound named, before torch sees it. A plug-in family's ranges are enforced the same way. Also
item 12: the schema's floats take no inf or nan (train.early_stopping.min_delta=.inf)."""
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import typing

import pytest
import yaml

from engine.config import COMMAND_LINE, ConfigError, load_config
from engine.registry import DATASETS, MODELS, Range

from conftest import ROOT

PLUGINS = os.path.join(ROOT, "tests", "plugins")
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
# a builder of the other section, for a config that names one builder under test
OTHER = {"model": ("data", "synthetic_classification"), "data": ("model", "mobilenet_v3_small")}




def _plug_in(name):
    """Register a family of tests/plugins in this process as `imports: [name]` would (its module is then
    in sys.modules), before the cases below are generated from the registries."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(PLUGINS, f"{name}.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_plug_in("toy_stripes")


def _numeric_type(t):
    return t in (int, float) or any(_numeric_type(a) for a in typing.get_args(t))


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def numeric(param):
    """A numeric argument: a number or a list of numbers by its default, or an annotation with int / float."""
    d = param.default
    if _is_number(d) or (isinstance(d, (list, tuple)) and d and all(_is_number(x) for x in d)):
        return True
    return param.annotation is not param.empty and _numeric_type(param.annotation)


def takes_list(param):
    annotation = param.annotation if param.annotation is not param.empty else None
    kinds = (annotation, *typing.get_args(annotation)) if annotation is not None else ()
    return isinstance(param.default, (list, tuple)) or any(typing.get_origin(a) is list for a in kinds)


def integer(param):
    annotation = param.annotation if param.annotation is not param.empty else None
    if isinstance(param.default, (list, tuple)):
        return all(isinstance(x, int) for x in param.default)
    if annotation is not None:
        return not any(float in (a, *typing.get_args(a)) for a in (annotation, *typing.get_args(annotation)))
    return isinstance(param.default, int)


def builders():
    return [(section, registry, name) for section, registry in (("model", MODELS), ("data", DATASETS))
            for name in registry.names()]


def outside(param, bound):
    """Values just outside a declared range, each one way it can be left (a bound, the length, the order)."""
    step = 1 if integer(param) else 0.001
    values = [v for v, b in ((None if bound.ge is None else bound.ge - step, bound.ge), (bound.gt, bound.gt),
                             (None if bound.le is None else bound.le + step, bound.le), (bound.lt, bound.lt))
              if b is not None]
    if bound.is_list():
        inside = list(param.default)
        out = [[v] * len(inside) for v in values]  # every item outside
        if bound.length is not None:
            out.append(inside + inside[:1])  # one item too many
        if bound.increasing:
            out.append(sorted(inside, reverse=True))
        return out
    return [[v] for v in values] if takes_list(param) else values


def cases():
    for section, registry, name in builders():
        params = inspect.signature(registry.get(name)).parameters
        for arg, bound in registry.ranges(name).items():
            for value in outside(params[arg], bound):
                yield pytest.param(section, name, arg, value, bound, id=f"{name}.{arg}={value}")


def test_every_numeric_builder_argument_declares_its_range():
    undeclared = [f"{section}.{arg} of {name}" for section, registry, name in builders()
                  for arg, param in inspect.signature(registry.get(name)).parameters.items()
                  if numeric(param) and arg not in registry.ranges(name)]
    assert not undeclared, f"numeric builder arguments without a declared Range: {undeclared}"
    assert {"toy_stripes", "toy_pixel_classifier"} <= set(DATASETS.names() + MODELS.names())


def test_every_default_is_inside_its_declared_range():
    for section, registry, name in builders():
        params = inspect.signature(registry.get(name)).parameters
        for arg, bound in registry.ranges(name).items():
            assert bound.problem(params[arg].default) is None, f"{name}.{arg}={params[arg].default!r}: {bound}"


def tiny_config(folder, section, name):
    """A config that names the builder under test and no argument of it."""
    other, other_name = OTHER[section]
    names = {section: name, other: other_name}
    path = os.path.join(folder, f"{section}-{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"model": {"name": names["model"]}, "data": {"name": names["data"], "batch_size": 2},
                        "optim": {"lr": 0.1}, "train": {"epochs": 1}}, f)
    return path


@pytest.mark.parametrize("section, name, arg, value, bound", list(cases()))
def test_a_value_outside_a_declared_range_is_refused_naming_the_key(tmp_path, section, name, arg, value, bound):
    key = f"{section}.{arg}"
    with pytest.raises(ConfigError) as e:
        load_config(tiny_config(tmp_path, section, name), [f"{key}={json.dumps(value)}"])
    message = str(e.value)
    assert f"key '{key}'" in message and COMMAND_LINE in message and str(bound) in message, message


def test_a_value_from_a_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text(f"_base_: {DEMO}\nmodel: {{width_mult: -1}}\n")
    expected = rf"^{re.escape(str(path))}: key 'model.width_mult' .*expected a finite number > 0, got -1"
    with pytest.raises(ConfigError, match=expected):
        load_config(str(path))


# the issue's probe: each reached torch (or trained, width_mult) unchecked
@pytest.mark.parametrize("override, bound", [
    ("data.image_size=100000", "<= 4096"),
    ("data.train_size=0", ">= 1"),
    ("model.dropout=2", ">= 0 and < 1"),
    ("model.label_smoothing=5", ">= 0 and < 1"),
    ("data.train_crop_scale=[1.5, 0.2]", "a list of 2 finite numbers > 0 and <= 1, each >= the one before"),
    ("model.width_mult=-1", "> 0"),
])
def test_the_issue_probe_is_refused_at_config_load(override, bound):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    assert f"{COMMAND_LINE}: key '{key}'" in str(e.value) and bound in str(e.value)
    assert f"got {yaml.safe_load(value)!r}" in str(e.value)


@pytest.mark.slow
def test_train_py_refuses_a_negative_width_mult_with_one_error_line(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", DEMO,
                          "--set", "model.width_mult=-1", "--output-dir", str(tmp_path / "run")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.width_mult" in errors[0] and "> 0" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not os.path.exists(tmp_path / "run" / "last.pt")


@pytest.mark.parametrize("override", ["train.early_stopping.min_delta=.inf", "train.early_stopping.min_delta=.nan",
                                      "optim.lr=.inf", "optim.clip_grad_norm=.inf", "sched.eta_min=.nan"])
def test_non_finite_schema_values_are_refused(override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"{COMMAND_LINE}: key '{key}': input should be a finite number")):
        load_config(DEMO, ["train.early_stopping.patience=2", override])


@pytest.mark.slow
def test_a_plug_in_family_gets_its_declared_ranges_enforced(tmp_path):
    """tests/plugins/toy_stripes.py declares ranges at its own registration; train.py enforces them."""
    config = os.path.join(PLUGINS, "toy_stripes.yaml")
    with pytest.raises(ConfigError, match=r"key 'model.num_classes' of model 'toy_pixel_classifier': expected a "
                                          r"finite number >= 2, got 1"):
        load_config(config, ["model.num_classes=1"])
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", config,
                          "--set", "data.train_samples=0", "--output-dir", str(tmp_path / "run")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=PLUGINS))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-2000:]
    assert "key 'data.train_samples' of dataset 'toy_stripes'" in errors[0] and ">= 1" in errors[0]


def test_a_range_must_name_an_argument_of_its_builder():
    from engine.registry import Registry
    with pytest.raises(ValueError, match="ranges\\['widht'\\]"):
        Registry("model").register(ranges={"widht": Range(gt=0)})(lambda width=1.0: None)
