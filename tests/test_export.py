"""export.py: every family round-trips through an export format and matches its eager model on real or
built-in validation samples; SSD's exportable post-processing gives torchvision's detections; the
combinations that cannot be exported stop with an error naming model, format and what to try."""
import json
import os

import numpy as np
import pytest
import torch

import export
import tiny_runs
from artifacts.load import load_artifact, load_run
from commands.export import INT8_ATOL, refuse
from engine.registry import MODELS
from exporters import ExportError, SSDExport, adapter_class, detections


def _export(checkpoint, out, fmt, *extra):
    path, spec = export.main(["--checkpoint", checkpoint, "--format", fmt, "--output", str(out),
                              "--check-samples", "6", *extra])
    with open(path + ".json") as f:
        assert json.load(f)["check"] == spec["check"]  # written beside the artifact
    return path, spec


# ---------------------------------------------------------------- classification

@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return tiny_runs.classifier(tmp_path_factory.mktemp("cls"))


@pytest.mark.slow
def test_classifier_torch_export_dynamic_batch_matches_eager(classifier, tmp_path):
    path, spec = _export(classifier, tmp_path, "torch_export", "--dynamic-batch")
    assert spec["check"]["ok"] and spec["check"]["same_top1"] == spec["check"]["samples"] == 6
    assert spec["classes"] and len(spec["classes"]) == 4
    # loaded again, on a batch size it was not traced with
    runner, adapter, _ = load_artifact(path)
    _, _, data, model = load_run(classifier)
    batch = torch.stack([data.val[i][0] for i in range(3)])
    with torch.no_grad():
        torch.testing.assert_close(runner(batch)[0], model(batch), atol=1e-4, rtol=1e-4)
    # the pre-processing rebuilt from the JSON is the data set's evaluation transform
    pil = _pil_sample()
    assert torch.equal(adapter.transform()(pil), data.val.transform(pil))


def _pil_sample():
    from PIL import Image
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (45, 61, 3), dtype=np.uint8))


@pytest.mark.slow
def test_int8_torchscript_of_fp32_checkpoint_by_ptq(classifier, tmp_path):
    from artifacts.load import load_int8 as load_artifact
    path, spec = _export(classifier, tmp_path, "torchscript", "--calib-batches", "2")
    assert spec["method"] == "ptq" and spec["artifact_format"] == "torchscript"
    assert spec["check"]["ok"] and spec["check"]["max_abs_logit_diff"] <= INT8_ATOL
    model, meta = load_artifact(path)  # plain torch.jit.load + metadata inside
    assert meta["classes"] == spec["classes"]
    assert any("quantized" in node.kind() for node in model.inlined_graph.nodes())


# ---------------------------------------------------------------- detection

def _spread_head(model, std=0.3, seed=0):
    """Random head weights: scores spread out, so detections are not ties (as after training)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.fill_(0.01)
                m.running_var.fill_(1.5)


def _rows(det):
    return sorted(zip(det["scores"].tolist(), det["labels"].tolist(), [tuple(b) for b in det["boxes"].tolist()]))


# head weights' scale: unsaturated scores (VGG's features are far larger: its input is in 0-255)
@pytest.mark.slow
@pytest.mark.parametrize("name, std", [("ssdlite320_mobilenet_v3_large", 0.3), ("ssd300_vgg16", 0.002)])
def test_ssd_export_module_gives_torchvision_detections(name, std):
    torch.manual_seed(0)
    kwargs = {"size": 128} if name.startswith("ssdlite") else {}
    model = MODELS.build(name, num_classes=4, score_thresh=0.2, detections_per_img=2000, **kwargs).eval()
    _spread_head(model, std)
    wrapped = SSDExport(model).eval()
    for shape in [(2, 3, 150, 210), (1, 3, 97, 64)]:
        images = torch.rand(*shape, generator=torch.Generator().manual_seed(shape[2]))
        with torch.no_grad():
            ref, got = model(list(images)), detections(wrapped(images))
        for r, g in zip(ref, got):
            assert len(r["boxes"]) > 0 and r["scores"].max() < 0.999
            a, b = _rows(r), _rows(g)
            assert len(a) == len(b)
            for (sa, la, ba), (sb, lb, bb) in zip(a, b):
                assert la == lb and sa == pytest.approx(sb, abs=1e-6)
                assert ba == pytest.approx(bb, abs=1e-3)


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    from engine.checkpoint import load_checkpoint, save_checkpoint
    out = tmp_path_factory.mktemp("det")
    path = tiny_runs.detector(out)
    state = load_checkpoint(path)
    _, _, _, model = load_run(path)
    _spread_head(model)
    state["model"] = model.state_dict()
    save_checkpoint(state, path)
    return path


@pytest.mark.slow
def test_detector_torch_export_matches_eager_boxes(detector, tmp_path):
    path, spec = _export(detector, tmp_path, "torch_export")
    check = spec["check"]
    assert check["ok"] and check["detections_compared"] > 0 and check["min_matched_iou"] > 0.99
    assert spec["outputs"] == ["boxes", "scores", "labels"] and spec["classes"][0] == "__background__"
    assert spec["label_to_category_id"] and spec["preprocessing"]["in_model"]["resize"] == [96, 96]
    # any image size: boxes come back in the input's pixels
    runner, _, _ = load_artifact(path)
    image = torch.rand(1, 3, 70, 130)
    boxes, scores, labels = runner(image)
    kept = boxes[labels > 0]
    assert kept.shape[0] > 0 and kept[:, 2].max() <= 130 + 1e-3 and kept[:, 3].max() <= 70 + 1e-3


# ---------------------------------------------------------------- sequences

@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return tiny_runs.text_agnews(tmp_path_factory.mktemp("text"))


@pytest.mark.slow
def test_text_onnx_runs_without_this_repository(text_model, tmp_path):
    """ONNX + tokenizer.json beside it: what a consumer needs, run with tokenizers and onnxruntime."""
    import onnxruntime as ort
    from tokenizers import Tokenizer
    path, spec = _export(text_model, tmp_path, "onnx")
    assert spec["check"]["ok"] and spec["classes"] == ["World", "Sports", "Business", "Sci/Tech"]
    p = spec["preprocessing"]
    tok = Tokenizer.from_file(os.path.join(tmp_path, p["tokenizer"]))
    session = ort.InferenceSession(path)
    _, _, data, model = load_run(text_model)
    for text in ["Stocks fell sharply as oil prices rose", "The team won the championship final on Sunday night"]:
        ids = np.array([tok.encode(text).ids[: p["max_length"]]], dtype=np.int64)
        logits = session.run(None, {spec["inputs"][0]: ids})[0]
        with torch.no_grad():
            expected = model(data.val.encode(text)[None])
        np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4)


def test_audio_torch_export_on_fsdd(tmp_path_factory, tmp_path):
    checkpoint = tiny_runs.audio_fsdd(tmp_path_factory.mktemp("audio"))
    path, spec = _export(checkpoint, tmp_path, "torch_export", "--dynamic-batch")
    assert spec["check"]["ok"] and spec["check"]["samples"] == 6
    assert spec["inputs"] == ["audio", "lengths"] and spec["preprocessing"]["sample_rate"] == 8000
    assert spec["preprocessing"]["in_model"]["log_mel"]["n_fft"] == 256
    assert sorted(spec["classes"]) == [str(d) for d in range(10)]


# ---------------------------------------------------------------- what cannot be exported

def _cfg(model, data="shapes", recipes=()):
    return {"model": model, "data": {"name": data}, "recipes": list(recipes)}


def test_clear_errors_for_combinations_that_cannot_be_exported(text_model, tmp_path):
    det = _cfg({"name": "ssdlite320_mobilenet_v3_large"})
    why = refuse(det, "torchscript", adapter_class(det))
    assert "ssdlite320_mobilenet_v3_large" in why and "torchscript" in why and "--format torch_export" in why
    qat = _cfg({"name": "mobilenet_v3_small", "quantize": True}, "imagefolder", ["qat"])
    why = refuse(qat, "onnx", adapter_class(qat))
    assert "mobilenet_v3_small" in why and "onnx" in why and "--format torchscript" in why
    assert refuse(qat, "torchscript", adapter_class(qat)) is None
    for name in ("fasterrcnn_mobilenet_v3_large_fpn", "fasterrcnn_mobilenet_v3_large_320_fpn"):
        frcnn = _cfg({"name": name})  # ONNX only, one image per graph: torch_export and --dynamic-batch refused
        why = refuse(frcnn, "torch_export", adapter_class(frcnn))
        assert f"{name}, format torch_export" in why and "depend on the data" in why and "--format onnx" in why
        assert refuse(frcnn, "onnx", adapter_class(frcnn)) is None and adapter_class(frcnn).one_image
    with pytest.raises(ExportError, match="no export adapter knows it"):
        adapter_class(_cfg({"name": "unknown_net"}))
    with pytest.raises(SystemExit, match="transformer_classifier, format torchscript"):
        export.main(["--checkpoint", text_model, "--format", "torchscript", "--output", str(tmp_path)])


# ---------------------------------------------------------------- issue 24: every artifact opens through the safe path

def _plain_outputs(path, fmt, input_names, inputs):
    """The artifact run the way a consumer without this project runs it (torch.export.load,
    torch.jit.load, an ONNX Runtime session), outputs as a tuple of tensors."""
    if fmt == "onnx":
        import onnxruntime as ort
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        feed = {n: x.numpy() for n, x in zip(input_names, inputs)}
        return tuple(torch.from_numpy(o) for o in session.run(None, feed))
    module = torch.export.load(path).module() if fmt == "torch_export" else torch.jit.load(path, map_location="cpu")
    with torch.no_grad():
        out = module(*inputs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _opens_safely_and_predicts_the_same(checkpoint, path, fmt):
    """Issue 24 acceptance 2: the artifact export.py wrote passes artifacts.safety (no pickled entry,
    no file-reaching call, no outside data), records the SHA-256 of what was written, and its safe
    load gives exactly the outputs of the plain loaders on a real validation sample."""
    import zipfile
    from artifacts.safety import check_artifact, code_digests
    from engine.files import file_sha256
    check_artifact(path, fmt)
    spec = json.load(open(path + ".json"))
    assert spec["check"]["ok"] and spec["artifact_sha256"] == file_sha256(path)
    folder = os.path.dirname(path)
    assert all(file_sha256(os.path.join(folder, n)) == d for n, d in spec.get("files_sha256", {}).items())
    if fmt == "torch_export":
        with zipfile.ZipFile(path) as z:
            configs = [json.loads(z.read(n))["config"] for n in z.namelist() if n.endswith("_config.json")]
        assert configs and all(meta["use_pickle"] is False for c in configs for meta in c.values())
    if fmt == "torchscript":
        assert spec["code_sha256"] == code_digests(path)
    loaded = load_artifact(path)
    _, _, data, _ = load_run(checkpoint)
    inputs = loaded.adapter.collate([loaded.adapter.sample_from_dataset(data.val[0])])
    got = loaded.runner(*inputs)
    want = _plain_outputs(path, fmt, spec["inputs"], inputs)
    assert len(got) == len(want) == len(spec["outputs"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_export", "onnx", "torchscript"])
def test_classifier_artifacts_open_through_the_safe_path_with_the_same_outputs(classifier, tmp_path, fmt):
    path, _ = _export(classifier, tmp_path, fmt, "--calib-batches", "2")
    _opens_safely_and_predicts_the_same(classifier, path, fmt)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
def test_detector_artifacts_open_through_the_safe_path_with_the_same_outputs(detector, tmp_path, fmt):
    path, _ = _export(detector, tmp_path, fmt)
    _opens_safely_and_predicts_the_same(detector, path, fmt)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "torch_export"])
def test_text_artifacts_open_through_the_safe_path_with_the_same_outputs(text_model, tmp_path, fmt):
    path, spec = _export(text_model, tmp_path, fmt)
    assert list(spec["files_sha256"]) == ["tokenizer.json"]  # the file copied beside it is recorded too
    _opens_safely_and_predicts_the_same(text_model, path, fmt)


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory):
    return tiny_runs.audio_fsdd(tmp_path_factory.mktemp("audio_safe"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
def test_audio_artifacts_open_through_the_safe_path_with_the_same_outputs(audio_model, tmp_path, fmt):
    path, _ = _export(audio_model, tmp_path, fmt)
    _opens_safely_and_predicts_the_same(audio_model, path, fmt)
