"""Backbone weights (weights_backbone) from a local file or a torchvision weights name, offline.

A whole model's weights (model.weights) are loaded by the model registry after its builder
(engine.transfer.load_weights: what depends on the classes is declared at registration); the
errors and the file lookup are engine.transfer's, named here too."""
import logging

from engine.transfer import (ShapeMismatchError, WeightsError, WeightsNotFound, _common_prefix_fix,  # noqa: F401
                             read_weights, resolve_weights_file)

log = logging.getLogger(__name__)


def resolve_pretrained(weights, weights_backbone):
    """The backbone weights to load, as torchvision decides: none when the whole model's weights are
    given (they win). Both are looked up first, so a missing file fails before anything is built
    (offline: the error says where to put it)."""
    weights_backbone = None if weights else weights_backbone
    for w in (weights, weights_backbone):
        if w:
            resolve_weights_file(w)
    return weights_backbone


def load_pretrained(module, weights, strict_shapes=True):
    """Load a backbone's published weights (a state dict, a torchvision weights name, or a project
    checkpoint's 'model' entry) into module: every tensor, of the module's shapes (strict_shapes=False:
    a tensor of another shape is skipped with a warning). Returns the file's path."""
    path, state, _ = read_weights(weights)
    own = module.state_dict()
    strip, add = _common_prefix_fix(state, own)
    state = {add + k[len(strip):]: v for k, v in state.items() if k.startswith(strip)}
    mismatched = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if k in own and own[k].shape != v.shape}
    for k in mismatched if not strict_shapes else ():
        log.warning("weights %s: skipping %s (shape %s, model has %s)", path, k, *mismatched[k])
        del state[k]
    if mismatched and strict_shapes:
        raise ShapeMismatchError(f"weights {path}: shape mismatch (file, model) for {mismatched}", mismatched)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in mismatched]
    if missing or unexpected:
        raise WeightsError(f"weights {path} do not fit the model: missing keys {missing[:5]}"
                           f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                           f"{'...' if len(unexpected) > 5 else ''}")
    return path
