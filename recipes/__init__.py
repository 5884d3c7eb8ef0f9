"""Training recipes: small hook objects around the loop, composed from `recipes: [...]` in a config.

Each recipe registers in engine.registry.RECIPES; its constructor arguments come from
`recipe_args.<name>`. They run in the order of their `order` attribute, whatever the YAML order.
"""
from recipes import amp, batchnorm, channels_last, ddp, ema, torch_compile  # noqa: F401
from recipes import qat  # noqa: F401
from recipes import activation_checkpointing, inplace_abn  # noqa: F401
from engine.hooks import Recipe, RecipeStack  # noqa: F401
