"""COCO panoptic data (and the built-in `shapes` set's panoptic files): loader, presets, builders.

Layout: ROOT/{split}2017/*.jpg, ROOT/annotations/panoptic_{split}2017.json and
ROOT/annotations/panoptic_{split}2017/*.png (RGB ids: id = R + 256 G + 256^2 B).

Labels, from the JSON's categories and isthing: things sorted by id are labels 1..T (the
detector's classes, 0 = background), stuff sorted by id T+1..T+S. Per image the target holds
  boxes, labels, masks  the non-crowd thing segments (XYXY boxes around the masks);
  sem_seg               [H, W] class index (label - 1) of every pixel, 255 for void and crowd;
  image_id.
Evaluation reports COCO bbox/segm AP of the instance branch (against
annotations/instances_{split}2017.json, or instances converted from the panoptic PNGs when that
file is absent) and PQ (datasets/panoptic_eval.py) in one pass.
"""
import json
import os

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.ops import masks_to_boxes
from torchvision.transforms import v2 as T

from datasets.base import DataError, DataSplits, MissingData
from datasets.coco import collate, grouped_batch_sampler_factory
from datasets.coco_eval import CocoEvaluator, load_gt, resolve_backend
from datasets.panoptic_eval import PanopticEvaluator
from datasets.panoptic_ids import read_ids
from engine.config import ConfigError
from engine.evaluation import CompositeEvaluator
from engine.registry import DATASETS

LAYOUT = """  {root}/{split}{year}/*.jpg
  {root}/annotations/panoptic_{split}{year}.json
  {root}/annotations/panoptic_{split}{year}/*.png   (RGB ids: id = R + 256 G + 256^2 B)"""
IGNORE = 255


class PanopticCategories:
    """Contiguous labels of a COCO panoptic category list: things 1..T, then stuff T+1..T+S."""

    def __init__(self, categories):
        things = sorted(c["id"] for c in categories if c.get("isthing", 0))
        stuff = sorted(c["id"] for c in categories if not c.get("isthing", 0))
        self.categories = list(categories)
        self.num_things, self.num_stuff = len(things), len(stuff)
        self.label_to_cat = {i + 1: c for i, c in enumerate(things + stuff)}
        self.cat_to_label = {c: label for label, c in self.label_to_cat.items()}
        self.names = {c["id"]: c.get("name", str(c["id"])) for c in categories}

    def thing_label_to_cat(self):
        return {label: c for label, c in self.label_to_cat.items() if label <= self.num_things}

    def class_names(self):
        return ["__background__"] + [self.names[self.label_to_cat[k]] for k in sorted(self.label_to_cat)]


def train_preset(augmentation="hflip", hflip_prob=0.5):
    """The model resizes (and may pick a random scale per image: model.min_size as a list)."""
    if augmentation not in ("hflip", "none"):
        raise ConfigError(f"data.augmentation: expected hflip or none, got {augmentation!r}")
    steps = [T.RandomHorizontalFlip(p=hflip_prob)] if augmentation == "hflip" else []
    return T.Compose([T.ToImage(), *steps, T.ToDtype(torch.float, scale=True), T.ToPureTensor()])


def eval_preset():
    return T.Compose([T.ToImage(), T.ToDtype(torch.float, scale=True), T.ToPureTensor()])


class CocoPanopticDataset(Dataset):
    """(image, target) with target = {boxes, labels, masks, sem_seg, image_id} (see the module doc)."""

    def __init__(self, img_folder, ann_file, png_folder, transforms=None, categories=None):
        with open(ann_file) as f:
            data = json.load(f)
        self.ann_file, self.img_folder, self.png_folder, self.transforms = ann_file, img_folder, png_folder, transforms
        self.data = data
        self.categories = categories or PanopticCategories(data["categories"])
        self.isthing = {c["id"]: bool(c.get("isthing", 0)) for c in data["categories"]}
        self.images = {img["id"]: img for img in data["images"]}
        self.annotations = sorted(data["annotations"], key=lambda a: a["image_id"])
        self.image_ids = [a["image_id"] for a in self.annotations]
        missing = [i for i in self.image_ids if i not in self.images]
        if missing:
            raise DataError(f"{ann_file}: annotations of image ids {missing[:5]} that are not in 'images'")

    def __len__(self):
        return len(self.annotations)

    def aspect_ratios(self):
        return [self.images[i]["width"] / self.images[i]["height"] for i in self.image_ids]

    def target(self, index):
        """The target of one image as plain tensors, before transforms."""
        ann = self.annotations[index]
        image_id = ann["image_id"]
        ids = read_ids(os.path.join(self.png_folder, ann["file_name"]))
        segments = ann["segments_info"]
        for s in segments:
            if s["category_id"] not in self.categories.cat_to_label:
                raise DataError(f"{self.ann_file}: image {image_id}, segment {s['id']}: unknown category_id "
                                f"{s['category_id']}")
        uniq, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(ids.shape)
        by_id = {int(s["id"]): s for s in segments}
        unknown = sorted(set(uniq.tolist()) - set(by_id) - {0})
        if unknown:
            raise DataError(f"{self.png_folder}/{ann['file_name']}: image {image_id} has segment id(s) {unknown} "
                            f"in the PNG that are not in {self.ann_file}")
        # semantic class (label - 1) of each id present; void, crowd and unknown ids are 255
        cls = np.full(len(uniq), IGNORE, np.uint8)
        for k, i in enumerate(uniq.tolist()):
            s = by_id.get(i)
            if s is not None and not s.get("iscrowd", 0):
                cls[k] = self.categories.cat_to_label[s["category_id"]] - 1
        position = {i: k for k, i in enumerate(uniq.tolist())}
        things = [s for s in segments if self.isthing[s["category_id"]] and not s.get("iscrowd", 0)
                  and int(s["id"]) in position]
        rows = np.array([position[int(s["id"])] for s in things], dtype=np.int64)
        masks = torch.from_numpy(inverse[None] == rows[:, None, None]).to(torch.uint8)
        boxes = masks_to_boxes(masks).float() if len(things) else torch.zeros(0, 4)
        boxes[:, 2:] += 1  # pixel edges: a one-pixel mask has a box of width 1
        target = {"boxes": boxes, "masks": masks, "sem_seg": torch.from_numpy(cls[inverse]),
                  "labels": torch.tensor([self.categories.cat_to_label[s["category_id"]] for s in things],
                                         dtype=torch.int64), "image_id": image_id}
        return target

    def __getitem__(self, index):
        image_id = self.image_ids[index]
        info = self.images[image_id]
        image = Image.open(os.path.join(self.img_folder, info["file_name"])).convert("RGB")
        target = self.target(index)
        canvas = (image.height, image.width)
        if tuple(target["sem_seg"].shape) != canvas:
            raise DataError(f"{self.png_folder}: the PNG of image {image_id} is {target['sem_seg'].shape[1]}x"
                            f"{target['sem_seg'].shape[0]}, the image {canvas[1]}x{canvas[0]}")
        target["boxes"] = tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=canvas)
        target["masks"] = tv_tensors.Mask(target["masks"])
        target["sem_seg"] = tv_tensors.Mask(target["sem_seg"])
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


def instances_from_panoptic(dataset):
    """A COCO instances dict (RLE masks, boxes, areas; crowd kept) from the panoptic PNGs, as
    panopticapi's converters/panoptic2detection_coco_format.py does."""
    from pycocotools import mask as mask_utils
    annotations = []
    for index, ann in enumerate(dataset.annotations):
        ids = read_ids(os.path.join(dataset.png_folder, ann["file_name"]))
        for s in ann["segments_info"]:
            if not dataset.isthing[s["category_id"]]:
                continue
            mask = ids == s["id"]
            if not mask.any():
                continue
            rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
            rle["counts"] = rle["counts"].decode("ascii")
            annotations.append({"id": len(annotations) + 1, "image_id": ann["image_id"],
                                "category_id": s["category_id"], "iscrowd": int(s.get("iscrowd", 0)),
                                "area": int(mask.sum()), "bbox": [float(v) for v in mask_utils.toBbox(rle)],
                                "segmentation": rle})
    things = [c for c in dataset.data["categories"] if c.get("isthing", 0)]
    return {"images": list(dataset.data["images"]), "annotations": annotations,
            "categories": [{k: c[k] for k in ("id", "name", "supercategory") if k in c} for c in things]}


def _panoptic_splits(root, train_split, val_split, year, aspect_ratio_group_factor, augmentation, hflip_prob,
                     eval_backend, instances, dataset_name):
    def paths(split):
        return (os.path.join(root, f"{split}{year}"), os.path.join(root, "annotations", f"panoptic_{split}{year}.json"),
                os.path.join(root, "annotations", f"panoptic_{split}{year}"))

    train_paths, val_paths = paths(train_split), paths(val_split)
    missing = [p for p in dict.fromkeys(train_paths + val_paths) if not os.path.exists(p)]
    if missing:
        layout = "\n".join(LAYOUT.format(root=root, split=s, year=year) for s in dict.fromkeys((train_split, val_split)))
        raise MissingData(
            f"{dataset_name}: not found: {', '.join(os.path.abspath(p) for p in missing)}\nexpected layout (COCO "
            f"panoptic 2017 from https://cocodataset.org/#download: train2017.zip, val2017.zip and "
            f"panoptic_annotations_trainval2017.zip, whose panoptic_*2017.zip unpack into annotations/):\n{layout}\n"
            f"set data.root (or data.train_split / data.val_split) with --set")
    val = CocoPanopticDataset(*val_paths, transforms=eval_preset())
    train = CocoPanopticDataset(*train_paths, transforms=train_preset(augmentation, hflip_prob),
                                categories=val.categories)
    cats = val.categories
    if PanopticCategories(train.data["categories"]).label_to_cat != cats.label_to_cat:
        raise DataError(f"{dataset_name}: {train_paths[1]} and {val_paths[1]} have different categories")
    instances = instances or os.path.join(root, "annotations", f"instances_{val_split}{year}.json")
    backend = resolve_backend(eval_backend)
    coco_gt = load_gt(instances if os.path.isfile(instances) else instances_from_panoptic(val), backend)
    panoptic_gt, png_folder, img_folder = val.data, val_paths[2], val_paths[0]

    def evaluator():
        return CompositeEvaluator({
            "": CocoEvaluator(coco_gt, cats.thing_label_to_cat(), backend=backend, img_folder=img_folder),
            "panoptic": PanopticEvaluator(panoptic_gt, png_folder, cats.label_to_cat, img_folder=img_folder)})

    return DataSplits(train=train, val=val, evaluator=evaluator, collate_fn=collate, classes=cats.class_names(),
                      train_batch_sampler=grouped_batch_sampler_factory(aspect_ratio_group_factor),
                      model_defaults={"num_classes": cats.num_things + 1, "num_stuff_classes": cats.num_stuff})


@DATASETS.register(inputs="image")
def coco_panoptic(root="data/coco", train_split="train", val_split="val", year="2017", augmentation="hflip",
                  hflip_prob=0.5, aspect_ratio_group_factor=3, eval_backend="auto", instances=None):
    """COCO panoptic layout (see the module doc). instances: the COCO instances json the box and
    mask AP are scored against (default ROOT/annotations/instances_{val_split}{year}.json, else
    converted from the panoptic PNGs)."""
    return _panoptic_splits(root, train_split, val_split, year, aspect_ratio_group_factor, augmentation, hflip_prob,
                            eval_backend, instances, "coco_panoptic")


@DATASETS.register(inputs="image")
def shapes_panoptic(root=None, seed=0, num_train=1000, num_val=200, image_size=256, num_categories=3,
                    max_objects=4, min_scale=0.1, max_scale=0.28, augmentation="hflip", hflip_prob=0.5,
                    aspect_ratio_group_factor=3, eval_backend="auto"):
    """The built-in synthetic shapes (datasets/shapes.py) through the COCO panoptic loader:
    num_categories thing shapes and 3 stuff backgrounds."""
    from datasets.shapes import ensure_shapes
    root = ensure_shapes(root, seed=seed, num_train=num_train, num_val=num_val, image_size=image_size,
                         num_categories=num_categories, max_objects=max_objects, min_scale=min_scale,
                         max_scale=max_scale)
    return _panoptic_splits(root, "train", "val", "2017", aspect_ratio_group_factor, augmentation, hflip_prob,
                            eval_backend, None, "shapes_panoptic")
