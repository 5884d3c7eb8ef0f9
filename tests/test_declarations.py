"""Declarations at registration instead of type tests (issue 33, finding 4): a model declares whether
it is quantizable and the formats it exports to, a data set its doctor source; export checks what a
model declares before anything is built, quantize and benchmark read `quantizable`."""
import os
import subprocess
import sys

import pytest
import torch

import datasets  # noqa: F401  (their modules register builders)
import models  # noqa: F401
from artifacts.quantization import NotQuantizable, check_quantizable
from conftest import ROOT
from engine.config import config_from_data
from engine.registry import DATASETS, DOCTOR_SOURCES, MODELS, Registry, RegistryError
from exporters import ExportError, adapter_class


@pytest.mark.slow
def test_exporting_a_faster_rcnn_fails_at_once_with_what_it_declares(tmp_path):
    """A real export.py process asking for a format Faster R-CNN cannot give: one error line with the
    reason it declares and the format it exports to; the data set (shapes, written on first use) is
    never built."""
    shapes = tmp_path / "shapes"
    cfg = config_from_data({"model": {"name": "fasterrcnn_mobilenet_v3_large_fpn", "num_classes": 4},
                            "data": {"name": "shapes", "root": str(shapes), "num_train": 4, "num_val": 2,
                                     "batch_size": 2}, "optim": {"name": "sgd", "lr": 0.01}, "train": {"epochs": 1},
                            "device": "cpu"})
    checkpoint = tmp_path / "last.pt"
    torch.save({"model": {}, "config": cfg.model_dump(mode="json"), "epoch": 0}, checkpoint)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), "--checkpoint", str(checkpoint),
                          "--format", "torch_export"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: model fasterrcnn_mobilenet_v3_large_fpn, format torch_export: not among the "
                               "formats it declares (torch.export cannot trace a two-stage detector"), lines
    assert lines[0].endswith("export fasterrcnn_mobilenet_v3_large_fpn with --format onnx"), lines
    assert not shapes.exists() and not (tmp_path / "export").exists()


def test_export_checks_the_declared_formats_before_the_adapter():
    cfg = {"model": {"name": "transformer_classifier"}, "data": {"name": "synthetic_text"}, "recipes": []}
    with pytest.raises(ExportError, match="format torchscript: not among the formats it declares .*quantizable=True"
                                          ".*--format onnx or --format torch_export"):
        adapter_class(cfg, "torchscript")
    assert adapter_class(cfg, "onnx").__name__ == "TextClassifier"


def test_quantizability_is_read_from_the_declaration():
    check_quantizable("mobilenet_v3_small")
    with pytest.raises(NotQuantizable, match="model ssd300_vgg16 declares quantizable=False"):
        check_quantizable("ssd300_vgg16")


def test_registration_refuses_a_declaration_outside_its_values():
    registry = Registry("model", declares=dict(MODELS.declares))
    for bad, words in ((dict(exports=("tflite",)), "a tuple of distinct items of onnx, torch_export, torchscript"),
                       (dict(exports="onnx"), "a tuple"), (dict(quantizable="yes"), "one of True, False"),
                       (dict(quantizable=1), "one of True, False"), (dict(preprocesing={}), "unknown declaration")):
        with pytest.raises(ValueError, match=words):
            registry.register("net", **bad)


def test_the_doctor_reads_the_source_a_data_set_declares():
    from datasets.doctor.sources import ImageFolderSource, sources_of
    assert DOCTOR_SOURCES.get(DATASETS.declared("imagefolder", "doctor")) is ImageFolderSource

    class Splits:
        train, val, classes = [1], [2], ["a"]
    [(_, source, why)] = sources_of(Splits, "synthetic_classification", {}, ["train"])
    assert source is None and "declares no doctor source" in why
    registry = Registry("dataset", declares=dict(DATASETS.declares))
    registry.register("mine", doctor="not_registered_anywhere")(lambda: None)
    with pytest.raises(RegistryError, match="unknown doctor source 'not_registered_anywhere'"):
        DOCTOR_SOURCES.get(registry.declared("mine", "doctor"))


def test_export_list_shows_every_models_formats_and_the_declared_reasons():
    """export.py --list (issue 36): a row per registered model with its task and formats, from what each
    declares, then the reasons the models declare for a format they are not exported to."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), "--list"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:] if not line.startswith("not ")}
    zoo = {n for n in MODELS.names() if not n.startswith(("_", "toy_"))}  # tests may register their own here
    assert zoo <= set(rows) <= set(MODELS.names()) and len(zoo) >= 13, sorted(rows)
    for name, (task, *formats) in rows.items():
        declared = MODELS.declared(name, "exports")
        assert task == MODELS.declared(name, "task")
        assert formats == ["yes" if f in declared else "-" for f in ("onnx", "torch_export", "torchscript")], name
    assert rows["fasterrcnn_mobilenet_v3_large_320_fpn"][1:] == ["yes", "-", "-"]
    assert rows["lraspp_mobilenet_v3_large"][1:] == ["yes", "yes", "-"]
    two_stage = sorted(n for n in MODELS.names() if n.startswith(("fasterrcnn_", "panoptic_fpn_")))
    assert f"not torch_export: {', '.join(two_stage)}: torch.export cannot trace a two-stage detector" in out.stdout
