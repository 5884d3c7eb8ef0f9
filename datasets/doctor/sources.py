"""What the doctor reads of each loader's data set: its samples, and the check of one sample with the
loader's own readers and checks (datasets/*.py), run in a worker process.

check(i) returns a small dict: file, record, problems [(severity, kind or None, message)], sha
(SHA-256 of the file), phash (64-bit perceptual hash of a decoded image) or, for an image under
MIN_PHASH_SIZE px, grey (its grey pixels), content (hash of a normalised text or of decoded audio
samples), labels (class indices the sample holds), sizes, lengths, durations, and with features on, a
feature vector per labelled thing (labels.py)."""
import hashlib
import logging
import os
import re

import numpy as np
import soundfile as sf
import torch
import torchaudio
from PIL import Image

from datasets.audio import read_audio
from datasets.base import collecting_problems, read_image
from datasets.coco import ROTATED, image_header, size_mismatch
from datasets.coco_panoptic import area_mismatches, read_segments
from datasets.text import read_csv
from engine.errors import BadSample
from engine.files import file_sha256
from engine.registry import DATASETS, DOCTOR_SOURCES
from datasets.doctor.findings import ERROR, INFO, WARNING, Finding

log = logging.getLogger(__name__)

MIN_PHASH_SIZE = 32  # smaller images (8x8 digits) are too coarse for a 64-bit perceptual hash: leaks.small_pairs
FEATURE_SIZE = 8  # images and crops are shrunk to this many pixels a side for the label check's model


def phash(image):
    import imagehash
    return int(str(imagehash.phash(image)), 16)


def _hashes(image, out):
    """A perceptual hash, or for a small image its grey pixels (leaks.small_pairs compares them resized)."""
    if min(image.size) >= MIN_PHASH_SIZE:
        out["phash"] = phash(image)
    else:
        out["grey"] = np.asarray(image.convert("L"))


def image_features(image, box=None):
    """A grey FEATURE_SIZE thumbnail and a 4x4 colour one (of the box, XYWH, when given), in [0, 1]."""
    if box is not None:
        x, y, w, h = box
        image = image.crop((int(x), int(y), int(round(x + w)), int(round(y + h))))
    image = image.convert("RGB")
    grey = np.asarray(image.convert("L").resize((FEATURE_SIZE, FEATURE_SIZE), Image.BILINEAR), dtype=np.float32)
    colour = np.asarray(image.resize((4, 4), Image.BILINEAR), dtype=np.float32)
    return np.concatenate([grey.ravel(), colour.ravel()]) / 255


def normalised_text(text):
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", text.lower())).strip()


class Source:
    """One split of one data set. Subclasses set kind and implement __len__ and check, and register
    with @DOCTOR_SOURCES.register("name"); a data set names it with @DATASETS.register(doctor="name")."""
    kind = "?"
    inputs = "image"
    classes = None
    clean_copy = True  # whether --write-clean can write a copy of this kind (datasets/doctor/clean.py)

    def __init__(self, split, dataset, cfg_data, features=False):
        self.split, self.dataset, self.features = split, dataset, features
        self.allow_size_mismatch = bool(cfg_data.get("allow_size_mismatch", False))

    @classmethod
    def of_split(cls, split, data, cfg_data, features, shared):
        """The source of data.<split> (data: the builder's DataSplits); shared: a dict the splits of
        one data set share (what is read once for all of them)."""
        return cls(split, getattr(data, split), cfg_data, features)

    def annotation_findings(self):
        """Findings of the annotation file as a whole (main process)."""
        return []

    def annotation_stats(self):
        return {}

    def thing_record(self, thing_id, result):
        """How the label check names one labelled thing of a checked sample (result: check's dict)."""
        file, record = result["file"], result["record"]
        return f"{file}, {record}" if file and record else file or record

    def _image(self, path, out, info=None, ann_file=None):
        """Decode with the loader's reader; sha, phash, size, EXIF orientation, size against the record."""
        out["sha"] = file_sha256(path)
        try:
            image = read_image(path)
        except BadSample as e:
            out["problems"].append((ERROR, None, str(e)))
            return None
        out["width"], out["height"] = image.width, image.height
        out["content"] = hashlib.sha1(image.tobytes()).hexdigest()  # the same pixels in another file
        _hashes(image, out)
        try:
            orientation = image_header(path)[2]
        except BadSample:
            orientation = 1
        if orientation in ROTATED:
            out["problems"].append((INFO, "exif_rotation", f"{path}: EXIF orientation {orientation}: viewers show it "
                                    f"turned by 90 degrees, the loaders read it as stored ({image.width}x{image.height})"))
        if info is not None:
            message = size_mismatch(info, image.width, image.height, ann_file)
            if message:
                severity = WARNING if self.allow_size_mismatch else ERROR
                out["problems"].append((severity, "size_mismatch", f"{path}: {message}"))
        return image


class ClassesOfData(Source):
    """A source whose class names are the data set's own (DataSplits.classes)."""

    def __init__(self, split, dataset, cfg_data, classes, features=False):
        super().__init__(split, dataset, cfg_data, features)
        self.classes = classes

    @classmethod
    def of_split(cls, split, data, cfg_data, features, shared):
        return cls(split, getattr(data, split), cfg_data, list(data.classes or []), features)


def _result(file, record=""):
    return {"file": file, "record": record, "problems": [], "labels": []}


# ---------------------------------------------------------------- COCO detection

@DOCTOR_SOURCES.register("coco")
class CocoSource(Source):
    """datasets.coco.CocoDetectionDataset: every image of the annotation file (also those training
    leaves out for having no box), boxes from the loader's own count (box_issues)."""
    kind = "coco"

    def __init__(self, split, dataset, cfg_data, features=False):
        super().__init__(split, dataset, cfg_data, features)
        self.coco, self.ids = dataset.coco, sorted(dataset.coco.imgs)
        self.cat_ids = sorted(self.coco.getCatIds())
        self.label_of = {c: k for k, c in enumerate(self.cat_ids)}
        self.classes = [self.coco.cats[c].get("name", str(c)) for c in self.cat_ids]
        self.bad_annotations = []  # records ("annotation N") of the integrity errors of annotation_findings

    def __len__(self):
        return len(self.ids)

    def path(self, i):
        return os.path.join(self.dataset.img_folder, self.coco.imgs[self.ids[i]]["file_name"])

    def check(self, i):
        image_id = self.ids[i]
        info, path = self.coco.imgs[image_id], self.path(i)
        out = _result(path, f"image {image_id}")
        anns = self.coco.imgToAnns.get(image_id, [])
        out["labels"] = [self.label_of[a["category_id"]] for a in anns if a["category_id"] in self.label_of]
        image = self._image(path, out, info, self.dataset.ann_file)
        if image is not None and self.features:
            out["things"] = [(a["id"], self.label_of[a["category_id"]], image_features(image, a["bbox"]))
                             for a in anns if not a.get("iscrowd", 0) and a["bbox"][2] >= 2 and a["bbox"][3] >= 2
                             and a["category_id"] in self.label_of]
        return out

    def where(self, ann):
        """(how a finding names an annotation, its file, its record)."""
        info = self.coco.imgs[ann["image_id"]]
        return (f"{self.dataset.ann_file}: annotation {ann['id']} (image {ann['image_id']}, {info['file_name']})",
                self.dataset.ann_file, f"annotation {ann['id']}")

    def thing_record(self, thing_id, result):
        return f"{self.dataset.ann_file}, annotation {thing_id} ({result['file']})"

    def annotation_findings(self):
        out = []
        issues = self.dataset.box_issues
        for kind, ids in issues.items():
            for ann_id in ids:
                ann = self.coco.anns.get(ann_id)
                if ann is None:
                    continue
                info = self.coco.imgs[ann["image_id"]]
                x, y, w, h = ann["bbox"]
                where, file, record = self.where(ann)
                if kind.startswith("outside"):  # a pixel over the border is COCO's rounding, not a fault
                    over = max(-x, -y, x + w - info["width"], y + h - info["height"])
                    severity = ERROR if over > 1 else INFO
                    message = f"{where}: bbox {ann['bbox']} lies {over:.1f} px outside the {info['width']}x{info['height']} image"
                    code = "box_outside"
                elif kind.startswith("negative"):
                    severity, code = ERROR, "box_negative_size"
                    message = f"{where}: bbox {ann['bbox']} has a negative width or height"
                else:
                    severity, code = ERROR, "box_outside"
                    message = f"{where}: bbox {ann['bbox']} lies wholly outside the {info['width']}x{info['height']} image"
                out.append(Finding("integrity", severity, code, message, file=file, record=record, split=self.split))
        for ann in self.coco.dataset["annotations"]:
            if not ann.get("iscrowd", 0) and ann["bbox"][2] >= 0 and ann["bbox"][3] >= 0 and (
                    ann["bbox"][2] == 0 or ann["bbox"][3] == 0):
                where, file, record = self.where(ann)
                out.append(Finding("integrity", ERROR, "box_zero_area", f"{where}: bbox {ann['bbox']} has no area",
                                   file=file, record=record, split=self.split))
        self.bad_annotations = [f.record for f in out if f.severity == ERROR]
        return out

    def annotation_stats(self):
        """Instances per class, object sizes in COCO's ranges, instances per image."""
        anns = [a for a in self.coco.dataset["annotations"] if a["category_id"] in self.label_of]
        per_class = np.bincount([self.label_of[a["category_id"]] for a in anns], minlength=len(self.cat_ids))
        areas = np.array([a.get("area") or a["bbox"][2] * a["bbox"][3] for a in anns], dtype=float)
        sizes = {"small": int((areas < 32 ** 2).sum()), "medium": int(((areas >= 32 ** 2) & (areas < 96 ** 2)).sum()),
                 "large": int((areas >= 96 ** 2).sum())}
        per_image = np.array([len(self.coco.imgToAnns.get(i, [])) for i in self.ids])
        return {"instances": int(len(anns)), "instances_per_class": dict(zip(self.classes, per_class.tolist())),
                "object_sizes": sizes, "instances_per_image": _summary(per_image),
                "images_without_annotations": int((per_image == 0).sum())}


# ---------------------------------------------------------------- VOC and YOLO label files

@DOCTOR_SOURCES.register("detection_labels")
class LabelFilesSource(CocoSource):
    """datasets.detection_labels (voc_detection, yolo_detection): CocoSource on the ground truth their
    loader converted in memory, each annotation named by its label file and line; the boxes the loader
    dropped for their size (errors) and, for YOLO, the images without a label file (info). Their label
    folders get no --write-clean copy (excluded.txt lists what to leave out)."""
    clean_copy = False

    def where(self, ann):
        info = self.coco.imgs[ann["image_id"]]
        origin = self.dataset.origins[ann["id"]]
        file, _, line = origin.partition(": ")
        return f"{origin} ({info['file_name']})", file, f"{line}, annotation {ann['id']}"

    def thing_record(self, thing_id, result):
        return f"{self.dataset.origins[thing_id]}, annotation {thing_id} ({result['file']})"

    def annotation_findings(self):
        out = super().annotation_findings()
        for size, message in self.dataset.dropped:
            file, _, rest = message.partition(": ")
            out.append(Finding("integrity", ERROR, "box_negative_size" if size == "negative size" else "box_zero_area",
                               message, file=file, record=rest.split(": ")[0], split=self.split))
        for path in self.dataset.unlabelled:
            out.append(Finding("integrity", INFO, "no_label_file", f"{path}: no label file: an image without "
                               f"objects (Ultralytics' convention)", file=path, split=self.split))
        return out


# ---------------------------------------------------------------- COCO panoptic

@DOCTOR_SOURCES.register("panoptic")
class PanopticSource(Source):
    """datasets.coco_panoptic.CocoPanopticDataset: image, PNG ids against segments_info both ways
    (read_segments), PNG size against the image, segment areas against their pixels."""
    kind = "panoptic"

    def __init__(self, split, dataset, cfg_data, features=False):
        super().__init__(split, dataset, cfg_data, False)
        cats = dataset.data["categories"]
        self.label_of = {c["id"]: k for k, c in enumerate(cats)}
        self.classes = [c.get("name", str(c["id"])) for c in cats]

    def __len__(self):
        return len(self.dataset.annotations)

    def path(self, i):
        ds = self.dataset
        return os.path.join(ds.img_folder, ds.images[ds.annotations[i]["image_id"]]["file_name"])

    def check(self, i):
        ds = self.dataset
        ann = ds.annotations[i]
        info, path = ds.images[ann["image_id"]], self.path(i)
        png = os.path.join(ds.png_folder, ann["file_name"])
        out = _result(path, f"image {ann['image_id']}")
        out["labels"] = [self.label_of[s["category_id"]] for s in ann["segments_info"]]
        image = self._image(path, out, info, ds.ann_file)
        try:
            ids, uniq, inverse = read_segments(ds.png_folder, ann, ds.ann_file)
        except BadSample as e:
            out["problems"].append((ERROR, None, str(e)))
            return out
        if image is not None and ids.shape != (image.height, image.width):
            out["problems"].append((ERROR, "png_size", f"{png}: the PNG of image {ann['image_id']} is "
                                    f"{ids.shape[1]}x{ids.shape[0]}, the image {image.width}x{image.height}"))
        for seg_id, area, pixels in area_mismatches(ann, uniq, inverse):
            out["problems"].append((ERROR, "segment_area", f"{png}: image {ann['image_id']}, segment {seg_id}: area "
                                    f"{area} in {ds.ann_file}, {pixels} pixels in the PNG"))
        return out


# ---------------------------------------------------------------- semantic segmentation

@DOCTOR_SOURCES.register("semantic")
class SemanticSource(ClassesOfData):
    """datasets.segmentation's data sets: the loader's read (image, mask values within the classes or
    255; for shapes_semantic, the panoptic PNG against its JSON); it gives the label check no features."""
    kind = "semantic"

    def __len__(self):
        return len(self.dataset)

    def path(self, i):
        ds = self.dataset
        if hasattr(ds, "annotations") and hasattr(ds, "images"):  # PanopticSemantic
            return os.path.join(ds.img_folder, ds.images[ds.annotations[i]["image_id"]]["file_name"])
        if hasattr(ds, "coco"):  # CocoSegmentation
            return os.path.join(ds.img_folder, ds.coco.imgs[ds.ids[i]]["file_name"])
        return ds.base.images[i]  # VOC

    def check(self, i):
        ds = self.dataset
        path = self.path(i)
        out = _result(path, ds.where(i))
        out["sha"] = file_sha256(path)
        try:
            image, mask = ds.read(i)
        except BadSample as e:
            out["problems"].append((ERROR, None, str(e)))
            return out
        out["width"], out["height"] = image.width, image.height
        out["content"] = hashlib.sha1(image.tobytes()).hexdigest()
        _hashes(image, out)
        values = np.unique(np.asarray(mask))
        out["labels"] = [int(v) for v in values if v < len(self.classes or [])]
        if tuple(mask.shape[-2:]) != (image.height, image.width):
            out["problems"].append((ERROR, "mask_size", f"{ds.where(i)}: the mask is {mask.shape[-1]}x{mask.shape[-2]}, "
                                    f"the image {image.width}x{image.height}"))
        return out


# ---------------------------------------------------------------- image classification

@DOCTOR_SOURCES.register("imagefolder")
class ImageFolderSource(Source):
    kind = "imagefolder"

    def __init__(self, split, dataset, cfg_data, features=False):
        super().__init__(split, dataset, cfg_data, features)
        self.classes = list(dataset.classes)

    def __len__(self):
        return len(self.dataset.samples)

    def path(self, i):
        return self.dataset.samples[i][0]

    def check(self, i):
        path, label = self.dataset.samples[i]
        out = _result(path)
        out["labels"] = [int(label)]
        image = self._image(path, out)
        if image is not None and self.features:
            out["things"] = [(i, int(label), image_features(image))]
        return out


# ---------------------------------------------------------------- audio

@DOCTOR_SOURCES.register("audio")
class AudioSource(ClassesOfData):
    """datasets.audio.AudioFiles: read_audio (decode, samples, finite), the file's own sample rate."""
    kind = "audio"
    inputs = "audio"

    def __len__(self):
        return len(self.dataset.files)

    def path(self, i):
        return self.dataset.files[i]

    def check(self, i):
        ds = self.dataset
        path, label = ds.files[i], ds.labels[i]
        out = _result(path)
        out["labels"] = [int(label)]
        out["sha"] = file_sha256(path)
        try:
            wave = read_audio(path, ds.sample_rate)
            info = sf.info(path)
        except (BadSample, RuntimeError) as e:
            out["problems"].append((ERROR, None, str(e)))
            return out
        if info.samplerate != ds.sample_rate:
            out["problems"].append((WARNING, "sample_rate", f"{path}: sample rate {info.samplerate} Hz, the config's "
                                    f"data.sample_rate is {ds.sample_rate} Hz (resampled when read)"))
        out["duration"] = info.frames / info.samplerate
        samples = wave.numpy()
        out["content"] = hashlib.sha256(samples.tobytes()).hexdigest()
        if self.features:
            out["things"] = [(i, int(label), audio_features(samples, ds.sample_rate))]
        return out


def audio_features(samples, sample_rate, mels=40):
    """Mean and standard deviation over time of the log-Mel bands."""
    spec = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=512, n_mels=mels)(torch.from_numpy(samples))
    logmel = torch.log(spec + 1e-6)
    return torch.cat([logmel.mean(1), logmel.std(1)]).numpy()


# ---------------------------------------------------------------- text

@DOCTOR_SOURCES.register("text")
class TextSource(Source):
    """datasets.text.TokenizedText: the texts the loader kept (its bad rows are problems collected
    when the data set was built); rows named through read_csv's own row numbers."""
    kind = "text"
    inputs = "text"

    def __init__(self, split, dataset, cfg_data, classes, rows=None, features=False):
        super().__init__(split, dataset, cfg_data, features)
        self.classes, self.rows = classes, rows or {}

    @classmethod
    def of_split(cls, split, data, cfg_data, features, shared):
        if "rows" not in shared:  # the CSV files, read once for both splits
            root = cfg_data.get("root") or ""
            files = [os.path.join(root, cfg_data.get("train_file", "train.csv"))]
            if not cfg_data.get("val_fraction"):
                files.append(os.path.join(root, cfg_data.get("val_file", "test.csv")))
            shared["rows"] = text_rows(cfg_data, files) if root else {}
        return cls(split, getattr(data, split), cfg_data, list(data.classes), shared["rows"], features)

    def __len__(self):
        return len(self.dataset.texts)

    def path(self, i):
        return self.rows.get(self.dataset.texts[i], ("", ""))[0]

    def check(self, i):
        text, label = self.dataset.texts[i], self.dataset.labels[i]
        file, record = self.rows.get(text, ("", f"text {i}"))
        out = _result(file, record)
        out["labels"] = [int(label)]
        out["content"] = hashlib.sha1(normalised_text(text).encode("utf-8", "surrogatepass")).hexdigest()
        out["length"] = len(text.split())
        if self.features:
            out["things"] = [(i, int(label), text)]
        return out


def _summary(values):
    values = np.asarray(values, dtype=float)
    if not len(values):
        return {"count": 0}
    return {"count": int(len(values)), "min": float(values.min()), "max": float(values.max()),
            "mean": round(float(values.mean()), 3), "median": float(np.median(values))}


def text_rows(cfg_data, split_files):
    """{text: (file, 'row N (line L)')} of the CSV files, read again with the loader's parser."""
    out = {}
    for path in split_files:
        rows = []
        with collecting_problems():  # its problems were collected when the data set was built
            try:
                texts, _ = read_csv(path, None, cfg_data.get("text_columns"), cfg_data.get("max_rows"), rows=rows)
            except Exception:  # noqa: BLE001  (an unreadable file was reported by the build)
                continue
        for text, (row, first, _last) in zip(texts, rows):
            out.setdefault(text, (path, f"row {row}" + (f" (line {first})" if first != row else "")))
    return out


def sources_of(data, name, cfg_data, splits, features=False):
    """[(split, Source or None, why not)] for the DataSplits of the builder `name`, read by the doctor
    source it declares (@DATASETS.register(doctor=...)); an unknown source is a RegistryError."""
    declared = DATASETS.declared_or(name, "doctor")
    source = declared and DOCTOR_SOURCES.get(declared)
    shared, out = {}, []
    for split in splits:
        if getattr(data, split, None) is None:
            out.append((split, None, "the builder gives no such split"))
        elif source is None:
            out.append((split, None, f"data set {name} declares no doctor source (@DATASETS.register(doctor=...)): "
                                     f"generated in memory, no files to check"))
        else:
            out.append((split, source.of_split(split, data, cfg_data, features, shared), ""))
    return out
