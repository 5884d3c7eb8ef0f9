"""Numeric config values are checked against their valid range before anything runs, and the error
names the key and where it came from (issue 26, faults 7, 9 and 13: a negative clip_grad_norm
trained by gradient ascent, max_steps_per_epoch=-1 ran full epochs with a flat schedule, step_size=0
and a negative weight_decay reached torch unchecked)."""
import pytest

from engine.config import ConfigError, load_config

from conftest import ROOT

DEMO = f"{ROOT}/configs/demo.yaml"


@pytest.mark.parametrize("override, words", [
    ("optim.clip_grad_norm=-1", "greater than 0"),
    ("train.max_steps_per_epoch=-1", "greater than 0"),
    ("train.max_steps_per_epoch=0", "greater than 0"),
    ("sched.step_size=0", "greater than 0"),
    ("optim.weight_decay=-0.1", "greater than or equal to 0"),
    ("optim.norm_weight_decay=-1", "greater than or equal to 0"),
    ("optim.momentum=1.5", "less than 1"),
    ("optim.eps=0", "greater than 0"),
    ("optim.betas=[0.9,1.2]", "less than 1"),
    ("sched.gamma=-0.1", "greater than 0"),
    ("sched.warmup_epochs=-1", "greater than or equal to 0"),
    ("sched.warmup_start_factor=0", "greater than 0"),
    ("sched.milestones=[3,-1]", "greater than or equal to 0"),
])
def test_out_of_range_values_are_refused_naming_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    key = override.split("=")[0]
    assert key.split(".")[-1] in str(e.value) and words in str(e.value) and "--set" in str(e.value)


def test_every_shipped_config_is_in_range():
    import glob
    paths = glob.glob(f"{ROOT}/configs/*.yaml")
    assert paths  # an empty glob would pass with nothing checked
    for path in paths:
        load_config(path)
