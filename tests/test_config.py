"""Config loading: _base_ inheritance, overrides, and errors that name the key and the file."""
import pytest

from engine.config import ConfigError, load_config

MINIMAL = """
model: {name: mobilenet_v3_small}
data: {name: synthetic_classification, batch_size: 8}
optim: {lr: 0.1}
train: {epochs: 1}
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_base_chain_deep_merges_and_overrides_win(tmp_path):
    write(tmp_path, "a.yaml", MINIMAL + "sched: {name: step, step_size: 3, gamma: 0.5}\n")
    write(tmp_path, "b.yaml", "_base_: a.yaml\noptim: {momentum: 0.8}\nsched: {gamma: 0.2}\n")
    top = write(tmp_path, "c.yaml", "_base_: [b.yaml]\ndata: {batch_size: 16}\n")
    cfg = load_config(top, ["optim.lr=0.5", "recipes=[amp,channels_last]"])
    assert cfg.optim.lr == 0.5 and cfg.optim.momentum == 0.8          # override, level-2 base
    assert (cfg.sched.name, cfg.sched.step_size, cfg.sched.gamma) == ("step", 3, 0.2)  # deep merge
    assert cfg.data.batch_size == 16 and cfg.data.name == "synthetic_classification"
    assert cfg.recipes == ["amp", "channels_last"]


@pytest.mark.parametrize("base,top,named", [
    (MINIMAL, "_base_: base.yaml\noptim: {lrr: 0.1}\n", ("optim.lrr", "top.yaml", "did you mean 'optim.lr'")),
    (None, MINIMAL.replace("{name: mobilenet_v3_small}", "{name: mobilenet_v3_small, widht_mult: 0.5}"),
     ("model.widht_mult", "top.yaml", "did you mean 'model.width_mult'")),  # checked against the builder
    (MINIMAL, "_base_: base.yaml\ntrain: {epochs: many}\n", ("train.epochs", "top.yaml", "'many'")),
    (None, "_base_: [nowhere.yaml]\n" + MINIMAL, ("nowhere.yaml", "top.yaml")),
], ids=["unknown_key", "unknown_builder_argument", "wrong_type", "missing_base_file"])
def test_the_error_names_the_key_and_the_file(tmp_path, base, top, named):
    if base is not None:
        write(tmp_path, "base.yaml", base)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "top.yaml", top))
    for words in named:
        assert words in str(e.value)


def test_unknown_model_name_suggests(tmp_path):
    top = write(tmp_path, "top.yaml", MINIMAL.replace("mobilenet_v3_small", "mobilenet_v3_smal"))
    with pytest.raises(ConfigError, match=r"top\.yaml.*unknown model 'mobilenet_v3_smal'.*mobilenet_v3_small"):
        load_config(top)


def test_missing_required_key_is_named(tmp_path):
    top = write(tmp_path, "top.yaml", MINIMAL.replace("optim: {lr: 0.1}", "optim: {name: sgd}"))
    with pytest.raises(ConfigError, match=r"missing required key 'optim\.lr'"):
        load_config(top)


@pytest.mark.parametrize("override,expected", [
    ("optim.lr", "bad override 'optim.lr'"),                 # no '='
    ("optim..lr=1", "bad override 'optim..lr=1'"),           # malformed key
    ("optim.lrr=1", "command line.*unknown key 'optim.lrr'.*did you mean 'optim.lr'"),
    ("optim.lr=fast", "command line.*'optim.lr'.*'fast'"),   # wrong type from the command line
])
def test_bad_override_is_named(tmp_path, override, expected):
    top = write(tmp_path, "top.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=expected):
        load_config(top, [override])


def test_every_shipped_config_validates():
    import glob
    import os

    from conftest import ROOT
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert paths
    for path in paths:
        load_config(path)


def test_a_config_from_data_is_checked_as_its_file_would_be(tmp_path):
    """engine.config.config_from_data (a checkpoint's saved config): the same Config and the same errors
    as the YAML file, with the source named where the file would be, and the --set overrides."""
    import yaml
    from engine.config import config_from_data
    data = yaml.safe_load(MINIMAL)
    path = write(tmp_path, "c.yaml", MINIMAL)
    assert config_from_data(data, "saved") == load_config(path)
    assert config_from_data(data, "saved", ["optim.lr=0.5"]) == load_config(path, ["optim.lr=0.5"])
    for key, value, expected in [("optim", {"lrr": 0.1}, r"saved: unknown key 'optim\.lrr'.*did you mean 'optim\.lr'"),
                                 ("model", {"dropot": 0.1}, r"saved: unknown key 'model\.dropot' for model"),
                                 ("model", {"dropout": 1.5}, r"saved: key 'model\.dropout'.*expected a finite number")]:
        bad = {**data, key: {**data[key], **value}}
        with pytest.raises(ConfigError, match=expected):
            config_from_data(bad, "saved")
        with pytest.raises(ConfigError, match=expected.replace("saved", "c.yaml")):
            load_config(write(tmp_path, "c.yaml", yaml.safe_dump(bad)))
    with pytest.raises(ConfigError, match=r"the command line.*'optim\.lr'.*'fast'"):
        config_from_data(data, "saved", ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"saved: expected a mapping"):
        config_from_data(["not", "a", "mapping"], "saved")


def test_a_config_from_data_follows_no_base_file(tmp_path):
    """A name in data is not a file to read: `_base_` in a saved config is an unknown key."""
    import yaml
    from engine.config import config_from_data
    base = write(tmp_path, "base.yaml", "optim: {lr: 0.5}\n")
    with pytest.raises(ConfigError, match=r"saved: unknown key '_base_'"):
        config_from_data({**yaml.safe_load(MINIMAL), "_base_": base}, "saved")
