"""MobileNetV3 builders, weights loading, the ImageNet recipe's numbers, BN and EMA recipes, learning."""
import os

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from engine.config import load_config
from engine.loop import train
from engine.optim import build_optimizer, build_scheduler
from engine.registry import MODELS
from helpers import stepped_lrs
from recipes.batchnorm import recompute_bn_stats

from conftest import ROOT, shared_data


@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "mobilenet_v3_large"])
def test_torchvision_state_dict_gives_torchvision_outputs(tmp_path, arch):
    torch.manual_seed(0)
    reference = getattr(torchvision.models, arch)(num_classes=7, width_mult=0.75, dropout=0.3).eval()
    path = tmp_path / "weights.pth"
    torch.save(reference.state_dict(), path)
    ours = MODELS.build(arch, num_classes=7, width_mult=0.75, dropout=0.3, weights=str(path)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(x), reference(x))


def test_reduced_tail_and_dilated_follow_torchvision():
    ours = MODELS.build("mobilenet_v3_large", reduced_tail=True, dilated=True)
    reference = torchvision.models.mobilenet_v3_large(reduced_tail=True, dilated=True)
    assert [tuple(v.shape) for v in ours.net.state_dict().values()] == \
        [tuple(v.shape) for v in reference.state_dict().values()]


def test_named_weights_missing_offline_say_where_to_put_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as e:
        MODELS.build("mobilenet_v3_large", weights="MobileNet_V3_Large_Weights.IMAGENET1K_V1")
    msg = str(e.value)
    assert "https://download.pytorch.org/models/mobilenet_v3_large-8738ca79.pth" in msg
    assert str(tmp_path / "hub" / "checkpoints" / "mobilenet_v3_large-8738ca79.pth") in msg
    with pytest.raises(FileNotFoundError, match="no such file"):
        MODELS.build("mobilenet_v3_small", weights=str(tmp_path / "missing.pth"))


def test_imagenet_config_carries_torchvision_recipe():
    cfg = load_config(os.path.join(ROOT, "configs", "mobilenet_v3_large.yaml"))
    assert (cfg.data.batch_size, cfg.train.epochs, cfg.data.auto_augment, cfg.data.random_erase) == \
        (128, 600, "imagenet", 0.2)
    assert cfg.data.root == "data/imagenet"
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))  # the numbers, not the network
    opt = build_optimizer(model, cfg.optim)
    assert isinstance(opt, torch.optim.RMSprop)
    group = opt.param_groups[0]
    assert (group["lr"], group["alpha"], group["eps"], group["momentum"], group["weight_decay"]) == \
        (0.064, 0.9, 0.0316, 0.9, 1e-5)
    iters = 5
    sched = build_scheduler(opt, cfg.sched, cfg.train.epochs, iters)
    epoch_lr = stepped_lrs(opt, sched, 6 * iters)[::iters]  # at the start of epochs 0..5: StepLR(step 2, gamma 0.973)
    assert epoch_lr == pytest.approx([0.064, 0.064, 0.064 * 0.973, 0.064 * 0.973, 0.064 * 0.973 ** 2,
                                      0.064 * 0.973 ** 2])


def test_precise_bn_gives_the_plain_average_of_batch_statistics():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=0.01)
    batches = [torch.randn(8, 3) * (i + 1) + i for i in range(4)]
    recompute_bn_stats(bn, batches, lambda model, batch: model(batch))
    assert torch.allclose(bn.running_mean, torch.stack([b.mean(0) for b in batches]).mean(0), atol=1e-6)
    assert torch.allclose(bn.running_var, torch.stack([b.var(0) for b in batches]).mean(0), atol=1e-5)
    assert bn.momentum == 0.01 and bn.training


def test_ema_follows_its_definition():
    from types import SimpleNamespace

    from recipes.ema import EMA
    model = nn.Linear(2, 1)
    run = SimpleNamespace(model=model, step=1)
    ema = EMA(decay=0.75)
    ema.setup(run)
    ema.after_step(run)  # the first update copies the weights (torch's AveragedModel)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.after_step(run)
    assert torch.allclose(ema.eval_models(run)["ema"].weight, 0.75 * start + 0.25 * model.weight)
    assert not torch.allclose(ema.eval_models(run)["ema"].weight, model.weight)


def learn(tmp_path, config, *overrides):
    run = train(load_config(os.path.join(ROOT, "configs", config), list(overrides)), str(tmp_path))
    return run.metrics["val/top1"]


@pytest.mark.slow
def test_learns_builtin_shapes_in_eval_mode(tmp_path):
    top1 = learn(tmp_path, "demo.yaml", "data.num_classes=4", "data.train_size=480", "data.val_size=160",
                 "data.image_size=32", "train.epochs=3")
    assert top1 >= 70.0  # chance is 25%; held-out images, eval mode


@pytest.mark.slow
def test_learns_digits_in_eval_mode(tmp_path):
    root = shared_data("digits")
    top1 = learn(tmp_path, "mobilenet_v3_small_digits.yaml", f"data.root={root}", "train.epochs=3",
                 "train.eval_every=3")
    assert top1 >= 85.0


@pytest.mark.slow
def test_crop_flip_normalize_draws_as_random_resized_crop_and_flip():
    """The batch's draws (each from its own seed) follow RandomResizedCrop + RandomHorizontalFlip:
    the same distribution of crop sizes, positions and flips over 20000 draws, and the same
    centre-crop fallback when no trial fits (square and wide images)."""
    from torchvision.transforms import v2 as T
    from datasets.classification import CropFlipNormalize
    image = torch.zeros(3, 48, 40, dtype=torch.uint8)
    ours = CropFlipNormalize(40, (0.3, 1.0), 0.3)
    crop = T.RandomResizedCrop(40, scale=(0.3, 1.0))
    torch.manual_seed(0)
    v2 = [crop.make_params([image]) for _ in range(20000)]
    v2 = np.array([(p["top"], p["left"], p["height"], p["width"]) for p in v2])
    draws = np.array(ours.draw(range(20000), 48, 40), dtype=float)
    for k, name in enumerate(("top", "left", "height", "width")):
        values = np.union1d(v2[:, k], draws[:, k])
        tv = 0.5 * np.abs(np.array([(v2[:, k] == v).mean() - (draws[:, k] == v).mean() for v in values])).sum()
        assert tv < 0.03, (name, tv)
    log_aspect = lambda d: np.log(d[:, 3] / d[:, 2]).mean()  # noqa: E731
    assert abs(log_aspect(v2) - log_aspect(draws)) < 0.01
    assert abs(draws[:, 4].mean() - 0.3) < 0.015
    for shape in ((3, 30, 30), (3, 20, 64), (3, 64, 20)):  # scale > 1: no trial fits
        image = torch.zeros(shape, dtype=torch.uint8)
        p = T.RandomResizedCrop(16, scale=(2.0, 3.0)).make_params([image])
        t, l, h, w, _ = CropFlipNormalize(16, (2.0, 3.0)).draw([5], *shape[1:])[0]
        assert (t, l, h, w) == (p["top"], p["left"], p["height"], p["width"]), shape


def test_crop_flip_normalize_pixels_equal_the_v2_transforms():
    """For the same draws: v2's float resize where the crop is upsampled (the batched grid_sample),
    v2's uint8 resize exactly where it is downsampled, within one uint8 level of the uint8 v2 chain."""
    from torchvision.transforms import v2 as T
    from datasets.classification import CropFlipNormalize, synthetic_classification
    image = synthetic_classification(image_size=48).train._render(0)[0]
    mean, std = torch.tensor((0.5, 0.4, 0.3)).view(3, 1, 1), torch.tensor((0.2, 0.3, 0.4)).view(3, 1, 1)
    fused = CropFlipNormalize(40, (0.3, 1.0), 0.5, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4))
    draws = fused.draw(range(300), 48, 48)
    kinds = set()
    for d in draws:
        top, left, h, w, flip = d
        a = fused.apply([image], [d])[0]
        geometry = lambda x: T.functional.resized_crop(x, top, left, h, w, [40, 40], antialias=True)  # noqa: E731
        flipped = lambda x: x.flip(-1) if flip else x  # noqa: E731
        in_uint8 = (flipped(geometry(image)).float() / 255 - mean) / std
        in_float = (flipped(geometry(image.float())) / 255 - mean) / std
        upsampled = h <= 40 and w <= 40
        kinds.add((upsampled, flip))
        torch.testing.assert_close(a, in_float if upsampled else in_uint8, rtol=0, atol=1e-4, msg=str(d))
        assert ((a - in_uint8) * std * 255).abs().max() <= 1.001, d
    assert kinds == {(True, True), (True, False), (False, True), (False, False)}
    batch = fused.apply([image] * 5, draws[:5])  # a batch: the same as one by one
    for x, d in zip(batch, draws[:5]):
        torch.testing.assert_close(x, fused.apply([image], [d])[0], rtol=0, atol=1e-5)


def test_a_batch_of_built_in_samples_equals_the_samples_one_by_one():
    """SeededSamples hands the built-in data a batch's seeds at once: the same samples as fetching
    each key alone, each with its own draws; the validation set, without seeded_items, is read with
    torch's generator seeded per sample."""
    from datasets.classification import synthetic_classification
    from engine.seeding import SeededSamples
    data = synthetic_classification(image_size=32, train_size=40)
    samples = SeededSamples(data.train)
    keys = [(7, i) for i in range(0, 40, 3)]
    batch = samples.__getitems__(keys)
    for key, (x, y) in zip(keys, batch):
        one_x, one_y = samples[key]
        assert y == one_y and x.shape == (3, 32, 32)
        torch.testing.assert_close(x, one_x, rtol=0, atol=1e-5)
    assert len({x.sum().item() for x, _ in batch}) == len(keys)
    assert not torch.equal(samples[(8, 0)][0], samples[(7, 0)][0])  # another epoch, other draws
