"""Load weights from a local file or a torchvision weights name, offline."""
import logging
import os

import torch
from torchvision.models import get_weight
from engine.checkpoint import CheckpointError, load_checkpoint
from engine.errors import UserError

log = logging.getLogger(__name__)


class WeightsError(UserError, ValueError):
    """Published weights that do not fit the model."""


class WeightsNotFound(UserError, FileNotFoundError):
    """A weights file or name that is not available offline; the message says where to put it."""


class ShapeMismatchError(WeightsError):
    """Weights whose tensors do not fit the model's shapes; `shapes`: {key: (file's, model's)}."""

    def __init__(self, message, shapes):
        super().__init__(message)
        self.shapes = shapes


def resolve_weights_file(weights):
    """Path of a local weights file for `weights` (a path or a torchvision weights name)."""
    if os.path.exists(os.path.expanduser(weights)):
        return os.path.expanduser(weights)
    try:
        enum = get_weight(weights)
    except (ValueError, KeyError, AttributeError):
        raise WeightsNotFound(
            f"weights '{weights}': no such file, and not a torchvision weights name "
            f"(e.g. MobileNet_V3_Large_Weights.IMAGENET1K_V1)") from None
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(enum.url))
    if not os.path.exists(path):
        raise WeightsNotFound(
            f"weights '{weights}' are not available offline. Download {enum.url} on a machine with "
            f"network access and put the file at {path} (or set TORCH_HOME), or point the config's "
            f"weights key at a local file.")
    return path


def resolve_pretrained(weights, weights_backbone):
    """The backbone weights to load, as torchvision decides: none when the whole model's weights are
    given (they win). Both are looked up first, so a missing file fails before anything is built
    (offline: the error says where to put it)."""
    weights_backbone = None if weights else weights_backbone
    for w in (weights, weights_backbone):
        if w:
            resolve_weights_file(w)
    return weights_backbone


def load_pretrained(module, weights, strict_shapes=False, may_miss=()):
    """Load published weights (a state dict, a torchvision weights name, or a project checkpoint's
    'model' entry) into module; not a checkpoint resume (that is engine.checkpoint.load_model_state).

    Tensors whose shape does not match (e.g. a classifier for another number of classes) are
    skipped with a log line unless strict_shapes. Keys starting with one of `may_miss` (a head the
    file does not have) may be missing. Returns the file's path.
    """
    path = resolve_weights_file(weights)
    try:  # torch.load(weights_only=True); a pickled object is refused in one line naming the file and the object
        state = load_checkpoint(path)
    except CheckpointError as e:
        raise WeightsError(f"weights {e}") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    own = module.state_dict()
    prefix = _common_prefix_fix(state, own)
    state = {prefix[1] + k[len(prefix[0]):]: v for k, v in state.items() if k.startswith(prefix[0])}
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    if skipped and strict_shapes:
        raise ShapeMismatchError(f"{path}: shape mismatch for {skipped}",
                                 {k: (tuple(state[k].shape), tuple(own[k].shape)) for k in skipped})
    for k in skipped:
        log.warning("weights %s: skipping %s (shape %s, model has %s)", path, k,
                    tuple(state[k].shape), tuple(own[k].shape))
        del state[k]
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in skipped and not k.startswith(tuple(may_miss))]
    if missing or unexpected:
        raise WeightsError(f"weights {path} do not fit the model: missing keys {missing[:5]}"
                           f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                           f"{'...' if len(unexpected) > 5 else ''}")
    return path


def _common_prefix_fix(state, own):
    """(strip, add) so that a plain torchvision state dict fits a wrapper (e.g. 'net.') or back."""
    for strip, add in (("", ""), ("", "net."), ("net.", ""), ("module.", ""), ("module.", "net.")):
        if any((add + k[len(strip):]) in own for k in state if k.startswith(strip)):
            return strip, add
    return "", ""
