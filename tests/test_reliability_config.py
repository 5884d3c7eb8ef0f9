"""Fault table of issue 14, config rows: each bad config stops before anything is built, with an error
that names the file, the line or key, and what was expected (docs/reliability.md)."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import train
from engine.config import ConfigError, load_config

MINIMAL = """\
model: {name: mobilenet_v3_small}
data: {name: synthetic_classification, batch_size: 8}
optim: {lr: 0.1}
train: {epochs: 1}
"""


def write(folder, name, text):
    path = os.path.join(str(folder), name)
    with open(path, "w") as f:
        f.write(text)
    return path


def refused(tmp_path, config_text, *overrides):
    """train.py's error for a config; the run folder must not have been created."""
    config = write(tmp_path, "top.yaml", config_text)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--config", config, "--output-dir", str(out), *(["--set", *overrides] if overrides else [])])
    assert not out.exists(), "a refused config left a run folder behind"
    return str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    msg = refused(tmp_path, MINIMAL + "optim: {lr: 0.1\n")
    assert msg.startswith("error: ") and "top.yaml" in msg and "line 5" in msg


def test_unknown_key_and_wrong_type_name_key_and_file(tmp_path):
    msg = refused(tmp_path, MINIMAL + "train: {epochs: 1, epocs: 2}\n")
    assert "top.yaml" in msg and "train.epocs" in msg and "did you mean 'train.epochs'" in msg
    msg = refused(tmp_path, MINIMAL.replace("lr: 0.1", "lr: fast"))
    assert "top.yaml" in msg and "optim.lr" in msg and "'fast'" in msg


def test_circular_base_names_the_chain(tmp_path):
    write(tmp_path, "a.yaml", "_base_: top.yaml\n" + MINIMAL)
    msg = refused(tmp_path, "_base_: a.yaml\n")
    assert "cycle" in msg and "a.yaml" in msg and "top.yaml" in msg


def test_builder_argument_of_the_wrong_type_names_key_type_and_file(tmp_path):
    """Issue 14: `data.train_size: "lots"` gave a raw traceback from inside the builder."""
    msg = refused(tmp_path, MINIMAL.replace("batch_size: 8", 'batch_size: 8, train_size: "lots"'))
    assert "top.yaml" in msg and "data.train_size" in msg and "integer" in msg and "'lots'" in msg
    with pytest.raises(ConfigError, match=r"command line.*model\.dropout.*a number.*'high'"):
        load_config(write(tmp_path, "ok.yaml", MINIMAL), ["model.dropout=high"])
    with pytest.raises(ConfigError, match=r"data\.hflip_prob.*a number.*True"):
        load_config(write(tmp_path, "ok.yaml", MINIMAL), ["data.hflip_prob=true"])


def test_right_types_of_builder_arguments_still_load(tmp_path):
    """ints for floats, lists for tuples, null for anything."""
    cfg = load_config(write(tmp_path, "ok.yaml", MINIMAL),
                      ["data.hflip_prob=1", "data.train_crop_scale=[0.5,1.0]", "model.weights=null"])
    assert cfg.data.model_extra["hflip_prob"] == 1 and cfg.data.model_extra["train_crop_scale"] == [0.5, 1.0]


def test_batchsize_typo_suggests_batch_size(tmp_path):
    """Issue 14: `data.batchsize` suggested `data.val_size`."""
    with pytest.raises(ConfigError, match=r"unknown key 'data\.batchsize'.*did you mean 'data\.batch_size'"):
        load_config(write(tmp_path, "ok.yaml", MINIMAL), ["data.batchsize=4"])


def test_num_classes_smaller_than_the_data_is_refused_before_training(tmp_path):
    config = write(tmp_path, "top.yaml", MINIMAL.replace("batch_size: 8", "batch_size: 8, num_classes: 6"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--config", config, "--output-dir", str(out), "--set", "model.num_classes=4",
                    "data.train_size=16", "data.val_size=8", "data.image_size=32", "data.workers=0"])
    msg = str(e.value)
    assert "model.num_classes is 4" in msg and "needs 6" in msg
    assert not any(n.endswith(".pt") for n in os.listdir(out)) if out.exists() else True


# ---------------------------------------------------------------- property-based: only ConfigError

KEYS = st.sampled_from(["model", "data", "optim", "train", "sched", "recipes", "recipe_args", "name", "lr",
                        "batch_size", "epochs", "train_size", "_base_", "seed", "amp", "momentum", "x"]) | \
    st.text(min_size=1, max_size=6)
SCALARS = (st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6) | st.floats(allow_nan=True)
           | st.text(max_size=8) | st.sampled_from(["${x}", "${model.name}", "mobilenet_v3_small", "2024-13-45",
                                                   "[1, 2", "{a: ", "ema", "1e400"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(top=st.dictionaries(KEYS, VALUES, max_size=6), overrides=st.lists(
    st.tuples(st.lists(KEYS, min_size=1, max_size=3).map(".".join), st.text(max_size=10)).map("=".join)
    | st.text(max_size=12), max_size=3))
def test_config_loader_raises_only_config_errors(tmp_path, top, overrides):
    import yaml
    write(tmp_path, "base.yaml", MINIMAL)
    path = write(tmp_path, "random.yaml", yaml.safe_dump({"_base_": "base.yaml", **top}, allow_unicode=True))
    try:
        load_config(path, overrides)
    except ConfigError as e:  # and it names where the bad value came from
        assert any(where in str(e) for where in ("random.yaml", "base.yaml", "command line")), str(e)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.text(max_size=80).map(str.encode) | st.binary(max_size=80)
       | st.sampled_from([b"a: [1", b"model: !!python/object:os.system {}", b"- 1\n- 2", b"x: 2024-13-45",
                          b"a: &a [*a]", b"\xff\xfe", b"_base_: [1, 2]", b"_base_: raw.yaml"]))
def test_any_file_content_gives_a_config_error_or_a_config(tmp_path, content):
    path = os.path.join(str(tmp_path), "raw.yaml")
    with open(path, "wb") as f:
        f.write(content)
    try:
        load_config(path)
    except ConfigError as e:
        assert "raw.yaml" in str(e), str(e)
