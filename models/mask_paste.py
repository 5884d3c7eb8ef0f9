"""Mask R-CNN's mask pasting without torchvision's per-detection overhead, with the same values.

torchvision's `paste_masks_in_image` loops in Python over detections: per detection it rounds
the box with 0-d tensor arithmetic, allocates a zeroed H x W image, resizes the 28 x 28 mask
onto the box and copies it in, then stacks the N images (a second N x H x W copy).
`paste_masks` does the box arithmetic for all detections at once, allocates the N x H x W output
once and writes each resized mask straight into its box.

The resize itself stays one `F.interpolate` call per detection, on the same view of the same
padded mask as torchvision's, so the values are bit-identical. A single batched resampling
(`grid_sample`, or gathers replicating bilinear interpolation) cannot promise that: the rounding
of `F.interpolate`'s CPU kernel (which products are fused into FMAs, in which order) depends on
the build and on the output size; an element-wise replica differs slightly, enough to flip pixels
that sit at the 0.5 threshold (figures in docs/performance.md).
"""
import torch
import torch.nn.functional as F
import torchvision
from torchvision.models.detection.roi_heads import expand_boxes, expand_masks, paste_masks_in_image


def paste_masks(masks, boxes, img_shape, padding=1):
    """masks [N, 1, M, M] (probabilities), boxes [N, 4] (x0, y0, x1, y1) in the image of size
    img_shape (H, W) -> [N, 1, H, W] as torchvision's `paste_masks_in_image`.

    Boxes are expanded by `padding` mask pixels, truncated to integers, each mask is resized
    (bilinear, align_corners=False) to its box's (h, w) = (y1 - y0 + 1, x1 - x0 + 1), at least
    1 x 1, and the part inside the image is pasted. A box entirely outside the image gives an
    empty mask (torchvision's slice ends then go negative and wrap around: it pastes nothing or,
    depending on the sizes, raises a shape-mismatch error). Under tracing / scripting it defers to
    torchvision (its ONNX path)."""
    if torchvision._is_tracing() or torch.jit.is_scripting():
        return paste_masks_in_image(masks, boxes, img_shape, padding)
    masks, scale = expand_masks(masks, padding=padding)
    boxes = expand_boxes(boxes, scale).to(dtype=torch.int64)
    im_h, im_w = img_shape
    out = masks.new_zeros((masks.shape[0], 1, im_h, im_w))
    if masks.shape[0] == 0:
        return out
    size = (boxes[:, 2:] - boxes[:, :2] + 1).clamp(min=1)                   # (w, h) of the resized mask
    start = boxes[:, :2].clamp(min=0)                                        # the box inside the image
    end = torch.minimum(boxes[:, 2:] + 1, boxes.new_tensor([im_w, im_h]))
    table = torch.cat([boxes[:, :2], size, start, end], 1).tolist()          # one device sync
    for i, (bx, by, w, h, x0, y0, x1, y1) in enumerate(table):
        if x1 <= x0 or y1 <= y0:  # nothing of the box in the image
            continue
        resized = F.interpolate(masks[i][0].expand((1, 1, -1, -1)), size=(h, w), mode="bilinear", align_corners=False)
        out[i, 0, y0:y1, x0:x1] = resized[0, 0, y0 - by:y1 - by, x0 - bx:x1 - bx]
    return out
