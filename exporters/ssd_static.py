"""torchvision SSD's eval path with outputs of static shape (torch.export can trace it), and the
matching of two detection lists that compares an exported detector with the eager one."""
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import box_iou, boxes as box_ops

log = logging.getLogger(__name__)


class SSDExport(nn.Module):
    """torchvision SSD's eval path as one traceable function of images [B, 3, H, W] in [0, 1], any size.

    torchvision filters by score before its top-k, so its shapes depend on the data and torch.export
    cannot trace it. Here the top-k runs over all anchors (the same boxes survive), the threshold
    selects what enters one class-wise NMS, and the kept scores are scattered back to static shapes.
    Outputs: boxes [B, D, 4] (xyxy, input pixels), scores [B, D], labels [B, D], sorted by score;
    padding rows have score 0 and label 0. D = detections_per_img.
    """

    def __init__(self, ssd):
        super().__init__()
        self.ssd = ssd
        width, height = ssd.transform.fixed_size
        self.size = (int(height), int(width))

    def forward(self, images):
        ssd, (h0, w0) = self.ssd, self.size
        b, _, h, w = images.shape
        x = F.interpolate(ssd.transform.normalize(images), size=(h0, w0), mode="bilinear", align_corners=False)
        features = list(ssd.backbone(x).values())
        head = ssd.head(features)
        anchors = ssd.anchor_generator(ImageList(x[:1], [(h0, w0)]), features)[0]  # one input size: shared
        n = anchors.shape[0]
        boxes = ssd.box_coder.decode_single(head["bbox_regression"].reshape(-1, 4), anchors.repeat(b, 1))
        boxes = box_ops.clip_boxes_to_image(boxes.reshape(b, n, 4), (h0, w0))
        scores = F.softmax(head["cls_logits"], -1)[:, :, 1:].transpose(1, 2)  # [B, C-1, N], no background
        c1, k = scores.shape[1], min(ssd.topk_candidates, n)
        top, idx = scores.topk(k, dim=2)  # [B, C-1, k]
        cand = boxes.unsqueeze(1).expand(b, c1, n, 4).gather(2, idx.unsqueeze(-1).expand(b, c1, k, 4))
        labels = torch.arange(1, c1 + 1, device=images.device).view(1, c1, 1).expand(b, c1, k)
        groups = torch.arange(b, device=images.device).view(b, 1, 1) * (c1 + 1) + labels
        flat_boxes, flat_scores = cand.reshape(-1, 4), top.reshape(-1)
        # class-wise (and image-wise) NMS in one call: boxes of other groups moved apart (torchvision's trick)
        shifted = flat_boxes + (groups.reshape(-1, 1) * (max(h0, w0) + 1)).to(flat_boxes)
        selected = (flat_scores > ssd.score_thresh).nonzero().squeeze(1)
        keep = selected[torch.ops.torchvision.nms(shifted[selected], flat_scores[selected], ssd.nms_thresh)]
        kept = torch.zeros_like(flat_scores).scatter(0, keep, flat_scores[keep]).reshape(b, c1 * k)
        out_scores, order = kept.topk(min(ssd.detections_per_img, c1 * k), dim=1)
        valid = out_scores > 0
        out_boxes = cand.reshape(b, c1 * k, 4).gather(1, order.unsqueeze(-1).expand(-1, -1, 4))
        ratio_w, ratio_h = w / w0, h / h0
        out_boxes = torch.stack([out_boxes[..., 0] * ratio_w, out_boxes[..., 1] * ratio_h,
                                 out_boxes[..., 2] * ratio_w, out_boxes[..., 3] * ratio_h], -1)
        out_labels = labels.reshape(b, c1 * k).gather(1, order) * valid
        return out_boxes * valid.unsqueeze(-1), out_scores, out_labels


def detections(outputs, score_thresh=0.0):
    """Exported outputs -> one {boxes, scores, labels} dict per image (padding and low scores dropped)."""
    boxes, scores, labels = outputs
    keep = (labels > 0) & (scores >= score_thresh)
    return [{"boxes": b[k], "scores": s[k], "labels": lab[k]} for b, s, lab, k in zip(boxes, scores, labels, keep)]


def match_detections(ref, got, min_score=0.05, iou_thresh=0.9, score_tol=0.01, capacity=None):
    """Per image, every detection of one list scoring >= min_score must have a counterpart in the
    other (same label, IoU >= iou_thresh, scores within score_tol). Counterparts may score down to
    min_score - score_tol, so a box on the threshold does not count as missing; likewise, when the
    other list is full (`capacity` detections), boxes scoring within score_tol of its last one."""
    unmatched, compared, worst_iou, worst_score = [0, 0], 0, 1.0, 0.0
    for r, g in zip(ref, got):
        for side, (a, b) in enumerate(((r, g), (g, r))):
            strong = a["scores"] >= min_score
            if capacity and len(b["scores"]) >= capacity:  # b was cut at its capacity: ties may fall off
                strong &= a["scores"] > b["scores"].min() + score_tol
            near = b["scores"] >= min_score - score_tol
            a_boxes, a_scores, a_labels = a["boxes"][strong], a["scores"][strong], a["labels"][strong]
            b_boxes, b_scores, b_labels = b["boxes"][near], b["scores"][near], b["labels"][near]
            if side == 0:
                compared += len(a_boxes)
            if not len(a_boxes):
                continue
            if not len(b_boxes):
                unmatched[side] += len(a_boxes)
                continue
            iou = box_iou(a_boxes.float(), b_boxes.float())
            iou = iou * (a_labels[:, None] == b_labels[None]) * ((a_scores[:, None] - b_scores[None]).abs() <= score_tol)
            best, j = iou.max(1)
            unmatched[side] += int((best < iou_thresh).sum())
            ok = best >= iou_thresh
            if ok.any():
                worst_iou = min(worst_iou, best[ok].min().item())
                worst_score = max(worst_score, (a_scores[ok] - b_scores[j[ok]]).abs().max().item())
    return {"images": len(ref), "detections_compared": compared, "unmatched_eager": unmatched[0],
            "unmatched_exported": unmatched[1], "min_matched_iou": worst_iou, "max_score_diff": worst_score,
            "tolerance": {"min_score": min_score, "iou": iou_thresh, "score": score_tol},
            "ok": unmatched == [0, 0]}
