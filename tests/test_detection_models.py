"""SSD builders: torchvision equivalence, initialisation, offline weights, overfitting (acceptance 3)."""
import math

import pytest
import torch
from torchvision.models import mobilenetv3
from torchvision.models.detection import ssd300_vgg16 as tv_ssd300
from torchvision.models.detection import ssdlite320_mobilenet_v3_large as tv_ssdlite

from conftest import shared_data
from engine.registry import DATASETS, MODELS
from helpers import detection_images, detection_targets


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("ssd300_vgg16", tv_ssd300),
                                             ("ssdlite320_mobilenet_v3_large", tv_ssdlite)])
def test_same_state_dict_same_outputs_as_torchvision(name, reference):
    torch.manual_seed(0)
    ours = MODELS.build(name, num_classes=4, score_thresh=0.0)
    theirs = reference(weights=None, weights_backbone=None, num_classes=4, score_thresh=0.0)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # same keys, same shapes
    with torch.no_grad():
        for m in (ours, theirs):  # move BN statistics away from their defaults, identically
            for p in m.modules():
                if isinstance(p, torch.nn.BatchNorm2d):
                    p.running_mean.fill_(0.01)
                    p.running_var.fill_(1.5)
        ours.eval(), theirs.eval()
        a, b = ours(detection_images()), theirs(detection_images())
    assert len(a[0]["boxes"]) > 0
    for pa, pb in zip(a, b):
        for key in ("boxes", "scores", "labels"):
            torch.testing.assert_close(pa[key], pb[key])
    ours.train(), theirs.train()
    la, lb = ours(detection_images(), detection_targets()), theirs(detection_images(), detection_targets())
    assert set(la) == {"bbox_regression", "classification"}
    for key in la:
        torch.testing.assert_close(la[key], lb[key])


@pytest.mark.slow
def test_ssd300_xavier_init_without_backbone_weights():
    model = MODELS.build("ssd300_vgg16", num_classes=5)
    fc = model.backbone.extra[0][-1]  # conv6 (atrous) and conv7, new in SSD
    new_convs = [m for m in fc.modules() if isinstance(m, torch.nn.Conv2d)]
    new_convs += [m for m in model.backbone.extra[1:].modules() if isinstance(m, torch.nn.Conv2d)]
    new_convs += [m for m in model.head.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(new_convs) == 2 + 8 + 12
    for conv in new_convs:
        assert torch.all(conv.bias == 0)
        fan_in = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
        fan_out = conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
        bound = math.sqrt(6.0 / (fan_in + fan_out))  # xavier_uniform_
        assert conv.weight.abs().max() <= bound + 1e-6
        assert conv.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.15)
    assert all(p.requires_grad for p in model.parameters())  # from scratch: nothing frozen


def test_weights_offline_errors_and_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError, match="vgg16_features-amdegroot") as e:
        MODELS.build("ssd300_vgg16", num_classes=3, weights_backbone="VGG16_Weights.IMAGENET1K_FEATURES")
    assert str(tmp_path / "torch") in str(e.value) and "Download" in str(e.value)
    with pytest.raises(FileNotFoundError, match="no such file"):
        MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=3, weights="missing/ssdlite.pth")
    # a local backbone file: loaded, full MobileNetV3 tail (reduced only from scratch), layers trainable
    torch.manual_seed(1)
    net = mobilenetv3.mobilenet_v3_large()
    torch.save(net.state_dict(), tmp_path / "mnv3.pth")
    model = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=3, weights_backbone=str(tmp_path / "mnv3.pth"))
    torch.testing.assert_close(model.backbone.features[0][0][0].weight, net.features[0][0].weight)
    assert model.backbone.features[1][-1].out_channels == 960  # not the reduced tail (480)
    # a whole detector from a local file gives the same predictions
    ref = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=3, score_thresh=0.0).eval()
    torch.save(ref.state_dict(), tmp_path / "det.pth")
    again = MODELS.build("ssdlite320_mobilenet_v3_large", num_classes=3, score_thresh=0.0,
                         weights=str(tmp_path / "det.pth")).eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(detection_images())[0]["scores"], again(detection_images())[0]["scores"])


@pytest.mark.slow
def test_overfits_two_coco6_images():
    """Acceptance 3: 40 steps on two coco6 images at least halve the total loss."""
    data = DATASETS.build("coco_detection", root=shared_data("coco6"), train_split="val", val_split="val",
                          augmentation="none")
    batch = data.collate_fn([data.train[0], data.train[1]])
    torch.manual_seed(0)
    model = MODELS.build("ssdlite320_mobilenet_v3_large", **data.model_defaults).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(40):
        loss = sum(model(*batch).values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] <= 0.5 * losses[0], losses
