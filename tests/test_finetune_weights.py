"""model.weights for other classes (issue 35, items 1, 2 and 6's weights errors; acceptance 4): what
fits is loaded, what a family declares class-dependent starts from the family's own initialiser, the
classes both sides have keep their trained rows (model.class_map), and the run folder's weights.json
says so. Every registered family is walked from the registry's declarations; a plug-in family
declaring its class-dependent parameters gets the same."""
import json
import os
import re

import pytest
import torch

import datasets  # noqa: F401  (their modules register builders)
import models  # noqa: F401
from conftest import ROOT
from engine.build import build_model, build_run
from engine.config import ConfigError, config_from_data
from engine.loop import train
from engine.registry import MODELS
from engine.transfer import (ClassMapError, Interleaved, Rows, SemanticRows, ShapeMismatchError, WeightsError,
                             merge_rows)

PLUGINS = os.path.join(ROOT, "tests", "plugins")
BG = "__background__"
# per family: tiny arguments, the classes of the weights and the (other) classes of the new data
IMAGE_OLD, IMAGE_NEW = ["a", "b", "c"], ["d", "c", "a", "e"]
DET_OLD, DET_NEW = [BG, "circle", "square", "triangle"], [BG, "star", "triangle", "circle", "cross"]
SEG_OLD, SEG_NEW = ["background", "circle", "square"], ["background", "star", "circle", "cross", "square"]
PAN_OLD = [BG, "circle", "square", "sky", "grass"]  # 2 things, 2 stuff
PAN_NEW = [BG, "square", "star", "circle", "road", "sky", "grass"]  # 3 things, 3 stuff
PANOPTIC_TINY = {"mask_head": [16], "box_head_dim": 32, "min_size": 64, "max_size": 64, "sem_channels": 32}
FAMILIES = {
    "mobilenet_v3_small": ({"width_mult": 0.25}, IMAGE_OLD, IMAGE_NEW, False),
    "mobilenet_v3_large": ({"width_mult": 0.25}, IMAGE_OLD, IMAGE_NEW, False),
    "transformer_classifier": ({"dim": 16, "depth": 1, "heads": 2, "vocab_size": 50}, IMAGE_OLD, IMAGE_NEW, False),
    "ssdlite320_mobilenet_v3_large": ({"size": 96, "width_mult": 0.25}, DET_OLD, DET_NEW, False),
    "ssd300_vgg16": ({}, DET_OLD, DET_NEW, True),
    "fasterrcnn_mobilenet_v3_large_fpn": ({}, DET_OLD, DET_NEW, True),
    "fasterrcnn_mobilenet_v3_large_320_fpn": ({}, DET_OLD, DET_NEW, False),
    "lraspp_mobilenet_v3_large": ({}, SEG_OLD, SEG_NEW, False),
    "deeplabv3_mobilenet_v3_large": ({}, SEG_OLD, SEG_NEW, True),
    "deeplabv3_resnet50": ({}, SEG_OLD, SEG_NEW, True),
    "panoptic_fpn_mobilenet_v3_large": ({**PANOPTIC_TINY, "fpn_channels": 32}, PAN_OLD, PAN_NEW, False),
    "panoptic_fpn_resnet50": (PANOPTIC_TINY, PAN_OLD, PAN_NEW, True),
    "panoptic_fpn_resnet50_v2": (PANOPTIC_TINY, PAN_OLD, PAN_NEW, True),
}


def zoo_models():
    return [m for m in MODELS.names() if not m.startswith("_") and not m.startswith("toy_")]


def class_args(name, names):
    """The builder's class counts for names ([background, things..., stuff...] for panoptic)."""
    if MODELS.declared(name, "task") == "panoptic":
        stuff = sum(n in ("sky", "grass", "road") for n in names)
        return {"num_classes": len(names) - stuff, "num_stuff_classes": stuff}
    return {"num_classes": len(names)}


def write_weights(path, name, kwargs, names, seed=0):
    """A checkpoint as train.py writes it (its 'model' and 'classes' entries) of a model for names."""
    torch.manual_seed(seed)
    model = MODELS.build(name, **kwargs, **class_args(name, names))
    torch.save({"model": model.state_dict(), "classes": names, "epoch": 0}, path)
    return model.state_dict()


def fresh_and_loaded(name, kwargs, names, seed=1, **transfer):
    """The fresh model for names and the same build with the weights loaded (same seed: the same init)."""
    torch.manual_seed(seed)
    fresh = MODELS.build(name, **kwargs, **class_args(name, names)).state_dict()
    torch.manual_seed(seed)
    model, report = MODELS.build_reported(name, {**kwargs, **class_args(name, names), **transfer}, classes=names)
    return fresh, model.state_dict(), report


def rows_of(layout, rows, names, num_classes, c):
    """The rows of class index c, by the layouts' documented formulas."""
    if isinstance(layout, Rows):
        return list(range(c * layout.per, (c + 1) * layout.per))
    if isinstance(layout, Interleaved):
        return [r for r in range(rows) if r % num_classes == c]
    if rows == len(names) - 1:  # SemanticRows, 'all'
        return [c - 1]
    return [c - (len(names) - rows)]  # 'stuff': the 'things' row, then the last rows - 1 names


def check_transfer(name, tmp_path):
    kwargs, old, new, _ = FAMILIES[name]
    declared = MODELS.declared(name, "class_params")
    theirs = write_weights(tmp_path / "w.pt", name, kwargs, old)
    fresh, ours, report = fresh_and_loaded(name, kwargs, new, weights=str(tmp_path / "w.pt"), class_map="auto")
    shared = [n for n in new if n in old and n != BG]
    assert report["classes_differ"] and report["file_classes"] == old and report["classes"] == new
    assert report["kept_classes"] == {n: n for n in shared} and report["file"] == str(tmp_path / "w.pt")
    reset = set(report["reset"])
    assert reset == {k for k in ours if any(k.rpartition(".")[0].split(".") == p.split(".")
                                            or _star(k.rpartition(".")[0], p) for p in declared)}, reset
    assert set(report["loaded"]) == (set(theirs) & set(ours)) - reset and report["loaded"]
    for k in report["loaded"]:
        assert torch.equal(ours[k], theirs[k]), k
    things = class_args(name, new)["num_classes"]
    for k in reset:
        layout = next(v for p, v in declared.items() if _star(k.rpartition(".")[0], p))
        from_file = torch.zeros(ours[k].shape[0], dtype=torch.bool)
        kept = ["background"] if getattr(layout, "background", False) else []
        for n in shared + kept:
            c_new, c_old = (new.index(n), old.index(n)) if n != "background" else (0, 0)
            if isinstance(layout, (Rows, Interleaved)) and c_new >= things:
                continue  # a stuff class has no box or mask rows
            if isinstance(layout, SemanticRows) and ours[k].shape[0] != len(new) - 1 and c_new < things:
                continue  # nor a thing class a row of the 'stuff' semantic head
            a = rows_of(layout, ours[k].shape[0], new, things, c_new)
            b = rows_of(layout, theirs[k].shape[0], old, class_args(name, old)["num_classes"], c_old)
            assert torch.equal(ours[k][a], theirs[k][b]), (k, n)
            from_file[a] = True
        if isinstance(layout, SemanticRows) and ours[k].shape[0] != len(new) - 1:
            assert torch.equal(ours[k][0], theirs[k][0])  # the 'things' row
            from_file[0] = True
        assert from_file.any(), k
        assert torch.equal(ours[k][~from_file], fresh[k][~from_file]), k  # the family's own initialiser
        assert report["reset"][k]["rows_from_file"] == int(from_file.sum()), k


def _star(module, pattern):
    parts, pat = module.split("."), pattern.split(".")
    return len(parts) == len(pat) and all(q == "*" or p == q for p, q in zip(parts, pat))


# ---------------------------------------------------------------- the layouts on known tensors

def test_ssd_rows_interleave_anchors_and_classes():
    """torchvision's SSD head: channel = anchor * K + class. 2 anchors; the file's classes [bg, b, c, a],
    the model's [bg, a, x, b]: background and a, b keep the file's rows, x keeps the model's."""
    theirs = torch.arange(8.0)[:, None] * torch.ones(1, 3)  # row r holds r
    own = -torch.ones(8, 3)
    merged, copied = merge_rows(own, theirs, Interleaved(background=True), [BG, "a", "x", "b"],
                                [BG, "b", "c", "a"], 4, {"a": "a", "b": "b"})
    assert merged[:, 0].tolist() == [0, 3, -1, 1, 4, 7, -1, 5]
    assert sorted(what for _, _, what in copied) == ["a <- a", "a <- a", "b <- b", "b <- b", "background",
                                                     "background"]
    # other numbers of classes on each side: 2 anchors x 3 classes in the file, 2 x 2 in the model
    merged, _ = merge_rows(-torch.ones(4), torch.arange(6.0), Interleaved(background=True), [BG, "c"],
                           [BG, "a", "c"], 2, {"c": "c"})
    assert merged.tolist() == [0, 2, 3, 5]


def test_faster_rcnn_box_rows_are_four_per_class():
    """bbox_pred: row = class * 4 + j; cls_score: row = class. The file [bg, a, b], the model [bg, b, new]."""
    theirs = torch.arange(12.0)
    merged, _ = merge_rows(-torch.ones(12), theirs, Rows(per=4, background=True), [BG, "b", "new"], [BG, "a", "b"],
                           3, {"b": "b"})
    assert merged.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1]
    merged, _ = merge_rows(-torch.ones(3, 2), torch.arange(6.0).view(3, 2), Rows(background=True),
                           [BG, "b", "new"], [BG, "a", "b"], 3, {"b": "b"})
    assert merged[:, 0].tolist() == [0, 4, -1]
    # an explicit map: the new class 'new' keeps the file's 'a'
    merged, _ = merge_rows(-torch.ones(3), torch.arange(3.0), Rows(background=True), [BG, "b", "new"],
                           [BG, "a", "b"], 3, {"new": "a"})
    assert merged.tolist() == [0, -1, 1]


def test_semantic_rows_keep_the_things_row_and_map_stuff():
    """Panoptic FPN's 'stuff' head: a 'things' row, then the stuff classes (the last names)."""
    merged, _ = merge_rows(-torch.ones(4), torch.arange(3.0), SemanticRows(), PAN_NEW, PAN_OLD, 4,
                           {"sky": "sky", "grass": "grass"})
    assert merged.tolist() == [0, -1, 1, 2]


# ---------------------------------------------------------------- every registered family

def test_every_registered_family_declares_its_class_dependent_parameters():
    """Walked from the registry: a zoo model without a declaration (or without a case here) fails."""
    assert set(zoo_models()) == set(FAMILIES), set(zoo_models()) ^ set(FAMILIES)
    for name in zoo_models():
        assert MODELS.declared(name, "class_params"), name


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if FAMILIES[n][3] else n
                                  for n in FAMILIES])
def test_weights_for_other_classes_load_what_fits_and_keep_shared_classes(name, tmp_path):
    check_transfer(name, tmp_path)


def test_new_classes_true_resets_even_the_same_classes_and_false_keeps_the_error(tmp_path):
    kwargs = FAMILIES["mobilenet_v3_small"][0]
    theirs = write_weights(tmp_path / "w.pt", "mobilenet_v3_small", kwargs, IMAGE_OLD)
    fresh, ours, report = fresh_and_loaded("mobilenet_v3_small", kwargs, IMAGE_OLD, weights=str(tmp_path / "w.pt"))
    assert not report["classes_differ"] and not report["reset"] and set(report["loaded"]) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    fresh, ours, report = fresh_and_loaded("mobilenet_v3_small", kwargs, IMAGE_OLD, weights=str(tmp_path / "w.pt"),
                                           new_classes=True)
    assert set(report["reset"]) == {"net.classifier.3.weight", "net.classifier.3.bias"}
    assert torch.equal(ours["net.classifier.3.weight"], fresh["net.classifier.3.weight"])
    with pytest.raises(ShapeMismatchError, match=r"w\.pt.*net\.classifier\.3\.weight.*new_classes=auto"):
        MODELS.build("mobilenet_v3_small", **kwargs, num_classes=4, weights=str(tmp_path / "w.pt"),
                     new_classes=False)


def test_a_plain_state_dict_has_no_class_names(tmp_path):
    """Only the shapes tell: new_classes (auto) resets by shape; class_map: auto is refused naming the file."""
    kwargs = FAMILIES["ssdlite320_mobilenet_v3_large"][0]
    torch.manual_seed(0)
    plain = MODELS.build("ssdlite320_mobilenet_v3_large", **kwargs, num_classes=4).state_dict()
    torch.save(plain, tmp_path / "plain.pth")
    fresh, ours, report = fresh_and_loaded("ssdlite320_mobilenet_v3_large", kwargs, DET_NEW,
                                           weights=str(tmp_path / "plain.pth"))
    assert report["file_classes"] is None and report["classes_differ"] and "shapes" in report["why"]
    assert len(report["reset"]) == 12 and not report["kept_classes"]
    for k, what in report["reset"].items():  # the background rows only: one per anchor
        assert what["kept"] == ["background"] and what["rows_from_file"] == ours[k].shape[0] // len(DET_NEW)
    with pytest.raises(ClassMapError, match=r"plain\.pth has no class names .*its class names are unknown"):
        MODELS.build_reported("ssdlite320_mobilenet_v3_large",
                              {**kwargs, "num_classes": 5, "weights": str(tmp_path / "plain.pth"), "class_map": "auto"},
                              classes=DET_NEW)


def test_any_other_missing_or_mismatched_tensor_stays_an_error(tmp_path):
    kwargs = FAMILIES["mobilenet_v3_small"][0]
    state = write_weights(tmp_path / "w.pt", "mobilenet_v3_small", kwargs, IMAGE_OLD)
    state["net.features.0.0.weight"] = state["net.features.0.0.weight"][:, :2]
    torch.save({"model": state, "classes": IMAGE_OLD}, tmp_path / "bad.pt")
    with pytest.raises(ShapeMismatchError, match=r"bad\.pt.*net\.features\.0\.0\.weight.*class-dependent"):
        MODELS.build("mobilenet_v3_small", **kwargs, num_classes=4, weights=str(tmp_path / "bad.pt"))
    del state["net.features.0.0.weight"]
    torch.save({"model": state, "classes": IMAGE_OLD}, tmp_path / "missing.pt")
    with pytest.raises(WeightsError, match=r"missing\.pt.*missing keys \['net\.features\.0\.0\.weight'\]"):
        MODELS.build("mobilenet_v3_small", **kwargs, num_classes=4, weights=str(tmp_path / "missing.pt"))


def test_a_class_map_naming_a_class_one_side_lacks_is_a_config_error(tmp_path):
    """Through the config (engine.build.build_model): a ConfigError naming the class and the side."""
    write_weights(tmp_path / "w.pt", "mobilenet_v3_small", FAMILIES["mobilenet_v3_small"][0], ["x", "y", "z"])

    def config(**model):
        return config_from_data({"model": {"name": "mobilenet_v3_small", "width_mult": 0.25,
                                           "weights": str(tmp_path / "w.pt"), **model},
                                 "data": {"name": "synthetic_classification", "num_classes": 3, "train_size": 4,
                                          "val_size": 2, "image_size": 32, "batch_size": 2},
                                 "optim": {"lr": 0.1}, "train": {"epochs": 1}, "device": "cpu"})
    cfg = config(class_map={"nope": "x"})
    data = datasets.classification.synthetic_classification(num_classes=3, train_size=4, val_size=2, image_size=32)
    with pytest.raises(ConfigError, match=r"'nope' is not a class of the data \(the new side"):
        build_model(cfg, data)
    with pytest.raises(ConfigError, match=rf"'gone' \(mapped to '{data.classes[0]}'\) is not a class of the weights "
                                          rf".*w\.pt \(the old side"):
        build_model(config(class_map={data.classes[0]: "gone"}), data)
    with pytest.raises(ConfigError, match="model.class_map is set but model.new_classes=false"):
        build_model(config(class_map="auto", new_classes=False), data)
    model = build_model(config(class_map={data.classes[1]: "y"}), data)  # an explicit map: new <- old
    theirs = torch.load(tmp_path / "w.pt", weights_only=True)["model"]["net.classifier.3.weight"]
    assert torch.equal(model.state_dict()["net.classifier.3.weight"][1], theirs[1])
    with pytest.raises(ConfigError, match="model.new_classes"):
        config(new_classes="maybe")


# ---------------------------------------------------------------- a real run and a plug-in family

@pytest.mark.slow
def test_a_detector_trained_here_fine_tuned_to_six_shapes_writes_weights_json(tmp_path):
    """SSDlite trained by the loop on the built-in shapes (3 classes): its checkpoint stores the class
    names; a run for all 6 shapes from it keeps circle, square and triangle, and weights.json says so."""
    common = {"seed": 0, "device": "cpu", "optim": {"name": "adamw", "lr": 0.003}, "sched": {"name": "constant"}}
    model = {"name": "ssdlite320_mobilenet_v3_large", "size": 96, "width_mult": 0.25}
    data = {"name": "shapes", "num_train": 8, "num_val": 2, "image_size": 96, "workers": 0, "batch_size": 4}
    cfg = config_from_data({**common, "model": model, "data": {**data, "root": str(tmp_path / "shapes3")},
                            "train": {"epochs": 1, "max_steps_per_epoch": 1, "log_every": 100}})
    train(cfg, str(tmp_path / "pretrain"))
    checkpoint = torch.load(tmp_path / "pretrain" / "last.pt", weights_only=True)
    assert checkpoint["classes"] == [BG, "circle", "square", "triangle"]
    cfg = config_from_data({**common, "model": {**model, "weights": str(tmp_path / "pretrain" / "last.pt"),
                                                "class_map": "auto"},
                            "data": {**data, "root": str(tmp_path / "shapes6"), "num_categories": 6},
                            "train": {"epochs": 1}})
    run = build_run(cfg, str(tmp_path / "finetune"))
    report = json.load(open(tmp_path / "finetune" / "weights.json"))
    assert report["file"] == str(tmp_path / "pretrain" / "last.pt") and report["classes_differ"]
    assert report["kept_classes"] == {"circle": "circle", "square": "square", "triangle": "triangle"}
    assert report["classes"][4:] == ["pentagon", "star", "cross"]
    assert sorted(report["reset"]) == sorted(k for k in run.model.state_dict()  # the last conv of each level
                                             if re.fullmatch(r"head\.classification_head\.module_list\.\d\.1\.\w+", k))
    ours = run.model.state_dict()
    for k in report["loaded"]:
        assert torch.equal(ours[k], checkpoint["model"][k]), k


def test_a_plug_in_family_declaring_its_class_parameters_gets_the_same(tmp_path, monkeypatch):
    """tests/plugins/toy_finetune.py, plugged in by `imports`: its builder takes no `weights`; the config
    accepts model.weights / class_map for it, and the weights load as for the zoo's families."""
    monkeypatch.syspath_prepend(PLUGINS)
    cfg = {"imports": ["toy_stripes", "toy_finetune"], "device": "cpu", "optim": {"lr": 0.1}, "train": {"epochs": 1},
           "data": {"name": "toy_stripes", "train_samples": 4, "val_samples": 2, "batch_size": 2, "workers": 0}}
    config_from_data({**cfg, "model": {"name": "_toy_finetune_net"}})  # registers the plug-in
    theirs = write_weights(tmp_path / "w.pt", "_toy_finetune_net", {}, ["stripe", "dot", "background"])
    cfg = config_from_data({**cfg, "model": {"name": "_toy_finetune_net", "weights": str(tmp_path / "w.pt"),
                                             "class_map": "auto"}})
    run = build_run(cfg, str(tmp_path / "run"))
    report = json.load(open(tmp_path / "run" / "weights.json"))
    assert sorted(report["reset"]) == ["body.2.bias", "body.2.weight"]
    assert report["kept_classes"] == {"background": "background", "stripe": "stripe"}
    ours = run.model.state_dict()
    assert torch.equal(ours["body.2.weight"][[0, 1]], theirs["body.2.weight"][[2, 0]])  # background, stripe
    assert all(torch.equal(ours[k], theirs[k]) for k in report["loaded"]) and len(report["loaded"]) == 2
