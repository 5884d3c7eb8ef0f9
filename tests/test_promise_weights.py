"""The COCO pretrained-weights path, offline: a weights file in torchvision's format (a torchvision
model's state_dict saved with torch.save) under the hub file name that the weights name resolves to,
in $TORCH_HOME/hub/checkpoints. The project's model loads it exactly, and predict.py with it gives the
detections that torchvision's own model gives with the same weights."""
import os

import pytest
import torch
import torchvision
from PIL import Image
from torchvision.transforms.functional import to_tensor

import predict
from conftest import ROOT, shared_data
from engine.registry import MODELS

WEIGHTS = "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"
THRESH = 0.5


def _photos(folder):
    images = []
    for name in sorted(os.listdir(folder)):
        with Image.open(os.path.join(folder, name)) as image:
            images.append(to_tensor(image.convert("RGB")))
    return images


@pytest.fixture
def published(tmp_path, monkeypatch):
    """torchvision's SSDlite with random weights whose detections differ by image (BatchNorm statistics
    measured on the photos: with the initial ones every image gives the same tied scores), saved as the
    published file; TORCH_HOME points at it. Returns torchvision's model (eval mode)."""
    torch.manual_seed(0)
    theirs = torchvision.models.detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None).eval()
    images = _photos(shared_data("photos"))
    with torch.no_grad():
        norms = [m for m in theirs.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        for m in norms:
            m.train(), m.reset_running_stats()
            m.momentum = None  # the plain average over the batch
        theirs(images + [x.flip(-1) for x in images])
        for m in norms:
            m.eval()
        for conv in theirs.head.classification_head.module_list:  # wider score range: clear winners
            conv[1].weight.mul_(2)
    url = torchvision.models.get_weight(WEIGHTS).url
    folder = tmp_path / "torch_home" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(theirs.state_dict(), folder / os.path.basename(url))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    return theirs.eval()


@pytest.mark.slow
def test_weights_named_by_torchvision_load_exactly_and_predict_as_torchvision(published, tmp_path, monkeypatch):
    ours = MODELS.build("ssdlite320_mobilenet_v3_large", weights=WEIGHTS)
    theirs_state, ours_state = published.state_dict(), ours.state_dict()
    assert set(ours_state) == set(theirs_state)
    for k, v in theirs_state.items():
        assert torch.equal(ours_state[k], v), k

    photos = shared_data("photos")
    monkeypatch.chdir(ROOT)
    results = predict.main(["--config", os.path.join("configs", "ssdlite320.yaml"), "--set", f"model.weights={WEIGHTS}",
                            "data.contiguous_labels=false", "--output", str(tmp_path / "out"), "--score-thresh",
                            str(THRESH), photos])
    categories = torchvision.models.get_weight(WEIGHTS).meta["categories"]
    assert len(results) == len(os.listdir(photos))
    compared = 0
    for r, x in zip(results, _photos(photos)):
        with torch.no_grad():
            expected = published([x])[0]
        keep = expected["scores"] >= THRESH
        want = zip([categories[i] for i in expected["labels"][keep].tolist()], expected["scores"][keep].tolist(),
                   expected["boxes"][keep].tolist())
        got = [(d["label"], d["score"], d["bbox_xyxy"]) for d in r["detections"]]
        assert len(got) == int(keep.sum()), r["input"]
        for label, score, box in want:  # each of torchvision's detections, once, in any order (near-ties)
            same = [d for d in got if d[0] == label and d[1] == pytest.approx(score, abs=1e-3)
                    and d[2] == pytest.approx(box, abs=0.05)]
            assert same, (r["input"], label, score, box)
            got.remove(same[0])
        compared += int(keep.sum())
    assert 10 <= compared < 300  # detections to compare, all above the threshold (not cut at 300)
