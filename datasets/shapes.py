"""The generator of `shapes`: a synthetic scene data set written to disk as a real COCO data set
(offline demos and tests), registered as `shapes` (detection, datasets/coco.py), `shapes_panoptic`
and `shapes_semantic`. Not the in-memory `synthetic_classification` set (datasets/classification.py).

Layout (the same as COCO, so the same loaders read it):

    ROOT/train2017/*.jpg, ROOT/val2017/*.jpg
    ROOT/annotations/instances_{train,val}2017.json      polygons, boxes, areas (things only)
    ROOT/annotations/panoptic_{train,val}2017.json       segments_info (things + stuff)
    ROOT/annotations/panoptic_{train,val}2017/*.png      RGB ids: id = R + 256 G + 256^2 B
    ROOT/annotations/panoptic_categories.json
    ROOT/shapes.json                                      the generation settings (written last)

Each image has two or three "stuff" background regions (sky / ground / water, split by random
lines) and a few non-overlapping, randomly coloured and rotated "thing" shapes. Everything is a
function of (seed, split, index), so the data set is the same on every machine. It is generated
once into a cache folder (default: data/shapes/<settings>/ under the repository) and reused.
"""
import json
import logging
import math
import os
import shutil
import tempfile
import time

import numpy as np
from PIL import Image, ImageDraw

from engine.errors import DataError
from evaluators.panoptic_ids import id_to_rgb
from engine.config import ConfigError

log = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = 1
THINGS = ("circle", "square", "triangle", "pentagon", "star", "cross")
STUFF = ("sky", "ground", "water")
STUFF_COLOURS = {"sky": (95, 125, 165), "ground": (105, 85, 60), "water": (40, 75, 95)}
STUFF_ID0 = 101  # stuff category ids are 101, 102, ... (thing ids 1..K), as in COCO panoptic


def default_root(settings):
    base = os.environ.get("ZOO_SHAPES_CACHE") or os.path.join(ROOT, "data", "shapes")
    name = "v{version}-seed{seed}-{num_train}x{num_val}-{image_size}px-{num_categories}cls".format(
        version=VERSION, **settings)
    extra = {k: v for k, v in settings.items() if k not in
             ("seed", "num_train", "num_val", "image_size", "num_categories")}
    if extra != DEFAULTS_EXTRA:
        name += "-" + "-".join(f"{k}{v}" for k, v in sorted(extra.items()))
    return os.path.join(base, name.replace(" ", "").replace("[", "").replace("]", "").replace(",", "_"))


DEFAULTS_EXTRA = {"max_objects": 4, "min_scale": 0.1, "max_scale": 0.28}


def settings_of(seed=0, num_train=1000, num_val=200, image_size=256, num_categories=3, max_objects=4,
                min_scale=0.1, max_scale=0.28):
    if not 1 <= num_categories <= len(THINGS):
        raise ConfigError(f"shapes: num_categories must be 1..{len(THINGS)}, got {num_categories}")
    if not 0 < min_scale <= max_scale < 0.5:
        raise ConfigError(f"shapes: need 0 < min_scale <= max_scale < 0.5, got {min_scale}, {max_scale}")
    return dict(seed=int(seed), num_train=int(num_train), num_val=int(num_val), image_size=int(image_size),
                num_categories=int(num_categories), max_objects=int(max_objects), min_scale=float(min_scale),
                max_scale=float(max_scale))


def ensure_shapes(root=None, **kwargs):
    """Generate the data set into root (default: the cache folder) unless it is already there."""
    settings = settings_of(**kwargs)
    root = root or default_root(settings)
    marker = os.path.join(root, "shapes.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            saved = json.load(f)
        if saved.get("settings") != settings or saved.get("version") != VERSION:
            raise DataError(f"shapes: {root} holds a shapes data set generated with other settings "
                            f"({saved.get('settings')}); delete it or choose another data.root")
        return root
    if os.path.exists(root) and os.listdir(root):
        raise DataError(f"shapes: {root} exists but is not a complete shapes data set (no shapes.json); "
                        f"delete it or choose another data.root")
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-shapes-")
    log.info("shapes: generating the data set once: %d train + %d val images of %d px, %d classes, into %s",
             settings["num_train"], settings["num_val"], settings["image_size"], settings["num_categories"], root)
    began = time.perf_counter()
    try:
        write_shapes(tmp, settings)
        try:
            if os.path.isdir(root) and not os.listdir(root):
                os.rmdir(root)
            os.rename(tmp, root)  # atomic: a parallel process either sees nothing or all of it
        except OSError:
            if not os.path.isfile(marker):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("shapes: written in %.1f s (COCO files: %s); later runs read it from there", time.perf_counter() - began,
             os.path.join(root, "annotations"))
    return root


def categories(num_categories):
    things = [{"id": i + 1, "name": THINGS[i], "supercategory": "shape", "isthing": 1,
               "color": [220, 40 + 35 * i, 60]} for i in range(num_categories)]
    stuff = [{"id": STUFF_ID0 + i, "name": s, "supercategory": "background", "isthing": 0,
              "color": list(STUFF_COLOURS[s])} for i, s in enumerate(STUFF)]
    return things, stuff


def write_shapes(root, settings):
    things, stuff = categories(settings["num_categories"])
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    offsets = {"train": 0, "val": 1_000_000}
    for split, count in (("train", settings["num_train"]), ("val", settings["num_val"])):
        img_dir = os.path.join(root, f"{split}2017")
        png_dir = os.path.join(root, "annotations", f"panoptic_{split}2017")
        os.makedirs(img_dir)
        os.makedirs(png_dir)
        images, instances, panoptic = [], [], []
        for index in range(count):
            image_id = offsets[split] + index + 1
            rng = np.random.default_rng([settings["seed"], 0 if split == "train" else 1, index])
            image, ids, objects, regions = render(rng, settings)
            name = f"{image_id:012d}"
            image.save(os.path.join(img_dir, name + ".jpg"), quality=92)
            Image.fromarray(id_to_rgb(ids)).save(os.path.join(png_dir, name + ".png"))
            h, w = ids.shape
            images.append({"id": image_id, "file_name": name + ".jpg", "height": h, "width": w, "license": 0})
            segments = []
            for seg_id, category_id in regions + [(o["id"], o["category_id"]) for o in objects]:
                mask = ids == seg_id
                area = int(mask.sum())
                if area == 0:
                    continue
                segments.append({"id": seg_id, "category_id": category_id, "area": area,
                                 "bbox": mask_bbox(mask), "iscrowd": 0})
            for o in objects:
                mask = ids == o["id"]
                instances.append({"id": len(instances) + 1 + offsets[split], "image_id": image_id,
                                  "category_id": o["category_id"], "iscrowd": 0, "area": int(mask.sum()),
                                  "bbox": mask_bbox(mask),
                                  "segmentation": [[round(float(c), 2) for xy in o["polygon"] for c in xy]]})
            panoptic.append({"image_id": image_id, "file_name": name + ".png", "segments_info": segments})
        info = {"description": "zoo synthetic shapes", "version": str(VERSION), "settings": settings}
        licenses = [{"id": 0, "name": "generated; public domain", "url": ""}]
        _dump(os.path.join(root, "annotations", f"instances_{split}2017.json"),
              {"info": info, "licenses": licenses, "images": images, "annotations": instances,
               "categories": [{k: c[k] for k in ("id", "name", "supercategory")} for c in things]})
        _dump(os.path.join(root, "annotations", f"panoptic_{split}2017.json"),
              {"info": info, "licenses": licenses, "images": images, "annotations": panoptic,
               "categories": things + stuff})
    _dump(os.path.join(root, "annotations", "panoptic_categories.json"), things + stuff)
    _dump(os.path.join(root, "shapes.json"), {"version": VERSION, "settings": settings})


def _dump(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def mask_bbox(mask):
    ys, xs = np.nonzero(mask)
    x0, y0 = int(xs.min()), int(ys.min())
    return [x0, y0, int(xs.max()) - x0 + 1, int(ys.max()) - y0 + 1]


def _polygon(kind, cx, cy, r, angle):
    if kind == "circle":
        n, radii = 32, [r]
    elif kind == "square":
        n, radii = 4, [r]
    elif kind == "triangle":
        n, radii = 3, [r]
    elif kind == "pentagon":
        n, radii = 5, [r]
    elif kind == "star":
        n, radii = 10, [r, 0.45 * r]
    else:  # cross: 12 corners
        a, b = r, r / 3
        pts = [(b, a), (b, b), (a, b), (a, -b), (b, -b), (b, -a), (-b, -a), (-b, -b), (-a, -b), (-a, b),
               (-b, b), (-b, a)]
        c, s = math.cos(angle), math.sin(angle)
        return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]
    return [(cx + radii[i % len(radii)] * math.cos(angle + 2 * math.pi * i / n),
             cy + radii[i % len(radii)] * math.sin(angle + 2 * math.pi * i / n)) for i in range(n)]


def render(rng, settings):
    """(RGB image, segment id map, thing objects, stuff regions [(segment id, category id)])."""
    s = settings["image_size"]
    w, h = [(s, s), (s * 5 // 4, s * 3 // 4), (s * 3 // 4, s * 5 // 4)][int(rng.integers(3))]
    ids = Image.new("I", (w, h), 1)  # region 1 below everything: no void pixels
    draw_ids = ImageDraw.Draw(ids)
    # stuff: a top region, then one or two regions below split by random slanted lines
    kinds = [STUFF[int(k)] for k in rng.permutation(len(STUFF))[: int(rng.integers(2, 4))]]
    cuts = sorted(rng.uniform(0.25, 0.8, size=len(kinds) - 1) * h)
    slants = rng.uniform(-0.15, 0.15, size=len(kinds) - 1) * h
    lines = [[(0, c - d), (w, c + d)] for c, d in zip(cuts, slants)]
    regions, colour_map = [], {}
    for i, kind in enumerate(kinds):
        seg_id = i + 1
        top = [(0, 0), (w, 0)] if i == 0 else lines[i - 1]
        bottom = [(w, h), (0, h)] if i == len(kinds) - 1 else lines[i][::-1]
        draw_ids.polygon(top + bottom, fill=seg_id)
        regions.append((seg_id, STUFF_ID0 + STUFF.index(kind)))
        base = np.array(STUFF_COLOURS[kind]) + rng.integers(-20, 21, size=3)
        colour_map[seg_id] = np.clip(base, 0, 255)
    # things: non-overlapping discs hold the shapes
    objects, placed = [], []
    for _ in range(int(rng.integers(1, settings["max_objects"] + 1))):
        for _attempt in range(30):
            r = float(rng.uniform(settings["min_scale"], settings["max_scale"]) * min(w, h))
            cx, cy = float(rng.uniform(r, w - r)), float(rng.uniform(r, h - r))
            if all(math.hypot(cx - px, cy - py) > r + pr + 3 for px, py, pr in placed):
                break
        else:
            continue
        placed.append((cx, cy, r))
        category = int(rng.integers(settings["num_categories"]))
        polygon = _polygon(THINGS[category], cx, cy, r, float(rng.uniform(0, 2 * math.pi)))
        seg_id = len(regions) + len(objects) + 1
        draw_ids.polygon(polygon, fill=seg_id)
        hue = rng.uniform(0, 1)
        colour = np.array([255 * (0.5 + 0.5 * math.cos(2 * math.pi * (hue + k / 3))) for k in range(3)])
        colour_map[seg_id] = np.clip(colour * 0.8 + 50, 0, 255)
        objects.append({"id": seg_id, "category_id": category + 1, "polygon": polygon})
    ids = np.array(ids, dtype=np.int64)
    rgb = np.zeros((h, w, 3), np.float32)
    for seg_id, colour in colour_map.items():
        rgb[ids == seg_id] = colour
    rgb += rng.normal(0, 12, size=rgb.shape)
    image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    return image, ids, objects, regions
