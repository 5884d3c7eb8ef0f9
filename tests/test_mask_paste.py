"""models.mask_paste.paste_masks gives torchvision's paste_masks_in_image bit for bit: tiny boxes,
boxes past the image's edges, no detections, non-square images, and a property test."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.models.detection.roi_heads import paste_masks_in_image

from models.mask_paste import paste_masks


def assert_same_paste(masks, boxes, size):
    ref = paste_masks_in_image(masks, boxes, size)
    got = paste_masks(masks, boxes, size)
    assert got.shape == ref.shape == (len(masks), 1, *size) and got.dtype == ref.dtype
    assert torch.equal(got, ref), f"max difference {(got - ref).abs().max().item()}"
    assert torch.equal(got > 0.5, ref > 0.5)
    return got


@pytest.mark.parametrize("size", [(48, 48), (37, 90), (90, 23), (12, 9)])
def test_paste_equals_torchvision_on_edge_boxes(size):
    h, w = size
    boxes = torch.tensor([
        [5.0, 6.0, 30.0, 20.0],                   # inside
        [-12.3, -7.9, 10.2, 8.8],                 # past the top-left corner
        [w - 9.5, h - 4.2, w + 15.0, h + 30.0],   # past the bottom-right corner
        [-20.0, 2.0, w + 20.0, 3.0],              # wider than the image, 1 px high
        [3.0, 3.0, 3.0, 3.0],                     # zero size: a 1 x 1 mask after rounding
        [7.2, 9.6, 8.1, 11.4],                    # 1-2 px
        [0.0, 0.0, float(w), float(h)],           # the whole image
    ])
    torch.manual_seed(0)
    masks = torch.rand(len(boxes), 1, 28, 28)
    pasted = assert_same_paste(masks, boxes, size)
    if size == (48, 48):
        assert (pasted[:, 0] > 0).flatten(1).any(1).all()  # every box paints something


def test_paste_without_detections_and_with_other_mask_sizes():
    for size in [(20, 30), (0, 5)]:
        assert_same_paste(torch.zeros(0, 1, 28, 28), torch.zeros(0, 4), size)
    torch.manual_seed(1)
    assert_same_paste(torch.rand(3, 1, 14, 14), torch.tensor([[1.0, 2, 9, 30], [0, 0, 1, 1], [5, 5, 39, 19]]), (32, 40))
    assert_same_paste(torch.rand(2, 1, 28, 28, dtype=torch.float64), torch.tensor([[1.0, 2, 9, 30], [3, 1, 4, 2]]),
                      (32, 40))


def test_box_entirely_outside_the_image_pastes_nothing():
    torch.manual_seed(2)
    # torchvision pastes nothing for these
    assert (assert_same_paste(torch.rand(2, 1, 28, 28), torch.tensor([[5.0, -40, 20, -3], [-400, 5, -300, 20]]),
                              (60, 80)) == 0).all()
    # on these its negative slice ends wrap around into a shape-mismatch error; here they are empty too
    boxes = torch.tensor([[-50.0, 5.0, -10.0, 20.0], [100.0, 5.0, 140.0, 20.0], [5.0, 70.0, 20.0, 90.0]])
    for box in boxes:
        with pytest.raises(RuntimeError):
            paste_masks_in_image(torch.rand(1, 1, 28, 28), box[None], (60, 80))
    pasted = paste_masks(torch.rand(3, 1, 28, 28), boxes, (60, 80))
    assert pasted.shape == (3, 1, 60, 80) and (pasted == 0).all()


@settings(max_examples=60, deadline=None)
@given(height=st.integers(1, 70), width=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       boxes=st.lists(st.tuples(*[st.floats(0, 1)] * 4), max_size=6))
def test_paste_equals_torchvision_on_random_boxes(height, width, seed, boxes):
    # centres inside the image (as Mask R-CNN's clipped boxes), sizes up to 1.5x the image
    rel = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    scale = torch.tensor([width, height], dtype=torch.float32)
    centre, half = rel[:, :2] * scale, rel[:, 2:] * scale * 0.75
    masks = torch.rand(len(rel), 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    assert_same_paste(masks, torch.cat([centre - half, centre + half], 1), (height, width))
