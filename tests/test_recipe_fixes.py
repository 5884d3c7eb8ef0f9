"""Recipe fidelity fixes (issue 11): warm-up modes, box clamping, PTQ calibration transform,
detector weights and contiguous labels, trainable backbone layers, checkpoint averaging."""
import json
import os

import pytest
import torch
from torchvision.models.detection import ssdlite320_mobilenet_v3_large
from torchvision.transforms import v2 as T

from conftest import shared_data
from engine.config import config_from_data
from engine.registry import DATASETS, MODELS
from helpers import schedule_lrs


# ---------------------------------------------------------------- item 2: warm-up modes

def lrs(sched_cfg):
    return schedule_lrs(sched_cfg, epochs=4, iters_per_epoch=10)


def sched(**kwargs):
    base = {"model": {"name": "mobilenet_v3_small"}, "data": {"name": "synthetic_classification", "batch_size": 2},
            "optim": {"lr": 1.0}, "train": {"epochs": 4}}
    return config_from_data({**base, "sched": kwargs}).sched


def test_warmup_chain_shifts_the_schedule_overlay_does_not():
    common = dict(name="multistep", milestones=[2], gamma=0.1, warmup_iters=5, warmup_start_factor=0.5)
    chain, overlay = lrs(sched(**common, warmup_mode="chain")), lrs(sched(**common, warmup_mode="overlay"))
    ramp = [0.5 + 0.5 * i / 5 for i in range(5)]
    assert chain[:5] == pytest.approx(ramp) and overlay[:5] == pytest.approx(ramp)
    # chain (torchvision classification): the milestone counts from the end of the warm-up
    assert chain[24] == 1.0 and chain[25] == pytest.approx(0.1)
    # overlay (torchvision detection): milestone at epoch 2 = iteration 20, as without warm-up
    assert overlay[19] == 1.0 and overlay[20] == pytest.approx(0.1)
    assert overlay[20:] == lrs(sched(name="multistep", milestones=[2], gamma=0.1))[20:]
    # overlay is capped at len(loader) - 1 iterations of epoch 0 (references/detection/engine.py)
    capped = lrs(sched(name="constant", warmup_iters=1000, warmup_start_factor=0.001, warmup_mode="overlay"))
    assert capped[8] == pytest.approx(0.001 + 0.999 * 8 / 9) and capped[9:] == [1.0] * 31
    # cosine under overlay: the product of the ramp and the cosine counted from 0
    cosine = lrs(sched(name="cosine", warmup_iters=5, warmup_start_factor=0.5, warmup_mode="overlay"))
    plain = lrs(sched(name="cosine"))
    assert cosine[:5] == pytest.approx([r * p for r, p in zip(ramp, plain[:5])]) and cosine[5:] == pytest.approx(plain[5:])
    with pytest.raises(ValueError, match="warmup_iters or warmup_epochs"):
        lrs(sched(warmup_iters=5, warmup_epochs=1))


# ---------------------------------------------------------------- item 5: boxes clamped, then sanitized

def coco6_with_boxes_past_the_border(tmp_path):
    """coco6's annotations (its images) with 3 boxes stretched past the border, as some of COCO's are,
    and 1 moved fully outside the image."""
    root = shared_data("coco6")
    with open(os.path.join(root, "annotations", "instances_val2017.json")) as f:
        coco = json.load(f)
    sizes = {im["id"]: (im["width"], im["height"]) for im in coco["images"]}
    anns = [a for a in coco["annotations"] if not a["iscrowd"]]
    for a in anns[:3]:  # right edge 2.5 px past the border
        w, _ = sizes[a["image_id"]]
        a["bbox"][2] = w - a["bbox"][0] + 2.5
    w, _ = sizes[anns[3]["image_id"]]
    anns[3]["bbox"][0] = w + 5.0  # fully outside: degenerate once clamped
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(coco))
    return os.path.join(root, "val2017"), str(path), {a["id"] for a in anns[:3]}


def count_changes(img_folder, ann_file, augmentation):
    """(boxes in the annotations file, boxes changed by clamping, boxes dropped) through the loader
    (which clamps at load time and counts it in box_issues) and the train preset `augmentation`."""
    from datasets.coco import CocoDetectionDataset, train_preset
    with open(ann_file) as f:
        total = sum(1 for a in json.load(f)["annotations"] if not a["iscrowd"])
    raw = CocoDetectionDataset(img_folder, ann_file)
    changed = sum(len(ids) for problem, ids in raw.box_issues.items() if "clamp" in problem)
    preset = train_preset(augmentation)
    kept = 0
    for index in range(len(raw)):
        image, target = raw[index]
        torch.manual_seed(index)
        kept += len(preset(image, target)[1]["boxes"])
    return total, changed, total - kept


@pytest.mark.parametrize("augmentation", ["none", "hflip"])
def test_boxes_past_the_border_are_clamped_not_dropped(tmp_path, augmentation):
    root = shared_data("coco6")
    # coco6 as it is: no box pokes out, nothing is changed or dropped
    assert count_changes(os.path.join(root, "val2017"), os.path.join(root, "annotations", "instances_val2017.json"),
                         augmentation) == (35, 0, 0)
    # 3 boxes past the border: clamped and kept; the one fully outside: dropped (degenerate)
    img_folder, ann_file, stretched = coco6_with_boxes_past_the_border(tmp_path)
    assert count_changes(img_folder, ann_file, augmentation) == (35, 4, 1)
    from datasets.coco import CocoDetectionDataset, train_preset
    data = CocoDetectionDataset(img_folder, ann_file, train_preset("none"))
    for index in range(len(data)):
        image, target = data[index]
        h, w = image.shape[-2:]
        assert (target["boxes"][:, 2] <= w).all() and (target["boxes"][:, 0] >= 0).all()
    stretched_images = {a["image_id"] for a in data.coco.loadAnns(list(stretched))}
    for image_id in stretched_images:
        index = data.image_ids.index(image_id)
        image, target = data[index]
        assert (target["boxes"][:, 2] == image.shape[-1]).any()  # clamped to the right edge


# ---------------------------------------------------------------- item 6: PTQ calibration transform

def classification_config(**extra):
    return config_from_data({
        "seed": 0, "device": "cpu",
        "model": {"name": "mobilenet_v3_small", "dropout": 0.0},
        "data": {"name": "synthetic_classification", "num_classes": 3, "train_size": 16, "val_size": 8,
                 "image_size": 32, "batch_size": 4, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.01}, "train": {"epochs": 1}, **extra})


def test_ptq_calibrates_on_training_images_with_the_eval_transform(tmp_path):
    from engine.checkpoint import load_checkpoint, save_checkpoint
    from artifacts.load import load_int8 as load_artifact
    from artifacts.quantization import calibration_loader
    import quantize
    cfg = classification_config()
    data = DATASETS.build(cfg.data.name, **cfg.data.model_extra)
    train_transform = data.train.transform
    loader = calibration_loader(data, batch_size=4, seed=0)
    assert data.train.transform is train_transform  # the training set keeps its augmentation
    calib = loader.dataset
    assert len(calib) == len(data.train) and calib.transform is data.val.transform
    data.train.transform = None
    image, label = data.train[5]
    data.train.transform = train_transform
    x, y = calib[5]
    assert y == label and torch.equal(x, data.val.transform(image))  # the train image, eval preprocessing
    torch.manual_seed(0)
    assert not torch.equal(data.train[5][0], x)  # (the training preset would have cropped / flipped it)
    with pytest.raises(ValueError, match="eval or train"):
        calibration_loader(data, 4, transform="val")
    # quantize.py: eval transform by default, recorded in the artifact
    model = MODELS.build("mobilenet_v3_small", num_classes=3, dropout=0.0)
    save_checkpoint({"model": model.state_dict(), "config": cfg.model_dump(mode="json"), "epoch": 0},
                    str(tmp_path / "fp32.pt"))
    _, path = quantize.main(["--checkpoint", str(tmp_path / "fp32.pt"), "--calib-batches", "2"])
    assert load_artifact(path)[1]["calibration_transform"] == "eval"
    assert load_checkpoint(str(tmp_path / "fp32.pt"))["epoch"] == 0


# ---------------------------------------------------------------- item 7: COCO detector weights

def test_coco_detector_weights_for_other_classes_reset_the_head_or_stop_when_told(tmp_path, monkeypatch):
    """torchvision's COCO SSDlite (a random-init stand-in at the path the weights name resolves to):
    for 81 classes the head starts anew (model.new_classes: auto) and the backbone loads; with
    new_classes: false it stops naming the class counts; 91 load whole."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    folder = tmp_path / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    reference = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=91)
    torch.save(reference.state_dict(), folder / "ssdlite320_mobilenet_v3_large_coco-a79551df.pth")
    name = "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"
    with pytest.raises(ValueError, match=r"new_classes=auto") as e:
        MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=81, weights=name, new_classes=False)
    assert "num_classes=81" in str(e.value) and "file: 91 class names" in str(e.value)
    model81 = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=81, weights=name)
    key = "backbone.features.0.0.0.weight"
    assert torch.equal(model81.state_dict()[key], reference.state_dict()[key])
    model = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=91, weights=name)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


# ---------------------------------------------------------------- item 8: trainable layers without weights

def test_trainable_backbone_layers_without_weights_trains_every_layer():
    """torchvision's _validate_trainable_layers: without pretrained weights, warn and train all."""
    with pytest.warns(UserWarning, match="trainable_backbone_layers=1 has no effect"):
        model = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=3, trainable_backbone_layers=1)
    assert all(p.requires_grad for p in model.backbone.parameters())
    with pytest.raises(ValueError, match="0..6"):
        MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=3, trainable_backbone_layers=7)


def test_trainable_backbone_layers_with_backbone_weights_freezes(tmp_path):
    from torchvision.models import mobilenetv3
    torch.save(mobilenetv3.mobilenet_v3_large().state_dict(), tmp_path / "mnv3.pth")
    model = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=3, trainable_backbone_layers=1,
                         weights_backbone=str(tmp_path / "mnv3.pth"))
    # MobileNetV3-Large's 6 stages (torchvision's _mobilenet_extractor: the stem, the 4 stride-2 blocks, the
    # last layer): 1 trainable = its last layer alone (the 1x1 conv to 960 channels), plus SSDlite's extra layers
    last = model.backbone.features[1][-1]
    assert last[0].out_channels == 960
    trainable = {id(p) for p in model.backbone.parameters() if p.requires_grad}
    assert trainable == {id(p) for m in (last, model.backbone.extra) for p in m.parameters()}


# ---------------------------------------------------------------- item 9: checkpoint averaging

def test_average_checkpoints_writes_a_loadable_average(tmp_path):
    import average_checkpoints
    import evaluate
    from engine.checkpoint import save_checkpoint
    cfg = classification_config()
    paths, states = [], []
    for i, batches in enumerate((10, 11, 13)):
        torch.manual_seed(i)
        model = MODELS.build("mobilenet_v3_small", num_classes=3, dropout=0.0)
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        bn.running_mean.normal_()
        bn.num_batches_tracked.fill_(batches)
        state = {"model": model.state_dict(), "config": cfg.model_dump(mode="json"), "epoch": i, "step": 10 * i,
                 "optimizer": {"state": {}, "param_groups": []},
                 "recipes": {"ema": {"module.w": torch.full((2,), float(i)), "n_averaged": torch.tensor(i + 1)}}}
        paths.append(str(tmp_path / f"best_{i}.pt"))
        save_checkpoint(state, paths[-1])
        states.append(state["model"])
    out = average_checkpoints.main([*paths, "--output", str(tmp_path / "avg.pt")])
    avg = torch.load(out, map_location="cpu", weights_only=True)
    assert avg["epoch"] == 2 and avg["averaged_from"] == paths and "optimizer" not in avg
    for key, value in avg["model"].items():
        if value.is_floating_point():  # weights and BatchNorm running statistics: the mean
            torch.testing.assert_close(value, sum(s[key] for s in states) / 3)
        else:  # num_batches_tracked: floor of the mean, as torchvision's average_checkpoints
            assert torch.equal(value, sum(s[key] for s in states) // 3)
    assert avg["recipes"]["ema"]["module.w"].tolist() == [1.0, 1.0] and int(avg["recipes"]["ema"]["n_averaged"]) == 2
    bn_key = next(k for k in avg["model"] if k.endswith("num_batches_tracked") and avg["model"][k] > 0)
    assert int(avg["model"][bn_key]) == (10 + 11 + 13) // 3
    report = evaluate.main(["--checkpoint", out, "--report-dir", str(tmp_path / "report")])
    assert report["num_samples"] == 8
    other = dict(torch.load(paths[0], weights_only=True))
    other["model"] = {k: v for k, v in other["model"].items() if not k.startswith("net.classifier")}
    save_checkpoint(other, str(tmp_path / "other.pt"))
    with pytest.raises(SystemExit, match="missing"):
        average_checkpoints.main([paths[1], str(tmp_path / "other.pt"), "--output", str(tmp_path / "x.pt")])
    with pytest.raises(SystemExit, match="at least two"):
        average_checkpoints.main([paths[0], "--output", str(tmp_path / "x.pt")])
