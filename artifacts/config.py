"""The config a checkpoint (or artifact) is used with: one policy for --config and --set.

Without --config the checkpoint's saved config is used, with the --set overrides applied and checked
exactly as a config file's would be (engine.config.config_from_data: schema, builder arguments and
their ranges). With --config, that file with the overrides. Either way, what differs from the
checkpoint's config in the model, the data or the pre-processing (engine.config_changes.trained_for_changes:
data.root, the batch sizes and workers may differ) is listed key by key and refused unless force:
the weights were trained for the checkpoint's values, so other values would give other results
without a word. artifacts.load.open_checkpoint reads a checkpoint and applies this policy.
"""
import logging

from engine.config import ConfigError, config_from_data, load_config
from engine.config_changes import describe_changes, trained_for_changes

log = logging.getLogger(__name__)


def config_from_checkpoint(state, config_file=None, overrides=(), force=False, checkpoint_path="the checkpoint"):
    """The Config to use a checkpoint (or an artifact's description: {"config": ...}) with.

    state: the loaded checkpoint, whose "config" is the training config as a dict (None if it has none).
    config_file / overrides: --config and --set. force: accept model, data and pre-processing keys
    that differ from the checkpoint's config (with a warning) instead of refusing them."""
    saved = state.get("config") if isinstance(state, dict) else None
    overrides = list(overrides or ())
    if saved is not None and not isinstance(saved, dict):
        raise ConfigError(f"{checkpoint_path}: its saved config is not a mapping ({type(saved).__name__})")
    if config_file:
        cfg = load_config(config_file, overrides)
    elif saved is None:
        raise ConfigError(f"{checkpoint_path} holds no training config: give one with --config")
    else:
        cfg = config_from_data(saved, f"the config saved in {checkpoint_path}", overrides)
    if saved is None:
        return cfg
    changes = trained_for_changes(saved, cfg.model_dump(mode="json"))
    if not changes:
        return cfg
    given = " ".join(([f"--config {config_file}"] if config_file else []) + (["--set"] if overrides else []))
    given = given or "the config"
    if not force:
        text = describe_changes(changes, {k for k, _, _ in changes})
        raise ConfigError(f"{given} differs from the config saved in {checkpoint_path} in model, data or "
                          f"preprocessing:\n{text}\nthe weights were trained for the checkpoint's values, so the "
                          f"results would not be the trained model's: drop these keys to use the checkpoint's "
                          f"config, or pass --force")
    log.warning("%s differs from the config saved in %s (--force):\n%s", given, checkpoint_path,
                describe_changes(changes, set()))
    return cfg
