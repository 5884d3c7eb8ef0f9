"""Semantic segmentation data: COCO (a category subset, VOC's 20 by default), Pascal VOC, and the
shapes data set's semantic map (things and stuff), with torchvision's reference presets.

Samples are (image [3, H, W] float, mask [H, W] int64) with 255 = ignore. A mask value outside the
classes, an unreadable image or mask is a BadSample naming the file (data.skip_bad_samples skips it);
an annotation file or split list with nothing to learn from is a DataError when the data set is built. Batches are padded to
the largest sample (images with 0, masks with 255), so evaluation may use batches of any size.
"""
import os
from typing import Optional

import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.datasets import VOCSegmentation
from torchvision.transforms import v2 as T

from datasets.base import DataSplits, ReadDataset, read_image
from datasets.shapes import ensure_shapes
from engine.errors import BadSample, DataError, MissingData
from datasets.coco import kept_inside, load_annotations
from evaluators.coco import load_gt
from datasets.coco_panoptic import PNG_CHECK_LIMIT, check_pngs, load_panoptic, read_segments
from evaluators.segmentation import IGNORE_INDEX, SegmentationEvaluator
from engine.config import ConfigError
from engine.registry import DATASETS, Range

# torchvision's references/segmentation/coco_utils.py CAT_LIST: the COCO ids of VOC's 20 classes,
# in VOC's order (aeroplane, bicycle, bird, boat, bottle, bus, car, cat, chair, cow, diningtable,
# dog, horse, motorbike, person, pottedplant, sheep, sofa, train, tvmonitor) -> labels 1..20.
VOC_CATEGORIES_IN_COCO = [5, 2, 16, 9, 44, 6, 3, 17, 62, 21, 67, 18, 19, 4, 1, 64, 20, 63, 7, 72]
VOC_CLASSES = ["__background__", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
               "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
               "train", "tvmonitor"]
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# ---------------------------------------------------------------- presets (transforms v2)

def train_preset(base_size, crop_size, hflip_prob=0.5, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """references/segmentation/presets.py SegmentationPresetTrain: shorter side resized to a random
    size in [0.5, 2] x base_size, flip, random crop (padded: image 0, mask 255), normalise."""
    steps = [T.RandomResize(int(0.5 * base_size), int(2.0 * base_size))]
    if hflip_prob > 0:
        steps.append(T.RandomHorizontalFlip(hflip_prob))
    steps.append(T.RandomCrop(crop_size, pad_if_needed=True, fill={tv_tensors.Mask: IGNORE_INDEX, "others": 0}))
    return T.Compose([T.ToImage(), *steps, *_finish(mean, std)])


def eval_preset(base_size, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """SegmentationPresetEval: the shorter side resized to base_size, normalise."""
    return T.Compose([T.ToImage(), T.Resize(base_size), *_finish(mean, std)])


def _finish(mean, std):
    return [T.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64, "others": None}, scale=True),
            T.Normalize(mean, std), T.ToPureTensor()]


def collate(batch):
    """Stack samples padded to the largest: images with 0, masks with 255 (torchvision's cat_list)."""
    images, masks = zip(*batch)
    h = max(i.shape[-2] for i in images)
    w = max(i.shape[-1] for i in images)
    out_images = images[0].new_zeros(len(images), images[0].shape[0], h, w)
    out_masks = masks[0].new_full((len(masks), h, w), IGNORE_INDEX)
    for i, (image, mask) in enumerate(zip(images, masks)):
        out_images[i, :, : image.shape[-2], : image.shape[-1]] = image
        out_masks[i, : mask.shape[-2], : mask.shape[-1]] = mask
    return out_images, out_masks


class _SegmentationDataset(ReadDataset):
    """Subclasses give image(index) -> PIL RGB, mask(index) -> uint8 [H, W] numpy array, where(index) ->
    the file (and record) the mask comes from, and num_classes. A sample that cannot be used is a
    BadSample naming the file; with skip_bad_samples a Skipped marker (read_or_skip)."""

    num_classes = None

    def read(self, index):
        """(PIL image, Mask) with every mask value a class (0..num_classes-1) or the ignore index."""
        image, mask = self.image(index), self.mask(index)
        if mask.ndim != 2:
            raise BadSample(self.where(index), f"the mask has shape {mask.shape}: expected one class index per "
                                               f"pixel (a palette or greyscale PNG)")
        if self.num_classes is not None and mask.size and mask.max() >= self.num_classes:
            values = np.unique(mask[mask >= self.num_classes])
            bad = [int(v) for v in values if v != IGNORE_INDEX]
            if bad:
                raise BadSample(self.where(index), f"mask values {bad[:10]} are outside the classes "
                                                   f"0..{self.num_classes - 1} ({IGNORE_INDEX} = ignore)")
        return image, tv_tensors.Mask(torch.from_numpy(mask))


def read_mask(path):
    """A mask PNG's pixel values (palette indices or grey levels); BadSample when it cannot be decoded."""
    try:
        with open(path, "rb") as f:
            return np.array(Image.open(f))
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ...
        raise BadSample(path, f"cannot read mask ({type(e).__name__}: {e})") from None


def _splits(train, val, classes, skip_bad_samples=False):
    return DataSplits(train=train, val=val, collate_fn=collate, classes=classes,
                      model_defaults={"num_classes": len(classes)},
                      evaluator=lambda: SegmentationEvaluator(classes)).skip_bad_samples(skip_bad_samples)


def _missing(dataset, paths, layout, hint=""):
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise MissingData(f"{dataset}: not found: {', '.join(os.path.abspath(p) for p in missing)}\n"
                          f"expected layout:\n{layout}\nset data.root with --set data.root=PATH" +
                                (f"\n{hint}" if hint else ""))


# ---------------------------------------------------------------- COCO, a category subset

class CocoSegmentation(_SegmentationDataset):
    """Semantic masks built from COCO's instance polygons / RLE for a subset of categories, as
    torchvision's reference does: annotations of other categories are dropped, the kept ones get
    labels 1..K in the order of `categories`, pixels covered by two instances become 255, and with
    min_area the images whose kept annotations cover no more than min_area pixels are left out."""

    def __init__(self, img_folder, ann_file, categories=VOC_CATEGORIES_IN_COCO, transforms=None, min_area=None,
                 skip_bad_samples=False):
        self.coco = load_gt(load_annotations(ann_file, img_folder)[0])  # checked: DataError naming file and record
        unknown = [c for c in categories if c not in self.coco.cats]
        if unknown:
            raise ConfigError(f"{ann_file}: data.categories {unknown} are not category ids of this file")
        self.img_folder, self.ann_file, self.transforms = img_folder, ann_file, transforms
        self.skip_bad_samples = skip_bad_samples
        self.cat_to_label = {c: i + 1 for i, c in enumerate(categories)}
        self.num_classes = len(categories) + 1
        self.ids = sorted(self.coco.imgs)
        if not any(a["category_id"] in self.cat_to_label for a in self.coco.dataset["annotations"]):
            raise DataError(f"{ann_file}: holds no usable annotation (none of its "
                            f"{len(self.coco.dataset['annotations'])} annotations, on {len(self.ids)} images, is of "
                            f"data.categories {list(categories)[:20]})")
        if min_area is not None:  # references/segmentation/coco_utils.py _coco_remove_images_without_annotations
            self.ids = [i for i in self.ids if sum(a["area"] for a in self.annotations(i)) > min_area]
            if not self.ids:
                raise DataError(f"{ann_file}: holds no usable annotation (no image whose annotations of "
                                f"data.categories cover more than data.min_area={min_area} pixels)")

    def __len__(self):
        return len(self.ids)

    def annotations(self, image_id):
        """The image's annotations of the chosen categories (crowd regions included)."""
        return [a for a in self.coco.imgToAnns.get(image_id, []) if a["category_id"] in self.cat_to_label]

    def image(self, index):
        info = self.coco.imgs[self.ids[index]]
        return read_image(os.path.join(self.img_folder, info["file_name"]))

    def where(self, index):
        return f"{self.ann_file}, image {self.ids[index]}"

    def instance_masks(self, index):
        """(labels [K], masks uint8 [K, H, W]) of the kept instances, decoded by pycocotools."""
        image_id = self.ids[index]
        info = self.coco.imgs[image_id]
        anns = self.annotations(image_id)
        masks = np.zeros((len(anns), info["height"], info["width"]), np.uint8)
        for k, ann in enumerate(anns):
            masks[k] = self.coco.annToMask(ann)
        return np.array([self.cat_to_label[a["category_id"]] for a in anns], np.uint8), masks

    def mask(self, index):
        labels, masks = self.instance_masks(index)
        if len(labels) == 0:
            return np.zeros(masks.shape[1:], np.uint8)
        semantic = (masks * labels[:, None, None]).max(0)
        semantic[masks.sum(0) > 1] = IGNORE_INDEX  # overlapping instances: unknown class
        return semantic


COCO_LAYOUT = """  {root}/train2017/*.jpg, {root}/val2017/*.jpg
  {root}/annotations/instances_train2017.json, {root}/annotations/instances_val2017.json"""


@DATASETS.register(inputs="image", doctor="semantic",
                   ranges={"categories": Range(ge=1), "base_size": Range(ge=1, le=8192),
                           "crop_size": Range(ge=1, le=8192), "hflip_prob": Range(ge=0, le=1),
                           "min_area": Range(ge=0)})
def coco_segmentation(root="data/coco", train_split="train", val_split="val", year="2017",
                      categories=VOC_CATEGORIES_IN_COCO, base_size=520, crop_size=480, hflip_prob=0.5,
                      min_area=1000, skip_bad_samples=False):
    """COCO with semantic masks for `categories` (COCO category ids; default: torchvision's 20 VOC
    classes -> 21 classes with background). min_area: training images whose kept annotations cover
    no more area are dropped (torchvision: 1000 px); evaluation keeps every image.
    skip_bad_samples: leave unreadable images out of their batch (logged, counted per epoch)."""
    def paths(split):
        images = os.path.join(root, f"{split}{year}")
        return images, os.path.join(root, "annotations", f"instances_{split}{year}.json")

    (train_img, train_ann), (val_img, val_ann) = paths(train_split), paths(val_split)
    _missing("coco_segmentation", [train_img, val_img, train_ann, val_ann], COCO_LAYOUT.format(root=root),
             "no COCO at hand? configs/shapes_lraspp.yaml trains on the built-in shapes data")
    val = CocoSegmentation(val_img, val_ann, categories, eval_preset(base_size), skip_bad_samples=skip_bad_samples)
    train = CocoSegmentation(train_img, train_ann, categories, train_preset(base_size, crop_size, hflip_prob),
                             min_area=min_area, skip_bad_samples=skip_bad_samples)
    names = ["__background__"] + [val.coco.cats[c]["name"] for c in categories]
    if list(categories) == VOC_CATEGORIES_IN_COCO:
        names = list(VOC_CLASSES)
    return _splits(train, val, names, skip_bad_samples)


# ---------------------------------------------------------------- Pascal VOC

class VOCSegmentationDataset(_SegmentationDataset):
    num_classes = len(VOC_CLASSES)

    def __init__(self, root, year, image_set, transforms=None, skip_bad_samples=False):
        self.base = VOCSegmentation(root, year=year, image_set=image_set, download=False)
        self.transforms, self.skip_bad_samples = transforms, skip_bad_samples
        voc = os.path.join(root, "VOCdevkit", f"VOC{year}")
        split = os.path.join(voc, "ImageSets", "Segmentation", f"{image_set}.txt")
        with open(split) as f:  # the names torchvision joined as they are: each must stay in its folder
            names = [x.strip() for x in f.readlines()]
        keep = [i for i, name in enumerate(names)
                if all(kept_inside(os.path.join(voc, folder), name + ext, f"{split}: line {i + 1}: image name")
                       for folder, ext in (("JPEGImages", ".jpg"), ("SegmentationClass", ".png")))]
        if len(keep) < len(names):  # under collecting_problems: the others left out
            self.base.images = [self.base.images[i] for i in keep]
            self.base.targets = [self.base.targets[i] for i in keep]
        if not len(self.base):
            raise DataError(f"{split}: holds no usable annotation (no image names): an empty split")

    def __len__(self):
        return len(self.base)

    def image(self, index):
        return read_image(self.base.images[index])

    def mask(self, index):
        return read_mask(self.base.masks[index])  # palette indices: classes 0..20, 255 borders

    def where(self, index):
        return self.base.masks[index]


VOC_LAYOUT = """  {root}/VOCdevkit/VOC{year}/JPEGImages/*.jpg
  {root}/VOCdevkit/VOC{year}/SegmentationClass/*.png
  {root}/VOCdevkit/VOC{year}/ImageSets/Segmentation/{{train,val}}.txt"""


@DATASETS.register(inputs="image", doctor="semantic",
                   ranges={"base_size": Range(ge=1, le=8192), "crop_size": Range(ge=1, le=8192),
                           "hflip_prob": Range(ge=0, le=1)})
def voc_segmentation(root="data/voc", year="2012", train_set="train", val_set="val", base_size=520, crop_size=480,
                     hflip_prob=0.5, skip_bad_samples=False):
    """Pascal VOC (the standard VOCdevkit/VOC2012 layout): 21 classes, 255 on object borders.
    skip_bad_samples: leave unreadable images or masks, and masks with values outside the 21 classes
    (and 255), out of their batch (logged, counted per epoch)."""
    voc = os.path.join(root, "VOCdevkit", f"VOC{year}")
    _missing("voc_segmentation", [os.path.join(voc, d) for d in ("JPEGImages", "SegmentationClass")] +
             [os.path.join(voc, "ImageSets", "Segmentation", f"{s}.txt") for s in (train_set, val_set)],
             VOC_LAYOUT.format(root=root, year=year))
    train = VOCSegmentationDataset(root, year, train_set, train_preset(base_size, crop_size, hflip_prob),
                                   skip_bad_samples)
    val = VOCSegmentationDataset(root, year, val_set, eval_preset(base_size), skip_bad_samples)
    return _splits(train, val, list(VOC_CLASSES), skip_bad_samples)


# ---------------------------------------------------------------- shapes: things and stuff

class PanopticSemantic(_SegmentationDataset):
    """The semantic map of a COCO panoptic split (PNG ids -> segments -> categories): every
    category, thing or stuff, is a class (0..K-1, in the order of the JSON's categories); void
    pixels (id 0) and crowd segments are 255."""

    def __init__(self, img_folder, panoptic_json, png_folder, transforms=None, skip_bad_samples=False):
        data = load_panoptic(panoptic_json, png_folder, img_folder)  # checked: DataError naming file and record
        self.categories = data["categories"]
        self.cat_to_label = {c["id"]: i for i, c in enumerate(self.categories)}
        self.num_classes = len(self.categories)
        self.images = {img["id"]: img for img in data["images"]}
        self.annotations = data["annotations"]
        self.img_folder, self.png_folder, self.transforms = img_folder, png_folder, transforms
        self.ann_file, self.skip_bad_samples = panoptic_json, skip_bad_samples

    def __len__(self):
        return len(self.annotations)

    def check_pngs(self, limit=PNG_CHECK_LIMIT):
        check_pngs(self.annotations, self.png_folder, self.ann_file, limit, self.skip_bad_samples)

    def image(self, index):
        info = self.images[self.annotations[index]["image_id"]]
        return read_image(os.path.join(self.img_folder, info["file_name"]))

    def where(self, index):
        return os.path.join(self.png_folder, self.annotations[index]["file_name"])

    def mask(self, index):
        ann = self.annotations[index]
        ids, uniq, inverse = read_segments(self.png_folder, ann, self.ann_file)  # BadSample: PNG and JSON differ
        by_id = {int(s["id"]): s for s in ann["segments_info"]}
        classes = np.full(len(uniq), IGNORE_INDEX, np.uint8)  # void and crowd: ignore
        for k, i in enumerate(uniq.tolist()):
            seg = by_id.get(i)
            if seg is not None and not seg.get("iscrowd", 0):
                classes[k] = self.cat_to_label[seg["category_id"]]
        return classes[inverse]


@DATASETS.register(inputs="image", doctor="semantic", ranges={
    "seed": Range(ge=0), "num_train": Range(ge=1), "num_val": Range(ge=1), "image_size": Range(ge=1, le=4096),
    "num_categories": Range(ge=1, le=6), "max_objects": Range(ge=1), "min_scale": Range(gt=0, lt=0.5),
    "max_scale": Range(gt=0, lt=0.5), "hflip_prob": Range(ge=0, le=1), "base_size": Range(ge=1, le=8192),
    "crop_size": Range(ge=1, le=8192), "png_check_limit": Range(ge=0)})
def shapes_semantic(root=None, seed=0, num_train=1000, num_val=200, image_size=256, num_categories=3,
                    max_objects=4, min_scale=0.1, max_scale=0.28, base_size: int | None = None,
                    crop_size: int | None = None, hflip_prob=0.5,
                    skip_bad_samples=False, png_check_limit: Optional[int] = PNG_CHECK_LIMIT):
    """The built-in shapes data set (datasets/shapes.py) as semantic segmentation: its panoptic
    PNGs give num_categories thing classes then 3 stuff classes (sky, ground, water), no void.
    base_size / crop_size default to image_size. skip_bad_samples, png_check_limit: as coco_panoptic's."""
    root = ensure_shapes(root, seed=seed, num_train=num_train, num_val=num_val, image_size=image_size,
                         num_categories=num_categories, max_objects=max_objects, min_scale=min_scale,
                         max_scale=max_scale)
    base_size, crop_size = base_size or image_size, crop_size or image_size

    def split(name, transforms):
        ann = os.path.join(root, "annotations")
        return PanopticSemantic(os.path.join(root, f"{name}2017"), os.path.join(ann, f"panoptic_{name}2017.json"),
                                os.path.join(ann, f"panoptic_{name}2017"), transforms, skip_bad_samples)

    train = split("train", train_preset(base_size, crop_size, hflip_prob))
    val = split("val", eval_preset(base_size))
    for dataset in (train, val):
        dataset.check_pngs(png_check_limit)
    return _splits(train, val, [c["name"] for c in val.categories], skip_bad_samples)
