"""A recipe argument a user set wrongly is a ConfigError naming its key (one `error: ...` line from
the command lines), not a ValueError traceback (issue 33, finding 5)."""
import types

import pytest
import torch

from engine.config import ConfigError
from engine.errors import UserError
from recipes.amp import AMP
from recipes.ema import EMA


@pytest.mark.parametrize("build, key", [
    (lambda: AMP(dtype="float32"), "recipe_args.amp.dtype"),
    (lambda: AMP(fp32_depthwise="yes"), "recipe_args.amp.fp32_depthwise"),
    (lambda: EMA(decay=1.5), "recipe_args.ema.decay"),
    (lambda: EMA(decay=0), "recipe_args.ema.decay"),
])
def test_a_wrong_recipe_argument_is_a_config_error_naming_its_key(build, key):
    with pytest.raises(ConfigError, match=key):
        build()


def test_float16_autocast_on_cpu_is_a_config_error():
    run = types.SimpleNamespace(device=torch.device("cpu"), model=torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match=r"recipe_args\.amp\.dtype: float16 autocast is for CUDA"):
        AMP(dtype="float16").setup(run)
