"""A model's starting weights (model.weights): a local file (a state dict or a checkpoint of this
zoo) or a torchvision weights name, found offline, loaded into a freshly built model.

When the weights were trained for other classes (model.new_classes: auto, the default, judges it by
the class names on both sides, else by the shapes), every tensor a family declares class-dependent
at registration (`@MODELS.register(class_params={module: layout})`) keeps the fresh model's values,
the family's own initialiser, and everything else is loaded; any other missing or mismatched tensor
is an error. With model.class_map (auto: by name, or {new: old}) a class both sides have keeps its
trained rows: its logit, its per-class boxes, its mask or semantic channel. A layout says which class
each row of a tensor's dim 0 belongs to. What was loaded, reset and kept is returned as a report
(engine/build.py writes it as the run folder's weights.json).
"""
import fnmatch
import logging
import os
import weakref

import torch
from torchvision.models import get_weight

from engine.checkpoint import CheckpointError, load_checkpoint
from engine.errors import UserError

log = logging.getLogger(__name__)

NEW_CLASSES = ("auto", True, False)
_reports = weakref.WeakKeyDictionary()  # model -> the report of the weights loaded into it


class WeightsError(UserError, ValueError):
    """Weights that do not fit the model."""


class WeightsNotFound(UserError, FileNotFoundError):
    """A weights file or name that is not available offline; the message says where to put it."""


class ShapeMismatchError(WeightsError):
    """Weights whose tensors do not fit the model's shapes; `shapes`: {key: (file's, model's)}."""

    def __init__(self, message, shapes):
        super().__init__(message)
        self.shapes = shapes


class ClassMapError(WeightsError):
    """model.new_classes / model.class_map that cannot apply (engine.build raises it as a ConfigError)."""


# ---------------------------------------------------------------- layouts of the class axis

KEEP = "kept"  # a row that is no class of the data (detection's background): always the file's


class Layout:
    """Which class each row of a class-dependent tensor's dim 0 belongs to: `slots(rows, names,
    num_classes)` -> one (group, class) per row, class an index into names, or (KEEP, what) for a row
    the file's weights always give. `num_classes`: the classes this side's tensor is for."""

    def slots(self, rows, names, num_classes):
        raise NotImplementedError


class Rows(Layout):
    """Row = class * per + j (a logit per class: per=1; Faster R-CNN's boxes: per=4). background:
    class 0 is the detectors' background, kept from the file."""

    def __init__(self, per=1, background=False):
        self.per, self.background = per, background

    def slots(self, rows, names, num_classes):
        if rows % self.per:
            return None
        return [(r % self.per, (KEEP, "background") if self.background and r // self.per == 0 else r // self.per)
                for r in range(rows)]

    def __repr__(self):
        return f"Rows(per={self.per}, background={self.background})"


class Interleaved(Layout):
    """Row = anchor * K + class, the class varying fastest (torchvision's SSD heads)."""

    def __init__(self, background=False):
        self.background = background

    def slots(self, rows, names, num_classes):
        if not num_classes or rows % num_classes:
            return None
        return [(r // num_classes, (KEEP, "background") if self.background and r % num_classes == 0
                 else r % num_classes) for r in range(rows)]

    def __repr__(self):
        return f"Interleaved(background={self.background})"


class SemanticRows(Layout):
    """Panoptic FPN's semantic logits, for names [background, things..., stuff...]: 'all' has a row per
    thing and stuff class (rows = len(names) - 1), 'stuff' one 'things' row (kept) and the S stuff
    classes (the last S names)."""

    def slots(self, rows, names, num_classes):
        if names and rows == len(names) - 1:
            return [(0, r + 1) for r in range(rows)]
        first = len(names) - rows + 1 if names else 1
        return [(0, (KEEP, "things") if r == 0 else first + r - 1) for r in range(rows)]

    def __repr__(self):
        return "SemanticRows()"


def _matches(module, name):
    """A module name against a declared one, level by level ('*' is any one level: 'head.*.1')."""
    parts, pattern = module.split("."), name.split(".")
    return len(parts) == len(pattern) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern))


def layout_of(key, class_params):
    """The declared layout of a state-dict key (its module's name matched against the declared names),
    or None."""
    module = key.rpartition(".")[0]
    return next((layout for name, layout in class_params.items() if _matches(module, name)), None)


# ---------------------------------------------------------------- reading the file

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


def read_weights(weights):
    """(path, state dict, class names or None): a checkpoint's 'model' and 'classes' entries, a plain
    state dict (no names), or a torchvision weights name (the categories of its meta)."""
    path = resolve_weights_file(weights)
    try:  # torch.load(weights_only=True); a pickled object is refused in one line naming the file and the object
        state = load_checkpoint(path)
    except CheckpointError as e:
        raise WeightsError(f"weights {e}") from None
    names = None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        names = state.get("classes")
        if names is not None and not (isinstance(names, (list, tuple)) and all(isinstance(n, (str, int)) for n in names)):
            raise WeightsError(f"weights {path}: its 'classes' entry is not a list of class names: {names!r:.80}")
        state = state["model"]
    elif not os.path.exists(os.path.expanduser(weights)):
        names = get_weight(weights).meta.get("categories")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"weights {path}: not a state dict (a mapping of names to tensors) nor a checkpoint")
    return path, state, list(names) if names is not None else None


def _common_prefix_fix(state, own):
    """(strip, add) so that a plain torchvision state dict fits a wrapper (e.g. 'net.') or back."""
    for strip, add in (("", ""), ("", "net."), ("net.", ""), ("module.", ""), ("module.", "net.")):
        if any((add + k[len(strip):]) in own for k in state if k.startswith(strip)):
            return strip, add
    return "", ""


def _listed(keys, n=5):
    keys = list(keys)
    return f"{keys[:n]}{'...' if len(keys) > n else ''}"


# ---------------------------------------------------------------- the class map

def resolve_class_map(class_map, path, file_names, names):
    """{new: old} for model.class_map: auto (every name both sides have) or an explicit mapping,
    each class checked against its side."""
    if class_map is None:
        return {}
    if file_names is None:
        raise ClassMapError(f"model.class_map: the weights file {path} has no class names (a plain state dict, or "
                            f"a checkpoint written before checkpoints stored them): its class names are unknown. "
                            f"Set model.class_map=null; model.new_classes still starts the class-dependent "
                            f"tensors anew.")
    if names is None:
        raise ClassMapError(f"model.class_map: the model's class names are unknown (its data set gives none): "
                            f"set model.class_map=null")
    if class_map == "auto":
        return {n: n for n in names if n in file_names}
    if not isinstance(class_map, dict):
        raise ClassMapError(f"model.class_map: expected null, auto or a mapping {{new class: class of the "
                            f"weights}}, got {class_map!r:.80}")
    for new, old in class_map.items():
        if new not in names:
            raise ClassMapError(f"model.class_map: '{new}' is not a class of the data (the new side; its classes: "
                                f"{', '.join(map(str, names))})")
        if old not in file_names:
            raise ClassMapError(f"model.class_map: '{old}' (mapped to '{new}') is not a class of the weights "
                                f"{path} (the old side; its classes: {', '.join(map(str, file_names))})")
    return dict(class_map)


def _keys(slots, names):
    """(group, class name) per row; a class without a name (or no names) by its index."""
    out = []
    for group, c in slots:
        if isinstance(c, tuple):
            out.append((group, c))
        else:
            out.append((group, names[c] if names and c < len(names) else ("#", c)))
    return out


def merge_rows(own, theirs, layout, names, file_names, num_classes, mapping):
    """A class-dependent tensor: the fresh model's rows, with the file's for its kept rows (KEEP) and
    for each mapped class (mapping {new: old}). Returns (tensor, [(model row, file row, what)]) or
    None when the layout does not fit the file's rows."""
    file_classes = None
    if num_classes and (theirs.shape[0] * num_classes) % own.shape[0] == 0:
        file_classes = theirs.shape[0] * num_classes // own.shape[0]  # Interleaved: same anchors on both sides
    ours_slots = layout.slots(own.shape[0], names, num_classes)
    their_slots = layout.slots(theirs.shape[0], file_names, file_classes)
    if ours_slots is None or their_slots is None:
        return None
    rows = {}
    for r, key in enumerate(_keys(their_slots, file_names)):
        rows.setdefault(key, r)
    out, copied = own.detach().clone(), []
    for r, (group, c) in enumerate(_keys(ours_slots, names)):
        if isinstance(c, tuple) and c[0] == KEEP:
            source, what = (group, c), c[1]
        elif isinstance(c, str) and c in mapping:
            source, what = (group, mapping[c]), f"{c} <- {mapping[c]}"
        else:
            continue
        if source in rows:
            out[r] = theirs[rows[source]].to(out.dtype)
            copied.append((r, rows[source], what))
    return out, copied


# ---------------------------------------------------------------- loading

def load_weights(model, weights, class_params=None, new_classes="auto", class_map=None, classes=None,
                 num_classes=None, may_miss=()):
    """Load `weights` into the freshly built `model`.

    class_params: {module name or fnmatch pattern: Layout}, the family's declaration; classes: the
    model's class names (the data's), num_classes: its number of classes (the builder's argument);
    may_miss: key prefixes the file may lack (kept as built). Returns the report."""
    if new_classes not in NEW_CLASSES or isinstance(new_classes, int) and not isinstance(new_classes, bool):
        raise ClassMapError(f"model.new_classes: expected auto, true or false, got {new_classes!r}")
    if class_map is not None and new_classes is False:
        raise ClassMapError(f"model.class_map is set but model.new_classes=false (load the class-dependent "
                            f"tensors as they are): set model.new_classes=auto or true, or model.class_map=null")
    class_params = dict(class_params or {})
    path, state, file_names = read_weights(weights)
    own = model.state_dict()
    strip, add = _common_prefix_fix(state, own)
    state = {add + k[len(strip):]: v for k, v in state.items() if k.startswith(strip)}
    classes = list(classes) if classes is not None else None
    class_keys = {k: layout_of(k, class_params) for k in own if layout_of(k, class_params) is not None}
    both = [k for k in class_keys if k in state]
    shapes_differ = [k for k in both if state[k].shape != own[k].shape]
    names_differ = classes is not None and file_names is not None and classes != file_names
    if new_classes is True:
        differ, why = True, "model.new_classes=true"
    elif new_classes == "auto" and names_differ:
        differ, why = True, "the class names differ from the weights'"
    elif new_classes == "auto" and shapes_differ:
        unknown = " (the weights' class names are unknown)" if file_names is None else (
            " (the model's class names are unknown)" if classes is None else "")
        differ, why = True, f"the class-dependent shapes differ from the weights'{unknown}"
    else:
        differ, why = False, ("model.new_classes=false" if new_classes is False else "the same classes")
    mapping = resolve_class_map(class_map, path, file_names, classes)  # checked even when nothing differs
    mapping = mapping if differ else {}
    if new_classes is False and names_differ:
        log.warning("model.weights %s: its class names differ from the data's, loaded as they are "
                    "(model.new_classes=false): %s vs %s", path, _listed(file_names), _listed(classes))
    if not differ and shapes_differ:
        theirs, ours = state[shapes_differ[0]].shape, own[shapes_differ[0]].shape
        raise ShapeMismatchError(
            f"model.weights {weights} ({path}): its class-dependent tensors are for other classes "
            f"({shapes_differ[0]}: {tuple(theirs)} in the file, {tuple(ours)} in the model, num_classes="
            f"{num_classes}; file: {len(file_names) if file_names else 'unknown'} class names): with "
            f"model.new_classes=false they load as they are. Set model.new_classes=auto (or true) to start them "
            f"anew, and model.class_map=auto to keep the classes both sides have.",
            {k: (tuple(state[k].shape), tuple(own[k].shape)) for k in shapes_differ})
    load, reset, mismatched = {}, {}, {}
    for k, v in state.items():
        if k in class_keys and differ:
            merged = None
            if v.shape[1:] == own[k].shape[1:]:
                merged = merge_rows(own[k], v, class_keys[k], classes, file_names,
                                    num_classes or (len(classes) if classes else None), mapping)
            if merged is None:
                mismatched[k] = (tuple(v.shape), tuple(own[k].shape))
                continue
            load[k], copied = merged
            kept = sorted({what for _, _, what in copied})
            reset[k] = {"why": f"class-dependent ({class_keys[k]!r}): {why}", "rows": own[k].shape[0],
                        "rows_from_file": len(copied), "kept": kept}
        elif k in own and own[k].shape != v.shape:
            mismatched[k] = (tuple(v.shape), tuple(own[k].shape))
        else:
            load[k] = v
    if mismatched:
        raise ShapeMismatchError(f"model.weights {weights} ({path}) do not fit the model: shape mismatch (file, "
                                 f"model) for {_listed(f'{k} {a} vs {b}' for k, (a, b) in mismatched.items())}; "
                                 f"only the tensors the model declares class-dependent may differ",
                                 mismatched)
    missing, unexpected = model.load_state_dict(load, strict=False)
    absent = [k for k in missing if k not in state]
    allowed = [k for k in absent if k.startswith(tuple(may_miss))]
    missing = [k for k in absent if k not in allowed]
    if missing or unexpected:
        raise WeightsError(f"model.weights {weights} ({path}) do not fit the model: missing keys {_listed(missing)}, "
                           f"unexpected keys {_listed(unexpected)}")
    report = {"weights": str(weights), "file": os.path.abspath(path), "file_classes": file_names, "classes": classes,
              "new_classes": new_classes, "classes_differ": differ, "why": why,
              "class_map": {new: old for new, old in mapping.items()},
              "kept_classes": {new: old for new, old in mapping.items()
                               if any(f"{new} <- {old}" in r["kept"] for r in reset.values())},
              "loaded": sorted(k for k in load if k in own and k not in reset),
              "reset": reset, "missing_allowed": sorted(allowed)}
    log_report(report)
    _reports[model] = report
    return report


def report_of(model):
    """The report of the weights load_weights loaded into model, or None."""
    return _reports.get(model)


def log_report(report):
    log.info("model.weights %s: %d tensors loaded, %d class-dependent started anew (%s)%s%s", report["file"],
             len(report["loaded"]), len(report["reset"]), report["why"],
             f"; classes kept (new <- old): {report['kept_classes']}" if report["kept_classes"] else "",
             f"; not in the file, kept as built: {_listed(report['missing_allowed'], 3)}"
             if report["missing_allowed"] else "")
    for key, what in report["reset"].items():
        log.info("  reset %s: %s; %d of %d rows from the file %s", key, what["why"], what["rows_from_file"],
                 what["rows"], what["kept"])
