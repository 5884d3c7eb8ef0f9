"""export.py's body: a checkpoint written as ONNX, a torch.export .pt2 program or the int8
TorchScript file, checked against the eager model on validation samples, and described beside it
(artifacts.spec) with the SHA-256 of every file written. The task's adapter (exporters) gives the
exportable module, the pre-processing and the comparison. The check opens the file written through
artifacts.load, so an export that would hold a pickled entry (or anything else artifacts.safety
refuses) fails here rather than on the user's machine."""
import logging
import os
import sys
import time
import warnings

import torch

from artifacts.load import build_with_weights, load_int8, load_program, open_checkpoint
from artifacts.quantization import int8_from_checkpoint, write_int8_artifact
from artifacts.runners import TorchRunner
from artifacts.safety import onnx_external_files
from artifacts.spec import ARTIFACT_FORMATS, describe, spec_path, write_spec
from commands.cli import run_or_exit
from engine.checkpoint import epoch_number
from engine.files import file_sha256
from engine.errors import UserError
from engine.registry import MODELS
from exporters import LOGITS_ATOL, ExportError, adapter_class, undeclared_export

log = logging.getLogger(__name__)

FORMATS = ARTIFACT_FORMATS
LEGACY_OPSET = 17  # the TorchScript-based ONNX exporter's default opset here (RoiAlign, NonMaxSuppression)
INT8_ATOL = 1e-5  # the TorchScript int8 model runs the eager model's kernels: equal logits expected


def is_int8(cfg):
    return "qat" in cfg["recipes"] or bool(cfg["model"].get("quantize"))


def refuse(cfg, fmt, adapter_cls=None):
    """The clear error for a combination that cannot be exported, or None: the formats the model
    declares (exporters.undeclared_export), then int8's rule."""
    name = cfg["model"]["name"]
    why = undeclared_export(name, fmt)
    if why:
        return why
    if fmt != "torchscript" and is_int8(cfg):
        return (f"model {name} (int8, QAT/quantizable), format {fmt}: eager-mode int8 modules (torch.ao) do not go "
                f"through torch.export or the ONNX exporter; use --format torchscript for the int8 model, or export "
                f"the fp32 checkpoint the QAT run started from with --format {fmt}")
    return None


def export_program(module, example, path, fmt, adapter, dynamic_batch=False, opset=None):
    """Write module as fmt (torch_export or onnx, by the adapter's exporter) and return the runner of
    the file written."""
    dynamic_shapes = adapter.dynamic_shapes(dynamic_batch)
    if fmt == "torch_export":
        torch.export.save(torch.export.export(module, example, dynamic_shapes=dynamic_shapes), path)
    elif adapter.onnx_exporter == "torchscript":  # torchvision's way for graphs with data-dependent sizes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notices and the exporter's deprecation
            torch.onnx.export(module, example, path, dynamo=False, opset_version=opset or LEGACY_OPSET,
                              input_names=list(adapter.input_names), output_names=list(adapter.output_names),
                              dynamic_axes=adapter.dynamic_axes(dynamic_batch))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation / fake-tensor notices
            program = torch.onnx.export(module, example, dynamo=True, dynamic_shapes=dynamic_shapes,
                                        opset_version=opset, input_names=list(adapter.input_names),
                                        output_names=list(adapter.output_names), verbose=False)
        program.save(path)
    return load_program(path, fmt, {"inputs": list(adapter.input_names)})


def batches(adapter, samples, batch_size):
    """Consecutive samples of one batch_key, at most batch_size per batch."""
    group = []
    for s in samples:
        if group and (len(group) == batch_size or adapter.batch_key(s) != adapter.batch_key(group[0])):
            yield group
            group = []
        group.append(s)
    if group:
        yield group


def check(adapter, eager, runner, samples, batch_size, atol):
    """Eager vs exported outputs on the samples, compared by the task's adapter."""
    ref, got = [], []
    for group in batches(adapter, samples, batch_size):
        inputs = adapter.collate(group)
        ref.append(eager(*inputs))
        got.append(runner(*inputs))
    return adapter.compare(adapter.join(ref), adapter.join(got), atol=atol)


def example_samples(adapter, samples, n):
    """n samples of one batch_key (text: sequences of 2+ tokens, so that the length stays dynamic)."""
    usable = [s for s in samples if not (isinstance(s, torch.Tensor) and s.dim() == 1 and len(s) < 2)] or samples
    first = usable[0]
    same = [s for s in usable if adapter.batch_key(s) == adapter.batch_key(first)]
    return same[:n] if len(same) >= n else [first] * n


def export_checkpoint(checkpoint, fmt="onnx", output=None, dynamic_batch=False, opset=None, check_samples=16,
                      config_file=None, overrides=(), force=False, calib_batches=32):
    """(artifact path, spec, files copied beside it): the checkpoint exported to fmt in `output`
    (default: export/ beside it), checked against the eager model on the first check_samples
    validation samples. The config is open_checkpoint's (--config / --set / --force)."""
    state, cfg = open_checkpoint(checkpoint, config_file, overrides, force)
    d = cfg.model_dump(mode="json")
    why = refuse(d, fmt)  # what the model declares, before anything is built
    if why:
        raise ExportError(why)
    adapter_cls = adapter_class(d)
    if dynamic_batch and adapter_cls.one_image:
        raise ExportError(f"model {d['model']['name']}: its {adapter_cls.task} graph takes one image at a time "
                          f"(the sizes inside depend on the data); export it without --dynamic-batch")
    run_dir = os.path.dirname(os.path.abspath(checkpoint))
    out_dir = output or os.path.join(run_dir, "export")
    os.makedirs(out_dir, exist_ok=True)
    int8 = fmt == "torchscript"
    path = os.path.join(out_dir, ("model_int8" if int8 else "model") + FORMATS[fmt])

    fields = {}
    if int8:  # quantize.py's int8 model: QAT converted, or PTQ of an fp32 checkpoint
        q = int8_from_checkpoint(checkpoint, state, cfg, calib_batches=calib_batches)
        data, model, module = q.run.data, q.run.model, q.model.eval()
        fields = {"method": q.method, "backend": q.backend, **q.fields}
    else:
        data, model = build_with_weights(cfg, state, checkpoint)
    adapter = adapter_cls.create(d, data, model, run_dir)
    if not int8:
        module = adapter.module(model)
    samples = [adapter.sample_from_dataset(data.val[i]) for i in range(min(check_samples, len(data.val)))]
    if not samples:
        raise ExportError(f"{d['data']['name']}: the validation split is empty; nothing to check the export on")
    example = adapter.collate(example_samples(adapter, samples, 2 if dynamic_batch else 1))
    source = {"checkpoint": os.path.abspath(checkpoint), "sha256": file_sha256(checkpoint), "epoch": epoch_number(state)}
    if fmt == "onnx" and adapter_cls.onnx_exporter == "torchscript":
        opset = opset or LEGACY_OPSET  # recorded as used
    spec = describe(adapter.spec, fmt, d, artifact=os.path.basename(path), dynamic_batch=dynamic_batch, opset=opset,
                    **fields, source=source)

    print(f"exporting {d['model']['name']} ({adapter.task}) to {fmt}: {path}")
    tick = time.perf_counter()
    try:
        if int8:
            spec = write_int8_artifact(module, path, example[0], spec, data)
            runner = TorchRunner(load_int8(path)[0])
        else:
            runner = export_program(module, example, path, fmt, adapter, dynamic_batch, opset)
    except UserError:
        raise
    except Exception as e:
        other = "onnx" if fmt == "torch_export" else "torch_export"
        hint = " or without --dynamic-batch" if dynamic_batch else ""
        raise ExportError(f"model {d['model']['name']}, format {fmt}: export failed "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          f"try --format {other}{hint}") from e
    seconds = time.perf_counter() - tick
    adapter.copy_files(out_dir)
    result = check(adapter, TorchRunner(module), runner, samples, 8 if dynamic_batch else 1,
                   INT8_ATOL if int8 else LOGITS_ATOL)
    spec = dict(spec, check={"data": f"{d['data']['name']} val, first {len(samples)} samples", **result},
                export_seconds=round(seconds, 1))
    beside = list(adapter.files()) + (onnx_external_files(path) if fmt == "onnx" else [])
    spec = write_spec(path, spec, files=beside)  # with the SHA-256 of the artifact and of each file beside it
    return path, spec, [os.path.join(out_dir, f) for f in adapter.files()]


def format_table():
    """{model: {"task": task, format: True, or why not}} for every registered model, from what it declares."""
    table = {}
    for name in MODELS.names():
        exports = MODELS.declared_or(name, "exports", ())
        table[name] = {"task": MODELS.declared_or(name, "task"),
                       **{fmt: fmt in exports or undeclared_export(name, fmt) for fmt in FORMATS}}
    return table


def list_formats():
    """export.py --list: per registered model, its task and the formats it exports to; then the
    reasons the models declare for a format they cannot be exported to (not_exported)."""
    table = format_table()
    width = max(map(len, table))
    print(f"{'model':<{width}}  {'task':<21}  " + "  ".join(f"{f:<12}" for f in FORMATS))
    for name, row in table.items():
        print(f"{name:<{width}}  {row['task']:<21}  " + "  ".join(f"{'yes' if row[f] is True else '-':<12}"
                                                                   for f in FORMATS))
    reasons = {}
    for name in table:
        for fmt, why in MODELS.declared_or(name, "not_exported", {}).items():
            reasons.setdefault((fmt, why), []).append(name)
    for (fmt, why), names in sorted(reasons.items()):
        print(f"not {fmt}: {', '.join(names)}: {why}")
    return table


def main(args):
    """export.py's parsed arguments: the artifact written and checked, the check printed; exit status 1
    when the exported model disagrees with the eager one. Returns (path, spec)."""
    if args.list:
        return list_formats()
    path, spec, files = run_or_exit(export_checkpoint, args.checkpoint, args.format, args.output,
                                    args.dynamic_batch, args.opset, args.check_samples, args.config, args.set,
                                    args.force, args.calib_batches)
    result = spec["check"]
    summary = {k: v for k, v in result.items() if k not in ("ok", "tolerance", "data")}
    print(f"check vs eager on {result['data']}: {'OK' if result['ok'] else 'MISMATCH'} {summary} "
          f"(tolerance {result['tolerance']})")
    print(f"artifact: {path}\ndescription: {spec_path(path)}" + "".join(f"\nfile: {f}" for f in files))
    if not result["ok"]:
        sys.exit(f"error: the exported model disagrees with the eager one (see {spec_path(path)})")
    return path, spec
