"""Panoptic FPN: fusion rules, torchvision Mask R-CNN weights, semantic targets through the
transform, training steps on edge cases, eval outputs."""
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torchvision.models.detection import maskrcnn_resnet50_fpn, maskrcnn_resnet50_fpn_v2
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import FrozenBatchNorm2d

import datasets.coco_panoptic  # noqa: F401  (registers shapes_panoptic)
from engine.registry import DATASETS, MODELS
from models.panoptic import PanopticTransform, panoptic_fusion, semantic_loss

STUFF = [4, 5]  # labels 1..3 things, 4..5 stuff


def square(h, w, y0, y1, x0, x1, value=1.0):
    m = torch.zeros(h, w)
    m[y0:y1, x0:x1] = value
    return m


def fuse(masks, scores, labels, semantic, **kwargs):
    kwargs.setdefault("stuff_area_thresh", 10)
    return panoptic_fusion(torch.stack(masks), torch.tensor(scores), torch.tensor(labels), semantic, STUFF, **kwargs)


def test_fusion_overlapping_instances_in_score_order():
    semantic = torch.zeros(20, 20, dtype=torch.long)
    a = square(20, 20, 0, 10, 0, 10)            # 100 px, score 0.9
    b = square(20, 20, 0, 10, 6, 16)            # 100 px, 40 on a: 40% taken -> kept with its 60 free px
    c = square(20, 20, 0, 10, 2, 12)            # 100 px, all taken -> dropped
    pan, segs = fuse([b, a, c], [0.8, 0.9, 0.7], [2, 1, 3], semantic)
    assert [(s["category_id"], s["area"], s["isthing"]) for s in segs] == [(1, 100, True), (2, 60, True)]
    assert (pan[:10, :10] == 1).all() and (pan[:10, 10:16] == 2).all() and (pan[10:] == 0).all()
    assert segs[0]["score"] == pytest.approx(0.9)
    # more than half taken -> dropped (overlap 60 of 100 > 0.5)
    d = square(20, 20, 0, 10, 4, 14)
    pan, segs = fuse([a, d], [0.9, 0.8], [1, 2], semantic)
    assert [s["category_id"] for s in segs] == [1]


def test_fusion_drops_low_scores_and_binarises_masks_at_half():
    semantic = torch.full((20, 20), 4)
    weak = square(20, 20, 0, 10, 0, 10)
    soft = square(20, 20, 10, 20, 10, 20, 0.6) + square(20, 20, 10, 20, 0, 10, 0.4)  # only the 0.6 half is in
    pan, segs = fuse([weak, soft], [0.49, 0.5], [1, 2], semantic)
    assert [(s["category_id"], s["area"]) for s in segs] == [(2, 100), (4, 300)]  # the rest is stuff 4
    assert (pan[10:, 10:] == 1).all() and (pan[:10, :10] == 2).all()
    _, segs = fuse([weak], [0.49], [1], semantic, score_thresh=0.4)
    assert segs[0]["category_id"] == 1


def test_fusion_small_stuff_regions_are_void():
    semantic = torch.full((20, 20), 4)
    semantic[:3, :3] = 5                       # 9 px of stuff 5 < 10
    pan, segs = fuse([square(20, 20, 0, 1, 0, 1)], [0.1], [1], semantic)
    assert [(s["category_id"], s["area"], s["isthing"]) for s in segs] == [(4, 391, False)]
    assert (pan[:3, :3] == 0).all() and (pan == 1).sum() == 391
    _, segs = fuse([square(20, 20, 0, 1, 0, 1)], [0.1], [1], semantic, stuff_area_thresh=9)
    assert sorted(s["category_id"] for s in segs) == [4, 5]


def test_fusion_thing_classes_in_the_semantic_output_stay_void():
    semantic = torch.full((20, 20), 4)
    semantic[:, 10:] = 2                       # a thing class ('all' head) where no instance was kept
    semantic[:5, :5] = 0                       # the "things" class ('stuff' head)
    pan, segs = fuse([square(20, 20, 0, 1, 0, 1)], [0.2], [1], semantic)
    assert [(s["category_id"], s["area"]) for s in segs] == [(4, 175)]
    assert (pan[:, 10:] == 0).all() and (pan[:5, :5] == 0).all()


def test_fusion_with_no_instances_and_ids_consistent():
    semantic = torch.full((8, 8), 5)
    pan, segs = panoptic_fusion(torch.zeros(0, 1, 8, 8), torch.zeros(0), torch.zeros(0, dtype=torch.long), semantic,
                                STUFF, stuff_area_thresh=1)
    assert pan.dtype == torch.int32 and segs == [{"id": 1, "category_id": 5, "isthing": False, "score": 1.0,
                                                  "area": 64}]


# ---------------------------------------------------------------- weights

@pytest.mark.slow
def test_torchvision_maskrcnn_state_dict_loads_with_only_the_semantic_head_missing(tmp_path):
    torch.manual_seed(0)
    reference = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=91)
    path = tmp_path / "maskrcnn.pth"
    torch.save(reference.state_dict(), path)
    model = MODELS.build("panoptic_fpn_resnet50", num_classes=91, num_stuff_classes=53, weights=str(path))
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(set(ours) - set(theirs)) == sorted(k for k in ours if k.startswith("semantic_head."))
    assert set(theirs) - set(ours) == {k for k in theirs if k.endswith("num_batches_tracked")}  # frozen BN
    for k in ours:
        if k in theirs:
            assert torch.equal(ours[k], theirs[k]), k
    assert any(k.startswith("semantic_head.") for k in ours)


@pytest.mark.slow
def test_v2_is_torchvisions_maskrcnn_v2_with_batchnorm_heads_and_trains(tmp_path):
    """panoptic_fpn_resnet50_v2 loads torchvision's maskrcnn_resnet50_fpn_v2 state dict (only the
    semantic head missing), its BatchNorm trains (not frozen), and a training step gives the loss dict."""
    torch.manual_seed(0)
    reference = maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone=None, num_classes=4)
    path = tmp_path / "maskrcnn_v2.pth"
    torch.save(reference.state_dict(), path)
    model = MODELS.build("panoptic_fpn_resnet50_v2", num_classes=4, num_stuff_classes=2, weights=str(path),
                         trainable_backbone_layers=5)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(set(ours) - set(theirs)) == sorted(k for k in ours if k.startswith("semantic_head."))
    assert set(theirs) <= set(ours) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    norms = [type(m) for m in model.modules() if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, FrozenBatchNorm2d))]
    assert set(norms) == {torch.nn.BatchNorm2d} and len(norms) == 53 + 8 + 4 + 4  # backbone, FPN, box head, mask head
    model = MODELS.build("panoptic_fpn_resnet50_v2", num_classes=4, num_stuff_classes=2, min_size=64, max_size=64,
                         mask_head=[16], box_head_dim=32, maskrcnn_args={"rpn_post_nms_top_n_train": 20,
                                                                         "box_batch_size_per_image": 16}).train()
    sem = torch.randint(0, 3, (64, 64), dtype=torch.uint8)
    losses = model([torch.rand(3, 64, 64), torch.rand(3, 64, 64)],
                   [target([[10, 20, 40, 50]], [2], sem), target([[5, 5, 30, 30]], [1], sem)])
    assert {"loss_classifier", "loss_mask", "loss_sem_seg"} <= set(losses)
    sum(losses.values()).backward()
    assert model.roi_heads.mask_head[0][1].weight.grad is not None


def test_offline_weights_name_says_where_to_put_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not available offline.*hub/checkpoints"):
        MODELS.build("panoptic_fpn_mobilenet_v3_large", weights_backbone="MobileNet_V3_Large_Weights.IMAGENET1K_V1")
    with pytest.raises(FileNotFoundError, match="no such file"):
        MODELS.build("panoptic_fpn_resnet50", weights=str(tmp_path / "missing.pth"))


# ---------------------------------------------------------------- transform, loss, training

def test_transform_resizes_and_pads_the_semantic_target():
    t = PanopticTransform(min_size=100, max_size=1000, image_mean=[0.0] * 3, image_std=[1.0] * 3)
    sem = torch.zeros(50, 70, dtype=torch.uint8)
    sem[:, 35:] = 3
    sem[:10] = 255
    images, targets = t([torch.rand(3, 50, 70), torch.rand(3, 40, 40)],
                        [{"boxes": torch.zeros(0, 4), "sem_seg": sem},
                         {"boxes": torch.zeros(0, 4), "sem_seg": torch.ones(40, 40, dtype=torch.uint8)}])
    assert images.image_sizes == [(100, 140), (100, 100)] and images.tensors.shape[-2:] == (128, 160)
    out = targets[0]["sem_seg"]
    assert out.shape == (128, 160) and out.dtype == torch.long
    assert (out[100:] == 255).all() and (out[:, 140:] == 255).all()   # padding
    assert (out[:20, :140] == 255).all() and (out[20:100, :70] == 0).all() and (out[20:100, 70:140] == 3).all()
    assert (targets[1]["sem_seg"][:100, :100] == 1).all() and (targets[1]["sem_seg"][:, 100:] == 255).all()


def test_semantic_loss_ignores_255_and_ohem_keeps_the_hardest():
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 4, 4)
    target = torch.randint(0, 3, (1, 4, 4))
    target[0, 0] = 255
    per_pixel = F.cross_entropy(logits, target, ignore_index=255, reduction="none")[0, 1:].flatten()
    assert semantic_loss(logits, target) == pytest.approx(per_pixel.mean().item())
    k = math.ceil(0.25 * 12)
    assert semantic_loss(logits, target, ohem=0.25) == pytest.approx(per_pixel.topk(k).values.mean().item())
    empty = semantic_loss(logits.requires_grad_(), torch.full((1, 4, 4), 255))
    assert empty.item() == 0 and empty.requires_grad


def tiny_model(**kwargs):
    torch.manual_seed(0)
    args = dict(num_classes=3, num_stuff_classes=2, min_size=64, max_size=96, fpn_channels=32, sem_channels=32,
                mask_head=[16], box_head_dim=32, anchor_sizes=[8, 16, 32, 64, 128], stuff_area_thresh=1,
                box_score_thresh=0.0, instance_score_thresh=0.0,
                maskrcnn_args={"rpn_pre_nms_top_n_train": 50, "rpn_post_nms_top_n_train": 20,
                               "rpn_pre_nms_top_n_test": 50, "rpn_post_nms_top_n_test": 20,
                               "box_batch_size_per_image": 16})
    args.update(kwargs)
    return MODELS.build("panoptic_fpn_mobilenet_v3_large", **args)


def target(boxes, labels, sem):
    masks = torch.zeros(len(boxes), 64, 64, dtype=torch.uint8)
    for m, (x0, y0, x1, y1) in zip(masks, boxes):
        m[y0:y1, x0:x1] = 1
    return {"boxes": torch.tensor(boxes, dtype=torch.float).reshape(-1, 4), "labels": torch.tensor(labels,
            dtype=torch.int64), "masks": masks, "sem_seg": sem, "image_id": 1}


@pytest.mark.slow
@pytest.mark.parametrize("semantic_classes", ["stuff", "all"])
def test_training_step_without_things_and_without_valid_semantic_pixels(semantic_classes):
    model = tiny_model(semantic_classes=semantic_classes, sem_ohem=0.25)
    model.train()
    sem = torch.randint(0, 4, (64, 64), dtype=torch.uint8)
    no_things = target([], [], torch.full((64, 64), 2, dtype=torch.uint8))
    no_valid_sem = target([[8, 8, 30, 30]], [1], torch.full((64, 64), 255, dtype=torch.uint8))
    normal = target([[10, 20, 40, 50]], [2], sem)
    for batch in ([no_things], [no_valid_sem], [no_things, no_valid_sem], [normal, no_things]):
        losses = model([torch.rand(3, 64, 64) for _ in batch], batch)
        assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness",
                               "loss_rpn_box_reg", "loss_sem_seg"}
        assert all(torch.isfinite(v) for v in losses.values()), losses
        sum(losses.values()).backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    only_invalid = model([torch.rand(3, 64, 64)], [no_valid_sem])
    assert only_invalid["loss_sem_seg"].item() == 0


def test_semantic_head_classes_and_target_mapping():
    stuff, every = tiny_model(semantic_classes="stuff"), tiny_model(semantic_classes="all")
    assert stuff.semantic_head.predictor.out_channels == 3 and every.semantic_head.predictor.out_channels == 4
    data = torch.tensor([0, 1, 2, 3, 255])  # class indices (label - 1): things 0, 1; stuff 2, 3
    assert stuff.sem_target_map[data].tolist() == [0, 0, 1, 2, 255]
    assert every.sem_target_map[data].tolist() == [0, 1, 2, 3, 255]
    assert stuff.sem_to_label.tolist() == [0, 3, 4] and every.sem_to_label.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="semantic_classes"):
        tiny_model(semantic_classes="things")


def test_eval_outputs_per_image():
    model = tiny_model().eval()
    with torch.no_grad():
        out = model([torch.rand(3, 64, 64), torch.rand(3, 50, 70)])
    for o, size in zip(out, [(64, 64), (50, 70)]):
        assert {"boxes", "labels", "scores", "masks", "sem_seg", "panoptic", "segments_info"} <= set(o)
        assert o["panoptic"].shape == size and o["panoptic"].dtype == torch.int32 and o["sem_seg"].shape == size
        ids = sorted(torch.unique(o["panoptic"]).tolist())
        assert [s["id"] for s in o["segments_info"]] == [i for i in ids if i]
        for s in o["segments_info"]:
            assert (o["panoptic"] == s["id"]).sum() == s["area"]
            assert (1 <= s["category_id"] <= 2) == s["isthing"] and 1 <= s["category_id"] <= 4


def test_eval_masks_pasted_as_torchvision_does(tmp_path):
    # the model's postprocess (models.mask_paste) against torchvision's, on shapes_panoptic images:
    # an untrained mask head puts many pixels near the 0.5 threshold
    data = DATASETS.build("shapes_panoptic", root=str(tmp_path / "shapes"), num_train=1, num_val=4, image_size=64)
    images = [data.val[i][0] for i in range(len(data.val))]
    model = tiny_model(num_classes=4, num_stuff_classes=3).eval()
    with torch.no_grad():
        ours = model(images)
        model.transform.postprocess = types.MethodType(GeneralizedRCNNTransform.postprocess, model.transform)
        theirs = model(images)
    assert sum(len(o["masks"]) for o in ours) > 10
    for o, t, image in zip(ours, theirs, images):
        assert list(o) == list(t) and o["masks"].shape == (len(o["boxes"]), 1, *image.shape[-2:])
        for key in ("boxes", "labels", "scores", "masks", "sem_seg", "panoptic"):
            assert torch.equal(o[key], t[key]), key
        assert o["segments_info"] == t["segments_info"]
