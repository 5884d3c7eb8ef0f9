"""average_checkpoints.py's body: the weights of several checkpoints of one run averaged into a
new checkpoint (torchvision's utils.average_checkpoints rules), the inputs read as data."""
import torch

from artifacts import ArtifactError
from artifacts.load import read_checkpoint
from commands.cli import run_or_exit
from engine.checkpoint import save_checkpoint


def average_state_dicts(states, name="model"):
    """Mean of state dicts with the same keys: floats averaged (in float32 for half precision, then
    cast back), integers floor-divided."""
    keys = list(states[0])
    for i, state in enumerate(states[1:], 1):
        if list(state) != keys:
            missing, extra = sorted(set(keys) - set(state)), sorted(set(state) - set(keys))
            raise ArtifactError(f"{name} of input {i + 1} does not have the keys of the first: missing {missing[:5]}, "
                           f"extra {extra[:5]}")
    out = {}
    for k in keys:
        tensors = [s[k] for s in states]
        if any(t.shape != tensors[0].shape for t in tensors):
            raise ArtifactError(f"{name}.{k}: shapes differ between inputs: {[tuple(t.shape) for t in tensors]}")
        if tensors[0].is_floating_point():
            out[k] = torch.stack([t.float() for t in tensors]).mean(0).to(tensors[0].dtype)
        else:
            out[k] = torch.stack(tensors).sum(0) // len(tensors)
    return out


def check_tensors(path, state_dict, name):
    """A state dict of tensors, or an ArtifactError naming the file and the key."""
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ArtifactError(f"{path}: {name}.{key} is a {type(value).__name__}, not a tensor: not a checkpoint "
                                f"of train.py")


def average_checkpoints(paths):
    if len(paths) < 2:
        raise ArtifactError("average_checkpoints: give at least two checkpoints")
    states = [read_checkpoint(p) for p in paths]  # as data (weights_only), each a checkpoint of train.py
    for path, state in zip(paths, states):
        check_tensors(path, state["model"], "model")
        recipes = state.get("recipes", {})
        if not isinstance(recipes, dict) or not isinstance(recipes.get("ema", {}), dict):
            raise ArtifactError(f"{path}: not a checkpoint of train.py ('recipes' is not a mapping of recipe states)")
        check_tensors(path, recipes.get("ema", {}), "recipes.ema")
    last = states[-1]
    out = {"model": average_state_dicts([s["model"] for s in states]), "averaged_from": list(paths),
           "recipes": {}}
    for key in ("config", "epoch", "step", "best", "metrics"):
        if key in last:
            out[key] = last[key]
    for name, recipe_state in last.get("recipes", {}).items():
        if name == "ema":
            if all("ema" in s.get("recipes", {}) for s in states):
                out["recipes"]["ema"] = average_state_dicts([s["recipes"]["ema"] for s in states], "ema")
        else:
            out["recipes"][name] = recipe_state  # e.g. qat's freezing flags: the last input's
    return out


def main(args):
    """average_checkpoints.py's parsed arguments: the averaged checkpoint written; its path."""
    run_or_exit(lambda: save_checkpoint(average_checkpoints(args.checkpoints), args.output))
    print(f"averaged {len(args.checkpoints)} checkpoints into {args.output}")
    return args.output
