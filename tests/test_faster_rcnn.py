"""Faster R-CNN MobileNetV3-Large (FPN, 320 FPN): torchvision equivalence, offline weights, the
COCO recipe's numbers (acceptance 1, 5)."""
import os

import pytest
import torch
import torchvision
from torchvision.models import mobilenetv3
from torchvision.ops.misc import FrozenBatchNorm2d

from conftest import ROOT
from engine.config import load_config
from engine.optim import build_optimizer, build_scheduler
from engine.registry import MODELS
from helpers import detection_images, detection_targets, stepped_lrs

NAMES = ["fasterrcnn_mobilenet_v3_large_fpn", "fasterrcnn_mobilenet_v3_large_320_fpn"]


@pytest.mark.parametrize("name", NAMES)
def test_defaults_are_torchvision_s(name):
    ours = MODELS.build(name)
    theirs = getattr(torchvision.models.detection, name)(weights=None, weights_backbone=None)
    assert (ours.transform.min_size, ours.transform.max_size) == (theirs.transform.min_size, theirs.transform.max_size)
    for attr in ("_pre_nms_top_n", "_post_nms_top_n", "score_thresh", "nms_thresh"):
        assert getattr(ours.rpn, attr) == getattr(theirs.rpn, attr), attr
    assert (ours.roi_heads.score_thresh, ours.roi_heads.detections_per_img) == \
        (theirs.roi_heads.score_thresh, theirs.roi_heads.detections_per_img)
    assert list(ours.state_dict()) == list(theirs.state_dict())  # published weights' keys


@pytest.mark.parametrize("name", NAMES)
def test_same_state_dict_same_outputs_as_torchvision(name, tmp_path):
    """Every learned stage gives torchvision's outputs: backbone + FPN, RPN head, box head on the
    same proposals (the rest is torchvision's own FasterRCNN code). Whole-model detections are not
    compared: with random weights many scores nearly tie, and float rounding that differs between
    two instances (kernel paths, not weights) can reorder them."""
    torch.manual_seed(0)
    theirs = getattr(torchvision.models.detection, name)(weights=None, weights_backbone=None, num_classes=4)
    with torch.no_grad():  # move BN statistics away from their defaults
        for m in theirs.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    torch.save(theirs.state_dict(), tmp_path / "detector.pth")  # as published weights are stored
    ours = MODELS.build(name, num_classes=4, weights=str(tmp_path / "detector.pth")).eval()
    theirs.eval()
    x = torch.rand(2, 3, 160, 224, generator=torch.Generator().manual_seed(0))
    sizes = [(160, 224)] * 2
    proposals = [torch.tensor([[0., 0., 100., 100.], [50., 20., 200., 150.]]), torch.tensor([[10., 10., 60., 90.]])]
    outputs = []
    with torch.no_grad():
        for m in (ours, theirs):
            feats = m.backbone(x)
            objectness, deltas = m.rpn.head(list(feats.values()))
            boxes = m.roi_heads.box_head(m.roi_heads.box_roi_pool(feats, proposals, sizes))
            outputs.append([*feats.values(), *objectness, *deltas, *m.roi_heads.box_predictor(boxes)])
    assert list(feats) == ["0", "1", "pool"]
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b)
    ours.transform.min_size, ours.transform.max_size = (160,), 320  # a fast training step
    ours.train()
    assert set(ours(detection_images(), detection_targets())) == {"loss_classifier", "loss_box_reg", "loss_objectness",
                                                "loss_rpn_box_reg"}


def test_backbone_weights_offline_frozen_bn_and_trainable_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError, match="mobilenet_v3_large-8738ca79") as e:
        MODELS.build(NAMES[1], weights_backbone="MobileNet_V3_Large_Weights.IMAGENET1K_V1")
    assert str(tmp_path / "torch") in str(e.value)
    torch.manual_seed(2)
    net = mobilenetv3.mobilenet_v3_large()
    torch.save(net.state_dict(), tmp_path / "mnv3.pth")
    model = MODELS.build(NAMES[1], num_classes=3, weights_backbone=str(tmp_path / "mnv3.pth"))
    body = model.backbone.body
    torch.testing.assert_close(body["0"][0].weight, net.features[0][0].weight)
    assert isinstance(body["0"][1], FrozenBatchNorm2d)  # pretrained: frozen BN, as torchvision
    # 3 trainable stages by default when pretrained: the first blocks are frozen, the last are not
    assert not any(p.requires_grad for p in body["0"].parameters())
    assert all(p.requires_grad for p in body["16"].parameters())
    scratch = MODELS.build(NAMES[1], num_classes=3)
    assert isinstance(scratch.backbone.body["0"][1], torch.nn.BatchNorm2d)
    assert all(p.requires_grad for p in scratch.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_coco_config_carries_torchvision_recipe(name):
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
    # references/detection/README.md: --epochs 26 --lr-steps 16 22 --aspect-ratio-group-factor 3
    #   --weights-backbone MobileNet_V3_Large_Weights.IMAGENET1K_V1
    assert (cfg.train.epochs, cfg.sched.milestones, cfg.data.aspect_ratio_group_factor) == (26, [16, 22], 3)
    assert cfg.model.weights_backbone == "MobileNet_V3_Large_Weights.IMAGENET1K_V1"
    # references/detection/train.py defaults: -b 2, --lr 0.02, --momentum 0.9, --wd 1e-4, hflip
    assert (cfg.data.name, cfg.data.batch_size, cfg.data.augmentation) == ("coco_detection", 2, "hflip")
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg.optim)
    assert isinstance(opt, torch.optim.SGD)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.02, 0.9, 1e-4)
    iters = 7330  # COCO train2017: 117266 images with annotations / 16 per step
    sched = build_scheduler(opt, cfg.sched, cfg.train.epochs, iters)
    lrs = stepped_lrs(opt, sched, 1001)
    # engine.py: linear warm-up from 0.02/1000 over the first 1000 iterations of epoch 0
    assert lrs[0] == pytest.approx(0.02 * 0.001)
    assert lrs[500] == pytest.approx(0.02 * (0.001 + 0.999 * 500 / 1000), rel=1e-3)
    assert lrs[1000] == pytest.approx(0.02, rel=1e-3)
    # the steps (x0.1 at epochs 16 and 22) count from iteration 0 (the warm-up is overlaid, as in
    # references/detection/train.py: MultiStepLR stepped per epoch, warm-up inside epoch 0)
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg.optim)
    sched = build_scheduler(opt, cfg.sched, cfg.train.epochs, iters)
    for it, lr in {16 * iters - 1: 0.02, 16 * iters: 0.002, 22 * iters - 1: 0.002, 22 * iters: 0.0002,
                   26 * iters - 1: 0.0002}.items():
        sched.last_epoch = it - 1
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-9), it
