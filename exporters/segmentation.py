"""Semantic segmentation (LR-ASPP, DeepLabV3): images [B, 3, H, W] of any size -> per-pixel class logits
[B, C, H, W] at the input's size. The spec says how to make the input without torch (the data's
evaluation transform: the shorter side resized, scaled, normalised) and, for data whose labels come
from COCO categories, how to rebuild the ground truth from the COCO files. Exported and eager logits
are compared within LOGITS_ATOL with the share of pixels whose class differs; predict.py draws each
image's classes blended over it (a fixed colour per class index) with a legend (<name>_seg.png) and
writes the class of every pixel (<name>_mask.png: uint8 class indices at the original image's size, the
model's map resized with nearest).
"""
import copy
import logging
import os
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch import nn
from torchvision.transforms import InterpolationMode, v2 as T

from evaluators.segmentation import IGNORE_INDEX, palette
from exporters.base import EXPORTERS, LOGITS_ATOL, Adapter, ExportError, RunnerAsModel
from exporters.inputs import read_image

log = logging.getLogger(__name__)

PIXELS_DIFFERING = 1e-4  # share of pixels whose argmax may differ (near-ties of logits within LOGITS_ATOL)
NOT_DRAWN = ("__background__", "void")  # class names left uncoloured in the drawn picture
ALPHA = 0.5  # the class colours' weight over the image
# a class's colour by its index: matplotlib's tab10 then its lighter tab20 half, well apart; beyond 20 classes the
# evaluators' seeded palette
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207), (174, 199, 232), (255, 187, 120),
           (152, 223, 138), (255, 152, 150), (197, 176, 213), (196, 156, 148), (247, 182, 210), (199, 199, 199),
           (219, 219, 141), (158, 218, 229)]


class Sample(NamedTuple):
    """What load() gives: the model's input [3, h, w] and the image as read (uint8 [3, H, W]) to draw on
    (None for a val sample, which export.py's check reads)."""
    image: torch.Tensor
    original: Optional[torch.Tensor]


# ---------------------------------------------------------------- the pre-processing

def preprocessing_spec(transform, where):
    """The data's evaluation transform (datasets/segmentation.py eval_preset: ToImage, Resize, ToDtype,
    Normalize, ToPureTensor) as JSON a consumer without torch can follow."""
    spec = {"image_mode": "RGB"}
    for step in getattr(transform, "transforms", [transform]):
        if isinstance(step, T.Resize):
            if len(step.size) == 1:
                spec["resize_shorter"] = int(step.size[0])
            else:
                spec["resize"] = [int(s) for s in step.size]
            spec.update(max_size=step.max_size, interpolation=step.interpolation.value,
                        antialias=bool(step.antialias))
        elif isinstance(step, T.Normalize):
            spec.update(mean=[float(m) for m in step.mean], std=[float(s) for s in step.std])
        elif not isinstance(step, (T.ToImage, T.PILToTensor, T.ToDtype, T.ToPureTensor)):
            raise ExportError(f"{where}: the evaluation transform has a step the segmentation export does not "
                              f"describe: {step!r} (known: ToImage, Resize, ToDtype, Normalize, ToPureTensor)")
    if "resize_shorter" in spec:
        spec["resize_rule"] = ("the shorter side to resize_shorter, the longer to int(resize_shorter * longer / "
                               "shorter) (truncated), on the uint8 image (torchvision's antialiased bilinear; "
                               "PIL's bilinear: within 2 grey levels)")
    spec.update(scale=1 / 255, layout="NCHW float32", order="resize, then scale, then normalise")
    return spec


def transform_from_spec(p):
    """The evaluation transform (PIL image -> normalised float tensor [3, h, w]) preprocessing_spec described:
    resized as a uint8 tensor, as the data's transform does."""
    steps = [T.ToImage()]
    size = [p["resize_shorter"]] if "resize_shorter" in p else p.get("resize")
    if size:
        steps.append(T.Resize(size, InterpolationMode(p["interpolation"]), p.get("max_size"),
                              antialias=p["antialias"]))
    steps.append(T.ToDtype(torch.float32, scale=True))
    if "mean" in p:
        steps.append(T.Normalize(p["mean"], p["std"]))
    return T.Compose(steps + [T.ToPureTensor()])


def ground_truth_spec(dataset):
    """Postprocessing keys that say how a consumer rebuilds the val masks from the data's COCO files, when its
    labels come from COCO categories (the data set's cat_to_label), else {}."""
    cat_to_label = getattr(dataset, "cat_to_label", None)
    if not cat_to_label:
        return {}
    if hasattr(dataset, "png_folder"):  # the semantic map of a COCO panoptic split
        rule = ("COCO panoptic PNGs: segment id (R + 256 G + 256^2 B) -> its segments_info category -> "
                "label_of_category; void (id 0) and iscrowd segments -> ignore_index")
    else:  # COCO instance annotations of a category subset
        rule = ("COCO instance masks of the listed categories -> label_of_category; other categories -> 0; "
                "pixels of two listed instances -> ignore_index")
    return {"label_of_category": {str(c): int(label) for c, label in cat_to_label.items()}, "ground_truth": rule,
            "ground_truth_resize": "as the image, with torch's nearest (source pixel floor(i * in / out))"}


# ---------------------------------------------------------------- the exported module

class GuardFreeMaxPool(nn.Module):
    """nn.MaxPool2d (dilation 1, no ceil mode) as the maximum over unfolded windows of the input padded with
    -inf: equal values, but torch.export's shape function of max_pool2d adds a guard on the parity of the
    input's size (ResNet's stem: ((H - 1) // 2) % 2 != 0), and a .pt2 with it refuses half of all sizes."""

    def __init__(self, pool):
        super().__init__()
        pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
        self.kernel, self.stride, self.padding = pair(pool.kernel_size), pair(pool.stride), pair(pool.padding)

    def forward(self, x):
        (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.padding
        x = F.pad(x, (pw, pw, ph, ph), value=float("-inf"))
        return x.unfold(2, kh, sh).unfold(3, kw, sw).amax(dim=(-2, -1))


def for_export(model):
    """model, or a copy of it made for the exported graph: without torchvision's auxiliary head (`aux_classifier`,
    a training loss only, which the eval forward still computes and drops) and with GuardFreeMaxPool for its
    max-pools. The eval output is the same."""
    def swappable(m):
        return (isinstance(m, nn.MaxPool2d) and not m.ceil_mode and not m.return_indices
                and m.dilation in (1, (1, 1)))
    if not any(swappable(m) or getattr(m, "aux_classifier", None) is not None for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    for m in list(model.modules()):
        if getattr(m, "aux_classifier", None) is not None:
            m.aux_classifier = None
    for name, m in list(model.named_modules()):
        if swappable(m):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, GuardFreeMaxPool(m))
    return model


class SegmentationLogits(nn.Module):
    """images -> (logits,): the model's eval output as a tuple."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        return (self.model(images),)


class ImageByImage(RunnerAsModel):
    """A runner exported for batches of one: the val loader's batch fed one image at a time (the padded
    images of a batch are its rows, so the logits are those of the batch)."""

    def forward(self, inputs):
        rows = []
        for row in inputs:
            rows.append(super().forward(row[None]))
        return torch.cat(rows)


# ---------------------------------------------------------------- the adapter

@EXPORTERS.register(task="semantic_segmentation", inputs="image")
class Segmenter(Adapter):
    """images [B, 3, H, W] (normalised as the spec's preprocessing says; H, W any) -> logits [B, C, H, W]."""
    task = "semantic_segmentation"

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        if data is None:
            raise ExportError(f"model {cfg['model']['name']}: the evaluation pre-processing and class names come "
                              f"from the data set ({cfg['data']['name']}), which could not be built")
        where = f"data {cfg['data']['name']} (its val transform)"
        transform = getattr(data.val, "transforms", None) or getattr(data.val, "transform", None)
        post = {"logits": "[B, C, H, W]: the input's H and W, one channel per class",
                "prediction": "argmax over C", "ignore_index": IGNORE_INDEX}
        post.update(ground_truth_spec(data.val))
        return {"classes": list(data.classes), "preprocessing": preprocessing_spec(transform, where),
                "postprocessing": post}

    # ---- export
    def module(self, model):
        return SegmentationLogits(for_export(model)).eval()

    def dynamic_shapes(self, dynamic_batch):
        dim = torch.export.Dim
        return ({0: dim.DYNAMIC if dynamic_batch else dim.STATIC, 2: dim.DYNAMIC, 3: dim.DYNAMIC},)

    def join(self, outputs):
        return list(outputs)  # batches of other sizes do not concatenate

    def eval_model(self, runner, where):
        return RunnerAsModel(runner, where) if self.spec.get("dynamic_batch", True) else ImageByImage(runner, where)

    def sample_from_dataset(self, item):
        return Sample(item[0], None)

    def compare(self, ref, got, atol=LOGITS_ATOL):
        """Per-pixel logits within atol, and the share of pixels whose class differs at most PIXELS_DIFFERING."""
        samples, pixels, differ, diff = 0, 0, 0, 0.0
        for (r,), (g,) in zip(ref, got):
            r, g = r.float(), g.float()
            if r.shape != g.shape:
                raise ExportError(f"exported logits {tuple(g.shape)}, eager {tuple(r.shape)}: the shapes differ")
            samples += len(r)
            pixels += r[:, 0].numel()
            differ += int((r.argmax(1) != g.argmax(1)).sum())
            diff = max(diff, (r - g).abs().max().item() if r.numel() else 0.0)
        share = differ / pixels if pixels else 0.0
        return {"samples": samples, "pixels": pixels, "pixels_differing": differ, "pixels_differing_share": share,
                "max_abs_logit_diff": diff,
                "tolerance": {"max_abs_logit_diff": atol, "pixels_differing_share": PIXELS_DIFFERING},
                "ok": diff <= atol and share <= PIXELS_DIFFERING}

    def transform(self):
        return transform_from_spec(self.spec["preprocessing"])

    # ---- predict
    def load(self, item):
        if not hasattr(self, "_transform"):
            self._transform = self.transform()
        image = read_image(item)
        return Sample(self._transform(image), torch.from_numpy(np.array(image)).permute(2, 0, 1))

    def collate(self, samples):
        return (torch.stack([s.image for s in samples]),)

    def batch_key(self, sample):
        return tuple(sample.image.shape)

    def present(self, outputs, items, samples, out_dir, args):
        results = []
        for path, sample, logits in zip(items, samples, outputs[0]):
            height, width = sample.original.shape[1:]
            labels = F.interpolate(logits.argmax(0)[None, None].float(), size=(height, width), mode="nearest")
            labels = labels[0, 0].numpy().astype(np.uint8 if logits.shape[0] <= 256 else np.uint16)
            found = self.classes_present(labels)
            stem = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0])
            Image.fromarray(labels).save(stem + "_mask.png")  # 8-bit grey (16-bit beyond 256 classes)
            self.drawn(sample.original, labels, found).save(stem + "_seg.png")
            results.append({"input": path, "drawn": stem + "_seg.png", "mask": stem + "_mask.png",
                            "height": height, "width": width, "input_size": list(logits.shape[1:]),
                            "mask_size": "the original image's: the model's class map resized with nearest",
                            "classes": found})
        return results

    def classes_present(self, labels):
        """[{"label", "index", "pixel_share"}] of the classes in the map, the largest first."""
        counts = np.bincount(labels.reshape(-1), minlength=len(self.classes or ()))
        order = sorted(np.flatnonzero(counts), key=lambda k: -counts[k])
        return [{"label": self.class_name(int(k)), "index": int(k), "pixel_share": round(counts[k] / labels.size, 4)}
                for k in order]

    def drawn(self, original, labels, found):
        """The image with each class's colour blended over its pixels (NOT_DRAWN left as they are), and to its
        right a legend of the classes present: a swatch, the name, the share of pixels."""
        colours = class_colours(max(len(self.classes or ()), int(labels.max()) + 1))
        image = original.permute(1, 2, 0).numpy().astype(np.float32)
        coloured = colours[labels].astype(np.float32)
        plain = np.isin(labels, [k for k, name in enumerate(self.classes or ()) if name in NOT_DRAWN])
        blended = np.where(plain[..., None], image, (1 - ALPHA) * image + ALPHA * coloured)
        height, width = labels.shape
        size = max(10, min(32, height // 24))
        font = ImageFont.load_default(size=size)
        line, pad = size + size // 2, size // 2
        names = [f"{f['label']}  {100 * f['pixel_share']:.1f}%" for f in found]
        text_width = max((font.getlength(n) for n in names), default=0)
        panel = int(pad * 3 + size + text_width)
        canvas = Image.new("RGB", (width + panel, max(height, pad * 2 + line * len(names))), "white")
        canvas.paste(Image.fromarray(blended.round().clip(0, 255).astype(np.uint8)), (0, 0))
        draw = ImageDraw.Draw(canvas)
        for i, (f, name) in enumerate(zip(found, names)):
            x, y = width + pad, pad + i * line
            draw.rectangle([x, y, x + size, y + size], fill=tuple(int(c) for c in colours[f["index"]]),
                           outline="black")
            draw.text((x + size + pad, y), name, fill="black", font=font)
        return canvas

    def summary(self, result):
        return f"{result['input']}: " + ", ".join(f"{c['label']} {100 * c['pixel_share']:.1f}%"
                                                  for c in result["classes"][:8])


def class_colours(num_classes):
    """uint8 [num_classes, 3]: COLOURS, then the evaluators' palette for the classes beyond them."""
    colours = np.array(COLOURS[:num_classes], np.uint8).reshape(-1, 3)
    if num_classes > len(COLOURS):
        colours = np.concatenate([colours, palette(num_classes)[len(COLOURS):num_classes].numpy()])
    return colours
