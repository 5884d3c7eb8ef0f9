"""Evaluation speed: Conv2d+BatchNorm2d folding for eval, evaluate.py's images/s, and the comparison with
torchvision's reference evaluation (benchmarks/reference_eval.py) on the same checkpoint."""
import contextlib
import io
import json
import time

import pytest
import torch
from torch import nn
from torchvision.models.detection.ssd import SSD

import evaluate
import train
from benchmarks import reference_eval
from conftest import ROOT
from engine.fusion import fold_batch_norms
from engine.registry import MODELS


def _randomise_norms(model):
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # trained-like statistics, so that folding changes the weights
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)


def test_folded_detector_predicts_what_the_model_predicts():
    model = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=4, size=128)
    _randomise_norms(model)
    model.eval()
    folded = fold_batch_norms(model)
    count = lambda m: sum(isinstance(x, nn.BatchNorm2d) for x in m.modules())  # noqa: E731
    assert count(model) > 50 and count(folded) == 0  # every norm of SSDlite follows a conv in a Sequential
    images = [torch.rand(3, 128, 160), torch.rand(3, 96, 128)]
    with torch.no_grad():
        batch = model.transform(images)[0].tensors
        features, folded_features = model.backbone(batch), folded.backbone(batch)
        head, folded_head = model.head(list(features.values())), folded.head(list(folded_features.values()))
        expected, got = model(images), folded(images)
    for a, b in zip(features.values(), folded_features.values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for key in ("cls_logits", "bbox_regression"):  # what the post-processing decodes
        torch.testing.assert_close(folded_head[key], head[key], rtol=1e-4, atol=1e-4)
    for e, g in zip(expected, got):  # the detections, up to the order of (near) ties in score
        assert len(e["boxes"]) > 0
        torch.testing.assert_close(g["scores"], e["scores"], rtol=1e-4, atol=1e-4)


def test_fold_leaves_the_model_and_what_it_cannot_prove_alone():
    class Branches(nn.Module):  # registration order says nothing about data flow outside a Sequential
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.conv(self.bn(torch.cat([x, x], 1)[:, :4]))[:, :3]

    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    _randomise_norms(plain)
    assert fold_batch_norms(plain) is plain  # training mode: nothing to fold
    plain.eval()
    folded = fold_batch_norms(plain)
    assert folded is not plain and isinstance(plain[1], nn.BatchNorm2d) and isinstance(folded[1], nn.Identity)
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(folded(x), plain(x), rtol=1e-5, atol=1e-5)
    other = Branches().eval()
    assert fold_batch_norms(other) is other
    hooked = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    hooked[1].register_forward_hook(lambda *a: None)
    assert fold_batch_norms(hooked) is hooked


@pytest.fixture(scope="module")
def shapes_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalspeed")
    out = tmp / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(["--config", f"{ROOT}/configs/shapes_demo.yaml", "--output-dir", str(out), "--set",
                    f"data.root={tmp / 'shapes'}", "data.num_train=8", "data.num_val=5", "data.image_size=96",
                    "model.size=96", "data.batch_size=4", "data.eval_batch_size=2", "data.workers=0",
                    "train.epochs=1", "recipes=[channels_last]"])
    return out / "last.pt"


def test_evaluate_reports_images_per_second(shapes_checkpoint, tmp_path):
    """The reported times against clocks read outside the code: the whole command (before its first
    line, after its last) and the detector's forwards (global module hooks on every SSD: the first
    forward's start, the last one's end). Invariants that hold at any load, no timing threshold."""
    forwards = []

    def clock(module, *args):
        if isinstance(module, SSD):
            forwards.append(time.perf_counter())

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(clock),
             torch.nn.modules.module.register_module_forward_hook(clock)]
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            start = time.perf_counter()
            evaluate.main(["--checkpoint", str(shapes_checkpoint), "--report-dir", str(tmp_path),
                           "--set", "data.eval_batch_size=3"])  # a key that may differ from training's
            took = time.perf_counter() - start
    finally:
        for hook in hooks:
            hook.remove()
    speed = json.loads((tmp_path / "report.json").read_text())["speed"]
    assert speed["images"] == 5  # data.num_val
    assert 0 < speed["total_s"] <= took and speed["images_per_s"] >= 5 / took
    assert len(forwards) == 2 * 2  # two batches of at most 3 images, each forward's start and end
    assert speed["inference_s"] >= max(forwards) - min(forwards)  # the forwards lie in inference
    assert 0 <= speed["scoring_s"] <= took - (max(forwards) - min(forwards))
    assert "images/s" in printed.getvalue() and "images/s" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit, match="model.size"):  # one that scores other inputs is refused
        evaluate.main(["--checkpoint", str(shapes_checkpoint), "--report-dir", str(tmp_path),
                       "--set", "model.size=128"])


def test_reference_evaluation_gives_the_same_stats(shapes_checkpoint, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result = reference_eval.main(["--checkpoint", str(shapes_checkpoint), "--compare", "--workers", "0",
                                      "--json", str(tmp_path / "r.json")])
    assert result["images"] == 5 and result["stats_identical"], printed.getvalue()
    assert result["reference_stats"]["AR100"] >= 0 and len(result["ratios"]) == 1 and result["ratios"][0] > 0
    # and the reference stats are pycocotools' on the project's detections
    with contextlib.redirect_stdout(io.StringIO()):
        report = evaluate.main(["--checkpoint", str(shapes_checkpoint), "--report-dir", str(tmp_path / "e")])
    assert report["bbox"] == result["reference_stats"]


@pytest.mark.slow
def test_streams_give_the_single_stream_predictions_in_loader_order():
    from engine.evaluation import evaluate, eval_streams

    class Recorder:
        def __init__(self):
            self.seen = []

        def update(self, predictions, targets):
            self.seen += [(t, p["scores"]) for p, t in zip(predictions, targets)]

    model = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=4, size=96)
    _randomise_norms(model)
    torch.manual_seed(1)
    loader = [([torch.rand(3, 96, 96) for _ in range(2)], [2 * i, 2 * i + 1]) for i in range(5)]
    one = evaluate(model, loader, Recorder(), torch.device("cpu"), show_progress=False, streams=1).seen
    threads = torch.get_num_threads()
    three = evaluate(model, loader, Recorder(), torch.device("cpu"), show_progress=False, streams=3).seen
    assert torch.get_num_threads() == threads  # restored after the pool
    assert [t for t, _ in three] == list(range(10)) == [t for t, _ in one]
    for (_, a), (_, b) in zip(one, three):
        torch.testing.assert_close(b, a)
    torch.set_num_threads(2)
    try:  # one stream per thread, but a compiled model runs one stream
        assert eval_streams(model, torch.device("cpu")) == 2
        assert eval_streams(torch.compile(model), torch.device("cpu")) == 1
    finally:
        torch.set_num_threads(threads)


def test_one_stream_when_a_recipe_context_changes_the_model(tmp_path):
    """The qat recipe pauses the observers of the model itself while evaluating: threads entering and
    leaving that context at different times would let one batch's forward record into them."""
    from engine.build import build_run
    from engine.evaluation import eval_streams
    from helpers import tiny_config
    from helpers import qat_config
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        qat = build_run(qat_config(), str(tmp_path / "qat"))
        qat.model.eval()
        assert eval_streams(qat.model, qat.device, qat.recipes, qat) == 1
        amp = build_run(tiny_config("recipes=[amp,channels_last]", "recipe_args.amp.dtype=bfloat16"),
                        str(tmp_path / "amp"))
        assert eval_streams(amp.model, amp.device, amp.recipes, amp) == 2  # autocast is per thread
    finally:
        torch.set_num_threads(threads)
