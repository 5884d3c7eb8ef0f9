"""Two promises of the speed recipes, on a model of the zoo (MobileNetV3-Small on the built-in
synthetic shapes) through the real loop: channels-last gives the outputs of contiguous memory, in eval
and in a training step; bf16 autocast gives losses that track fp32's."""
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine.build import build_run
from engine.checkpoint import load_checkpoint
from engine.config import config_from_data
from engine.loop import train
from engine.registry import MODELS


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """Initial weights whose BatchNorm statistics are measured on the training images (precise_bn's
    way): with the initial ones, activations fade layer after layer and the logits hardly depend on the
    input (an input with height and width swapped changed them by 1e-7)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("start")
    run = build_run(_config(None, 1), str(folder))
    norms = [m for m in run.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # the plain average over the batches
        for inputs, _ in run.train_loader:
            run.model(inputs)
    path = folder / "start.pt"
    torch.save(run.model.state_dict(), path)
    return str(path)


def _config(start, steps, recipes=(), recipe_args=None, seed=0):
    return config_from_data({
        "seed": seed, "device": "cpu",
        "model": {"name": "mobilenet_v3_small", "dropout": 0.0, **({"weights": start} if start else {})},
        "data": {"name": "synthetic_classification", "num_classes": 4, "train_size": 64, "val_size": 8,
                 "image_size": 48, "batch_size": 8, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.05},
        "sched": {"name": "constant"},
        "train": {"epochs": 1, "max_steps_per_epoch": steps, "log_every": 1, "analysis": False},
        "recipes": list(recipes), "recipe_args": recipe_args or {}})


def _losses(folder):
    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


@pytest.mark.slow
def test_channels_last_gives_the_outputs_of_contiguous_memory(start, tmp_path):
    """The same computation in another memory layout differs by float rounding (measured: logits 7e-7,
    weights after the step 2e-7); a wrong permute of the inputs (height and width swapped: the same
    shape at 48x48) changes the logits by far more than the tolerance, which the test checks too."""
    plain = build_run(_config(start, 1), str(tmp_path / "a"))
    nhwc = build_run(_config(start, 1, ["channels_last"]), str(tmp_path / "b"))
    convs = [m.weight for m in nhwc.model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert any(not w.is_contiguous() for w in convs)  # (a depthwise kernel, C x 1 x k x k, is both)
    before = plain.model.state_dict()
    for a, b in zip(before.values(), nhwc.model.state_dict().values()):
        assert torch.equal(a, b)  # the same model, in another layout
    inputs, _ = next(iter(plain.val_loader))
    moved = nhwc.recipes.prepare_inputs(inputs)
    assert moved.is_contiguous(memory_format=torch.channels_last) and not moved.is_contiguous()
    plain.model.eval(), nhwc.model.eval()
    with torch.no_grad():
        expected, got = plain.model(inputs), nhwc.model(moved)
        swapped = nhwc.model(inputs.transpose(2, 3).contiguous(memory_format=torch.channels_last))
    assert (swapped - expected).abs().max() > 100 * 1e-5  # the tolerance below catches a wrong permute
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

    # one training step of the loop (SGD: the update is the gradient, not its sign as in Adam's first step)
    train(_config(start, 1), str(tmp_path / "a"))
    train(_config(start, 1, ["channels_last"]), str(tmp_path / "b"))
    after_plain = load_checkpoint(str(tmp_path / "a" / "last.pt"))["model"]
    after_nhwc = load_checkpoint(str(tmp_path / "b" / "last.pt"))["model"]
    floats = [k for k, v in before.items() if v.is_floating_point()]
    assert max((after_plain[k] - before[k]).abs().max().item() for k in floats) > 1e-2  # a step was taken
    for k in floats:
        torch.testing.assert_close(after_nhwc[k], after_plain[k], rtol=1e-4, atol=1e-5, msg=k)
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "b")), torch.tensor(_losses(tmp_path / "a")),
                               rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_autocast_losses_track_fp32(tmp_path, seed):
    """Eight SGD steps of the same run in fp32 and under bf16 autocast (the amp recipe, dtype bfloat16).
    bf16 keeps 8 bits of mantissa (a relative rounding of 2^-9 = 0.2% per value); convolutions and
    matmuls accumulate in fp32 and the loss is computed in fp32. The first step (the same weights, the
    same batch) differs by rounding alone: measured 0.02% and 0.01% (seeds 0, 1), bound 0.5%. Later
    steps start from weights that the rounding moved apart, and the noisy losses of a short run amplify
    that: measured at most 0.4% and 1.4%, bound 3%. With the weights held in bf16 (the model cast
    instead of autocast) the losses drift by 9.7% and 5.3%, and the bound fails."""
    steps = 8
    train(_config(None, steps, seed=seed), str(tmp_path / "fp32"))
    train(_config(None, steps, ["amp"], {"amp": {"dtype": "bfloat16"}}, seed=seed), str(tmp_path / "bf16"))
    fp32, bf16 = torch.tensor(_losses(tmp_path / "fp32")), torch.tensor(_losses(tmp_path / "bf16"))
    assert len(fp32) == len(bf16) == steps
    assert fp32[-3:].mean() < fp32[:3].mean()  # it trains
    relative = (bf16 - fp32).abs() / fp32
    assert 0 < relative[0] < 0.005, (fp32.tolist(), bf16.tolist())  # 0: autocast did not run in bf16
    assert relative.max() < 0.03, (fp32.tolist(), bf16.tolist())
