"""Every shipped recipe config, pinned to the numbers of the torchvision reference it reproduces.

Each test builds the optimizer, the LR schedule and the presets from the config alone (no
training) and checks them against the reference: lr at chosen epochs and iterations for the
global batch the config names, optimizer settings, augmentation parameters, epochs, eval sizes.
The source of each reference number is given next to it:
  [det-README]  torchvision references/detection/README.md (SSD300 VGG16 / SSDlite320 commands)
  [det-train]   references/detection/train.py argparse defaults
  [det-engine]  references/detection/engine.py train_one_epoch (warm-up in epoch 0)
  [det-presets] references/detection/presets.py DetectionPresetTrain / DetectionPresetEval
  [cls-README]  references/classification/README.md (MobileNetV3 Large; Quantized: MobileNetV3 Large)
  [cls-train]   references/classification/train.py argparse defaults and optimizer construction
  [cls-presets] references/classification/presets.py ClassificationPresetTrain / ClassificationPresetEval
  [cls-quant]   references/classification/train_quantization.py (defaults, observer / BN freezing)
  [tv-models]   the torchvision model builders installed here (torchvision.models.detection.ssd*)
  [d2-pfpn]     detectron2 configs/COCO-PanopticSegmentation/panoptic_fpn_R_50_1x.yaml with its
                Base-Panoptic-FPN.yaml and Base-RCNN-FPN.yaml (SOLVER, INPUT, MODEL.SEM_SEG_HEAD)
"""
import math
import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2 as T

from conftest import ROOT, shared_data
from engine.config import load_config
from engine.optim import build_optimizer, build_scheduler
from engine.registry import DATASETS, MODELS
from helpers import stepped_lrs

GPUS = 8                           # [det-README], [cls-README]: torchrun --nproc_per_node=8
COCO_TRAIN_IMAGES = 117266         # train2017 images with annotations, the reference's training set
                                   # (references/detection/coco_utils.py _coco_remove_images_without_annotations)
IMAGENET_TRAIN_IMAGES = 1281167    # ILSVRC2012 train


def config(name):
    return load_config(os.path.join(ROOT, "configs", name))


def iters_per_epoch(images, batch_per_gpu, gpus=GPUS):
    """The loop's loader length per process (engine/build.py build_loaders): DistributedSampler
    (drop_last) gives N // gpus samples, full batches only. The references' loaders give the same
    for these recipes, except ImageNet's last partial batch (1252 instead of 1251 iterations)."""
    return images // gpus // batch_per_gpu


def schedule(cfg, images):
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, cfg.optim)
    ipe = iters_per_epoch(images, cfg.data.batch_size)
    return optimizer, build_scheduler(optimizer, cfg.sched, cfg.train.epochs, ipe), ipe


def lr_at(optimizer, scheduler, iteration):
    """The lr the optimizer uses at `iteration` (0-based, counted over the whole run)."""
    scheduler.last_epoch = iteration - 1
    optimizer.step()  # no gradients: changes nothing, keeps the scheduler's order check quiet
    scheduler.step()
    return optimizer.param_groups[0]["lr"]


def steps_of(transform, kind):
    found = [t for t in transform.transforms if isinstance(t, kind)]
    found += [t.inner for t in transform.transforms if isinstance(getattr(t, "inner", None), kind)]
    assert len(found) == 1, f"expected one {kind.__name__} in {transform}"
    return found[0]


def coco6_splits(cfg):
    args = dict(cfg.data.model_extra, root=shared_data("coco6"), train_split="val", val_split="val")
    return DATASETS.build(cfg.data.name, **args)


# ---------------------------------------------------------------- detection

def check_ssd_augmentation(train):
    # [det-presets] "ssd": RandomPhotometricDistort(), RandomZoomOut(fill=mean), RandomIoUCrop(),
    # RandomHorizontalFlip(p=hflip_prob), all with torchvision's defaults; mean=(123.0, 117.0, 104.0)
    distort = steps_of(train, T.RandomPhotometricDistort)
    assert distort.p == 0.5
    assert (distort.brightness, distort.contrast, distort.saturation, distort.hue) == \
        ((0.875, 1.125), (0.5, 1.5), (0.5, 1.5), (-0.05, 0.05))
    zoom = steps_of(train, T.RandomZoomOut)
    assert (zoom.side_range, zoom.p) == ((1.0, 4.0), 0.5)
    assert zoom.fill == {tv_tensors.Mask: 0, "others": [123.0, 117.0, 104.0]}


def check_iou_crop_and_flip(train):
    crop = steps_of(train, T.RandomIoUCrop)  # torchvision's defaults (SSD paper's sampler)
    assert (crop.min_scale, crop.max_scale, crop.min_aspect_ratio, crop.max_aspect_ratio, crop.trials) == \
        (0.3, 1.0, 0.5, 2.0, 40)
    assert crop.options == [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]  # 1.0: "no crop"
    assert steps_of(train, T.RandomHorizontalFlip).p == 0.5  # [det-train] hflip_prob 0.5


@pytest.mark.parametrize("name,epochs,batch_size,augmentation,weights_backbone,iterations,weight_decay", [
    # [det-README] --epochs 120 --lr-steps 80 110 --lr 0.002 --batch-size 4 --weight-decay 0.0005
    #              --aspect-ratio-group-factor 3 --data-augmentation ssd
    #              --weights-backbone VGG16_Weights.IMAGENET1K_FEATURES
    ("ssd300.yaml", 120, 4, "ssd", "VGG16_Weights.IMAGENET1K_FEATURES", 3664, 0.0005),  # 117266 images / (8 x 4)
    # [det-README] --epochs 660 --aspect-ratio-group-factor 3 --lr-scheduler cosineannealinglr --lr 0.15
    #              --batch-size 24 --weight-decay 0.00004 --data-augmentation ssdlite
    #              --weights-backbone MobileNet_V3_Large_Weights.IMAGENET1K_V1
    ("ssdlite320.yaml", 660, 24, "ssdlite", "MobileNet_V3_Large_Weights.IMAGENET1K_V1", 610, 0.00004),  # / (8 x 24)
], ids=["ssd300", "ssdlite320"])
def test_ssd_recipe_settings(name, epochs, batch_size, augmentation, weights_backbone, iterations, weight_decay):
    cfg = config(name)
    assert (cfg.train.epochs, cfg.data.batch_size, cfg.data.aspect_ratio_group_factor, cfg.data.augmentation,
            cfg.model.weights_backbone) == (epochs, batch_size, 3, augmentation, weights_backbone)
    optimizer, _, ipe = schedule(cfg, COCO_TRAIN_IMAGES)
    assert ipe == iterations
    # [det-train] SGD(momentum=0.9 default, weight_decay=args.weight_decay), no nesterov,
    # --norm-weight-decay None: every parameter decays
    assert isinstance(optimizer, torch.optim.SGD) and len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.9, weight_decay, False)


def test_ssd300_schedule():
    cfg = config("ssd300.yaml")
    optimizer, scheduler, ipe = schedule(cfg, COCO_TRAIN_IMAGES)
    # [det-engine] epoch 0: LinearLR(start_factor=1/1000, total_iters=min(1000, len(loader) - 1)),
    # stepped per iteration; [det-train] MultiStepLR([80, 110], 0.1) stepped per epoch, from epoch 0
    lr = 0.002
    expected = {0: lr / 1000, 500: lr * (0.001 + 0.999 * 0.5), 999: lr * (0.001 + 0.999 * 0.999), 1000: lr,
                ipe: lr, 80 * ipe - 1: lr, 80 * ipe: lr * 0.1, 110 * ipe - 1: lr * 0.1, 110 * ipe: lr * 0.01,
                120 * ipe - 1: lr * 0.01}
    for it, value in expected.items():
        assert lr_at(optimizer, scheduler, it) == pytest.approx(value, rel=1e-9), f"iteration {it}"
    optimizer, scheduler, _ = schedule(cfg, COCO_TRAIN_IMAGES)
    lrs = stepped_lrs(optimizer, scheduler, 1001)
    assert [lrs[i] for i in (0, 500, 999, 1000)] == pytest.approx([expected[i] for i in (0, 500, 999, 1000)])


def test_ssdlite320_schedule():
    optimizer, scheduler, ipe = schedule(config("ssdlite320.yaml"), COCO_TRAIN_IMAGES)
    # [det-engine] warm-up over min(1000, len(loader) - 1) = 609 iterations of epoch 0;
    # [det-train] CosineAnnealingLR(T_max=epochs) stepped per epoch, counted from epoch 0
    # (here stepped per iteration: equal at every epoch start)
    lr = 0.15

    def cosine(epoch):
        return lr * (1 + math.cos(math.pi * epoch / 660)) / 2

    assert lr_at(optimizer, scheduler, 0) == pytest.approx(lr / 1000)
    assert lr_at(optimizer, scheduler, 304) == pytest.approx(lr * (0.001 + 0.999 * 304 / 609), rel=1e-4)
    for epoch in (1, 2, 100, 330, 500, 659):
        assert lr_at(optimizer, scheduler, epoch * ipe) == pytest.approx(cosine(epoch), rel=1e-9), f"epoch {epoch}"
    assert lr_at(optimizer, scheduler, 330 * ipe) == pytest.approx(0.075)
    assert lr_at(optimizer, scheduler, 660 * ipe - 1) < 1e-6


def test_panoptic_fpn_r50_recipe():
    cfg = config("panoptic_fpn_r50.yaml")
    # [d2-pfpn] IMS_PER_BATCH 16 (2 per GPU x 8), BASE_LR 0.02, MAX_ITER 90000 (~12 epochs of
    # 118287 train2017 panoptic images), STEPS (60000, 80000) = 2/3 and 8/9 of the schedule, in epochs
    # 8 and 11 here; WARMUP_ITERS 1000, WARMUP_FACTOR 1/1000, linear, overlaid (WarmupMultiStepLR);
    # MOMENTUM 0.9, WEIGHT_DECAY 1e-4; MIN_SIZE_TRAIN (640..800 step 32), MAX_SIZE_TRAIN 1333;
    # SEM_SEG_HEAD.LOSS_WEIGHT 0.5; COMBINE OVERLAP 0.5, STUFF_AREA_LIMIT 4096, INSTANCES_CONFIDENCE 0.5
    assert cfg.train.epochs == 12 and cfg.data.batch_size == 2
    assert cfg.model.min_size == [640, 672, 704, 736, 768, 800] and cfg.model.max_size == 1333
    assert (cfg.model.sem_loss_weight, cfg.model.instance_score_thresh, cfg.model.overlap_thresh,
            cfg.model.stuff_area_thresh) == (0.5, 0.5, 0.5, 4096)
    assert cfg.recipe_args["ddp"]["find_unused_parameters"] is True
    assert cfg.data.root == "data/coco" and cfg.train.best_metric == "panoptic/PQ"
    optimizer, scheduler, ipe = schedule(cfg, 118287)
    assert ipe == 7392  # 118287 images / (8 x 2)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.SGD) and len(optimizer.param_groups) == 1
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.9, 0.0001, False)
    lr = 0.02
    expected = {0: lr / 1000, 500: lr * (0.001 + 0.999 * 0.5), 1000: lr, 8 * ipe - 1: lr, 8 * ipe: lr * 0.1,
                11 * ipe - 1: lr * 0.1, 11 * ipe: lr * 0.01, 12 * ipe - 1: lr * 0.01}
    for it, value in expected.items():
        assert lr_at(optimizer, scheduler, it) == pytest.approx(value, rel=1e-9), f"iteration {it}"


def test_detection_presets_and_models_match_the_reference():
    ssd, lite = config("ssd300.yaml"), config("ssdlite320.yaml")
    train = coco6_splits(ssd).train.transforms
    check_ssd_augmentation(train)
    check_iou_crop_and_flip(train)
    train = coco6_splits(lite).train.transforms
    # [det-presets] "ssdlite": RandomIoUCrop(), RandomHorizontalFlip(p=hflip_prob); no photometric, no zoom-out
    assert not [t for t in train.transforms if isinstance(t, (T.RandomPhotometricDistort, T.RandomZoomOut))]
    check_iou_crop_and_flip(train)
    # eval: [det-presets] DetectionPresetEval only converts to float; the models resize:
    # [tv-models] SSD300: 300x300, image_mean [0.48235, 0.45882, 0.40784], image_std [1/255] * 3;
    # SSDlite320: 320x320, mean 0.5, std 0.5 (on images in [0, 1]); postprocessing (score_thresh,
    # nms_thresh, detections_per_img, topk_candidates): SSD300 0.01 / 0.45 / 200 / 400, SSDlite 0.001 / 0.55 / 300 / 300
    for cfg, size, mean, std, post in ((ssd, 300, [0.48235, 0.45882, 0.40784], [1 / 255] * 3, (0.01, 0.45, 200, 400)),
                                       (lite, 320, [0.5] * 3, [0.5] * 3, (0.001, 0.55, 300, 300))):
        model = MODELS.build(cfg.model.name, num_classes=81)  # weights: not offline here, the numbers only
        assert model.transform.fixed_size == (size, size)
        assert model.transform.image_mean == pytest.approx(mean) and model.transform.image_std == pytest.approx(std)
        assert (model.score_thresh, model.nms_thresh, model.detections_per_img, model.topk_candidates) == post
    # [tv-models] ssdlite320_mobilenet_v3_large: BatchNorm eps 0.001, momentum 0.03
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert (bn.eps, bn.momentum) == (0.001, 0.03)


# ---------------------------------------------------------------- classification

def imagefolder(cfg, tmp_path):
    for split in ("train", "val"):
        os.makedirs(tmp_path / split / "a")
        Image.new("RGB", (300, 280)).save(tmp_path / split / "a" / "x.png")
    return DATASETS.build(cfg.data.name, **dict(cfg.data.model_extra, root=str(tmp_path)))


def check_imagenet_presets(data, auto_augment, random_erase):
    # [cls-presets] train: RandomResizedCrop(224, bilinear), RandomHorizontalFlip(0.5), AutoAugment
    # (policy imagenet), ToDtype, Normalize(ImageNet mean/std), RandomErasing(p); eval: Resize(256,
    # bilinear), CenterCrop(224); [cls-train] --train-crop-size 224 --val-resize-size 256 --val-crop-size 224
    train, val = data.train.transform, data.val.transform
    crop = steps_of(train, T.RandomResizedCrop)
    assert (crop.size, crop.scale, crop.interpolation) == ((224, 224), (0.08, 1.0), T.InterpolationMode.BILINEAR)
    assert steps_of(train, T.RandomHorizontalFlip).p == 0.5
    augment = [t for t in train.transforms if isinstance(t, T.AutoAugment)]
    assert [a.policy for a in augment] == ([T.AutoAugmentPolicy.IMAGENET] if auto_augment else [])
    erase = [t.p for t in train.transforms if isinstance(t, T.RandomErasing)]
    assert erase == ([random_erase] if random_erase else [])
    for preset in (train, val):
        norm = steps_of(preset, T.Normalize)
        assert (norm.mean, norm.std) == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    resize = steps_of(val, T.Resize)
    assert (resize.size, resize.interpolation) == ([256], T.InterpolationMode.BILINEAR)
    assert steps_of(val, T.CenterCrop).size == (224, 224)
    assert data.val[0][0].shape == (3, 224, 224) and data.train[0][0].shape == (3, 224, 224)


def test_mobilenet_v3_large_recipe(tmp_path):
    cfg = config("mobilenet_v3_large.yaml")
    # [cls-README] torchrun --nproc_per_node=8 train.py --model mobilenet_v3_large --epochs 600 --opt rmsprop
    #   --batch-size 128 --lr 0.064 --wd 0.00001 --lr-step-size 2 --lr-gamma 0.973 --auto-augment imagenet
    #   --random-erase 0.2
    assert cfg.train.epochs == 600 and cfg.data.batch_size == 128
    assert (cfg.model.num_classes, cfg.model.dropout) == (1000, 0.2)  # torchvision's mobilenet_v3_large
    model = MODELS.build(cfg.model.name, **cfg.model.model_extra)
    optimizer = build_optimizer(model, cfg.optim)
    # [cls-train] RMSprop(lr, momentum=args.momentum (0.9), weight_decay, eps=0.0316, alpha=0.9);
    # --norm-weight-decay / --bias-weight-decay None: one group, every parameter decays
    assert isinstance(optimizer, torch.optim.RMSprop) and len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["alpha"], group["eps"], group["weight_decay"]) == \
        (0.064, 0.9, 0.9, 0.0316, 0.00001)
    assert len(group["params"]) == len(list(model.parameters()))
    # [cls-train] StepLR(step_size=2, gamma=0.973) stepped per epoch; --lr-warmup-epochs 0
    optimizer, scheduler, ipe = schedule(cfg, IMAGENET_TRAIN_IMAGES)
    assert ipe == 1251  # 1281167 images / (8 x 128)
    for epoch in (0, 1, 2, 3, 100, 599):
        assert lr_at(optimizer, scheduler, epoch * ipe) == pytest.approx(0.064 * 0.973 ** (epoch // 2)), epoch
    assert lr_at(optimizer, scheduler, 2 * ipe - 1) == pytest.approx(0.064)
    check_imagenet_presets(imagefolder(cfg, tmp_path), auto_augment=True, random_erase=0.2)


def test_mobilenet_v3_large_qat_recipe(tmp_path):
    from recipes.qat import QAT
    cfg = config("mobilenet_v3_large_qat.yaml")
    # [cls-README] Quantized MobileNetV3 Large: train_quantization.py --model mobilenet_v3_large --wd 0.00001
    #   --lr 0.001; settings: batch_size 32, num_epochs 90, num_observer_update_epochs 4,
    #   num_batch_norm_update_epochs 3, momentum 0.9, lr_step_size 30, lr_gamma 0.1
    assert cfg.train.epochs == 90 and cfg.data.batch_size == 32 and cfg.model.quantize
    optimizer, scheduler, ipe = schedule(cfg, IMAGENET_TRAIN_IMAGES)
    assert isinstance(optimizer, torch.optim.SGD) and ipe == 5004  # 1281167 / (8 x 32)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.001, 0.9, 0.00001)
    for epoch, lr in ((0, 1e-3), (29, 1e-3), (30, 1e-4), (59, 1e-4), (60, 1e-5), (89, 1e-5)):
        assert lr_at(optimizer, scheduler, epoch * ipe) == pytest.approx(lr), epoch
    # [cls-quant] after training epoch `epoch`: `if epoch >= args.num_observer_update_epochs:
    # disable_observer`, `if epoch >= args.num_batch_norm_update_epochs: freeze_bn_stats`: observers
    # learn during epochs 0-4, BatchNorm statistics during epochs 0-3
    recipe = QAT(**cfg.recipe_args["qat"])
    model = MODELS.build(cfg.model.name, **dict(cfg.model.model_extra, weights=None))
    run = SimpleNamespace(cfg=cfg, model=model, device=torch.device("cpu"), epoch=0)
    recipe.setup(run)
    observing, bn_updating = [], []
    for epoch in range(8):
        run.epoch = epoch
        recipe.before_epoch(run)
        observing.append(all(int(m.observer_enabled) for m in run.model.modules()
                             if isinstance(m, torch.ao.quantization.FakeQuantizeBase)))
        bn_updating.append(not any(getattr(m, "freeze_bn", False) for m in run.model.modules()))
    assert observing == [True] * 5 + [False] * 3
    assert bn_updating == [True] * 4 + [False] * 4
    check_imagenet_presets(imagefolder(cfg, tmp_path), auto_augment=False, random_erase=0.0)


def reference_detection_preset(augmentation, hflip_prob=0.5, mean=(123.0, 117.0, 104.0)):
    """[det-presets] DetectionPresetTrain(data_augmentation=..., backend="tv_tensor", use_v2=True),
    written out with torchvision's own v2 transforms (references/ is not installed). The zoom-out
    fill is the v1 branch's `list(mean)`, with which the published weights were trained: the v2
    branch's `defaultdict(lambda: mean, {Mask: 0})` pads with 0 (see the test below)."""
    steps = {"hflip": [T.RandomHorizontalFlip(p=hflip_prob)],
             "ssd": [T.RandomPhotometricDistort(), T.RandomZoomOut(fill=list(mean)),
                     T.RandomIoUCrop(), T.RandomHorizontalFlip(p=hflip_prob)],
             "ssdlite": [T.RandomIoUCrop(), T.RandomHorizontalFlip(p=hflip_prob)]}[augmentation]
    return T.Compose([T.ToImage(), *steps, T.ToDtype(torch.float, scale=True),
                      T.ConvertBoundingBoxFormat(tv_tensors.BoundingBoxFormat.XYXY), T.SanitizeBoundingBoxes(),
                      T.ToPureTensor()])


@pytest.mark.parametrize("augmentation", ["ssd", "ssdlite", "hflip"])
def test_detection_presets_equal_torchvision_v2_pipeline(augmentation):
    """Same image, boxes and seed: this repository's train preset and torchvision's v2 pipeline give
    the same pixels, boxes and labels (every coco6 image with boxes, shrunk to 160 px for speed,
    3 seeds each)."""
    from datasets.coco import CocoDetectionDataset, train_preset
    root = shared_data("coco6")
    raw = CocoDetectionDataset(os.path.join(root, "val2017"), os.path.join(root, "annotations",
                                                                          "instances_val2017.json"))
    ours, theirs = train_preset(augmentation), reference_detection_preset(augmentation)
    compared = 0
    for index in range(len(raw)):
        image, target = T.Resize(160)(*raw[index])
        if len(target["boxes"]) == 0:  # the reference trains on images with annotations only
            continue
        for seed in range(3):
            torch.manual_seed(seed)
            a_image, a_target = ours(image, dict(target))
            torch.manual_seed(seed)
            b_image, b_target = theirs(image, dict(target))
            torch.testing.assert_close(a_image, b_image, rtol=0, atol=0)
            torch.testing.assert_close(a_target["boxes"], b_target["boxes"], rtol=0, atol=0)
            assert torch.equal(a_target["labels"], b_target["labels"])
            compared += 1
    assert compared == 5 * 3


def test_reference_v2_zoom_out_defaultdict_fill_pads_black():
    """Why the zoom-out fill is written {Mask: 0, "others": mean} here: torchvision's v2 transforms look
    the fill up with `type in fill` (transforms/v2/_utils.py _get_fill), which a defaultdict answers
    False, so presets.py's use_v2 fill gives None, i.e. 0, not the mean (torchvision 0.26)."""
    from collections import defaultdict

    from datasets.coco import train_preset
    image = tv_tensors.Image(torch.full((3, 8, 8), 200, dtype=torch.uint8))
    reference = T.RandomZoomOut(fill=defaultdict(lambda: (123.0, 117.0, 104.0), {tv_tensors.Mask: 0}), p=1.0)
    ours = steps_of(train_preset("ssd"), T.RandomZoomOut)
    torch.manual_seed(0)
    padded = reference(image)
    assert padded.shape[-1] > 8 and padded[:, 0, 0].tolist() == [0, 0, 0]
    ours.p = 1.0
    torch.manual_seed(0)
    assert ours(image)[:, 0, 0].tolist() == [123, 117, 104]


@pytest.mark.slow
def test_iou_crop_draws_and_crops_as_torchvision_random_iou_crop():
    """datasets.coco.IoUCrop (the faster trial loop) against torchvision's RandomIoUCrop: the same
    parameters and the same random state afterwards, on 400 random canvases and box sets (tiny,
    thin, overlapping, past the border), XYXY and CXCYWH."""
    from datasets.coco import IoUCrop
    ours, theirs = IoUCrop(), T.RandomIoUCrop()
    g = torch.Generator().manual_seed(0)
    cropped = 0
    for case in range(400):
        h, w = (int(v) for v in torch.randint(8, 400, (2,), generator=g))
        n = int(torch.randint(1, 7, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w, h]) * 1.1 - 5
        wh = torch.rand(n, 2, generator=g) ** 3 * torch.tensor([w, h])
        fmt = ("XYXY", "CXCYWH")[case % 2]
        data = torch.cat([xy, xy + wh], 1) if fmt == "XYXY" else torch.cat([xy, wh], 1)
        boxes = tv_tensors.BoundingBoxes(data, format=fmt, canvas_size=(h, w))
        flat = [tv_tensors.Image(torch.zeros(3, h, w, dtype=torch.uint8)), boxes]
        torch.manual_seed(case)
        a = ours.make_params(flat)
        after = torch.random.get_rng_state()
        torch.manual_seed(case)
        b = theirs.make_params(flat)
        assert torch.equal(after, torch.random.get_rng_state()), case
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a), case
        cropped += bool(a)
    assert 100 < cropped < 400  # both outcomes: a crop, and the sample kept whole
