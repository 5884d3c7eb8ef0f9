"""Semantic segmentation: torchvision equivalence (acceptance 1), data loaders and presets (3),
mIoU from a hand-built confusion matrix (4), parameter groups and the poly schedule."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from pycocotools.coco import COCO

from conftest import shared_data
from datasets.segmentation import (VOC_CATEGORIES_IN_COCO, VOC_CLASSES, CocoSegmentation, collate, eval_preset,
                                   train_preset)
from evaluators.segmentation import SegmentationEvaluator, confusion_matrix
from evaluators.panoptic_ids import rgb_to_id
from engine.config import OptimConfig, SchedConfig
from engine.optim import build_optimizer, build_scheduler
from engine.registry import DATASETS, MODELS
from helpers import schedule_lrs
import io

# (name, torchvision builder keyword arguments)
MODELS_UNDER_TEST = [("lraspp_mobilenet_v3_large", {}), ("deeplabv3_mobilenet_v3_large", {"aux_loss": True}),
                     ("deeplabv3_resnet50", {"aux_loss": True})]


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs", MODELS_UNDER_TEST)
def test_same_state_dict_same_outputs_as_torchvision(name, kwargs, tmp_path):
    torch.manual_seed(0)
    theirs = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None, num_classes=5,
                                                           **kwargs)
    with torch.no_grad():  # move BN statistics away from their defaults
        for m in theirs.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    torch.save(theirs.state_dict(), tmp_path / "published.pth")  # torchvision's keys, as published
    ours = MODELS.build(name, num_classes=5, weights=str(tmp_path / "published.pth"), **kwargs)
    x = torch.rand(2, 3, 40, 48, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 5, (2, 40, 48), generator=torch.Generator().manual_seed(2))
    target[:, :8] = 255  # ignored
    with torch.no_grad():
        ours.eval(), theirs.eval()
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected["out"])
        assert ours(x).shape == (2, 5, 40, 48)
        ours.train(), theirs.train()
        torch.manual_seed(4)  # DeepLabV3's ASPP has dropout
        losses = ours(x, target)
        torch.manual_seed(4)
        out = theirs(x)
    # torchvision's references/segmentation/train.py criterion: out + 0.5 x aux, ignore_index 255
    torch.testing.assert_close(losses["loss_seg"], F.cross_entropy(out["out"], target, ignore_index=255))
    if "aux" in out:
        torch.testing.assert_close(losses["loss_aux"], 0.5 * F.cross_entropy(out["aux"], target, ignore_index=255))
    else:
        assert set(losses) == {"loss_seg"}


def test_backbone_weights_offline_and_local(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError, match="mobilenet_v3_large-8738ca79") as e:
        MODELS.build("lraspp_mobilenet_v3_large", weights_backbone="MobileNet_V3_Large_Weights.IMAGENET1K_V1")
    assert str(tmp_path / "torch") in str(e.value)
    torch.manual_seed(3)
    net = torchvision.models.mobilenet_v3_large(dilated=True)
    torch.save(net.state_dict(), tmp_path / "mnv3.pth")
    model = MODELS.build("deeplabv3_mobilenet_v3_large", num_classes=3, weights_backbone=str(tmp_path / "mnv3.pth"))
    torch.testing.assert_close(model.net.backbone["0"][0].weight, net.features[0][0].weight)


def test_miou_from_a_hand_built_confusion_matrix():
    # 3 classes; class 2 is never seen (no IoU, left out of the mean); 255 is not counted
    target = torch.tensor([[0, 0, 0, 1], [1, 1, 255, 255]])
    pred = torch.tensor([[0, 0, 1, 1], [1, 0, 2, 0]])
    cm = confusion_matrix(pred, target, 3)
    assert cm.tolist() == [[2, 1, 0], [1, 2, 0], [0, 0, 0]]
    evaluator = SegmentationEvaluator(["a", "b", "c"])
    logits = F.one_hot(pred.clamp(max=2), 3).permute(2, 0, 1)[None].float()
    evaluator.update(logits, target[None])
    report = evaluator.report()
    # IoU a: 2 / (3 + 3 - 2) = 0.5; b: 2 / (3 + 3 - 2) = 0.5; c: no pixel, true or predicted
    assert report["per_class_iou"] == {"a": 0.5, "b": 0.5, "c": None}
    assert report["metrics"]["mIoU"] == pytest.approx(0.5)
    assert report["metrics"]["pixel_accuracy"] == pytest.approx(4 / 6)
    assert report["num_pixels"] == 6
    with pytest.raises(ValueError, match="outside 0..2"):
        confusion_matrix(pred, torch.full_like(target, 7), 3)


def test_evaluator_draws_coloured_target_and_prediction(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(2, 2, 8, 10, generator=g), torch.randint(0, 2, (2, 8, 10), generator=g)
    evaluator = SegmentationEvaluator(["a", "b"], num_draw=1)
    evaluator.update(logits, target)
    writer = SummaryWriter(str(tmp_path))
    evaluator.log_extras(writer, 1, "val")
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    image = acc.Images("val/segmentation_0")[0]
    assert (image.width, image.height) == (20, 8)  # ground truth | prediction
    # the first image: left its target, right its prediction, one colour per class, two distinct colours
    pixels = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
    colour = {c: pixels[:, :10][target[0].numpy() == c] for c in (0, 1)}
    assert all(len(np.unique(colour[c], axis=0)) == 1 for c in (0, 1))
    colour = {c: tuple(colour[c][0]) for c in (0, 1)}
    assert colour[0] != colour[1]
    pred = logits[0].argmax(0).numpy()
    assert all(tuple(pixels[i, 10 + j]) == colour[pred[i, j]] for i in range(8) for j in range(10))


def test_coco_masks_match_pycocotools_and_the_voc_subset_mapping():
    """Acceptance 3: for every kept instance the loader's mask is annToMask's; the semantic map
    carries the subset's labels; other categories are dropped."""
    root = shared_data("coco6")
    ann_file = os.path.join(root, "annotations", "instances_val2017.json")
    data = CocoSegmentation(os.path.join(root, "val2017"), ann_file)
    reference = COCO(ann_file)
    # the VOC subset in COCO ids -> labels 1..20 in VOC's order (torchvision's CAT_LIST)
    names = {c: reference.cats[c]["name"] for c in VOC_CATEGORIES_IN_COCO}
    assert [names[c] for c in (5, 1, 72)] == ["airplane", "person", "tv"]
    assert (data.cat_to_label[5], data.cat_to_label[1], data.cat_to_label[72]) == (1, 15, 20)
    assert (VOC_CLASSES[1], VOC_CLASSES[15], VOC_CLASSES[20]) == ("aeroplane", "person", "tvmonitor")
    kept_total = 0
    for index, image_id in enumerate(data.ids):
        anns = [a for a in reference.imgToAnns.get(image_id, []) if a["category_id"] in VOC_CATEGORIES_IN_COCO]
        labels, masks = data.instance_masks(index)
        assert len(labels) == len(anns)
        for ann, label, mask in zip(anns, labels, masks):
            assert np.array_equal(mask, reference.annToMask(ann))
            assert label == VOC_CATEGORIES_IN_COCO.index(ann["category_id"]) + 1
        semantic = data.mask(index)
        covered = np.zeros(semantic.shape, int)
        for ann in anns:
            m = reference.annToMask(ann).astype(bool)
            covered += m
        for ann in anns:  # pixels of exactly one kept instance carry its label
            m = reference.annToMask(ann).astype(bool) & (covered == 1)
            assert (semantic[m] == VOC_CATEGORIES_IN_COCO.index(ann["category_id"]) + 1).all()
        assert (semantic[covered > 1] == 255).all() and (semantic[covered == 0] == 0).all()
        kept_total += len(anns)
    assert kept_total == 27  # 10 person, 1 car, 1 motorcycle, 1 bus, 14 bottle (1 crowd); bears etc. dropped
    # another subset: labels in the order given; min_area drops images with too little of it
    bears = CocoSegmentation(os.path.join(root, "val2017"), ann_file, categories=[23, 1], min_area=1000)
    assert bears.cat_to_label == {23: 1, 1: 2}
    assert sorted(bears.ids) == sorted({a["image_id"] for a in reference.dataset["annotations"]
                                        if a["category_id"] in (23, 1)})
    assert set(np.unique(bears.mask(bears.ids.index(next(a["image_id"] for a in reference.dataset["annotations"]
                                                          if a["category_id"] == 23))))) <= {0, 1, 2, 255}
    with pytest.raises(ValueError, match="not category ids"):
        CocoSegmentation(os.path.join(root, "val2017"), ann_file, categories=[999])


def test_coco_segmentation_builder_and_missing_data(tmp_path):
    root = shared_data("coco6")
    data = DATASETS.build("coco_segmentation", root=root, train_split="val", base_size=64, crop_size=48)
    assert data.model_defaults == {"num_classes": 21} and data.classes == VOC_CLASSES
    image, mask = data.train[0]
    assert image.shape == (3, 48, 48) and mask.shape == (48, 48) and mask.dtype == torch.int64
    image, mask = data.val[0]
    assert min(image.shape[1:]) == 64 and image.shape[1:] == mask.shape
    with pytest.raises(FileNotFoundError, match="instances_train2017.json"):
        DATASETS.build("coco_segmentation", root=str(tmp_path))


def test_presets_pad_masks_with_ignore_and_flip_together():
    from torchvision import tv_tensors
    image = Image.fromarray(np.tile(np.arange(30, dtype=np.uint8)[None, :, None] * 8, (20, 1, 3)))
    mask = tv_tensors.Mask(torch.arange(30).repeat(20, 1).to(torch.uint8))
    torch.manual_seed(0)
    out_image, out_mask = train_preset(base_size=20, crop_size=64, hflip_prob=0.5)(image, mask)
    assert out_image.shape == (3, 64, 64) and out_mask.shape == (64, 64) and out_mask.dtype == torch.int64
    assert (out_mask == 255).any()  # crop larger than the resized image: padded with the ignore index
    real = out_mask != 255
    # the image column's brightness follows the mask's label (both flipped and cropped together)
    normalised = out_image[0][real]
    assert torch.corrcoef(torch.stack([normalised, out_mask[real].float()]))[0, 1] > 0.99
    image, mask = eval_preset(40)(image, mask)
    assert image.shape == (3, 40, 60) and mask.shape == (40, 60)
    batch = collate([(torch.ones(3, 4, 5), torch.zeros(4, 5, dtype=torch.long)),
                     (torch.ones(3, 6, 3), torch.ones(6, 3, dtype=torch.long))])
    assert batch[0].shape == (2, 3, 6, 5) and batch[1][0, 5, 0] == 255 and batch[0][0, 0, 5, 0] == 0


def test_voc_layout_loads_and_missing_folder_says_where(tmp_path):
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / d).mkdir(parents=True)
    for name in ("a", "b"):
        Image.fromarray(np.full((30, 40, 3), 100, np.uint8)).save(voc / "JPEGImages" / f"{name}.jpg")
        labels = np.zeros((30, 40), np.uint8)
        labels[10:20, 10:30] = 15  # person
        labels[9, 10:30] = 255     # VOC's object border
        png = Image.fromarray(labels, mode="P")
        png.putpalette([0, 0, 0] * 256)
        png.save(voc / "SegmentationClass" / f"{name}.png")
    (voc / "ImageSets" / "Segmentation" / "train.txt").write_text("a\n")
    (voc / "ImageSets" / "Segmentation" / "val.txt").write_text("b\n")
    data = DATASETS.build("voc_segmentation", root=str(tmp_path), base_size=30, crop_size=24)
    assert (len(data.train), len(data.val), data.model_defaults["num_classes"]) == (1, 1, 21)
    image, mask = data.val[0]
    assert image.shape == (3, 30, 40) and set(mask.unique().tolist()) == {0, 15, 255}
    with pytest.raises(FileNotFoundError, match="VOCdevkit/VOC2012/JPEGImages"):
        DATASETS.build("voc_segmentation", root=str(tmp_path / "nowhere"))


def test_shapes_semantic_map_follows_the_panoptic_pngs(tmp_path):
    data = DATASETS.build("shapes_semantic", root=str(tmp_path / "shapes"), num_train=4, num_val=3, image_size=64)
    assert data.classes == ["circle", "square", "triangle", "sky", "ground", "water"]
    val = data.val
    for index in range(len(val)):
        ann = val.annotations[index]
        ids = rgb_to_id(np.array(Image.open(os.path.join(val.png_folder, ann["file_name"]))))
        semantic = val.mask(index)
        assert (semantic != 255).all()  # shapes has no void pixel
        for seg in ann["segments_info"]:
            assert (semantic[ids == seg["id"]] == data.classes.index(
                next(c["name"] for c in val.categories if c["id"] == seg["category_id"]))).all()
    image, mask = data.val[0]
    assert image.shape[1:] == mask.shape and min(mask.shape) == 64


def test_param_group_rules_set_lr_and_weight_decay_by_name():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 2, 1))
    cfg = OptimConfig(lr=0.1, weight_decay=1e-4, norm_weight_decay=0.0, param_groups=[
        {"params": ["2.*"], "lr_mult": 10}, {"params": ["0.bias", "2.bias"], "weight_decay": 0.5}])
    opt = build_optimizer(model, cfg)
    found = {}
    for group in opt.param_groups:
        for p in group["params"]:
            name = next(n for n, q in model.named_parameters() if q is p)
            found[name] = (group["lr"], group["weight_decay"])
    assert found == {"0.weight": (0.1, 1e-4), "0.bias": (0.1, 0.5),  # second rule
                     "1.weight": (0.1, 0.0), "1.bias": (0.1, 0.0),   # norm_weight_decay still applies
                     "2.weight": (1.0, 1e-4), "2.bias": (1.0, 1e-4)}  # first matching rule wins
    sched = build_scheduler(opt, SchedConfig(name="poly", power=0.9), 2, 5)
    for _ in range(5):
        sched.step()
    lrs = sorted({round(g["lr"], 12) for g in opt.param_groups})  # each group scaled from its own lr
    assert lrs == pytest.approx([0.1 * 0.5 ** 0.9, 1.0 * 0.5 ** 0.9])
    with pytest.raises(ValueError, match=r"param_groups\[0\].*match no parameter"):
        build_optimizer(model, OptimConfig(lr=0.1, param_groups=[{"params": ["classifier.*"]}]))


def test_poly_schedule_with_and_without_warmup():
    def lrs(cfg):
        return schedule_lrs(cfg, epochs=3, iters_per_epoch=10, lr=0.02)

    plain = lrs(SchedConfig(name="poly", power=0.9))
    assert plain == pytest.approx([0.02 * (1 - t / 30) ** 0.9 for t in range(30)])
    warm = lrs(SchedConfig(name="poly", power=0.9, warmup_epochs=1, warmup_start_factor=0.01))
    assert warm[0] == pytest.approx(0.02 * 0.01) and warm[5] < warm[9] < 0.02
    assert warm[10:] == pytest.approx([0.02 * (1 - t / 20) ** 0.9 for t in range(20)])  # poly after warm-up
