"""The one description of an exported artifact: JSON, format "zoo-export/1".

Every artifact (ONNX, torch.export .pt2, int8 TorchScript .pt) has it beside it as `<artifact>.json`;
the int8 TorchScript file also holds it inside (extra file SPEC_FILE), so that it describes itself
wherever it is copied. The description is data: parsed strictly (every field type-checked, unknown
fields and formats refused with an error naming the file), never evaluated.

Fields: the adapter's (exporters.Adapter.create: format, adapter, task, model, imports, inputs, outputs,
classes, preprocessing and, by task, label_to_category_id / postprocessing), then what the writer
adds (artifact, artifact_format, torch, config, ...: FIELDS below). A task's own settings go under
`preprocessing` / `postprocessing`, which are checked to be JSON data; the adapter reads them.
Integrity: write_spec records the SHA-256 of the artifact (artifact_sha256) and of the files beside
it (files_sha256: plain names in its folder, never paths); the int8 writer adds code_sha256 (its
TorchScript code entries). artifacts.safety.verify_digests compares them when the artifact is opened.
"""
import math
import os

import torch

from engine.files import file_sha256, write_json
from runtime.spec import (ARTIFACT_FORMATS, FIELDS, INT8_METHODS, REQUIRED, SPEC_FILE, SPEC_FORMAT,  # noqa: F401
                          loads, parse_spec, read_spec, spec_path)


def write_spec(artifact, spec, files=()):
    """`<artifact>.json`, checked first, with the SHA-256 of the artifact and of `files` (names of
    files beside it: a tokenizer, ONNX external data); the training config last (the longest field).
    Returns the spec written."""
    folder = os.path.dirname(os.path.abspath(artifact))
    spec = dict(spec, artifact_sha256=file_sha256(artifact))
    spec.pop("files_sha256", None)
    if files:
        spec["files_sha256"] = {name: file_sha256(os.path.join(folder, name)) for name in files}
    parse_spec(spec, spec_path(artifact))
    write_json(spec_path(artifact), {**{k: v for k, v in spec.items() if k != "config"},
                                     **({"config": spec["config"]} if "config" in spec else {})})
    return spec


def describe(adapter_spec, artifact_format, config, **fields):
    """An artifact's spec: the adapter's keys, the format, the torch version and the training config,
    plus writer fields (method, backend, source, check, ...)."""
    spec = dict(adapter_spec, artifact_format=artifact_format, torch=torch.__version__, **fields, config=config)
    return {k: _finite_or_none(v) if k == "metrics" else v for k, v in spec.items()}


def _finite_or_none(metrics):
    return {k: (v if v is None or math.isfinite(v) else None) for k, v in metrics.items()}
