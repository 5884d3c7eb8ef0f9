"""Export a trained model for use outside this repository, and check it against the eager model.

    python export.py --checkpoint RUN/best.pt [--format onnx|torch_export|torchscript] [--output DIR]
                     [--dynamic-batch] [--opset N] [--check-samples 16] [--config X.yaml --set k=v ...]

Formats: `torch_export` (torch.export.export, saved as .pt2 by torch.export.save), `onnx` (torch 2.11's
exporter, torch.onnx.export(dynamo=True), checked under ONNX Runtime), `torchscript` (the int8 path of
quantizable classifiers: a QAT checkpoint is converted, an fp32 one quantized after training (PTQ)).

Beside the artifact (default RUN/export/model.{onnx,pt2} or model_int8.pt): `<artifact>.json` with
the inputs and outputs, the pre-processing (resize, normalisation, tokenizer file, sample rate and
mel settings), the class names and the check of the exported model against the eager one on real
validation samples (same top-1 and logits within a tolerance; detections matched by IoU and
score), plus the files it names (e.g. tokenizer.json). Families plug in through
models/export_adapters.py.
"""
import argparse
import json
import os
import sys
import time
import warnings
from types import SimpleNamespace

import torch

from engine.checkpoint import file_sha256
from engine.config import ConfigError, config_from_dict, load_config
from engine.registry import RegistryError

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)
from models.export_adapters import LOGITS_ATOL, ExportError, adapter_class, adapter_from_spec, write_json

FORMATS = {"onnx": ".onnx", "torch_export": ".pt2", "torchscript": ".pt"}
INT8_ATOL = 1e-5  # the TorchScript int8 model runs the eager model's kernels: equal logits expected


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a last.pt / best.pt of train.py")
    p.add_argument("--format", default="onnx", choices=sorted(FORMATS), help="default: onnx")
    p.add_argument("--output", help="folder for the artifact (default: export/ next to the checkpoint)")
    p.add_argument("--dynamic-batch", action="store_true", help="any batch size (default: batch 1)")
    p.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    p.add_argument("--check-samples", type=int, default=16, help="validation samples compared (default 16)")
    p.add_argument("--config", help="YAML config (default: the config saved in the checkpoint)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys (needs --config)")
    p.add_argument("--calib-batches", type=int, default=32, help="torchscript of an fp32 checkpoint: PTQ batches")
    return p.parse_args(argv)


# ---------------------------------------------------------------- running an artifact

class OnnxRunner:
    def __init__(self, path, input_names):
        import onnxruntime as ort
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.input_names = input_names

    def __call__(self, *inputs):
        feed = {name: x.numpy() for name, x in zip(self.input_names, inputs)}
        return tuple(torch.from_numpy(o) for o in self.session.run(None, feed))


class TorchRunner:
    """An eager, torch.export or TorchScript module; outputs as a tuple of tensors."""

    def __init__(self, module):
        self.module = module

    @torch.no_grad()
    def __call__(self, *inputs):
        out = self.module(*inputs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def spec_path(artifact):
    return artifact + ".json"


def load_artifact(path):
    """(runner, adapter, spec) of an exported artifact with its `<artifact>.json`."""
    if not os.path.isfile(spec_path(path)):
        raise FileNotFoundError(f"{spec_path(path)}: the description written by export.py beside {path} is "
                                f"missing (pre-processing, classes, inputs)")
    with open(spec_path(path)) as f:
        spec = json.load(f)
    adapter = adapter_from_spec(spec, os.path.dirname(os.path.abspath(path)))
    fmt = spec.get("artifact_format")
    if fmt == "onnx":
        return OnnxRunner(path, spec["inputs"]), adapter, spec
    if fmt == "torch_export":
        return TorchRunner(torch.export.load(path).module()), adapter, spec
    if fmt == "torchscript":
        from recipes.qat import load_artifact as load_int8
        model, meta = load_int8(path)
        torch.backends.quantized.engine = meta.get("backend", torch.backends.quantized.engine)
        return TorchRunner(model), adapter, spec
    raise ValueError(f"{spec_path(path)}: unknown artifact_format {fmt!r} (expected {', '.join(FORMATS)})")


# ---------------------------------------------------------------- the model and its data

def load_run(checkpoint, config=None, overrides=()):
    """(cfg dict, state, data, model in eval mode on CPU) of a checkpoint, the way evaluate.py builds them."""
    from engine.checkpoint import load_checkpoint
    from engine.loop import build_data, build_model
    state = load_checkpoint(checkpoint)
    if overrides and not config:
        raise ConfigError("--set needs --config")
    cfg = load_config(config, overrides) if config else config_from_dict(state["config"])
    data = build_data(cfg, os.path.dirname(os.path.abspath(checkpoint)))
    model = build_model(cfg, data)
    model.load_state_dict(state["model"])
    return cfg.model_dump(mode="json"), state, data, model.cpu().eval()


def is_int8(cfg):
    return "qat" in cfg["recipes"] or bool(cfg["model"].get("quantize"))


def refuse(cfg, fmt, adapter_cls):
    """The clear error for a combination that cannot be exported, or None."""
    name = cfg["model"]["name"]
    if fmt not in adapter_cls.formats:
        why = adapter_cls.why_not.get(fmt)
        return (f"model {name}, format {fmt}: not supported{f' ({why})' if why else ''}; export {name} with "
                + " or ".join(f"--format {f}" for f in adapter_cls.formats))
    if fmt != "torchscript" and is_int8(cfg):
        return (f"model {name} (int8, QAT/quantizable), format {fmt}: eager-mode int8 modules (torch.ao) do not go "
                f"through torch.export or the ONNX exporter; use --format torchscript for the int8 model, or export "
                f"the fp32 checkpoint the QAT run started from with --format {fmt}")
    return None


# ---------------------------------------------------------------- export and check

def export_module(module, example, path, fmt, dynamic_shapes, adapter, opset=None):
    if fmt == "torch_export":
        ep = torch.export.export(module, example, dynamic_shapes=dynamic_shapes)
        torch.export.save(ep, path)
        return TorchRunner(torch.export.load(path).module())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation / fake-tensor notices
        program = torch.onnx.export(module, example, dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                                    input_names=list(adapter.input_names), output_names=list(adapter.output_names),
                                    verbose=False)
    program.save(path)
    return OnnxRunner(path, list(adapter.input_names))


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
    """Eager vs exported outputs on the samples, compared by the family's adapter."""
    ref, got = [], []
    for group in batches(adapter, samples, batch_size):
        inputs = adapter.collate(group)
        ref.append(eager(*inputs))
        got.append(runner(*inputs))
    cat = [tuple(torch.cat(parts) for parts in zip(*outs)) for outs in (ref, got)]
    return adapter.compare(cat[0], cat[1], atol=atol)


def example_samples(adapter, samples, n):
    """n samples of one batch_key (text: sequences of 2+ tokens, so that the length stays dynamic)."""
    usable = [s for s in samples if not (isinstance(s, torch.Tensor) and s.dim() == 1 and len(s) < 2)] or samples
    first = usable[0]
    same = [s for s in usable if adapter.batch_key(s) == adapter.batch_key(first)]
    return same[:n] if len(same) >= n else [first] * n


def export(args):
    from engine.checkpoint import load_checkpoint
    saved = load_checkpoint(args.checkpoint)
    cfg = load_config(args.config, args.set).model_dump(mode="json") if args.config else saved["config"]
    if args.set and not args.config:
        raise ConfigError("--set needs --config")
    adapter_cls = adapter_class(cfg)
    why = refuse(cfg, args.format, adapter_cls)
    if why:
        raise ExportError(why)
    run_dir = os.path.dirname(os.path.abspath(args.checkpoint))
    out_dir = args.output or os.path.join(run_dir, "export")
    os.makedirs(out_dir, exist_ok=True)
    int8 = args.format == "torchscript"
    path = os.path.join(out_dir, ("model_int8" if int8 else "model") + FORMATS[args.format])

    extra = {}
    if int8:  # the int8 model of quantize.py: QAT converted, or PTQ of an fp32 checkpoint
        import quantize
        qargs = SimpleNamespace(checkpoint=args.checkpoint, config=args.config, set=args.set, backend=None,
                                calib_batches=args.calib_batches, calib_transform="eval", eval_fp32=False)
        run, eager, method, backend, extra, _ = quantize.int8_from_checkpoint(qargs)
        data, model, extra = run.data, run.model, {"method": method, "backend": backend, **extra}
    else:
        cfg, _, data, model = load_run(args.checkpoint, args.config, args.set)
        eager = None
    adapter = adapter_cls.create(cfg, data, model, run_dir)
    module = eager.eval() if int8 else adapter.module(model)
    samples = [adapter.sample_from_dataset(data.val[i]) for i in range(min(args.check_samples, len(data.val)))]
    if not samples:
        raise ValueError(f"{cfg['data']['name']}: the validation split is empty; nothing to check the export on")
    example = adapter.collate(example_samples(adapter, samples, 2 if args.dynamic_batch else 1))
    dynamic = adapter.dynamic_shapes(args.dynamic_batch)

    print(f"exporting {cfg['model']['name']} ({adapter.task}) to {args.format}: {path}")
    tick = time.perf_counter()
    try:
        if int8:
            from recipes import qat as Q
            meta = Q.artifact_metadata(run, source_checkpoint=os.path.abspath(args.checkpoint), **extra)
            Q.export_artifact(eager, path, example[0], meta)
            runner = load_artifact_int8(path)
        else:
            runner = export_module(module, example, path, args.format, dynamic, adapter, args.opset)
    except ExportError:
        raise
    except Exception as e:
        other = "onnx" if args.format == "torch_export" else "torch_export"
        hint = " or without --dynamic-batch" if args.dynamic_batch else ""
        raise ExportError(f"model {cfg['model']['name']}, format {args.format}: export failed "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          f"try --format {other}{hint}") from e
    seconds = time.perf_counter() - tick
    adapter.copy_files(out_dir)
    result = check(adapter, TorchRunner(module), runner, samples, 8 if args.dynamic_batch else 1,
                   INT8_ATOL if int8 else LOGITS_ATOL)
    spec = dict(adapter.spec, artifact=os.path.basename(path), artifact_format=args.format,
                dynamic_batch=args.dynamic_batch, opset=args.opset, torch=torch.__version__, **extra,
                check={"data": f"{cfg['data']['name']} val, first {len(samples)} samples", **result},
                source={"checkpoint": os.path.abspath(args.checkpoint), "sha256": file_sha256(args.checkpoint),
                        "epoch": saved.get("epoch")},
                export_seconds=round(seconds, 1), config=cfg)
    write_json(spec_path(path), spec)
    verdict = "OK" if result["ok"] else "MISMATCH"
    summary = {k: v for k, v in result.items() if k not in ("ok", "tolerance")}
    print(f"check vs eager on {len(samples)} val samples: {verdict} {summary} (tolerance {result['tolerance']})")
    print(f"artifact: {path}\ndescription: {spec_path(path)}" +
          "".join(f"\nfile: {os.path.join(out_dir, f)}" for f in adapter.files()))
    return path, spec


def load_artifact_int8(path):
    from recipes.qat import load_artifact as load_int8
    model, _ = load_int8(path)
    return TorchRunner(model)


def main(argv=None):
    args = parse_args(argv)
    try:
        path, spec = export(args)
    except (ExportError, ConfigError, RegistryError, FileNotFoundError, ValueError, TypeError) as e:
        sys.exit(f"error: {e}")
    if not spec["check"]["ok"]:
        sys.exit(f"error: the exported model disagrees with the eager one (see {spec_path(path)})")
    return path, spec


if __name__ == "__main__":
    main()
