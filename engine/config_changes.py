"""What changed between two configs (a checkpoint's and the one given), and which changes are
allowed: on a resume (engine.loop) and when a checkpoint is used with another config (evaluate,
export, predict, quantize, benchmark: artifacts.config)."""
from engine.files import flatten

RESUME_BREAKING = ("model", "data", "seed", "optim.name", "recipes", "recipe_args")  # what a resume cannot change
RESUME_IGNORED = ("resume", "output_dir", "data.workers", "data.eval_batch_size")
EVAL_COMPARED = ("model", "data")  # what the weights were trained for: the model, data and preprocessing
EVAL_IGNORED = ("data.root", "data.workers", "data.batch_size", "data.eval_batch_size", "data.val_split")


def under(key, prefixes):
    """Is the dotted key one of the prefixes, or below one (model.width is under model)?"""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_changes(saved, current):
    """[(key, saved value, current value)] for every key that differs, key by key."""
    old, new = flatten(saved), flatten(current)
    missing = "(not set)"
    return [(k, old.get(k, missing), new.get(k, missing)) for k in sorted(set(old) | set(new))
            if old.get(k, missing) != new.get(k, missing)]


def resume_policy(saved, current):
    """(changes, refused keys) of a resume: what differs except RESUME_IGNORED; RESUME_BREAKING refused."""
    changes = [c for c in config_changes(saved, current) if not under(c[0], RESUME_IGNORED)]
    return changes, {k for k, _, _ in changes if under(k, RESUME_BREAKING)}


def trained_for_changes(saved, current):
    """The model, data and pre-processing keys that differ (EVAL_COMPARED minus EVAL_IGNORED)."""
    return [c for c in config_changes(saved, current) if under(c[0], EVAL_COMPARED) and not under(c[0], EVAL_IGNORED)]


def describe_changes(changes, refused):
    width = max(len(k) for k, _, _ in changes)
    return "\n".join(f"  {k:<{width}}  {a!r} -> {b!r}" + ("   (refused)" if k in refused else "")
                     for k, a, b in changes)
