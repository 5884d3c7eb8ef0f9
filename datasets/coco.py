"""COCO detection (and the built-in `shapes` set, written as COCO): loaders, presets, samplers.

Images and annotations come from pycocotools through `torchvision.datasets.CocoDetection` and
`wrap_dataset_for_transforms_v2` (tv_tensors: XYXY BoundingBoxes, Masks). On top of that:
crowd annotations and degenerate boxes are kept out of the targets, category ids are mapped to
contiguous labels 1..K (0 is the background) and back for results, and training may drop the
images without annotations while evaluation keeps them all.
"""
import bisect
import json
import logging
import math
import os
from collections import defaultdict
from functools import partial
from itertools import chain, repeat

import numpy as np
import torch
from torch.utils.data import BatchSampler, Dataset
from torchvision import tv_tensors
from torchvision.datasets import CocoDetection, VisionDataset, wrap_dataset_for_transforms_v2
from torchvision.transforms import v2 as T
from torchvision.transforms.v2._utils import get_bounding_boxes, query_size

from PIL import Image

from datasets.base import DataSplits, Skipped, problem, read_image, read_or_skip
from datasets.shapes import ensure_shapes
from engine.errors import BadSample, DataError, MissingData
from evaluators.coco import CocoEvaluator, load_gt
from engine.config import ConfigError
from engine.paths import OutsideFolder, join_inside
from engine.registry import DATASETS, Range

log = logging.getLogger(__name__)

COCO_LAYOUT = """  {root}/{train_dir}/*.jpg
  {root}/{val_dir}/*.jpg
  {root}/annotations/instances_{train_split}{year}.json
  {root}/annotations/instances_{val_split}{year}.json"""
SHAPES_HINT = ("no COCO at hand? train on the built-in synthetic shapes data (generated offline, a real COCO "
               "data set): python train.py --config configs/shapes_demo.yaml (SSDlite, ~6 min on 2 CPU cores) or "
               "--config configs/shapes_ssd300.yaml (SSD300-VGG16)")


# ---------------------------------------------------------------- presets (transforms v2)

class _IfBoxes(T.Transform):
    """Apply a box-driven transform (RandomIoUCrop) only to samples that have boxes."""

    def __init__(self, transform):
        super().__init__()
        self.inner = transform

    def forward(self, *inputs):
        sample = inputs if len(inputs) > 1 else inputs[0]
        target = sample[1] if isinstance(sample, (tuple, list)) and len(sample) > 1 else None
        if isinstance(target, dict) and "boxes" in target and len(target["boxes"]) == 0:
            return sample
        return self.inner(*inputs)


class IoUCrop(T.RandomIoUCrop):
    """torchvision's RandomIoUCrop, the same random draws and the same crops (tests/test_recipes.py),
    its trial loop vectorised: one torch.rand for a round's trials (rand(k) draws what k rand(1) do),
    all trials scored at once on numpy float32 (as torch's float32 ops round), then the generator
    rewound and advanced by what torchvision's loop would have drawn. Trial by trial, it was most
    of a shapes sample's loading time."""

    def make_params(self, flat_inputs):
        orig_h, orig_w = query_size(flat_inputs)
        boxes = get_bounding_boxes(flat_inputs)
        xyxy = T.functional.convert_bounding_box_format(boxes.as_subclass(torch.Tensor), boxes.format,
                                                        tv_tensors.BoundingBoxFormat.XYXY).numpy()
        half = np.float32(0.5)
        cx, cy = half * (xyxy[:, 0] + xyxy[:, 2]), half * (xyxy[:, 1] + xyxy[:, 3])
        area = (xyxy[:, 2] - xyxy[:, 0]) * (xyxy[:, 3] - xyxy[:, 1])
        low, span = np.float32(self.min_scale), np.float32(self.max_scale - self.min_scale)
        while True:
            min_iou = self.options[int(torch.randint(low=0, high=len(self.options), size=(1,)))]
            if min_iou >= 1.0:  # leave the sample as it is
                return dict()
            state = torch.get_rng_state()
            u = torch.rand(4 * self.trials).numpy().reshape(-1, 2)  # enough for every trial's 2 + 2 draws
            size = ((low + span * u) * np.array([orig_w, orig_h], dtype=np.float32)).astype(np.int64)
            with np.errstate(divide="ignore", invalid="ignore"):
                fits = (self.min_aspect_ratio <= size[:, 0] / size[:, 1]) & (size[:, 0] / size[:, 1] <= self.max_aspect_ratio)
            at, scored = 0, []  # torchvision's loop: 2 draws per trial, 2 more where the aspect ratio fits
            for _ in range(self.trials):
                if fits[at]:
                    scored.append(at)
                    at += 2
                else:
                    at += 1
            used, k = at, None  # k: the first trial that gives a crop
            if scored:
                t = np.array(scored)
                w, h = size[t, 0], size[t, 1]
                left = ((orig_w - w).astype(np.float32) * u[t + 1, 0]).astype(np.int64)
                top = ((orig_h - h).astype(np.float32) * u[t + 1, 1]).astype(np.int64)
                right, bottom = left + w, top + h
                within = ((left[:, None] < cx) & (cx < right[:, None]) & (top[:, None] < cy) & (cy < bottom[:, None]))
                crop = np.stack([left, top, right, bottom], 1).astype(np.float32)[:, None, :]
                wh = np.clip(np.minimum(xyxy[:, 2:], crop[..., 2:]) - np.maximum(xyxy[:, :2], crop[..., :2]), 0, None)
                inter = wh[..., 0] * wh[..., 1]
                iou = inter / (area + (crop[..., 2] - crop[..., 0]) * (crop[..., 3] - crop[..., 1]) - inter)
                best = np.where(within, iou, -np.inf).max(1, initial=-np.inf)
                ok = (w > 0) & (h > 0) & within.any(1) & (best >= np.float32(min_iou))
                if ok.any():
                    k = int(ok.argmax())
                    used = int(t[k]) + 2
            torch.set_rng_state(state)
            torch.rand(2 * used)  # the generator where torchvision's loop leaves it
            if k is not None:
                return dict(top=int(top[k]), left=int(left[k]), height=int(h[k]), width=int(w[k]),
                            is_within_crop_area=torch.from_numpy(np.ascontiguousarray(within[k])))


def train_preset(name="ssd", hflip_prob=0.5, mean=(123.0, 117.0, 104.0)):
    """torchvision's references/detection/presets.py DetectionPresetTrain (use_v2), with its
    transforms' default parameters. Boxes are clamped to the image first, as the reference's
    ConvertCocoPolysToMask does (SanitizeBoundingBoxes would drop a box that pokes past the border),
    and again after the augmentation; SanitizeBoundingBoxes then drops only the boxes left
    degenerate (under 1 pixel wide or high)."""
    if name == "ssd":
        fill = {tv_tensors.Mask: 0, "others": tuple(mean)}
        steps = [T.RandomPhotometricDistort(), T.RandomZoomOut(fill=fill), _IfBoxes(IoUCrop()),
                 T.RandomHorizontalFlip(p=hflip_prob)]
    elif name == "ssdlite":
        steps = [_IfBoxes(IoUCrop()), T.RandomHorizontalFlip(p=hflip_prob)]
    elif name == "hflip":
        steps = [T.RandomHorizontalFlip(p=hflip_prob)]
    elif name == "none":
        steps = []
    else:
        raise ConfigError(f"data.augmentation: expected ssd, ssdlite, hflip or none, got {name!r}")
    return T.Compose([T.ToImage(), T.ClampBoundingBoxes(), *steps, T.ToDtype(torch.float, scale=True),
                      T.ConvertBoundingBoxFormat(tv_tensors.BoundingBoxFormat.XYXY),
                      T.ClampBoundingBoxes(), T.SanitizeBoundingBoxes(), T.ToPureTensor()])


def eval_preset():
    """No resizing: the detector resizes internally and maps boxes back to the image's pixels."""
    return T.Compose([T.ToImage(), T.ToDtype(torch.float, scale=True), T.ToPureTensor()])


# ---------------------------------------------------------------- annotations

def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _id(v):
    return isinstance(v, (int, str)) and not isinstance(v, bool)


def read_annotations_json(ann_file, what, lists):
    """The JSON object of an annotations file, with the given top-level lists; a DataError naming the
    file (and JSON's line and column) otherwise."""
    try:
        with open(ann_file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{ann_file}: not valid JSON ({e}); expected a {what} file") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in lists):
        raise DataError(f"{ann_file}: not a {what} file (expected an object with lists "
                        f"{', '.join(repr(k) for k in ('images', 'annotations', 'categories'))})")
    return data


def kept_inside(folder, name, where):
    """Whether a record's file name stays inside its folder (engine.paths.join_inside); one that leads
    out is a problem() naming `where` (the file and record), so the caller leaves the record out."""
    try:
        join_inside(folder, name, where, resolve=False)  # reading: the folder's own symlinks are its layout
        return True
    except OutsideFolder as e:
        problem(e)
        return False


def image_records(data, ann_file, img_folder=None):
    """{image id: record} of the file's 'images', each with an id, file_name, width and height, ids
    unique; with img_folder, each file must be there, its name inside the folder (else OutsideFolder).
    A record that fails is a DataError (under datasets.base.collecting_problems: recorded, and the
    record left out of data['images'])."""
    files = set(os.listdir(img_folder)) if img_folder else None
    images = {}
    for img in data["images"]:
        if not (isinstance(img, dict) and isinstance(img.get("file_name"), str) and _id(img.get("id"))
                and all(_number(img.get(k)) and img[k] > 0 for k in ("width", "height"))):
            problem(DataError(f"{ann_file}: image record {str(img)[:120]}: expected id, file_name, width, height"))
            continue
        if img["id"] in images:
            problem(DataError(f"{ann_file}: image id {img['id']} appears twice"))
            continue
        name = img["file_name"]
        if img_folder and not kept_inside(img_folder, name, f"{ann_file}: image {img['id']!r:.40}: file_name"):
            continue
        if files is not None and name not in files and not os.path.isfile(os.path.join(img_folder, name)):
            problem(DataError(f"{ann_file}: image {img['id']}: file not found: "
                              f"{os.path.abspath(os.path.join(img_folder, name))}"))
            continue
        images[img["id"]] = img
    if len(images) < len(data["images"]):
        data["images"] = list(images.values())
    return images


SIZE_CHECK_LIMIT = 20000  # splits up to this size have their image headers read before training (~0.1 ms each)
ROTATED = {5, 6, 7, 8}    # EXIF orientations that a viewer shows turned by 90 degrees


def image_header(path):
    """(width, height, EXIF orientation or 1) from an image file's header, no pixels decoded; a
    BadSample names the file PIL cannot open."""
    try:
        with Image.open(path) as im:
            return im.width, im.height, int(im.getexif().get(0x0112, 1) or 1)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ...
        raise BadSample(path, f"cannot read image ({type(e).__name__}: {e})") from None


def size_mismatch(info, width, height, ann_file):
    """Why an image whose decoded size differs from its record's width and height is wrong (its boxes
    would be misaligned), or None."""
    if (width, height) == (info["width"], info["height"]):
        return None
    return (f"image {info['id']} decodes to {width}x{height} but {ann_file} says "
            f"{info['width']}x{info['height']} (its boxes would be misaligned)")


def check_image_sizes(coco, img_folder, ann_file, allow=False, limit=None):
    """Before training: the header of every image of a split of at most `limit` images against its
    record. Mismatches are counted; refused (DataError listing them) unless `allow`
    (data.allow_size_mismatch), when they are logged. A larger split is checked as each image is read
    (_CocoImages). limit None: SIZE_CHECK_LIMIT. -> [message per mismatch]."""
    if len(coco.imgs) > (SIZE_CHECK_LIMIT if limit is None else limit):
        return []
    found = []
    for info in coco.imgs.values():
        path = os.path.join(img_folder, info["file_name"])
        try:
            width, height, _ = image_header(path)
        except BadSample:  # an unreadable file is the reader's to report (read_or_skip)
            continue
        message = size_mismatch(info, width, height, ann_file)
        if message:
            found.append(f"{path}: {message}")
    if found:
        summary = (f"{ann_file}: {len(found)} of {len(coco.imgs)} images decode to another size than their record "
                   f"says: {'; '.join(found[:5])}{' ...' if len(found) > 5 else ''}")
        if allow:
            log.warning("%s (data.allow_size_mismatch: true trains on them as they are)", summary)
        else:
            problem(DataError(f"{summary}; fix the records' width and height, or set data.allow_size_mismatch: "
                              f"true to train on them as they are"))
    return found


def load_annotations(ann_file, img_folder):
    """The COCO annotations dict of ann_file, checked before training: an error (DataError) names the
    file and the record (image id / annotation id) for JSON that is not JSON, an image whose file is
    missing, an annotation of an unknown image or category, a bbox that is not 4 finite numbers.
    Boxes that are merely off (negative size, outside the image) follow the loader's policy (clamped
    to the image, dropped when empty) and are counted: -> (dataset dict, {problem: [annotation ids]})."""
    data = read_annotations_json(ann_file, "COCO annotations", ("images", "categories"))
    return check_annotations(data, ann_file, img_folder)


def check_annotations(data, ann_file, img_folder, origins=None):
    """load_annotations' checks of a COCO dict already in memory (the VOC and YOLO loaders convert their
    label files to one; ann_file then names their folder). origins: {annotation id: 'file: line N'},
    named in the warning instead of the ids."""
    data.setdefault("annotations", [])
    listed = {img.get("id") for img in data["images"] if isinstance(img, dict) and _id(img.get("id"))}
    images = image_records(data, ann_file, img_folder)
    categories = set()
    for cat in data["categories"]:
        if not (isinstance(cat, dict) and _id(cat.get("id"))):
            raise DataError(f"{ann_file}: category record {str(cat)[:120]}: expected an id and a name")
        categories.add(cat["id"])
    issues = {"negative size (dropped)": [], "outside the image (clamped)": [], "empty after clamping (dropped)": []}
    kept = []
    for ann in data["annotations"]:
        if not (isinstance(ann, dict) and _id(ann.get("id"))):
            problem(DataError(f"{ann_file}: annotation record {str(ann)[:120]}: expected an object with an id"))
            continue
        where = f"{ann_file}: annotation {ann['id']} (image {ann.get('image_id')!r:.40})"
        if not _id(ann.get("image_id")) or ann["image_id"] not in images:
            if ann.get("image_id") not in listed:  # else its image record was reported (collecting_problems)
                problem(DataError(f"{where}: image_id {ann.get('image_id')!r} is not among the images of the file"))
            continue
        if not _id(ann.get("category_id")) or ann["category_id"] not in categories:
            problem(DataError(f"{where}: unknown category id {ann.get('category_id')!r} (categories: "
                              f"{sorted(categories, key=str)[:20]}{' ...' if len(categories) > 20 else ''})"))
            continue
        box = ann.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(map(_number, box))):
            problem(DataError(f"{where}: bbox must be [x, y, width, height] (4 finite numbers), got {str(box)[:80]}"))
            continue
        kept.append(ann)
        x, y, w, h = box
        img = images[ann["image_id"]]
        if w < 0 or h < 0:
            issues["negative size (dropped)"].append(ann["id"])
        elif x < 0 or y < 0 or x + w > img["width"] or y + h > img["height"]:
            x1, y1 = min(max(x, 0), img["width"]), min(max(y, 0), img["height"])
            x2, y2 = min(max(x + w, 0), img["width"]), min(max(y + h, 0), img["height"])
            empty = x2 <= x1 or y2 <= y1
            issues["empty after clamping (dropped)" if empty else "outside the image (clamped)"].append(ann["id"])
    if len(kept) < len(data["annotations"]):
        data["annotations"] = kept
    issues = {k: v for k, v in issues.items() if v}
    if issues:
        def named(ids):
            return f"annotation ids {ids[:10]}" if origins is None else "; ".join(origins[i] for i in ids[:10])
        log.warning("%s: boxes %s", ann_file, "; ".join(
            f"{len(v)} {k}: {named(v)}{' ...' if len(v) > 10 else ''}" for k, v in issues.items()))
    return data, issues


def keep_categories(data, issues, names, ann_file):
    """data.categories: the COCO dict with only the categories named (others' annotations dropped), and
    the box issues of those kept; -> their ids in the order of `names`. A name the file does not have
    is a DataError naming it and the file."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names) or not names:
        raise ConfigError(f"data.categories: expected a list of category names, got {names!r}")
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        raise ConfigError(f"data.categories: {twice} named twice")
    by_name = {}
    for cat in data["categories"]:
        by_name.setdefault(cat.get("name"), cat["id"])
    unknown = [n for n in names if n not in by_name]
    if unknown:
        known = sorted(str(n) for n in by_name)
        raise DataError(f"{ann_file}: data.categories {unknown} are not among its categories "
                        f"({', '.join(known[:30])}{' ...' if len(known) > 30 else ''})")
    ids = [by_name[n] for n in names]
    kept = set(ids)
    data["categories"] = [c for c in data["categories"] if c["id"] in kept]
    data["annotations"] = [a for a in data["annotations"] if a["category_id"] in kept]
    left = {a["id"] for a in data["annotations"]}
    for kind in list(issues):
        issues[kind] = [i for i in issues[kind] if i in left]
        if not issues[kind]:
            del issues[kind]
    return ids


# ---------------------------------------------------------------- dataset

class _CocoImages(CocoDetection):
    """torchvision's CocoDetection on an already loaded COCO object; unreadable images are BadSamples."""

    def __init__(self, root, coco, ann_file=None, check_size=False):
        VisionDataset.__init__(self, root)
        self.coco, self.ids = coco, sorted(coco.imgs)
        self.ann_file, self.check_size = ann_file, check_size

    def _load_image(self, id):
        info = self.coco.imgs[id]
        path = os.path.join(self.root, info["file_name"])
        image = read_image(path)
        if self.check_size:  # a split too large for the check before training (check_image_sizes)
            message = size_mismatch(info, image.width, image.height, self.ann_file)
            if message:
                raise BadSample(path, f"{message}; data.allow_size_mismatch: true trains on it")
        return image


class CocoDetectionDataset(Dataset):
    """(image, target) with target = {boxes [N,4] XYXY, labels [N] in 1..K, image_id, masks?}.
    Boxes are clamped to the image and empty ones dropped (counted in `box_issues` at load time).
    skip_bad_samples: an unreadable image becomes a Skipped marker (left out by the batch collate).
    cache_images: keep each decoded image (uint8) and its target in memory after the first read, for
    small data sets such as the built-in shapes (the transforms, which start with ToImage, still run).
    allow_size_mismatch: images whose decoded size differs from their record are refused (a DataError
    before training, listing them; a BadSample when read in a split over SIZE_CHECK_LIMIT images)
    unless this is set; `size_mismatches` lists those found before training."""

    def __init__(self, img_folder, ann_file, transforms=None, cat_ids=None, drop_empty=False,
                 masks=False, keep_crowd=False, skip_bad_samples=False, cache_images=False,
                 allow_size_mismatch=False, categories=None, annotations=None, origins=None):
        # annotations: a COCO dict made in memory (VOC, YOLO; ann_file names their folder), else ann_file is read;
        # categories: names of the categories kept (their order is the labels'), the others' annotations dropped
        if annotations is None:
            dataset, self.box_issues = load_annotations(ann_file, img_folder)
        else:
            dataset, self.box_issues = check_annotations(annotations, ann_file, img_folder, origins)
        if categories is not None:
            subset = keep_categories(dataset, self.box_issues, categories, ann_file)
            cat_ids = subset if cat_ids is None else cat_ids
        coco = load_gt(dataset)
        self.size_mismatches = check_image_sizes(coco, img_folder, ann_file, allow_size_mismatch)
        base = _CocoImages(img_folder, coco, ann_file,
                           check_size=not allow_size_mismatch and len(coco.imgs) > SIZE_CHECK_LIMIT)
        keys = ("boxes", "labels", "image_id", "iscrowd") + (("masks",) if masks else ())
        self.base = wrap_dataset_for_transforms_v2(base, target_keys=keys)
        self.coco = base.coco
        self.img_folder, self.ann_file = img_folder, ann_file
        self.transforms, self.masks, self.keep_crowd = transforms, masks, keep_crowd
        self.skip_bad_samples = skip_bad_samples
        # contiguous labels: 1..K in the order of category ids (or the ids themselves, cat_ids=None)
        self.cat_ids = sorted(self.coco.getCatIds()) if cat_ids is None else list(cat_ids)
        self.cat_to_label = {c: i + 1 for i, c in enumerate(self.cat_ids)}
        self.label_to_cat = {i + 1: c for i, c in enumerate(self.cat_ids)}
        self.indices = list(range(len(base)))
        if drop_empty:
            self.indices = [i for i in self.indices if self._has_valid_annotation(base.ids[i])]
        self.image_ids = [base.ids[i] for i in self.indices]
        self.cache = {} if cache_images else None

    def _has_valid_annotation(self, image_id):
        anns = self.coco.imgToAnns.get(image_id, [])
        return any(not a.get("iscrowd", 0) and a["bbox"][2] > 1 and a["bbox"][3] > 1 for a in anns)

    def __len__(self):
        return len(self.indices)

    def aspect_ratios(self):
        return [self.coco.imgs[i]["width"] / self.coco.imgs[i]["height"] for i in self.image_ids]

    def __getitem__(self, index):
        if self.cache is not None and index in self.cache:
            image, target = self.cache[index]
        else:
            item = read_or_skip(partial(self.base.__getitem__, self.indices[index]), self.skip_bad_samples)
            if isinstance(item, Skipped):
                return item
            image, target = self._target(*item, self.image_ids[index])
            if self.cache is not None:
                image = T.functional.to_image(image)
                self.cache[index] = image, target
        if self.transforms is not None:
            return self.transforms(image, dict(target))
        return image, target

    def _target(self, image, target, image_id):
        info = self.coco.imgs[image_id]
        canvas = (info["height"], info["width"])
        boxes = target.get("boxes")
        if boxes is None:  # no annotation at all: the v2 wrapper returns only image_id
            boxes = tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=canvas)
        boxes = T.functional.clamp_bounding_boxes(boxes)  # boxes past the image's border: clamped
        labels = target.get("labels", torch.zeros(0, dtype=torch.int64))
        crowd = torch.as_tensor(target.get("iscrowd", [0] * len(labels)), dtype=torch.bool)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        if not self.keep_crowd:
            keep &= ~crowd
        unknown = [int(c) for c in labels[keep] if int(c) not in self.cat_to_label]
        if unknown:
            raise DataError(f"{self.ann_file}: image {image_id} has annotations of category ids "
                            f"{sorted(set(unknown))} that are not among the categories {self.cat_ids}")
        out = {"boxes": tv_tensors.wrap(boxes[keep], like=boxes),
               "labels": torch.tensor([self.cat_to_label[int(c)] for c in labels[keep]], dtype=torch.int64),
               "image_id": image_id}
        if self.keep_crowd:
            out["iscrowd"] = crowd[keep].long()
        if self.masks:
            masks = target.get("masks")
            if masks is None:
                masks = tv_tensors.Mask(torch.zeros(0, *canvas, dtype=torch.uint8))
            out["masks"] = tv_tensors.Mask(masks[keep])
        return image, out


def require_usable(dataset, split, drop_empty=False):
    """An empty split is a DataError naming its annotation file, before training (not a sampler's
    `num_samples=0`)."""
    annotations, images = dataset.coco.dataset["annotations"], dataset.coco.imgs
    if not annotations or not images:
        raise DataError(f"{dataset.ann_file}: holds no usable annotation for {split} ({len(annotations)} "
                        f"annotations, {len(images)} images): an empty split")
    if not len(dataset):
        raise DataError(f"{dataset.ann_file}: holds no usable annotation for {split}: none of its {len(annotations)} "
                        f"annotations is a non-crowd box over 1 px" + (", and data.drop_empty_train leaves images "
                                                                       "without one out" if drop_empty else ""))


def collate(batch):
    """Detection batches: (tuple of images, tuple of target dicts); sizes may differ."""
    return tuple(zip(*batch))


# ---------------------------------------------------------------- aspect-ratio grouping

class GroupedBatchSampler(BatchSampler):
    """torchvision's references/detection/group_by_aspect_ratio.py: batches hold images of one
    aspect-ratio group. Wraps any sampler (RandomSampler, DistributedSampler), keeps `.sampler`
    for set_epoch, and yields len(sampler) // batch_size batches, topping up the last ones."""

    def __init__(self, sampler, group_ids, batch_size):
        self.sampler, self.group_ids, self.batch_size = sampler, list(group_ids), batch_size
        self.drop_last = True

    def __iter__(self):
        buffer_per_group, samples_per_group = defaultdict(list), defaultdict(list)
        num_batches = 0
        for idx in self.sampler:
            group = self.group_ids[idx]
            buffer_per_group[group].append(idx)
            samples_per_group[group].append(idx)
            if len(buffer_per_group[group]) == self.batch_size:
                yield buffer_per_group.pop(group)
                num_batches += 1
        remaining = len(self) - num_batches
        for group, buffer in sorted(buffer_per_group.items(), key=lambda x: len(x[1]), reverse=True):
            if remaining <= 0:
                break
            need = self.batch_size - len(buffer)
            pool = list(chain.from_iterable(repeat(samples_per_group[group], math.ceil(need / len(
                samples_per_group[group])) + 1)))
            yield buffer + pool[:need]
            remaining -= 1

    def __len__(self):
        return len(self.sampler) // self.batch_size


def aspect_ratio_groups(aspect_ratios, k=3):
    """Group ids from 2k+1 log-spaced bins of width/height between 0.5 and 2 (torchvision)."""
    bins = (2 ** np.linspace(-1, 1, 2 * k + 1)).tolist() if k > 0 else [1.0]
    return [bisect.bisect_right(sorted(bins), a) for a in aspect_ratios]


def grouped_batch_sampler_factory(group_factor):
    def build(dataset, sampler, batch_size):
        if group_factor is None or group_factor < 0:
            return BatchSampler(sampler, batch_size, drop_last=True)
        return GroupedBatchSampler(sampler, aspect_ratio_groups(dataset.aspect_ratios(), group_factor), batch_size)
    return build


# ---------------------------------------------------------------- builders

def _coco_splits(root, train_split, val_split, year, train_images, val_images, train_annotations,
                 val_annotations, augmentation, hflip_prob, aspect_ratio_group_factor, drop_empty_train,
                 masks, contiguous_labels, eval_backend, dataset_name, hint="", skip_bad_samples=False,
                 cache_images=False, allow_size_mismatch=False, categories=None):
    def paths(split, images, annotations):
        img = images or os.path.join(root, f"{split}{year}")
        ann = annotations or os.path.join(root, "annotations", f"instances_{split}{year}.json")
        return img, ann

    train_img, train_ann = paths(train_split, train_images, train_annotations)
    val_img, val_ann = paths(val_split, val_images, val_annotations)
    missing = [p for p in (train_img, val_img) if not os.path.isdir(p)]
    missing += [p for p in (train_ann, val_ann) if not os.path.isfile(p)]
    if missing:
        layout = COCO_LAYOUT.format(root=root, train_dir=os.path.basename(train_img),
                                    val_dir=os.path.basename(val_img), train_split=train_split,
                                    val_split=val_split, year=year)
        raise MissingData(
            f"{dataset_name}: not found: {', '.join(os.path.abspath(p) for p in dict.fromkeys(missing))}\n"
            f"expected layout (COCO 2017 from https://cocodataset.org/#download: train2017.zip, "
            f"val2017.zip, annotations_trainval2017.zip unpacked into data.root):\n{layout}\n"
            f"set data.root (or data.train_split / data.val_split / data.year) with --set"
            + (f"\n{hint}" if hint else ""))
    common = dict(masks=masks, skip_bad_samples=skip_bad_samples, cache_images=cache_images,
                  allow_size_mismatch=allow_size_mismatch, categories=categories)
    files = {"train": (train_img, train_ann), "val": (val_img, val_ann)}

    def make(split, transforms, **kwargs):
        return CocoDetectionDataset(*files[split], transforms, **common, **kwargs)
    return detection_splits(make, dataset_name, val_img, augmentation, hflip_prob, aspect_ratio_group_factor,
                            drop_empty_train, contiguous_labels, eval_backend, skip_bad_samples)


def detection_splits(make, dataset_name, val_img, augmentation, hflip_prob, aspect_ratio_group_factor,
                     drop_empty_train, contiguous_labels, eval_backend, skip_bad_samples):
    """The DataSplits of a detection data set whose splits make(split, transforms, **kwargs) builds as
    CocoDetectionDatasets ('train', 'val'): the COCO loader's and the VOC and YOLO loaders' (their
    ground truth converted to a COCO dict in memory): presets, labels, sampler, evaluator."""
    val = make("val", eval_preset())
    cat_ids = val.cat_ids
    if not contiguous_labels:  # labels are the category ids themselves
        cat_ids = list(range(1, max(val.cat_ids) + 1))
        val = make("val", eval_preset(), cat_ids=cat_ids)
    train = make("train", train_preset(augmentation, hflip_prob), cat_ids=cat_ids, drop_empty=drop_empty_train)
    if sorted(train.coco.getCatIds()) != sorted(val.coco.getCatIds()):
        raise DataError(f"{dataset_name}: {train.ann_file} and {val.ann_file} have different categories")
    require_usable(val, "evaluation")
    require_usable(train, "training", drop_empty_train)
    names = {c["id"]: c["name"] for c in val.coco.loadCats(val.coco.getCatIds())}
    classes = ["__background__"] + [names.get(c, f"unused_{c}") for c in cat_ids]
    coco_gt, label_to_cat = val.coco, dict(val.label_to_cat)
    if not contiguous_labels:
        label_to_cat = {c: c for c in cat_ids if c in names}
    return DataSplits(
        train=train, val=val, collate_fn=collate, classes=classes,
        train_batch_sampler=grouped_batch_sampler_factory(aspect_ratio_group_factor),
        model_defaults={"num_classes": len(cat_ids) + 1},
        evaluator=lambda: CocoEvaluator(coco_gt, label_to_cat, backend=eval_backend, img_folder=val_img)
    ).skip_bad_samples(skip_bad_samples)


@DATASETS.register(inputs="image", doctor="coco", ranges={"hflip_prob": Range(ge=0, le=1),
                                          "aspect_ratio_group_factor": Range(ge=-1)})  # -1: no grouping
def coco_detection(root="data/coco", train_split="train", val_split="val", year="2017", train_images=None,
                   val_images=None, train_annotations=None, val_annotations=None, augmentation="ssd",
                   hflip_prob=0.5, aspect_ratio_group_factor=3, drop_empty_train=True, masks=False,
                   contiguous_labels=True, eval_backend="auto", skip_bad_samples=False, cache_images=False,
                   allow_size_mismatch=False, categories=None):
    """COCO layout: ROOT/{split}{year}/ and ROOT/annotations/instances_{split}{year}.json.

    contiguous_labels: labels 1..K (num_classes K+1); false keeps COCO's category ids as labels
    (num_classes 91 on COCO, as torchvision's pretrained detectors expect).
    skip_bad_samples: leave unreadable images out of their batch (logged, counted per epoch).
    cache_images: keep decoded images in memory (small data sets only: COCO train2017 would need ~60 GB).
    allow_size_mismatch: train on images whose decoded size differs from their record's width and
    height (counted and logged); by default they are refused, naming each file.
    categories: train on these category names only (labels 1..K in this order; the other categories'
    annotations dropped, their images kept as images without objects); a name not in the file is an error.
    """
    return _coco_splits(root, train_split, val_split, year, train_images, val_images, train_annotations,
                        val_annotations, augmentation, hflip_prob, aspect_ratio_group_factor, drop_empty_train,
                        masks, contiguous_labels, eval_backend, "coco_detection", SHAPES_HINT, skip_bad_samples,
                        cache_images, allow_size_mismatch, categories)


@DATASETS.register(inputs="image", doctor="coco", ranges={
    "seed": Range(ge=0), "num_train": Range(ge=1), "num_val": Range(ge=1), "image_size": Range(ge=1, le=4096),
    "num_categories": Range(ge=1, le=6), "max_objects": Range(ge=1), "min_scale": Range(gt=0, lt=0.5),
    "max_scale": Range(gt=0, lt=0.5), "hflip_prob": Range(ge=0, le=1), "aspect_ratio_group_factor": Range(ge=-1)})
def shapes(root=None, seed=0, num_train=1000, num_val=200, image_size=256, num_categories=3, max_objects=4,
           min_scale=0.1, max_scale=0.28, augmentation="ssdlite", hflip_prob=0.5, aspect_ratio_group_factor=3,
           drop_empty_train=True, masks=False, eval_backend="auto", cache_images=True, skip_bad_samples=False,
           allow_size_mismatch=False):
    """Built-in synthetic shapes, generated once as a COCO data set (see datasets/shapes.py); its
    decoded images are kept in memory (cache_images; 1000 images of 192 px: 110 MB).
    skip_bad_samples, allow_size_mismatch: as coco_detection's."""
    root = ensure_shapes(root, seed=seed, num_train=num_train, num_val=num_val, image_size=image_size,
                         num_categories=num_categories, max_objects=max_objects, min_scale=min_scale,
                         max_scale=max_scale)
    return _coco_splits(root, "train", "val", "2017", None, None, None, None, augmentation, hflip_prob,
                        aspect_ratio_group_factor, drop_empty_train, masks, True, eval_backend, "shapes",
                        skip_bad_samples=skip_bad_samples, cache_images=cache_images,
                        allow_size_mismatch=allow_size_mismatch)
