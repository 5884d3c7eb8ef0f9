"""Panoptic FPN: torchvision's Mask R-CNN plus a semantic head, fused into one panoptic map.

As Kirillov et al. 2019 (detectron2's Panoptic FPN) and Porzi et al. 2019 (Mapillary's Seamless
Scene Segmentation). `PanopticFPN` subclasses torchvision's `MaskRCNN`, so the `backbone.*`,
`rpn.*` and `roi_heads.*` state-dict keys are torchvision's and COCO Mask R-CNN weights load with
only `semantic_head.*` missing.

Label spaces (see datasets/coco_panoptic.py): thing categories are labels 1..T (the detector's
classes, 0 = background), stuff categories T+1..T+S. The data's semantic target holds class
indices 0..T+S-1 (= label - 1), 255 for void and crowd. `semantic_classes` picks what the head
predicts:
  - "all" (seamseg): every thing and stuff class, T+S outputs;
  - "stuff" (detectron2): one "things" class (0) plus the S stuff classes, S+1 outputs.

Training returns torchvision's five losses plus `loss_sem_seg` (cross-entropy, ignore 255,
optional OHEM, times `sem_loss_weight`). Eval returns per image torchvision's boxes, labels,
scores, masks plus `sem_seg` (H x W category labels; 0 where the "stuff" head says "things"),
`panoptic` (H x W int32 segment ids, 0 = void) and `segments_info`.

Export (exporters/panoptic.py): `PanopticFPN.unfused`, the eval forward up to the fusion, is the ONNX
graph of one image; the fusion runs after it (runtime/panoptic.py: the same fusion in numpy).
"""
import math
from typing import Union
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import mobilenetv3, resnet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.rpn import RPNHead
from torchvision.models.detection.backbone_utils import _mobilenet_extractor, _resnet_fpn_extractor
from torchvision.models.detection.faster_rcnn import FastRCNNConvFCHead, FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNN, MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool

from engine.config import ConfigError
from engine.registry import MODELS, Range
from engine.transfer import Rows, SemanticRows
from models.backbones import pretrained_body
from models.faster_rcnn import NOT_EXPORTED
from models.mask_paste import paste_masks
from runtime.panoptic import panoptic_fusion as fusion_in_numpy
IGNORE = 255


# ---------------------------------------------------------------- semantic head and loss

class SemanticHead(nn.Module):
    """Panoptic FPN's semantic branch: each FPN level of stride 4..32 goes through 3x3 conv + GN +
    ReLU (+ 2x bilinear upsampling) stages until stride 4; the levels are summed and a 1x1 conv
    predicts the classes at stride 4."""

    def __init__(self, in_channels, num_classes, num_levels=4, channels=128, groups=32):
        super().__init__()
        self.scale_heads = nn.ModuleList()
        for level in range(num_levels):
            stages = []
            for k in range(max(1, level)):
                stages += [nn.Conv2d(in_channels if k == 0 else channels, channels, 3, padding=1, bias=False),
                           nn.GroupNorm(groups, channels), nn.ReLU(inplace=True)]
                if level > 0:
                    stages.append(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False))
            self.scale_heads.append(nn.Sequential(*stages))
        self.predictor = nn.Conv2d(channels, num_classes, 1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        nn.init.normal_(self.predictor.weight, std=0.001)
        nn.init.zeros_(self.predictor.bias)

    def forward(self, features):
        size = features[0].shape[-2:]
        out = 0
        for head, x in zip(self.scale_heads, features):
            x = head(x)
            if x.shape[-2:] != size:  # odd sizes (no size_divisible padding)
                x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
            out = out + x
        return self.predictor(out)


def semantic_loss(logits, target, ohem=None):
    """Cross-entropy over the valid pixels (target != 255), averaged per image then over images.
    ohem: keep only that fraction of each image's hardest valid pixels (seamseg: 0.25). An image
    with no valid pixel adds zero (still connected to the graph, so DDP sees every parameter)."""
    losses = []
    for lg, tg in zip(logits, target):
        loss = F.cross_entropy(lg[None], tg[None], ignore_index=IGNORE, reduction="none").flatten()
        loss = loss[tg.flatten() != IGNORE]
        if loss.numel() == 0:
            losses.append(lg.sum() * 0.0)
            continue
        if ohem is not None and ohem < 1:
            loss = loss.topk(max(1, math.ceil(ohem * loss.numel()))).values
        losses.append(loss.mean())
    return torch.stack(losses).mean()


# ---------------------------------------------------------------- panoptic fusion

@torch.no_grad()
def panoptic_fusion(masks, scores, labels, semantic, stuff_labels, semantic_scores=None, **settings):
    """runtime.panoptic.panoptic_fusion (Panoptic FPN's heuristic, in numpy: the one implementation,
    which an exported model's runner uses too) on tensors: (panoptic [H, W] int32 on semantic's device,
    segments_info). settings: score_thresh, mask_thresh, overlap_thresh, stuff_area_thresh."""
    arrays = [None if t is None else t.detach().cpu().numpy() for t in (masks, scores, labels, semantic,
                                                                         semantic_scores)]
    ids, segments = fusion_in_numpy(*arrays[:4], stuff_labels, arrays[4], **settings)
    return torch.from_numpy(ids).to(semantic.device), segments


# ---------------------------------------------------------------- the model

class PanopticTransform(GeneralizedRCNNTransform):
    """torchvision's resize + normalise + pad, and the same for the semantic target: resized
    (nearest) to each image's new size and padded with 255 to the batch's padded size. In eval,
    torchvision's postprocess with masks pasted by `models.mask_paste.paste_masks`."""

    def forward(self, images, targets=None):
        semantic = None
        if targets is not None and all("sem_seg" in t for t in targets):
            semantic = [t["sem_seg"] for t in targets]
            targets = [{k: v for k, v in t.items() if k != "sem_seg"} for t in targets]
        image_list, targets = super().forward(images, targets)
        if semantic is not None:
            batch = image_list.tensors
            padded = torch.full((batch.shape[0], *batch.shape[-2:]), IGNORE, dtype=torch.long, device=batch.device)
            for i, (sem, (h, w)) in enumerate(zip(semantic, image_list.image_sizes)):
                sem = sem.reshape(1, 1, *sem.shape[-2:]).float()
                padded[i, :h, :w] = F.interpolate(sem, size=(h, w), mode="nearest")[0, 0].long()
            for target, sem in zip(targets, padded):
                target["sem_seg"] = sem
        return image_list, targets

    def postprocess(self, result, image_shapes, original_image_sizes):
        """torchvision's (boxes back to the original sizes, masks pasted into the images), with the
        masks pasted by `paste_masks`: the same values without the per-detection overhead."""
        if self.training or not all("masks" in r for r in result):
            return super().postprocess(result, image_shapes, original_image_sizes)
        masks = [r.pop("masks") for r in result]
        result = super().postprocess(result, image_shapes, original_image_sizes)
        for r, m, size in zip(result, masks, original_image_sizes):
            r["masks"] = paste_masks(m, r["boxes"], size)
        return result


class PanopticFPN(MaskRCNN):
    """Mask R-CNN + a semantic head on FPN levels '0'..'3' (strides 4..32), fused per image."""

    def __init__(self, backbone, num_classes, num_stuff_classes, semantic_classes="stuff", sem_loss_weight=0.5,
                 sem_ohem=None, sem_channels=128, instance_score_thresh=0.5, mask_thresh=0.5, overlap_thresh=0.5,
                 stuff_area_thresh=4096, **maskrcnn_kwargs):
        # torchvision wants num_classes=None when the predictors are given
        super().__init__(backbone, None if "box_predictor" in maskrcnn_kwargs else num_classes, **maskrcnn_kwargs)
        if semantic_classes not in ("all", "stuff"):
            raise ConfigError(f"model.semantic_classes: expected 'all' (every thing and stuff class, seamseg) or "
                              f"'stuff' (stuff classes + one 'things' class, detectron2), got {semantic_classes!r}")
        if sem_ohem is not None and not 0 < sem_ohem <= 1:
            raise ConfigError(f"model.sem_ohem: expected a fraction in (0, 1] or null, got {sem_ohem}")
        t = self.transform
        self.transform = PanopticTransform(t.min_size, t.max_size, t.image_mean, t.image_std, t.size_divisible,
                                           t.fixed_size)
        num_things = num_classes - 1
        self.num_things, self.num_stuff = num_things, num_stuff_classes
        self.semantic_classes = semantic_classes
        self.sem_loss_weight, self.sem_ohem = sem_loss_weight, sem_ohem
        self.fusion = dict(score_thresh=instance_score_thresh, mask_thresh=mask_thresh,
                           overlap_thresh=overlap_thresh, stuff_area_thresh=stuff_area_thresh)
        num_sem = num_things + num_stuff_classes if semantic_classes == "all" else num_stuff_classes + 1
        self.semantic_head = SemanticHead(backbone.out_channels, num_sem, channels=sem_channels)
        # data class (0..T+S-1, 255) -> head class; head class -> category label (0: "things")
        target_map = torch.full((256,), IGNORE, dtype=torch.long)
        classes = torch.arange(num_things + num_stuff_classes)
        if semantic_classes == "all":
            target_map[classes] = classes
            to_label = classes + 1
        else:
            target_map[classes] = torch.where(classes < num_things, 0, classes - num_things + 1)
            to_label = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(num_stuff_classes) + num_things + 1])
        self.register_buffer("sem_target_map", target_map, persistent=False)
        self.register_buffer("sem_to_label", to_label, persistent=False)
        self.stuff_labels = list(range(num_things + 1, num_things + num_stuff_classes + 1))

    def forward(self, images, targets=None):
        if not self.training:
            detections = self.unfused(images)
            for det in detections:
                det["panoptic"], det["segments_info"] = panoptic_fusion(
                    det["masks"], det["scores"], det["labels"], det["sem_seg"], self.stuff_labels, det.pop("sem_prob"),
                    **self.fusion)
            return detections
        if targets is None or not all("sem_seg" in t and "boxes" in t for t in targets):
            raise ValueError("PanopticFPN in training mode needs targets with boxes, labels, masks and sem_seg")
        _, targets, _, _, losses, logits = self._heads(images, targets)
        target = self.sem_target_map[torch.stack([t["sem_seg"] for t in targets]).long()]
        loss = semantic_loss(logits.float(), target, self.sem_ohem)
        return {**losses, "loss_sem_seg": self.sem_loss_weight * loss}

    def _heads(self, images, targets=None):
        """(image list, targets, original sizes, detections, losses, semantic logits at the padded size)."""
        original_sizes = [tuple(img.shape[-2:]) for img in images]
        images, targets = self.transform(images, targets)
        features = self.backbone(images.tensors)
        proposals, proposal_losses = self.rpn(images, features, targets)
        detections, detector_losses = self.roi_heads(features, proposals, images.image_sizes, targets)
        logits = self.semantic_head([features[k] for k in ("0", "1", "2", "3")])
        logits = F.interpolate(logits, size=images.tensors.shape[-2:], mode="bilinear", align_corners=False)
        return images, targets, original_sizes, detections, {**proposal_losses, **detector_losses}, logits

    def unfused(self, images):
        """The eval forward up to the panoptic fusion, per image: torchvision's boxes, labels, scores,
        masks, plus sem_seg (category labels) and sem_prob (their softmax probability) at the image's
        size. The exported graph computes this (exporters/panoptic.py); the fusion runs after it."""
        image_list, _, original_sizes, detections, _, logits = self._heads(images)
        detections = self.transform.postprocess(detections, image_list.image_sizes, original_sizes)
        for det, lg, (h, w), size in zip(detections, logits, image_list.image_sizes, original_sizes):
            lg = F.interpolate(lg[None, :, :h, :w].float(), size=size, mode="bilinear", align_corners=False)[0]
            prob, cls = lg.softmax(0).max(0)
            det["sem_seg"], det["sem_prob"] = self.sem_to_label[cls], prob
        return detections


# ---------------------------------------------------------------- weights and builders

# the builders' keywords that PanopticFPN takes as they are
PASSED_ON = ("semantic_classes", "sem_loss_weight", "sem_ohem", "sem_channels", "min_size", "max_size",
             "box_score_thresh", "box_detections_per_img", "instance_score_thresh", "mask_thresh", "overlap_thresh",
             "stuff_area_thresh")


def _passed_on(args):
    """PASSED_ON's keywords of a builder's arguments (its locals())."""
    return {k: args[k] for k in PASSED_ON}


def _build(backbone, num_classes, num_stuff_classes, anchor_sizes, mask_head, box_head_dim, maskrcnn_args, **kwargs):
    extra = dict(maskrcnn_args or {})
    channels = backbone.out_channels
    if mask_head is not None or box_head_dim is not None:  # lighter heads than torchvision's
        mask_head, box_head_dim = mask_head or (256, 256, 256, 256), box_head_dim or 1024
        extra.update(mask_head=MaskRCNNHeads(channels, tuple(mask_head), 1),
                     mask_predictor=MaskRCNNPredictor(mask_head[-1], mask_head[-1], num_classes),
                     box_head=TwoMLPHead(channels * 7 * 7, box_head_dim),
                     box_predictor=FastRCNNPredictor(box_head_dim, num_classes))
    if anchor_sizes:
        num_maps = len(backbone.fpn.inner_blocks) + 1  # + the max-pooled level
        if len(anchor_sizes) != num_maps:
            raise ConfigError(f"model.anchor_sizes: one size per feature map ({num_maps}), got {anchor_sizes}")
        extra["rpn_anchor_generator"] = AnchorGenerator(tuple((int(s),) for s in anchor_sizes),
                                                        ((0.5, 1.0, 2.0),) * num_maps)
    return PanopticFPN(backbone, num_classes, num_stuff_classes, **kwargs, **extra)


# class 0 the background: a score and 4 box deltas per class, a mask channel per class; the semantic
# logits' rows (engine.transfer.SemanticRows). model.weights may be a Mask R-CNN (torchvision's or this
# repo's): only the semantic head may be missing from it.
PANOPTIC_DECLARED = dict(class_params={"roi_heads.box_predictor.cls_score": Rows(background=True),
                                       "roi_heads.box_predictor.bbox_pred": Rows(per=4, background=True),
                                       "roi_heads.mask_predictor.mask_fcn_logits": Rows(background=True),
                                       "semantic_head.predictor": SemanticRows()},
                         may_miss=("semantic_head.",))


# exported whole up to the fusion (one image in; boxes, masks and the semantic maps out) by the
# TorchScript-based ONNX exporter, as torchvision exports Mask R-CNN: exporters/panoptic.py; not to
# torch.export, for Faster R-CNN's reason (NOT_EXPORTED)


PANOPTIC_RANGES = {
    "num_classes": Range(ge=1), "num_stuff_classes": Range(ge=0), "trainable_backbone_layers": Range(ge=0, le=5),
    "sem_loss_weight": Range(ge=0), "sem_ohem": Range(gt=0, le=1), "sem_channels": Range(ge=1),
    "min_size": Range(ge=1, le=8192), "max_size": Range(ge=1, le=8192), "box_score_thresh": Range(ge=0, le=1),
    "box_detections_per_img": Range(ge=1), "instance_score_thresh": Range(ge=0, le=1), "mask_thresh": Range(ge=0, le=1),
    "overlap_thresh": Range(ge=0, le=1), "stuff_area_thresh": Range(ge=0), "anchor_sizes": Range(gt=0),
    "mask_head": Range(ge=1), "box_head_dim": Range(ge=1)}


@MODELS.register(task="panoptic", quantizable=False, exports=("onnx",), not_exported=NOT_EXPORTED,
                 ranges=PANOPTIC_RANGES, **PANOPTIC_DECLARED)
def panoptic_fpn_resnet50(num_classes=81, num_stuff_classes=53, weights=None, weights_backbone=None,
                          trainable_backbone_layers: int | None = None, semantic_classes="stuff", sem_loss_weight=0.5,
                          sem_ohem: float | None = None, sem_channels=128, min_size: Union[int, list[int]] = 800,
                          max_size=1333, box_score_thresh=0.05,
                          box_detections_per_img=100, instance_score_thresh=0.5, mask_thresh=0.5,
                          overlap_thresh=0.5, stuff_area_thresh=4096, anchor_sizes: list[float] | None = None,
                          mask_head: list[int] | None = None, box_head_dim: int | None = None, maskrcnn_args=None):
    """Panoptic FPN R50: torchvision's maskrcnn_resnet50_fpn (same modules and keys) + semantic head.

    weights: a Mask R-CNN (e.g. MaskRCNN_ResNet50_FPN_Weights.COCO_V1, a local state dict, or a
    checkpoint of this repo); weights_backbone: ResNet-50 (e.g. ResNet50_Weights.IMAGENET1K_V1).
    With either, BatchNorm is frozen as in torchvision; from scratch it trains.
    mask_head: channels of the mask head's convolutions (default torchvision's [256, 256, 256, 256]);
    box_head_dim: the box head's MLP width (default 1024): lighter heads for CPU runs.
    maskrcnn_args: any other torchvision MaskRCNN keyword (rpn_post_nms_top_n_train, ...).
    """
    kwargs = _passed_on(locals())
    body, trainable = pretrained_body(resnet.resnet50, weights, weights_backbone, trainable_backbone_layers, 5, 3)
    backbone = _resnet_fpn_extractor(body, trainable)
    return _build(backbone, num_classes, num_stuff_classes, anchor_sizes, mask_head, box_head_dim, maskrcnn_args,
                  **kwargs)


@MODELS.register(task="panoptic", quantizable=False, exports=("onnx",), not_exported=NOT_EXPORTED,
                 ranges=PANOPTIC_RANGES, **PANOPTIC_DECLARED)
def panoptic_fpn_resnet50_v2(num_classes=81, num_stuff_classes=53, weights=None, weights_backbone=None,
                             trainable_backbone_layers: int | None = None, semantic_classes="stuff",
                             sem_loss_weight=0.5, sem_ohem: float | None = None, sem_channels=128,
                             min_size: Union[int, list[int]] = 800, max_size=1333,
                             box_score_thresh=0.05, box_detections_per_img=100, instance_score_thresh=0.5,
                             mask_thresh=0.5, overlap_thresh=0.5, stuff_area_thresh=4096,
                             anchor_sizes: list[float] | None = None, mask_head: list[int] | None = None,
                             box_head_dim: int | None = None, maskrcnn_args=None):
    """Panoptic FPN R50 on torchvision's maskrcnn_resnet50_fpn_v2 (Li et al., "Benchmarking Detection
    Transfer Learning with Vision Transformers", 2021; same modules and keys) + semantic head:
    BatchNorm in the FPN, a 2-conv RPN head, 4 conv + BN + ReLU layers in the box head and in the
    mask head, BatchNorm (not frozen) in the backbone. The heads' BN + ReLU pairs are what
    inplace_abn converts there (docs/performance.md).

    weights: e.g. MaskRCNN_ResNet50_FPN_V2_Weights.COCO_V1 (box AP 47.4, mask AP 41.8 in torchvision's
    table); weights_backbone: ResNet-50. mask_head / box_head_dim: lighter heads for CPU runs.
    """
    kwargs = _passed_on(locals())
    body, trainable = pretrained_body(resnet.resnet50, weights, weights_backbone, trainable_backbone_layers, 5, 3,
                                      pretrained_norm=nn.BatchNorm2d)
    backbone = _resnet_fpn_extractor(body, trainable, norm_layer=nn.BatchNorm2d)
    channels = backbone.out_channels
    mask_head, box_head_dim = tuple(mask_head or (256, 256, 256, 256)), box_head_dim or 1024
    heads = dict(rpn_head=RPNHead(channels, 3, conv_depth=2),
                 box_head=FastRCNNConvFCHead((channels, 7, 7), [256, 256, 256, 256], [box_head_dim],
                                             norm_layer=nn.BatchNorm2d),
                 box_predictor=FastRCNNPredictor(box_head_dim, num_classes),
                 mask_head=MaskRCNNHeads(channels, mask_head, 1, norm_layer=nn.BatchNorm2d),
                 mask_predictor=MaskRCNNPredictor(mask_head[-1], mask_head[-1], num_classes))
    return _build(backbone, num_classes, num_stuff_classes, anchor_sizes, None, None,
                  {**heads, **(maskrcnn_args or {})}, **kwargs)


@MODELS.register(task="panoptic", quantizable=False, exports=("onnx",), not_exported=NOT_EXPORTED,
                  ranges={**PANOPTIC_RANGES, "trainable_backbone_layers": Range(ge=0, le=6),
                          "fpn_channels": Range(ge=1)}, **PANOPTIC_DECLARED)
def panoptic_fpn_mobilenet_v3_large(num_classes=81, num_stuff_classes=53, weights=None, weights_backbone=None,
                                    trainable_backbone_layers: int | None = None, semantic_classes="stuff",
                                    sem_loss_weight=0.5, sem_ohem: float | None = None, sem_channels=128,
                                    min_size: Union[int, list[int]] = 800, max_size=1333,
                                    box_score_thresh=0.05, box_detections_per_img=100, instance_score_thresh=0.5,
                                    mask_thresh=0.5, overlap_thresh=0.5, stuff_area_thresh=4096,
                                    anchor_sizes: list[float] | None = None, mask_head: list[int] | None = None,
                                    box_head_dim: int | None = None, fpn_channels=256, maskrcnn_args=None):
    """Panoptic FPN on MobileNetV3-Large (CPU demos and tests): torchvision's mobilenet FPN
    extractor with the levels of stride 4, 8, 16 and 32 (returned layers 1, 2, 3, 5) + max pool.

    weights_backbone: MobileNetV3-Large (e.g. MobileNet_V3_Large_Weights.IMAGENET1K_V1).
    fpn_channels: torchvision's 256 by default; fewer for CPU runs (with mask_head, box_head_dim).
    """
    kwargs = _passed_on(locals())
    body, trainable = pretrained_body(mobilenetv3.mobilenet_v3_large, weights, weights_backbone,
                                      trainable_backbone_layers, 6, 3,
                                      scratch_norm=partial(nn.BatchNorm2d, eps=0.001, momentum=0.01))
    backbone = _mobilenet_extractor(body, True, trainable, returned_layers=[1, 2, 3, 5])
    if fpn_channels != backbone.out_channels:  # a narrower FPN than torchvision's 256 channels (CPU runs)
        in_channels = [block[0].in_channels for block in backbone.fpn.inner_blocks]
        backbone.fpn = FeaturePyramidNetwork(in_channels, fpn_channels, LastLevelMaxPool())
        backbone.out_channels = fpn_channels
    return _build(backbone, num_classes, num_stuff_classes, anchor_sizes, mask_head, box_head_dim, maskrcnn_args,
                  **kwargs)
