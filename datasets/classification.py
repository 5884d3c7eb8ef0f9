"""Image classification: ImageFolder and a built-in synthetic set, with torchvision-style presets."""
import logging
import math
import os
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch.utils.data import Dataset
from torchvision import datasets as tvd
from torchvision.transforms import v2 as T

from datasets.base import DataSplits, read_image, read_or_skip, require_dir
from engine.errors import DataError, MissingData
from evaluators.classification import ClassificationEvaluator
from engine.seeding import torch_seeded
from engine.config import ConfigError
from engine.paths import walk_files
from engine.registry import DATASETS, Range

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGEFOLDER_LAYOUT = "  ROOT/train/<class>/*.png|jpg\n  ROOT/val/<class>/*.png|jpg"


def train_preset(crop_size, scale=(0.08, 1.0), hflip_prob=0.5, auto_augment=None, random_erase=0.0,
                 mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """torchvision's classification train preset (references/classification/presets.py)."""
    steps = [T.RandomResizedCrop(crop_size, scale=tuple(scale), antialias=True)]
    if hflip_prob > 0:
        steps.append(T.RandomHorizontalFlip(hflip_prob))
    if auto_augment == "imagenet":
        steps.append(T.AutoAugment(T.AutoAugmentPolicy.IMAGENET))
    elif auto_augment == "ta_wide":
        steps.append(T.TrivialAugmentWide())
    elif auto_augment == "ra":
        steps.append(T.RandAugment())
    elif auto_augment is not None:
        raise ConfigError(f"data.auto_augment: expected imagenet, ta_wide, ra or null, got {auto_augment!r}")
    steps += [T.PILToTensor(), T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)]
    if random_erase > 0:
        steps.append(T.RandomErasing(random_erase))
    return T.Compose(steps)


class CropFlipNormalize:
    """RandomResizedCrop, RandomHorizontalFlip, ToDtype and Normalize of uint8 image tensors, for a
    whole batch in a few calls: per-image v2 calls were a tenth of the demo's training loop.
    - Draws: RandomResizedCrop's rule (up to 10 trials of scale and log-uniform aspect ratio, the
      first crop that fits, else the centre crop of the nearest ratio) and the flip, vectorised over
      the batch, each image's from its own seed (`batch`) or from torch's generator (`__call__`).
    - Pixels: one grid_sample where every crop is at most the output size (upsampling, as on the
      built-in data): v2's bilinear resize of the crop (align_corners=False, clamped to the crop);
      otherwise v2's antialiased resize per image. Both tested against v2."""

    def __init__(self, size, scale=(0.08, 1.0), hflip_prob=0.5, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.scale, self.ratio, self.hflip_prob = tuple(scale), (3 / 4, 4 / 3), hflip_prob
        std = torch.tensor(std).view(-1, 1, 1)  # normalize((x / 255 - mean) / std) as x * gain + shift
        self.gain, self.shift = 1 / (255 * std), -torch.tensor(mean).view(-1, 1, 1) / std

    def __call__(self, image):
        return self.batch([image], [int(torch.randint(2 ** 32, ()))])[0]

    def batch(self, images, seeds):
        return self.apply(images, self.draw(seeds, *images[0].shape[-2:]))

    def draw(self, seeds, height, width):
        """(top, left, height, width, flip) per seed, as RandomResizedCrop + RandomHorizontalFlip draw them."""
        u = np.stack([np.random.default_rng(s).random(23) for s in seeds])  # 10 trials x 2, position, flip
        area = height * width * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, :10])
        low, high = np.log(self.ratio)
        ratio = np.exp(low + (high - low) * u[:, 10:20])
        w, h = np.round(np.sqrt(area * ratio)).astype(int), np.round(np.sqrt(area / ratio)).astype(int)
        fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        rows, first, none = np.arange(len(seeds)), fits.argmax(1), ~fits.any(1)
        w, h = w[rows, first], h[rows, first]
        w[none], h[none] = self._centre_crop(height, width)
        top = np.floor(u[:, 20] * (height - h + 1)).astype(int)
        left = np.floor(u[:, 21] * (width - w + 1)).astype(int)
        top[none], left[none] = (height - h[none]) // 2, (width - w[none]) // 2
        return [(int(t), int(l), int(hh), int(ww), bool(f))
                for t, l, hh, ww, f in zip(top, left, h, w, u[:, 22] < self.hflip_prob)]

    def _centre_crop(self, height, width):  # RandomResizedCrop's fallback: (w, h)
        low, high = self.ratio
        if width / height < low:
            return width, int(round(width / low))
        if width / height > high:
            return int(round(height * high)), height
        return width, height

    def apply(self, images, draws):
        """Per image: a crop no larger than the output in one grid_sample for all of them, a larger
        one (downsampling) with v2's antialiased resize."""
        up = [i for i, (_, _, h, w, _) in enumerate(draws) if h <= self.size[0] and w <= self.size[1]]
        resized = F.grid_sample(torch.stack([images[i] for i in up]).float(),
                                _crop_grid([draws[i] for i in up], images[0].shape[-2:], self.size),
                                mode="bilinear", align_corners=True) if up else None
        if len(up) == len(images):
            return resized.mul_(self.gain).add_(self.shift)
        x = torch.empty(len(images), images[0].shape[0], *self.size)
        if up:
            x[up] = resized
        for i in (i for i in range(len(images)) if i not in up):
            t, l, h, w, flip = draws[i]
            crop = T.functional.resized_crop(images[i], t, l, h, w, list(self.size), antialias=True).float()
            x[i] = crop.flip(-1) if flip else crop
        return x.mul_(self.gain).add_(self.shift)


def _crop_grid(draws, in_size, out_size):
    """grid_sample's grid for bilinear resized crops (align_corners=False sources clamped to the crop,
    as F.interpolate computes them), then flips: N x out_h x out_w x (x, y), in [-1, 1]."""
    top, left, h, w, flip = (torch.tensor(v, dtype=torch.float64)[:, None] for v in zip(*draws))

    def source(start, length, n, size):  # pixel coordinates in the whole image, for n outputs
        i = torch.arange(n, dtype=torch.float64) + 0.5
        return (start + (i * length / n - 0.5).clamp(min=0).minimum(length - 1)) / max(size - 1, 1) * 2 - 1

    xs = source(left, w, out_size[1], in_size[1])
    grid = torch.empty(len(draws), *out_size, 2)
    grid[..., 0] = torch.where(flip.bool(), xs.flip(1), xs)[:, None, :]
    grid[..., 1] = source(top, h, out_size[0], in_size[0])[:, :, None]
    return grid


def eval_preset(crop_size, resize_size, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    return T.Compose([T.Resize(resize_size, antialias=True), T.CenterCrop(crop_size), T.PILToTensor(),
                      T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])


def _splits(train, val, classes):
    return DataSplits(train=train, val=val, classes=classes, model_defaults={"num_classes": len(classes)},
                      evaluator=lambda: ClassificationEvaluator(classes))


def class_folders(root, ignore=()):
    """The class folders of `root` (a split of an image folder, an audio folder), sorted: its
    sub-folders, and symlinks to folders outside it (a class kept on another disk: common, so they
    are entered whatever follow_symlinks says). A symlink to `root`, to a folder holding it or to one
    inside it is no class: left out and named (a loop, or a second name for a folder already there).
    Names starting with one of `ignore` are skipped."""
    real = os.path.realpath(root)
    names, skipped = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(tuple(ignore)) or not entry.is_dir():
            continue
        if entry.is_symlink() and os.path.commonpath([real, os.path.realpath(entry.path)]) in (
                real, os.path.realpath(entry.path)):
            skipped.append(entry.path)
            continue
        names.append(entry.name)
    if skipped:
        log.warning("%s: %d class folder symlink(s) lead to this folder, into it or to a folder holding it (a loop): "
                    "left out so that each file counts once: %s", root, len(skipped), ", ".join(skipped))
    return names


def class_files(root, names, suffixes, follow_symlinks=False):
    """{class name: sorted files under root/<name>/, sub-folders included}, listed by
    engine.paths.walk_files: directory symlinks below a class folder are entered only with
    follow_symlinks, and then the whole of root is walked once, so that a link from one class into
    another or back up (a loop) is skipped and named and each file counts once, in its own class."""
    if not follow_symlinks:
        return {name: list(walk_files(os.path.join(root, name), suffixes)) for name in names}
    out = {name: [] for name in names}
    for path in walk_files(root, suffixes, follow_symlinks=True):
        first = os.path.relpath(path, root).split(os.sep)[0]
        if first in out:
            out[first].append(path)
    return out


class CheckedImageFolder(tvd.ImageFolder):
    """torchvision's ImageFolder whose errors name the folder / file and the expected layout; with
    skip_bad_samples an unreadable image becomes a Skipped marker (left out by the batch collate).
    Files are listed by class_files (engine.paths.walk_files), not torchvision's os.walk(followlinks=True),
    which trained on every image of a folder with a symlink loop about 40 times."""

    def __init__(self, root, transform, layout, skip_bad_samples=False, follow_symlinks=False):
        self.follow_symlinks = follow_symlinks
        try:
            super().__init__(root, transform, loader=read_image, allow_empty=True)
        except FileNotFoundError:  # find_classes: no class folder
            raise MissingData(f"imagefolder: no class folders in {os.path.abspath(root)}\n"
                                    f"expected layout:\n{layout}") from None
        present = set(self.targets)
        empty = [c for k, c in enumerate(self.classes) if k not in present]
        if empty:
            folders = ", ".join(os.path.abspath(os.path.join(root, c)) for c in empty)
            raise MissingData(f"imagefolder: no images ({', '.join(tvd.folder.IMG_EXTENSIONS)}) in the "
                                    f"class folder(s) {folders}\nexpected layout:\n{layout}")
        self.skip_bad_samples = skip_bad_samples

    def find_classes(self, directory):
        classes = class_folders(directory)
        if not classes:
            raise FileNotFoundError(f"no class folder in {directory}")
        return classes, {c: k for k, c in enumerate(classes)}

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        files = class_files(directory, list(class_to_idx), extensions or tvd.folder.IMG_EXTENSIONS,
                            self.follow_symlinks)
        return [(path, class_to_idx[name]) for name in sorted(class_to_idx) for path in files[name]]

    def __getitem__(self, index):
        return read_or_skip(partial(super().__getitem__, index), self.skip_bad_samples)


@DATASETS.register(inputs="image", doctor="imagefolder", ranges={
    "train_crop_size": Range(ge=1, le=8192), "val_crop_size": Range(ge=1, le=8192),
    "val_resize_size": Range(ge=1, le=8192), "train_crop_scale": Range(gt=0, le=1, length=2, increasing=True),
    "hflip_prob": Range(ge=0, le=1), "random_erase": Range(ge=0, le=1), "mean": Range(ge=0, le=1, length=3),
    "std": Range(gt=0, length=3)})
def imagefolder(root, train_split="train", val_split="val", train_crop_size=224, val_crop_size=224,
                val_resize_size=256, train_crop_scale=(0.08, 1.0), hflip_prob=0.5, auto_augment=None,
                random_erase=0.0, mean=IMAGENET_MEAN, std=IMAGENET_STD, skip_bad_samples=False,
                follow_symlinks=False):
    """ROOT/train/<class>/* and ROOT/val/<class>/*; grey images are converted to RGB.
    skip_bad_samples: leave unreadable images out of their batch (logged, counted per epoch) instead
    of stopping on them. follow_symlinks: enter directory symlinks inside class folders (loops are
    skipped, each file counted once); a class folder that is a symlink is entered either way
    (class_folders, docs/doctor.md)."""
    layout = IMAGEFOLDER_LAYOUT.replace("train", train_split).replace("val", val_split)
    for split in (train_split, val_split):
        require_dir(os.path.join(root, split), layout, "imagefolder")
    train = CheckedImageFolder(os.path.join(root, train_split), train_preset(
        train_crop_size, train_crop_scale, hflip_prob, auto_augment, random_erase, mean, std), layout,
        skip_bad_samples, follow_symlinks)
    val = CheckedImageFolder(os.path.join(root, val_split), eval_preset(val_crop_size, val_resize_size, mean, std),
                             layout, skip_bad_samples, follow_symlinks)
    if train.classes != val.classes:
        raise DataError(f"imagefolder {root}: {train_split}/ and {val_split}/ have different class "
                        f"folders: {train.classes} vs {val.classes}")
    return _splits(train, val, train.classes).skip_bad_samples(skip_bad_samples)


SHAPES = ("circle", "square", "triangle", "cross", "ring", "bar")
COLOURS = ((230, 60, 50), (50, 170, 70), (60, 90, 220), (240, 200, 40), (170, 70, 200), (40, 190, 200))


class SyntheticClassification(Dataset):
    """Coloured shapes on noisy backgrounds; the class is (shape, colour). Deterministic per index.
    Each image is drawn once and kept as a uint8 tensor (up to CACHE_BYTES in all): drawing was half
    of a sample's loading time, which on a small CPU is taken from training (docs/performance.md)."""
    CACHE_BYTES = 512 * 2 ** 20

    def __init__(self, size, num_classes, image_size, seed, transform):
        if not 2 <= num_classes <= len(SHAPES) * len(COLOURS):
            raise ConfigError(f"synthetic_classification: num_classes must be 2..{len(SHAPES) * len(COLOURS)}")
        self.size, self.num_classes, self.image_size, self.seed = size, num_classes, image_size, seed
        self.transform = transform
        self.classes = [f"{COLOURS.index(c)}_{s}" for s, c in self._kinds()]
        self.cache = {} if size * image_size ** 2 * 3 <= self.CACHE_BYTES else None

    def _kinds(self):
        return [(SHAPES[k % len(SHAPES)], COLOURS[(k + k // len(SHAPES)) % len(COLOURS)])
                for k in range(self.num_classes)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        image, label = self._image(index)
        return (self.transform(image) if self.transform else image), label

    def seeded_items(self, indices, seeds):
        """A batch's samples, each augmented from its own seed (engine.seeding.SeededSamples): the crops
        of the whole batch in a few calls (CropFlipNormalize.batch)."""
        images, labels = zip(*(self._image(i) for i in indices))
        if isinstance(self.transform, CropFlipNormalize):
            return list(zip(self.transform.batch(list(images), seeds), labels))
        return [(torch_seeded(s, self.transform, im) if self.transform else im, y)
                for im, y, s in zip(images, labels, seeds)]

    def _image(self, index):
        if self.cache is not None and index in self.cache:
            return self.cache[index]
        image, label = self._render(index)
        if self.cache is not None:
            self.cache[index] = image, label
        return image, label

    def _render(self, index):
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(self.num_classes))
        s = self.image_size
        background = rng.integers(0, 90, size=(s, s, 3), dtype=np.uint8)
        image = Image.fromarray(background)
        shape, colour = self._kinds()[label]
        colour = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in colour)
        r = s * rng.uniform(0.18, 0.32)
        cx, cy = rng.uniform(r, s - r, size=2)
        _draw(ImageDraw.Draw(image), shape, cx, cy, r, colour)
        return T.functional.pil_to_tensor(image), label


def _draw(draw, shape, cx, cy, r, colour):
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx + r * math.cos(a), cy + r * math.sin(a))
                      for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)], fill=colour)
    elif shape == "cross":
        draw.rectangle((cx - r, cy - r / 3, cx + r, cy + r / 3), fill=colour)
        draw.rectangle((cx - r / 3, cy - r, cx + r / 3, cy + r), fill=colour)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=max(2, int(r / 3)))
    else:  # bar
        draw.rectangle((cx - r, cy - r / 4, cx + r, cy + r / 4), fill=colour)


@DATASETS.register(inputs="image", ranges={
    "num_classes": Range(ge=2, le=len(SHAPES) * len(COLOURS)), "train_size": Range(ge=1), "val_size": Range(ge=1),
    "image_size": Range(ge=1, le=4096), "seed": Range(ge=0),
    "train_crop_scale": Range(gt=0, le=1, length=2, increasing=True), "hflip_prob": Range(ge=0, le=1)})
def synthetic_classification(num_classes=6, train_size=1200, val_size=300, image_size=64, seed=0,
                             train_crop_scale=(0.6, 1.0), hflip_prob=0.5):
    """Built-in, offline: generated on the fly, so nothing needs to be downloaded."""
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    train = SyntheticClassification(train_size, num_classes, image_size, seed, CropFlipNormalize(
        image_size, train_crop_scale, hflip_prob, mean=mean, std=std))
    val = SyntheticClassification(val_size, num_classes, image_size, seed + 1_000_003,
                          eval_preset(image_size, image_size, mean, std))
    return _splits(train, val, train.classes)
