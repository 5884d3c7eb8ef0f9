"""The shipped segmentation configs carry torchvision's recipes (acceptance 5); the shapes configs
validate and name the models and data they demo."""
import os

import pytest
import torch

from conftest import ROOT
from engine.config import load_config
from engine.optim import build_optimizer, build_scheduler
from engine.registry import MODELS
from helpers import stepped_lrs

# references/segmentation/README.md (8 GPUs, -b 4) and train.py's defaults (--epochs 30, --lr 0.01,
# --momentum 0.9, --wd 1e-4, PolynomialLR power 0.9 per iteration, aux classifier lr x 10):
#   deeplabv3_resnet50:           --lr 0.02 --aux-loss --weights-backbone ResNet50_Weights.IMAGENET1K_V1
#   deeplabv3_mobilenet_v3_large: --aux-loss --wd 0.000001 --weights-backbone MobileNet_V3_Large_Weights.IMAGENET1K_V1
#   lraspp_mobilenet_v3_large:    --wd 0.000001 --weights-backbone MobileNet_V3_Large_Weights.IMAGENET1K_V1
RECIPES = {"deeplabv3_resnet50": (0.02, 1e-4, True, "ResNet50_Weights.IMAGENET1K_V1"),
           "deeplabv3_mobilenet_v3_large": (0.01, 1e-6, True, "MobileNet_V3_Large_Weights.IMAGENET1K_V1"),
           "lraspp_mobilenet_v3_large": (0.01, 1e-6, False, "MobileNet_V3_Large_Weights.IMAGENET1K_V1")}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_config_carries_torchvision_recipe(name):
    lr, wd, aux, backbone = RECIPES[name]
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
    assert (cfg.model.name, cfg.model.weights_backbone, cfg.model.model_extra.get("aux_loss", False)) == \
        (name, backbone, aux)
    assert (cfg.data.name, cfg.data.batch_size, cfg.train.epochs) == ("coco_segmentation", 4, 30)
    # presets.py: base_size 520, crop_size 480; coco_utils.py: VOC's 20 categories, > 1000 px to train
    assert (cfg.data.base_size, cfg.data.crop_size, cfg.data.min_area) == (520, 480, 1000)
    assert "categories" not in cfg.data.model_extra  # the default: torchvision's CAT_LIST
    model = MODELS.build(name, num_classes=21, aux_loss=aux) if aux else MODELS.build(name, num_classes=21)
    opt = build_optimizer(model, cfg.optim)
    assert isinstance(opt, torch.optim.SGD)
    aux_ids = {id(p) for p in model.net.aux_classifier.parameters()} if aux else set()
    for group in opt.param_groups:
        in_aux = {id(p) in aux_ids for p in group["params"]}
        assert len(in_aux) == 1  # a group is all aux classifier or none of it
        assert group["lr"] == pytest.approx(lr * (10 if in_aux.pop() else 1))
        assert (group["momentum"], group["weight_decay"]) == (0.9, wd)
    assert len(opt.param_groups) == (2 if aux else 1)
    if aux:  # criterion: out + 0.5 x aux
        assert model.aux_weight == 0.5
    iters = 10
    sched = build_scheduler(opt, cfg.sched, cfg.train.epochs, iters)
    lrs = stepped_lrs(opt, sched, cfg.train.epochs * iters)
    total = cfg.train.epochs * iters  # PolynomialLR(total_iters=iters_per_epoch * epochs, power=0.9)
    for t in (0, 1, 150, 299):
        assert lrs[t] == pytest.approx(lr * (1 - t / total) ** 0.9)


@pytest.mark.parametrize("config, model, data", [("shapes_lraspp.yaml", "lraspp_mobilenet_v3_large", "shapes_semantic"),
                                                 ("shapes_fasterrcnn_320.yaml", "fasterrcnn_mobilenet_v3_large_320_fpn",
                                                  "shapes")])
def test_shapes_configs(config, model, data):
    cfg = load_config(os.path.join(ROOT, "configs", config))
    assert (cfg.model.name, cfg.data.name) == (model, data)
    assert "weights_backbone" not in cfg.model.model_extra  # offline: from scratch
