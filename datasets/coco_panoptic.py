"""COCO panoptic data (and the built-in `shapes` set's panoptic files): loader, presets, builders.

Layout: ROOT/{split}2017/*.jpg, ROOT/annotations/panoptic_{split}2017.json and
ROOT/annotations/panoptic_{split}2017/*.png (RGB ids: id = R + 256 G + 256^2 B).

Labels, from the JSON's categories and isthing: things sorted by id are labels 1..T (the
detector's classes, 0 = background), stuff sorted by id T+1..T+S. Per image the target holds
  boxes, labels, masks  the non-crowd thing segments (XYXY boxes around the masks);
  sem_seg               [H, W] class index (label - 1) of every pixel, 255 for void and crowd;
  image_id.
Checks (docs/reliability.md): the JSON is checked when the data set is built (load_panoptic); the
PNGs of a split with at most data.png_check_limit images are decoded and checked against it then too,
those of a larger split as each sample is read (read_segments: BadSample naming the PNG, which
data.skip_bad_samples skips).
Evaluation reports COCO bbox/segm AP of the instance branch (against
annotations/instances_{split}2017.json, or instances converted from the panoptic PNGs when that
file is absent) and PQ (evaluators/panoptic.py) in one pass.
"""
import logging
import os
from functools import partial
from typing import Optional

import numpy as np
import torch
from pycocotools import mask as mask_utils
from torchvision import tv_tensors
from torchvision.ops import masks_to_boxes
from torchvision.transforms import v2 as T

from datasets.base import DataSplits, ReadDataset, Skipped, problem, read_image, read_or_skip
from datasets.shapes import ensure_shapes
from engine.errors import BadSample, DataError, MissingData
from datasets.coco import (_id, collate, grouped_batch_sampler_factory, image_records, kept_inside,
                           read_annotations_json)
from evaluators.coco import CocoEvaluator, load_gt, resolve_backend
from evaluators.panoptic import PanopticEvaluator
from evaluators.panoptic_ids import read_ids
from engine.config import ConfigError
from engine.evaluation import CompositeEvaluator
from engine.registry import DATASETS, Range

LAYOUT = """  {root}/{split}{year}/*.jpg
  {root}/annotations/panoptic_{split}{year}.json
  {root}/annotations/panoptic_{split}{year}/*.png   (RGB ids: id = R + 256 G + 256^2 B)"""
IGNORE = 255
PNG_CHECK_LIMIT = 2000  # splits up to this size have their PNGs checked before training (~15 ms per COCO PNG)

log = logging.getLogger(__name__)


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def load_panoptic(ann_file, png_folder, img_folder=None):
    """The COCO panoptic dict of ann_file, checked before training: a DataError names the file and the
    record (image id, segment id) for JSON that is not JSON, a record without its fields, an annotation
    of an unknown image or a second one of the same image, a segment of an unknown category or a
    segment id twice in an image, a PNG or image file that is missing, and an empty split; a file_name
    that leads out of its folder is an OutsideFolder. What only the PNGs show is checked by read_segments."""
    data = read_annotations_json(ann_file, "COCO panoptic annotations", ("images", "annotations", "categories"))
    categories = set()
    for cat in data["categories"]:
        if not (isinstance(cat, dict) and _int(cat.get("id"))):
            raise DataError(f"{ann_file}: category record {str(cat)[:120]}: expected an integer id and a name")
        if cat["id"] in categories:
            raise DataError(f"{ann_file}: category id {cat['id']} appears twice")
        categories.add(cat["id"])
    images = image_records(data, ann_file)
    jpgs = set(os.listdir(img_folder)) if img_folder else None
    pngs = set(os.listdir(png_folder))
    annotated, kept = set(), []
    for ann in data["annotations"]:  # a record that fails: problem() (under collecting_problems, left out)
        if not (isinstance(ann, dict) and _id(ann.get("image_id")) and isinstance(ann.get("file_name"), str)
                and isinstance(ann.get("segments_info"), list)):
            problem(DataError(f"{ann_file}: annotation record {str(ann)[:120]}: expected image_id, file_name, "
                              f"segments_info"))
            continue
        image_id = ann["image_id"]
        where = f"{ann_file}: image {image_id!r:.40}"
        if image_id not in images:
            problem(DataError(f"{where}: image_id {image_id!r:.40} is not among the images of the file"))
            continue
        if image_id in annotated:
            problem(DataError(f"{where}: annotated twice"))
            continue
        annotated.add(image_id)
        if not kept_inside(png_folder, ann["file_name"], f"{ann_file}: annotation of image {image_id!r:.40}: "
                                                         f"file_name"):
            continue
        if ann["file_name"] not in pngs and not os.path.isfile(os.path.join(png_folder, ann["file_name"])):
            problem(DataError(f"{where}: PNG not found: {os.path.abspath(os.path.join(png_folder, ann['file_name']))}"))
            continue
        name = images[image_id]["file_name"]
        if img_folder and not kept_inside(img_folder, name, f"{ann_file}: image {image_id!r:.40}: file_name"):
            continue
        if jpgs is not None and name not in jpgs and not os.path.isfile(os.path.join(img_folder, name)):
            problem(DataError(f"{where}: file not found: {os.path.abspath(os.path.join(img_folder, name))}"))
            continue
        if segment_problems(ann, categories, where):
            kept.append(ann)
    if len(kept) < len(data["annotations"]):
        data["annotations"] = kept
    if not data["annotations"]:
        raise DataError(f"{ann_file}: holds no usable annotation (its 'annotations' list is empty; "
                        f"{len(images)} images): an empty split")
    return data


def segment_problems(ann, categories, where):
    """Whether an annotation's segments_info is usable: positive integer ids, each once, of known
    categories; each that is not is a problem() naming the image and segment."""
    seen = set()
    for seg in ann["segments_info"]:
        if not (isinstance(seg, dict) and _int(seg.get("id")) and seg["id"] > 0 and _id(seg.get("category_id"))):
            problem(DataError(f"{where}: segment record {str(seg)[:120]}: expected a positive integer id and a "
                              f"category_id"))
            return False
        if seg["category_id"] not in categories:
            problem(DataError(f"{where}, segment {seg['id']}: unknown category_id {seg['category_id']!r:.40} "
                              f"(categories: {sorted(categories)[:20]}{' ...' if len(categories) > 20 else ''})"))
            return False
        if seg["id"] in seen:
            problem(DataError(f"{where}: segment id {seg['id']} appears twice"))
            return False
        seen.add(seg["id"])
    return True


def area_mismatches(ann, uniq, inverse):
    """[(segment id, JSON area, pixels in the PNG)] of the segments whose `area` differs from their
    pixel count (uniq, inverse: of read_segments)."""
    counts = dict(zip(uniq.tolist(), np.bincount(inverse.ravel(), minlength=len(uniq)).tolist()))
    return [(int(s["id"]), s["area"], counts.get(int(s["id"]), 0)) for s in ann["segments_info"]
            if "area" in s and s["area"] != counts.get(int(s["id"]), 0)]


def read_segments(png_folder, ann, ann_file):
    """(ids [H, W], unique ids, inverse [H, W]) of an annotation's PNG. A BadSample names the PNG when
    it cannot be decoded or when its segment ids and the JSON's differ, either way."""
    path = os.path.join(png_folder, ann["file_name"])
    ids = read_ids(path)
    uniq, inverse = np.unique(ids, return_inverse=True)
    listed = {int(s["id"]) for s in ann["segments_info"]}
    present = set(uniq.tolist()) - {0}
    if present - listed:
        raise BadSample(path, f"image {ann['image_id']} has segment id(s) {sorted(present - listed)[:10]} in the PNG "
                              f"that are not in {ann_file}")
    if listed - present:
        raise BadSample(path, f"image {ann['image_id']}: segment id(s) {sorted(listed - present)[:10]} of "
                              f"{ann_file} are not in the PNG")
    return ids, uniq, inverse.reshape(ids.shape)


def check_pngs(annotations, png_folder, ann_file, limit=PNG_CHECK_LIMIT, skip=False):
    """Before training: decode every PNG of a split and check it against the JSON (read_segments), when
    the split has at most `limit` annotations (None: any number). A larger split is checked as each
    sample is read. With skip, bad PNGs are logged here and skipped when read (read_or_skip)."""
    if limit is not None and len(annotations) > limit:
        log.info("%s: %d PNGs, more than data.png_check_limit=%s: checked as each sample is read", ann_file,
                 len(annotations), limit)
        return
    for ann in annotations:
        read_or_skip(partial(read_segments, png_folder, ann, ann_file), skip)


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


class CocoPanopticDataset(ReadDataset):
    """(image, target) with target = {boxes, labels, masks, sem_seg, image_id} (see the module doc)."""

    def __init__(self, img_folder, ann_file, png_folder, transforms=None, categories=None, skip_bad_samples=False):
        data = load_panoptic(ann_file, png_folder, img_folder)
        self.skip_bad_samples = skip_bad_samples
        self.ann_file, self.img_folder, self.png_folder, self.transforms = ann_file, img_folder, png_folder, transforms
        self.data = data
        self.categories = categories or PanopticCategories(data["categories"])
        self.isthing = {c["id"]: bool(c.get("isthing", 0)) for c in data["categories"]}
        self.images = {img["id"]: img for img in data["images"]}
        self.annotations = sorted(data["annotations"], key=lambda a: a["image_id"])
        self.image_ids = [a["image_id"] for a in self.annotations]

    def check_pngs(self, limit=PNG_CHECK_LIMIT):
        check_pngs(self.annotations, self.png_folder, self.ann_file, limit, self.skip_bad_samples)

    def __len__(self):
        return len(self.annotations)

    def aspect_ratios(self):
        return [self.images[i]["width"] / self.images[i]["height"] for i in self.image_ids]

    def target(self, index):
        """The target of one image as plain tensors, before transforms."""
        ann = self.annotations[index]
        image_id = ann["image_id"]
        ids, uniq, inverse = read_segments(self.png_folder, ann, self.ann_file)
        segments = ann["segments_info"]
        by_id = {int(s["id"]): s for s in segments}
        # semantic class (label - 1) of each id present; void and crowd are 255
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

    def read(self, index):
        """(PIL image, target as tv_tensors) of one sample; BadSample names the file it cannot use."""
        image_id = self.image_ids[index]
        info = self.images[image_id]
        image = read_image(os.path.join(self.img_folder, info["file_name"]))
        target = self.target(index)
        canvas = (image.height, image.width)
        if tuple(target["sem_seg"].shape) != canvas:
            raise BadSample(os.path.join(self.png_folder, self.annotations[index]["file_name"]),
                            f"the PNG of image {image_id} is {target['sem_seg'].shape[1]}x"
                            f"{target['sem_seg'].shape[0]}, the image {canvas[1]}x{canvas[0]}")
        target["boxes"] = tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=canvas)
        target["masks"] = tv_tensors.Mask(target["masks"])
        target["sem_seg"] = tv_tensors.Mask(target["sem_seg"])
        return image, target


def instances_from_panoptic(dataset):
    """A COCO instances dict (RLE masks, boxes, areas; crowd kept) from the panoptic PNGs, as
    panopticapi's converters/panoptic2detection_coco_format.py does."""
    annotations = []
    for ann in dataset.annotations:
        ids = read_or_skip(partial(read_ids, os.path.join(dataset.png_folder, ann["file_name"])),
                           dataset.skip_bad_samples)
        if isinstance(ids, Skipped):  # skipped in evaluation too
            continue
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
                     eval_backend, instances, dataset_name, skip_bad_samples=False, png_check_limit=PNG_CHECK_LIMIT):
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
    val = CocoPanopticDataset(*val_paths, transforms=eval_preset(), skip_bad_samples=skip_bad_samples)
    train = CocoPanopticDataset(*train_paths, transforms=train_preset(augmentation, hflip_prob),
                                categories=val.categories, skip_bad_samples=skip_bad_samples)
    cats = val.categories
    if PanopticCategories(train.data["categories"]).label_to_cat != cats.label_to_cat:
        raise DataError(f"{dataset_name}: {train_paths[1]} and {val_paths[1]} have different categories")
    for dataset in (train, val):
        dataset.check_pngs(png_check_limit)
    instances = instances or os.path.join(root, "annotations", f"instances_{val_split}{year}.json")
    backend = resolve_backend(eval_backend)
    coco_gt = load_gt(instances if os.path.isfile(instances) else instances_from_panoptic(val), backend)
    panoptic_gt, png_folder, img_folder = val.data, val_paths[2], val_paths[0]

    def evaluator():
        return CompositeEvaluator({
            "": CocoEvaluator(coco_gt, cats.thing_label_to_cat(), backend=backend, img_folder=img_folder),
            "panoptic": PanopticEvaluator(panoptic_gt, png_folder, cats.label_to_cat, img_folder=img_folder,
                                          gt_json=val_paths[1])})

    return DataSplits(train=train, val=val, evaluator=evaluator, collate_fn=collate, classes=cats.class_names(),
                      train_batch_sampler=grouped_batch_sampler_factory(aspect_ratio_group_factor),
                      model_defaults={"num_classes": cats.num_things + 1, "num_stuff_classes": cats.num_stuff}
                      ).skip_bad_samples(skip_bad_samples)


@DATASETS.register(inputs="image", doctor="panoptic",
                   ranges={"hflip_prob": Range(ge=0, le=1), "aspect_ratio_group_factor": Range(ge=-1),
                           "png_check_limit": Range(ge=0)})
def coco_panoptic(root="data/coco", train_split="train", val_split="val", year="2017", augmentation="hflip",
                  hflip_prob=0.5, aspect_ratio_group_factor=3, eval_backend="auto", instances=None,
                  skip_bad_samples=False, png_check_limit: Optional[int] = PNG_CHECK_LIMIT):
    """COCO panoptic layout (see the module doc). instances: the COCO instances json the box and
    mask AP are scored against (default ROOT/annotations/instances_{val_split}{year}.json, else
    converted from the panoptic PNGs).
    skip_bad_samples: leave unreadable images and PNGs (or PNGs that do not match the JSON) out of
    their batch (logged, counted per epoch). png_check_limit: a split with at most this many images
    has its PNGs checked against the JSON before training (null: any size); a larger one as each
    sample is read."""
    return _panoptic_splits(root, train_split, val_split, year, aspect_ratio_group_factor, augmentation, hflip_prob,
                            eval_backend, instances, "coco_panoptic", skip_bad_samples, png_check_limit)


@DATASETS.register(inputs="image", doctor="panoptic", ranges={
    "seed": Range(ge=0), "num_train": Range(ge=1), "num_val": Range(ge=1), "image_size": Range(ge=1, le=4096),
    "num_categories": Range(ge=1, le=6), "max_objects": Range(ge=1), "min_scale": Range(gt=0, lt=0.5),
    "max_scale": Range(gt=0, lt=0.5), "hflip_prob": Range(ge=0, le=1), "aspect_ratio_group_factor": Range(ge=-1),
    "png_check_limit": Range(ge=0)})
def shapes_panoptic(root=None, seed=0, num_train=1000, num_val=200, image_size=256, num_categories=3,
                    max_objects=4, min_scale=0.1, max_scale=0.28, augmentation="hflip", hflip_prob=0.5,
                    aspect_ratio_group_factor=3, eval_backend="auto", skip_bad_samples=False,
                    png_check_limit: Optional[int] = PNG_CHECK_LIMIT):
    """The built-in synthetic shapes (datasets/shapes.py) through the COCO panoptic loader:
    num_categories thing shapes and 3 stuff backgrounds. skip_bad_samples, png_check_limit: as
    coco_panoptic's."""
    root = ensure_shapes(root, seed=seed, num_train=num_train, num_val=num_val, image_size=image_size,
                         num_categories=num_categories, max_objects=max_objects, min_scale=min_scale,
                         max_scale=max_scale)
    return _panoptic_splits(root, "train", "val", "2017", aspect_ratio_group_factor, augmentation, hflip_prob,
                            eval_backend, None, "shapes_panoptic", skip_bad_samples, png_check_limit)
