"""Detection labels in the formats people have: Pascal VOC XML (`voc_detection`) and Ultralytics YOLO
text (`yolo_detection`), read as they are (nothing converted on disk).

Each split's label files become a COCO dict in memory (boxes in pixels, XYWH; VOC's `difficult` boxes
as COCO's crowd boxes: ignored by the evaluation, left out of the training targets) that the COCO
loader's dataset, presets, sampler and evaluator take as they take a COCO file
(datasets.coco.detection_splits), so training targets, metrics, the doctor, analysis, export and
predict are the COCO loader's own. A bad line or object is a DataError naming the file and line
(under the doctor, recorded and left out); a box of zero or negative size is dropped and counted.
"""
import copy
import logging
import math
import os
from xml.parsers import expat

import yaml

from datasets.base import problem
from datasets.coco import CocoDetectionDataset, detection_splits, image_header, kept_inside
from datasets.segmentation import VOC_CLASSES
from engine.config import ConfigError
from engine.errors import BadSample, DataError, MissingData
from engine.paths import walk_files
from engine.registry import DATASETS, Range

log = logging.getLogger(__name__)

VOC_LAYOUT = """  {root}/Annotations/*.xml
  {root}/JPEGImages/*{ext}
  {root}/ImageSets/Main/{{{train},{val}}}.txt"""
YOLO_LAYOUT = """  {root}/{yaml}  (names: [...] or {{0: name, ...}})
  {root}/images/{{{train},{val}}}/*.jpg
  {root}/labels/{{{train},{val}}}/*.txt  (one 'class cx cy w h' line per box, normalised to [0, 1])"""
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")  # Ultralytics' common image formats
ZERO, NEGATIVE = "zero size", "negative size"


class LabelSet:
    """One split's labels as a COCO dict (images and annotations numbered from 1 in reading order,
    categories 1..K in the classes' order), with where each annotation came from ('file: line N'),
    the boxes dropped for their size [(ZERO or NEGATIVE, message)] and, for YOLO, the images
    without a label file."""

    def __init__(self, where, classes):
        self.where = where
        self.data = {"images": [], "annotations": [],
                     "categories": [{"id": i + 1, "name": name} for i, name in enumerate(classes)]}
        self.origins, self.dropped, self.unlabelled = {}, [], []

    def add_image(self, file_name, width, height):
        image_id = len(self.data["images"]) + 1
        self.data["images"].append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        return image_id

    def add_box(self, image_id, category_id, x, y, w, h, crowd, origin):
        ann_id = len(self.data["annotations"]) + 1
        self.data["annotations"].append({"id": ann_id, "image_id": image_id, "category_id": category_id,
                                         "bbox": [x, y, w, h], "area": w * h, "iscrowd": int(crowd)})
        self.origins[ann_id] = origin

    def drop(self, width, height, message):
        self.dropped.append((NEGATIVE if min(width, height) < 0 else ZERO, f"{message}; dropped"))

    def log_counts(self):
        if self.dropped:
            log.warning("%s: %d boxes of zero or negative size dropped: %s%s", self.where, len(self.dropped),
                        "; ".join(m for _, m in self.dropped[:5]), " ..." if len(self.dropped) > 5 else "")
        if self.unlabelled:
            log.warning("%s: %d of %d images have no label file, read as images without objects (Ultralytics' "
                        "convention): %s%s", self.where, len(self.unlabelled), len(self.data["images"]),
                        ", ".join(self.unlabelled[:3]), " ..." if len(self.unlabelled) > 3 else "")


class LabelFileDetection(CocoDetectionDataset):
    """The COCO loader's dataset on a LabelSet: `ann_file` names the label folder; `origins`, `dropped`
    and `unlabelled` are the LabelSet's (the doctor names files and lines with them)."""

    def __init__(self, img_folder, labels, transforms=None, **kwargs):
        super().__init__(img_folder, labels.where, transforms, annotations=copy.deepcopy(labels.data),
                         origins=labels.origins, **kwargs)
        self.origins, self.dropped, self.unlabelled = labels.origins, labels.dropped, labels.unlabelled


def check_classes(classes, key):
    """A list of distinct, non-empty class names; a ConfigError naming the key otherwise."""
    if isinstance(classes, str) or not isinstance(classes, (list, tuple)) or not classes or not all(
            isinstance(c, str) and c.strip() for c in classes):
        raise ConfigError(f"{key}: expected a list of class names, got {classes!r:.200}")
    twice = sorted({c for c in classes if list(classes).count(c) > 1})
    if twice:
        raise ConfigError(f"{key}: {twice} named twice")
    return list(classes)


def _number(text):
    """float(text), or None for what is not a finite number."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------- Pascal VOC

class XmlElement:
    """An element of parse_xml's tree: tag, the line it starts on, its text and child elements."""
    __slots__ = ("tag", "line", "text", "children")

    def __init__(self, tag, line):
        self.tag, self.line, self.text, self.children = tag, line, "", []

    def find(self, tag):
        return next((c for c in self.children if c.tag == tag), None)

    def findall(self, tag):
        return [c for c in self.children if c.tag == tag]

    def text_of(self, tag):
        child = self.find(tag)
        return child.text.strip() if child is not None else None


def parse_xml(path):
    """The root XmlElement of an XML file, read with expat. A DOCTYPE (and so any entity declaration) is
    refused: a VOC annotation has none, and entities can expand without bound (billion laughs); expat
    fetches no external entity. What is not XML is a DataError naming the file and line."""
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    stack, roots = [], []

    def start(tag, _attributes):
        element = XmlElement(tag, parser.CurrentLineNumber)
        (stack[-1].children if stack else roots).append(element)
        stack.append(element)

    def text(data):
        if stack:
            stack[-1].text += data

    def refuse(*_args):  # raised through expat as it is
        raise DataError(f"{path}: line {parser.CurrentLineNumber}: a DOCTYPE or entity declaration: refused (a "
                        f"Pascal VOC annotation has none, and entities can expand without bound)")

    parser.StartElementHandler, parser.EndElementHandler = start, lambda _tag: stack.pop()
    parser.CharacterDataHandler = text
    parser.StartDoctypeDeclHandler = parser.EntityDeclHandler = refuse
    try:
        with open(path, "rb") as f:
            parser.ParseFile(f)
    except expat.ExpatError as e:
        raise DataError(f"{path}: line {e.lineno}: not valid XML ({expat.ErrorString(e.code)}); expected a "
                        f"Pascal VOC annotation") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    return roots[0]


def _voc_size(tree):
    size = tree.find("size")
    if size is None:
        return None
    width, height = _number(size.text_of("width")), _number(size.text_of("height"))
    if width and height and width > 0 and height > 0 and width == int(width) and height == int(height):
        return int(width), int(height)
    return None  # missing or 0 (some VOC files): read from the image


def read_voc(root, image_set, classes, one_based=True, image_ext=".jpg"):
    """The LabelSet of ROOT/ImageSets/Main/{image_set}.txt: each id's Annotations/{id}.xml and
    JPEGImages/{id}{image_ext}. one_based: VOC's pixel coordinates start at 1 (the devkit's convention),
    so a box spans xmin - 1 .. xmax in the image's continuous coordinates (as detectron2 reads it)."""
    split_file = os.path.join(root, "ImageSets", "Main", f"{image_set}.txt")
    ann_dir, img_dir = os.path.join(root, "Annotations"), os.path.join(root, "JPEGImages")
    labels = LabelSet(ann_dir, classes)
    category = {name: i + 1 for i, name in enumerate(classes)}
    try:
        with open(split_file, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{split_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    seen = {}
    for number, line in enumerate(lines, 1):
        where = f"{split_file}: line {number}"
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 1:
            problem(DataError(f"{where}: expected one image id, got {line.strip()[:80]!r}"))
            continue
        name = fields[0]
        if name in seen:
            problem(DataError(f"{where}: image id {name!r} appears twice (first on line {seen[name]})"))
            continue
        seen[name] = number
        if not (kept_inside(ann_dir, name + ".xml", f"{where}: image id")
                and kept_inside(img_dir, name + image_ext, f"{where}: image id")):
            continue
        xml, image = os.path.join(ann_dir, name + ".xml"), os.path.join(img_dir, name + image_ext)
        missing = [p for p in (xml, image) if not os.path.isfile(p)]
        if missing:
            problem(MissingData(f"{where}: image id {name!r}: file not found: {os.path.abspath(missing[0])}"))
            continue
        try:
            tree = parse_xml(xml)
            if tree.tag != "annotation":
                raise DataError(f"{xml}: line {tree.line}: root element <{tree.tag}>, expected <annotation> "
                                f"(a Pascal VOC annotation)")
            size = _voc_size(tree) or image_header(image)[:2]
        except (DataError, BadSample) as e:
            problem(e)
            continue
        image_id = labels.add_image(name + image_ext, *size)
        for obj in tree.findall("object"):
            _voc_object(obj, xml, image_id, category, classes, one_based, labels)
    labels.log_counts()
    return labels


def _voc_object(obj, xml, image_id, category, classes, one_based, labels):
    at = f"{xml}: line {obj.line}"
    name = obj.text_of("name")
    if name not in category:
        problem(DataError(f"{at}: object name {name!r} is not among the classes ({', '.join(classes[:25])}"
                          f"{' ...' if len(classes) > 25 else ''}); set data.classes to the data set's class names"))
        return
    box = obj.find("bndbox")
    keys = ("xmin", "ymin", "xmax", "ymax")
    values = [_number(box.text_of(k)) for k in keys] if box is not None else [None]
    if None in values:
        got = {k: box.text_of(k) for k in keys} if box is not None else "no <bndbox>"
        problem(DataError(f"{at}: object {name!r}: expected <bndbox> with the numbers xmin, ymin, xmax, ymax, "
                          f"got {got}"))
        return
    difficult = obj.text_of("difficult") or "0"
    if difficult not in ("0", "1"):
        problem(DataError(f"{at}: object {name!r}: <difficult> must be 0 or 1, got {difficult!r:.40}"))
        return
    xmin, ymin, xmax, ymax = values
    x1, y1 = (xmin - 1, ymin - 1) if one_based else (xmin, ymin)
    if xmax <= x1 or ymax <= y1:
        labels.drop(xmax - x1, ymax - y1, f"{xml}: line {box.line}: object {name!r}: box xmin {xmin:g}, ymin "
                    f"{ymin:g}, xmax {xmax:g}, ymax {ymax:g} has zero or negative size"
                    + (" (one-based: it spans xmin - 1 to xmax)" if one_based else ""))
        return
    labels.add_box(image_id, category[name], x1, y1, xmax - x1, ymax - y1, difficult == "1", f"{xml}: line {box.line}")


def _missing(dataset, paths, layout):
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise MissingData(f"{dataset}: not found: {', '.join(os.path.abspath(p) for p in missing)}\n"
                          f"expected layout:\n{layout}\nset data.root (or the split keys) with --set")


def _splits(name, labels, images, augmentation, hflip_prob, aspect_ratio_group_factor, drop_empty_train,
            eval_backend, skip_bad_samples, cache_images, allow_size_mismatch):
    common = dict(skip_bad_samples=skip_bad_samples, cache_images=cache_images, allow_size_mismatch=allow_size_mismatch)

    def make(split, transforms, **kwargs):
        return LabelFileDetection(images[split], labels[split], transforms, **common, **kwargs)
    return detection_splits(make, name, images["val"], augmentation, hflip_prob, aspect_ratio_group_factor,
                            drop_empty_train, True, eval_backend, skip_bad_samples)


RANGES = {"hflip_prob": Range(ge=0, le=1), "aspect_ratio_group_factor": Range(ge=-1)}  # -1: no grouping


@DATASETS.register(inputs="image", doctor="detection_labels", ranges=RANGES)
def voc_detection(root="data/voc/VOCdevkit/VOC2012", train_set="train", val_set="val", classes=None,
                  one_based=True, image_ext=".jpg", augmentation="ssd", hflip_prob=0.5, aspect_ratio_group_factor=3,
                  drop_empty_train=True, eval_backend="auto", skip_bad_samples=False, cache_images=False,
                  allow_size_mismatch=False):
    """Pascal VOC detection: ROOT/Annotations/{id}.xml, ROOT/JPEGImages/{id}.jpg and the ids of each split
    in ROOT/ImageSets/Main/{train_set,val_set}.txt. classes: the class names (labels 1..K in this order;
    default VOC's 20). `difficult` objects are ignored by the evaluation as COCO's crowd boxes are and
    left out of the training targets. one_based: the devkit's pixel coordinates (from 1); false for
    files whose boxes are 0-based. The other keys are coco_detection's."""
    classes = check_classes(VOC_CLASSES[1:] if classes is None else classes, "data.classes")
    sets = {"train": train_set, "val": val_set}
    _missing("voc_detection", [os.path.join(root, d) for d in ("Annotations", "JPEGImages")]
             + [os.path.join(root, "ImageSets", "Main", f"{s}.txt") for s in sets.values()],
             VOC_LAYOUT.format(root=root, ext=image_ext, train=train_set, val=val_set))
    labels = {split: read_voc(root, image_set, classes, one_based, image_ext) for split, image_set in sets.items()}
    images = dict.fromkeys(sets, os.path.join(root, "JPEGImages"))
    return _splits("voc_detection", labels, images, augmentation, hflip_prob, aspect_ratio_group_factor,
                   drop_empty_train, eval_backend, skip_bad_samples, cache_images, allow_size_mismatch)


# ---------------------------------------------------------------- YOLO (Ultralytics)

def read_names(path):
    """The class names of an Ultralytics data.yaml (`names`: a list, or {id: name} with ids 0..K-1),
    read with yaml.safe_load; a DataError names the file (and YAML's line) otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise DataError(f"{path}: {f'line {mark.line + 1}: ' if mark else ''}not valid YAML "
                        f"({getattr(e, 'problem', None) or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    names = doc.get("names") if isinstance(doc, dict) else None
    if isinstance(names, dict):
        if set(names) != set(range(len(names))) or not all(isinstance(k, int) for k in names):
            raise DataError(f"{path}: names: the ids must be 0..{len(names) - 1}, got {sorted(names, key=str)[:20]}")
        names = [names[i] for i in range(len(names))]
    if not isinstance(names, list) or not names or not all(
            isinstance(n, (str, int)) and not isinstance(n, bool) and str(n).strip() for n in names):
        raise DataError(f"{path}: expected `names`: a list of class names or a mapping {{0: name, ...}}, "
                        f"got {names!r:.200}")
    names = [str(n) for n in names]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataError(f"{path}: names: {twice} appear twice")
    if "nc" in doc and doc["nc"] != len(names):
        raise DataError(f"{path}: nc is {doc['nc']!r} but names lists {len(names)} classes")
    return names


def labels_folder(images, key):
    """The label folder of an image folder by Ultralytics' rule: its last 'images' part made 'labels'."""
    parts = os.path.normpath(images).split(os.sep)
    if "images" not in parts:
        raise ConfigError(f"{key}: {images} has no 'images' folder in its path; YOLO labels are found by "
                          f"replacing it with 'labels' (Ultralytics' layout)")
    at = len(parts) - 1 - parts[::-1].index("images")
    return os.sep.join(parts[:at] + ["labels"] + parts[at + 1:])


def read_yolo(images, labels_dir, names, names_file):
    """The LabelSet of the images under `images` (any depth) and their labels_dir/<same path>.txt: one
    'class cx cy w h' line per box, normalised by the image's width and height. An image without a
    label file has no objects (Ultralytics' convention; counted and logged)."""
    labels = LabelSet(labels_dir, names)
    for path in walk_files(images, suffixes=IMAGE_SUFFIXES):
        rel = os.path.relpath(path, images)
        try:
            width, height = image_header(path)[:2]
        except BadSample as e:
            problem(e)
            continue
        image_id = labels.add_image(rel.replace(os.sep, "/"), width, height)
        label = os.path.join(labels_dir, os.path.splitext(rel)[0] + ".txt")
        if not os.path.isfile(label):
            labels.unlabelled.append(path)
            continue
        try:
            with open(label, encoding="utf-8-sig") as f:  # a BOM (Windows tools) is not a field
                lines = f.read().splitlines()
        except UnicodeDecodeError as e:
            problem(DataError(f"{label}: not UTF-8 text ({e.reason} at byte {e.start})"))
            continue
        for number, line in enumerate(lines, 1):
            if line.strip():
                _yolo_line(line, f"{label}: line {number}", image_id, width, height, names, names_file, labels)
    labels.log_counts()
    return labels


def _yolo_line(line, at, image_id, width, height, names, names_file, labels):
    fields = line.split()
    if len(fields) != 5:
        polygon = len(fields) > 5 and len(fields) % 2 == 1
        problem(DataError(f"{at}: expected 5 fields (class cx cy w h), got {len(fields)}: {line.strip()[:80]!r}"
                          + (" (a polygon: segment labels are not read)" if polygon else "")))
        return
    try:
        cls = int(fields[0])
    except ValueError:
        problem(DataError(f"{at}: class {fields[0]!r:.40} is not an integer"))
        return
    if not 0 <= cls < len(names):
        problem(DataError(f"{at}: class {cls} is not among the {len(names)} names of {names_file} "
                          f"(0..{len(names) - 1})"))
        return
    values = [_number(v) for v in fields[1:]]
    if None in values:
        problem(DataError(f"{at}: cx cy w h must be finite numbers, got {' '.join(fields[1:])[:80]!r}"))
        return
    outside = [(k, v) for k, v in zip(("cx", "cy", "w", "h"), values) if not 0 <= v <= 1]
    if outside:
        problem(DataError(f"{at}: {outside[0][0]} {outside[0][1]:g} is outside [0, 1] (YOLO coordinates are "
                          f"normalised by the image's width and height)"))
        return
    cx, cy, w, h = values
    if w == 0 or h == 0:
        labels.drop(w, h, f"{at}: box of class {cls} has zero size (w {w:g}, h {h:g})")
        return
    bw, bh = w * width, h * height
    labels.add_box(image_id, cls + 1, cx * width - bw / 2, cy * height - bh / 2, bw, bh, False, at)


@DATASETS.register(inputs="image", doctor="detection_labels", ranges=RANGES)
def yolo_detection(root="data/yolo", train_split="train", val_split="val", train_images=None, val_images=None,
                   data_yaml="data.yaml", augmentation="ssd", hflip_prob=0.5, aspect_ratio_group_factor=3,
                   drop_empty_train=True, eval_backend="auto", skip_bad_samples=False, cache_images=False,
                   allow_size_mismatch=False):
    """Ultralytics YOLO detection: ROOT/images/{split}/ (any depth), ROOT/labels/{split}/ with one .txt per
    image of the same path, and ROOT/data.yaml's `names` (class id k is label k + 1). train_images /
    val_images: other image folders (relative to ROOT), whose labels are found by Ultralytics' rule
    (the path's last 'images' made 'labels'; e.g. Roboflow's train/images). An image without a label
    file has no objects. The other keys are coco_detection's."""
    images = {"train": os.path.join(root, train_images or os.path.join("images", train_split)),
              "val": os.path.join(root, val_images or os.path.join("images", val_split))}
    labels_dirs = {split: labels_folder(path, f"data.{split}_images") for split, path in images.items()}
    names_file = os.path.join(root, data_yaml)
    _missing("yolo_detection", [names_file, *images.values(), *labels_dirs.values()],
             YOLO_LAYOUT.format(root=root, yaml=data_yaml, train=train_split, val=val_split))
    names = read_names(names_file)
    labels = {split: read_yolo(images[split], labels_dirs[split], names, names_file) for split in images}
    return _splits("yolo_detection", labels, images, augmentation, hflip_prob, aspect_ratio_group_factor,
                   drop_empty_train, eval_backend, skip_bad_samples, cache_images, allow_size_mismatch)
