"""Families as they leave the repository: the adapters behind export.py and predict.py.

An adapter knows, for one family:
  - the exportable module: the eval path with plain tensors in and out (what ONNX, torch.export
    and TorchScript store), e.g. SSD with its box decoding and NMS, outputs of static shape;
  - the pre-processing as data (`spec`, JSON): written beside an artifact so that a consumer needs
    nothing from this repository, and rebuilt from it by predict.py for a checkpoint and an
    artifact alike;
  - how an exported model's outputs are compared with the eager ones (top-1 and logits, or boxes
    matched by IoU and score);
  - how predict.py reads a user's inputs and presents the outputs.

A family plugs in with a subclass registered by name, in its own module; export.py and predict.py
are not edited:

    from models.export_adapters import ADAPTERS, Adapter

    @ADAPTERS.register()
    class Panoptic(Adapter):
        task, input_kind = "panoptic", "image"
        output_names = ("semantic", "instances")
        @classmethod
        def matches(cls, cfg): return cfg["model"]["name"].startswith("panoptic")
        @classmethod
        def build_spec(cls, cfg, data, model, folder): ...      # pre-processing, classes
        def module(self, model): ...                            # tensors in, tensors out
        def load(self, item): ...; def collate(self, samples): ...
        def compare(self, ref, got): ...; def present(self, outputs, items, samples, out_dir, args): ...
"""
import json
import os
import shutil

import torch
import torch.nn.functional as F
from torch import nn

from engine.registry import Registry

ADAPTERS = Registry("export adapter")
SPEC_FORMAT = "zoo-export/1"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg")
LOGITS_ATOL = 1e-3  # fp32 logits: exported vs eager (ONNX Runtime's kernels differ by ~1e-6 here)


class ExportError(ValueError):
    """A model / format combination that cannot be exported: says which, why and what to try."""


def adapter_class(cfg):
    """The adapter for a config (as a dict): the first registered one whose matches(cfg) holds."""
    for name in ADAPTERS.names():
        if ADAPTERS.get(name).matches(cfg):
            return ADAPTERS.get(name)
    raise ExportError(f"model {cfg['model']['name']} (data {cfg['data']['name']}): no export adapter knows it "
                      f"(adapters: {', '.join(ADAPTERS.names())}); a family plugs in with a subclass of "
                      f"models.export_adapters.Adapter registered in ADAPTERS")


def adapter_from_spec(spec, folder):
    if spec.get("format") != SPEC_FORMAT:
        raise ValueError(f"{folder}: not an export description of this project (format {spec.get('format')!r}, "
                         f"expected {SPEC_FORMAT})")
    return ADAPTERS.get(spec["adapter"])(spec, folder)


class Adapter:
    task = None
    input_kind = None            # "image", "text" or "audio": what predict.py reads
    input_names = ("images",)
    output_names = ("logits",)
    formats = ("torch_export", "onnx")  # what export.py may write for this family
    why_not = {"torchscript": "TorchScript is this project's int8 path (quantized MobileNetV3)"}

    def __init__(self, spec, folder):
        self.spec, self.folder = spec, folder  # folder: where the spec's files (tokenizer, ...) are

    @classmethod
    def matches(cls, cfg):
        raise NotImplementedError

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        """Family keys of the spec (classes, pre-processing) from the training config, its data
        (DataSplits, or None when the data is not at hand) and the model."""
        raise NotImplementedError

    @classmethod
    def create(cls, cfg, data, model, folder):
        spec = {"format": SPEC_FORMAT, "adapter": cls.__name__, "task": cls.task, "model": cfg["model"]["name"],
                "inputs": list(cls.input_names), "outputs": list(cls.output_names),
                **cls.build_spec(cfg, data, model, folder)}
        return cls(spec, folder)

    @property
    def classes(self):
        return self.spec.get("classes")

    def class_name(self, k):
        classes = self.classes
        return classes[k] if classes and 0 <= k < len(classes) else str(k)

    def files(self):
        """Files next to the spec a consumer needs (e.g. the tokenizer), relative to the folder."""
        return []

    def copy_files(self, out_dir):
        for name in self.files():
            if os.path.abspath(os.path.join(self.folder, name)) != os.path.abspath(os.path.join(out_dir, name)):
                shutil.copyfile(os.path.join(self.folder, name), os.path.join(out_dir, name))

    # ---- export
    def module(self, model):
        """The eval path with tensors in (input_names) and a tuple of tensors out (output_names)."""
        return _Outputs(model).eval()

    def dynamic_shapes(self, dynamic_batch):
        batch = torch.export.Dim.DYNAMIC if dynamic_batch else torch.export.Dim.STATIC
        return tuple({0: batch} for _ in self.input_names)

    def sample_from_dataset(self, item):
        """A val data set item -> what load() returns for a user's input."""
        return item[0]

    def compare(self, ref, got, atol=LOGITS_ATOL):
        raise NotImplementedError

    # ---- predict
    def load(self, item):
        raise NotImplementedError

    def collate(self, samples):
        return (torch.stack(samples),)

    def batch_key(self, sample):
        """Samples with equal keys can share a batch."""
        return None

    def present(self, outputs, items, samples, out_dir, args):
        """Print / write the predictions of one batch (items: the inputs' names, samples: what load()
        returned); returns one JSON-able dict per item."""
        raise NotImplementedError

    def finish(self, results, out_dir, args):
        """After the last batch (e.g. one JSON file for all images; predict.py writes predictions.json)."""


class _Outputs(nn.Module):
    """A model whose eval output is one tensor, as a tuple (exported graphs return tuples)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs):
        return (self.model(inputs),)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------- classifiers (logits)

class LogitsAdapter(Adapter):
    def compare(self, ref, got, atol=LOGITS_ATOL):
        ref, got = ref[0].float(), got[0].float()
        same = ref.argmax(1) == got.argmax(1)
        diff = (ref - got).abs().max().item() if ref.numel() else 0.0
        return {"samples": len(ref), "same_top1": int(same.sum()), "max_abs_logit_diff": diff,
                "tolerance": {"max_abs_logit_diff": atol, "top1": "identical"},
                "ok": bool(same.all()) and diff <= atol}

    def present(self, outputs, items, samples, out_dir, args):
        probs = outputs[0].float().softmax(1)
        top = probs.topk(min(args.topk, probs.shape[1]), dim=1)
        results = []
        for item, p, k in zip(items, top.values.tolist(), top.indices.tolist()):
            labels = [{"label": self.class_name(c), "index": c, "probability": round(q, 4)} for c, q in zip(k, p)]
            results.append({"input": item, "top": labels})
            shown = item if len(str(item)) <= 60 else str(item)[:57] + "..."
            print(f"{shown}: " + ", ".join(f"{t['label']} {t['probability']:.3f}" for t in labels))
        return results


def _transform_steps(transform, where):
    """Resize / CenterCrop / Normalize settings of a torchvision eval transform (v2 Compose)."""
    from torchvision.transforms import v2 as T
    spec = {"image_mode": "RGB", "scale": 1 / 255}
    for step in getattr(transform, "transforms", [transform]):
        if isinstance(step, T.Resize):
            spec.update(resize=list(step.size), interpolation=step.interpolation.value,
                        antialias=bool(step.antialias), max_size=step.max_size)
        elif isinstance(step, T.CenterCrop):
            spec["center_crop"] = list(step.size)
        elif isinstance(step, T.Normalize):
            spec.update(mean=list(step.mean), std=list(step.std))
        elif not isinstance(step, (T.PILToTensor, T.ToImage, T.ToDtype, T.ToPureTensor)):
            raise ExportError(f"{where}: the evaluation transform has a step the image classifier export does "
                              f"not describe: {step!r} (known: Resize, CenterCrop, PILToTensor/ToImage, "
                              f"ToDtype, Normalize)")
    return spec


def _open_image(path):
    from PIL import Image
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, ValueError, ...
        raise ValueError(f"{path}: cannot read image ({type(e).__name__}: {e})") from None


@ADAPTERS.register()
class ImageClassifier(LogitsAdapter):
    """MobileNetV3 (fp32, and the int8 TorchScript artifact): images [B, 3, H, W] -> logits [B, K]."""
    task, input_kind = "classification", "image"
    formats = ("torch_export", "onnx", "torchscript")

    @classmethod
    def matches(cls, cfg):
        return cfg["model"]["name"].startswith("mobilenet_v3")

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        if data is None:
            raise ExportError(f"model {cfg['model']['name']}: the evaluation pre-processing and class names come "
                              f"from the data set ({cfg['data']['name']}), which could not be built")
        return {"classes": list(data.classes),
                "preprocessing": _transform_steps(getattr(data.val, "transform", None), cfg["data"]["name"])}

    def transform(self):
        from torchvision.transforms import InterpolationMode, v2 as T
        p = self.spec["preprocessing"]
        steps = []
        if "resize" in p:
            steps.append(T.Resize(p["resize"], InterpolationMode(p["interpolation"]), p.get("max_size"),
                                  antialias=p["antialias"]))
        if "center_crop" in p:
            steps.append(T.CenterCrop(p["center_crop"]))
        steps += [T.PILToTensor(), T.ToDtype(torch.float32, scale=True)]
        if "mean" in p:
            steps.append(T.Normalize(p["mean"], p["std"]))
        return T.Compose(steps)

    def load(self, item):
        if not hasattr(self, "_transform"):
            self._transform = self.transform()
        return self._transform(_open_image(item))


# ---------------------------------------------------------------- sequences (Transformer classifier)

@ADAPTERS.register()
class TextClassifier(LogitsAdapter):
    """Transformer on token ids: tokens [B, T] (padded with pad_id) -> logits [B, K]. The tokenizer
    (tokenizers' JSON) is copied beside the artifact."""
    task, input_kind = "text_classification", "text"
    input_names = ("tokens",)

    @classmethod
    def matches(cls, cfg):
        return cfg["model"]["name"] == "transformer_classifier" and cfg["model"].get("front_end", "tokens") == "tokens"

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        if data is None or not hasattr(data.val, "tokenizer"):
            raise ExportError(f"model {cfg['model']['name']}: the tokenizer and class names come from the data "
                              f"set ({cfg['data']['name']}) and the run folder, which could not be read")
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise FileNotFoundError(f"{os.path.join(folder, 'tokenizer.json')}: the run's tokenizer is missing")
        front = model.front_end
        return {"classes": list(data.classes),
                "preprocessing": {"tokenizer": "tokenizer.json", "max_length": data.val.max_length,
                                  "pad_id": front.pad_id, "unk_token": "[UNK]",
                                  "max_positions": _max_positions(model)}}

    def files(self):
        return [self.spec["preprocessing"]["tokenizer"]]

    def dynamic_shapes(self, dynamic_batch):
        dim = torch.export.Dim
        return ({0: dim.DYNAMIC if dynamic_batch else dim.STATIC, 1: dim.DYNAMIC},)

    def load(self, item):
        from tokenizers import Tokenizer
        p = self.spec["preprocessing"]
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = Tokenizer.from_file(os.path.join(self.folder, p["tokenizer"]))
        ids = self._tokenizer.encode(item).ids
        ids = ids[: p["max_length"]] if p["max_length"] else ids[: p["max_positions"]]
        return torch.tensor(ids or [self._tokenizer.token_to_id(p["unk_token"])], dtype=torch.long)

    def collate(self, samples):
        pad = self.spec["preprocessing"]["pad_id"]
        return (torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=pad),)

    def module(self, model):
        return _Outputs(model).eval()


def _max_positions(model):
    pe = getattr(model.positions, "pe", None)
    return None if pe is None else int(pe.shape[0]) - (1 if model.pooling == "cls" else 0)


class _AudioInputs(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, audio, lengths):
        return (self.model({"audio": audio, "lengths": lengths}),)


@ADAPTERS.register()
class AudioClassifier(LogitsAdapter):
    """Transformer on waveforms (log-Mel front end inside the model): audio [B, N] float32 at
    sample_rate, padded / trimmed to N samples, and lengths [B] (samples before padding) -> logits."""
    task, input_kind = "audio_classification", "audio"
    input_names = ("audio", "lengths")

    @classmethod
    def matches(cls, cfg):
        return cfg["model"]["name"] == "transformer_classifier" and cfg["model"].get("front_end") == "audio"

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        if data is None:
            raise ExportError(f"model {cfg['model']['name']}: the sample rate, clip length and class names come "
                              f"from the data set ({cfg['data']['name']}), which could not be built")
        mel = model.front_end.mel
        return {"classes": list(data.classes),
                "preprocessing": {"sample_rate": data.val.sample_rate, "num_samples": data.val.num_samples,
                                  "mono": "mean of the channels", "resample": "torchaudio.functional.resample",
                                  "pad": "zeros at the end; longer clips are trimmed",
                                  "in_model": {"log_mel": {"n_fft": mel.n_fft, "win_length": mel.win_length,
                                                           "hop_length": mel.hop_length, "n_mels": mel.n_mels,
                                                           "top_db": 80.0}, "normalisation": "per clip"}}}

    def module(self, model):
        return _AudioInputs(model).eval()

    def load(self, item):
        from datasets.audio import pad_or_trim, read_audio
        p = self.spec["preprocessing"]
        return pad_or_trim(read_audio(item, p["sample_rate"]), p["num_samples"])

    def collate(self, samples):
        waves, lengths = zip(*samples)
        return torch.stack(waves), torch.as_tensor(lengths, dtype=torch.long)


# ---------------------------------------------------------------- detection (SSD)

class SSDExport(nn.Module):
    """torchvision SSD's eval path as one traceable function of a batch [B, 3, H, W] in [0, 1]:
    normalise and resize (the model's GeneralizedRCNNTransform settings), backbone, head, anchors,
    box decoding (BoxCoder), per-class score threshold and top-k, class-wise NMS
    (torchvision.ops.nms), the detections_per_img best, boxes scaled back to the input's pixels.

    torchvision's postprocess_detections filters by score before its top-k, so its tensors have
    data-dependent sizes and batched_nms branches on them, which torch.export cannot trace. Here
    the top-k runs over all anchors (the same boxes survive: the threshold only drops candidates),
    the threshold selects what enters NMS, and the kept scores are scattered back to static shapes.
    Outputs: boxes [B, D, 4] (xyxy), scores [B, D], labels [B, D], sorted by score; rows past an
    image's detections have score 0 and label 0 (background). D = detections_per_img.
    """

    def __init__(self, ssd):
        super().__init__()
        self.ssd = ssd
        width, height = ssd.transform.fixed_size
        self.size = (int(height), int(width))

    def forward(self, images):
        from torchvision.models.detection.image_list import ImageList
        from torchvision.ops import boxes as box_ops
        ssd, (h0, w0) = self.ssd, self.size
        b, _, h, w = images.shape
        x = F.interpolate(ssd.transform.normalize(images), size=(h0, w0), mode="bilinear", align_corners=False)
        features = list(ssd.backbone(x).values())
        head = ssd.head(features)
        anchors = ssd.anchor_generator(ImageList(x[:1], [(h0, w0)]), features)[0]  # one input size: shared
        n = anchors.shape[0]
        boxes = ssd.box_coder.decode_single(head["bbox_regression"].reshape(-1, 4), anchors.repeat(b, 1))
        boxes = box_ops.clip_boxes_to_image(boxes.reshape(b, n, 4), (h0, w0))
        scores = F.softmax(head["cls_logits"], -1)[:, :, 1:].transpose(1, 2)  # [B, C-1, N], no background
        c1, k = scores.shape[1], min(ssd.topk_candidates, n)
        top, idx = scores.topk(k, dim=2)  # [B, C-1, k]
        cand = boxes.unsqueeze(1).expand(b, c1, n, 4).gather(2, idx.unsqueeze(-1).expand(b, c1, k, 4))
        labels = torch.arange(1, c1 + 1, device=images.device).view(1, c1, 1).expand(b, c1, k)
        groups = torch.arange(b, device=images.device).view(b, 1, 1) * (c1 + 1) + labels
        flat_boxes, flat_scores = cand.reshape(-1, 4), top.reshape(-1)
        # class-wise (and image-wise) NMS in one call: boxes of other groups moved apart (torchvision's trick)
        shifted = flat_boxes + (groups.reshape(-1, 1) * (max(h0, w0) + 1)).to(flat_boxes)
        selected = (flat_scores > ssd.score_thresh).nonzero().squeeze(1)
        keep = selected[torch.ops.torchvision.nms(shifted[selected], flat_scores[selected], ssd.nms_thresh)]
        kept = torch.zeros_like(flat_scores).scatter(0, keep, flat_scores[keep]).reshape(b, c1 * k)
        out_scores, order = kept.topk(min(ssd.detections_per_img, c1 * k), dim=1)
        valid = out_scores > 0
        out_boxes = cand.reshape(b, c1 * k, 4).gather(1, order.unsqueeze(-1).expand(-1, -1, 4))
        ratio_w, ratio_h = w / w0, h / h0
        out_boxes = torch.stack([out_boxes[..., 0] * ratio_w, out_boxes[..., 1] * ratio_h,
                                 out_boxes[..., 2] * ratio_w, out_boxes[..., 3] * ratio_h], -1)
        out_labels = labels.reshape(b, c1 * k).gather(1, order) * valid
        return out_boxes * valid.unsqueeze(-1), out_scores, out_labels


def detections(outputs, score_thresh=0.0):
    """Exported outputs -> one {boxes, scores, labels} dict per image (padding and low scores dropped)."""
    boxes, scores, labels = outputs
    keep = (labels > 0) & (scores >= score_thresh)
    return [{"boxes": b[k], "scores": s[k], "labels": lab[k]} for b, s, lab, k in zip(boxes, scores, labels, keep)]


def match_detections(ref, got, min_score=0.05, iou_thresh=0.9, score_tol=0.01, capacity=None):
    """Per image, every detection of one list scoring >= min_score must have a counterpart in the
    other (same label, IoU >= iou_thresh, scores within score_tol). Counterparts may score down to
    min_score - score_tol, so a box on the threshold does not count as missing; likewise, when the
    other list is full (`capacity` detections), boxes scoring within score_tol of its last one."""
    from torchvision.ops import box_iou
    unmatched, compared, worst_iou, worst_score = [0, 0], 0, 1.0, 0.0
    for r, g in zip(ref, got):
        for side, (a, b) in enumerate(((r, g), (g, r))):
            strong = a["scores"] >= min_score
            if capacity and len(b["scores"]) >= capacity:  # b was cut at its capacity: ties may fall off
                strong &= a["scores"] > b["scores"].min() + score_tol
            near = b["scores"] >= min_score - score_tol
            a_boxes, a_scores, a_labels = a["boxes"][strong], a["scores"][strong], a["labels"][strong]
            b_boxes, b_scores, b_labels = b["boxes"][near], b["scores"][near], b["labels"][near]
            if side == 0:
                compared += len(a_boxes)
            if not len(a_boxes):
                continue
            if not len(b_boxes):
                unmatched[side] += len(a_boxes)
                continue
            iou = box_iou(a_boxes.float(), b_boxes.float())
            iou = iou * (a_labels[:, None] == b_labels[None]) * ((a_scores[:, None] - b_scores[None]).abs() <= score_tol)
            best, j = iou.max(1)
            unmatched[side] += int((best < iou_thresh).sum())
            ok = best >= iou_thresh
            if ok.any():
                worst_iou = min(worst_iou, best[ok].min().item())
                worst_score = max(worst_score, (a_scores[ok] - b_scores[j[ok]]).abs().max().item())
    return {"images": len(ref), "detections_compared": compared, "unmatched_eager": unmatched[0],
            "unmatched_exported": unmatched[1], "min_matched_iou": worst_iou, "max_score_diff": worst_score,
            "tolerance": {"min_score": min_score, "iou": iou_thresh, "score": score_tol},
            "ok": unmatched == [0, 0]}


@ADAPTERS.register()
class Detector(Adapter):
    """SSD300 / SSDlite: images [B, 3, H, W] (RGB in [0, 1], any size: resized inside) -> boxes
    [B, D, 4] in the input's pixels, scores [B, D], labels [B, D] (0 = padding)."""
    task, input_kind = "detection", "image"
    output_names = ("boxes", "scores", "labels")

    @classmethod
    def matches(cls, cfg):
        return cfg["model"]["name"] in ("ssd300_vgg16", "ssdlite320_mobilenet_v3_large")

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        num_classes = model.head.classification_head.num_columns
        if data is not None:
            classes, label_to_cat = list(data.classes), dict(getattr(data.val, "label_to_cat", {}))
        else:  # no data at hand: the names of torchvision weights, else numbers
            classes, label_to_cat = _weights_categories(cfg["model"].get("weights")), {}
        classes = classes or ["__background__"] + [str(i) for i in range(1, num_classes)]
        width, height = model.transform.fixed_size
        return {"classes": classes, "label_to_category_id": {str(k): v for k, v in label_to_cat.items()},
                "preprocessing": {"image_mode": "RGB", "scale": 1 / 255, "layout": "NCHW float32",
                                  "in_model": {"resize": [int(height), int(width)], "interpolation": "bilinear",
                                               "mean": list(model.transform.image_mean),
                                               "std": list(model.transform.image_std)}},
                "postprocessing": {"in_model": {"score_thresh": model.score_thresh, "nms_thresh": model.nms_thresh,
                                                "topk_candidates": model.topk_candidates,
                                                "detections_per_img": model.detections_per_img},
                                   "boxes": "xyxy in the input image's pixels", "padding": "label 0, score 0"}}

    def module(self, model):
        return SSDExport(model).eval()

    def dynamic_shapes(self, dynamic_batch):
        dim = torch.export.Dim
        return ({0: dim.DYNAMIC if dynamic_batch else dim.STATIC, 2: dim.DYNAMIC, 3: dim.DYNAMIC},)

    def compare(self, ref, got, atol=None):
        return match_detections(detections(ref), detections(got), capacity=ref[1].shape[1])

    def load(self, item):
        from torchvision.transforms.v2 import functional as TF
        return TF.to_dtype(TF.pil_to_tensor(_open_image(item)), torch.float32, scale=True)

    def batch_key(self, sample):
        return tuple(sample.shape)

    def category_id(self, label):
        return self.spec.get("label_to_category_id", {}).get(str(label), label)

    def present(self, outputs, items, samples, out_dir, args):
        from torchvision.io import write_png
        from torchvision.utils import draw_bounding_boxes
        results = []
        for path, image, det in zip(items, samples, detections(outputs, args.score_thresh)):
            names = [f"{self.class_name(int(c))} {s:.2f}" for c, s in zip(det["labels"], det["scores"].tolist())]
            drawn = draw_bounding_boxes((image * 255).round().to(torch.uint8), det["boxes"], names, width=2,
                                        colors="red")
            out = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + "_boxes.png")
            write_png(drawn, out)
            found = [{"label": self.class_name(int(c)), "category_id": self.category_id(int(c)),
                      "score": round(s, 4), "bbox_xyxy": [round(v, 2) for v in b]}
                     for c, s, b in zip(det["labels"].tolist(), det["scores"].tolist(), det["boxes"].tolist())]
            results.append({"input": path, "drawn": out, "height": image.shape[1], "width": image.shape[2],
                            "detections": found})
            print(f"{path}: {len(found)} detections" + (": " if found else "")
                  + ", ".join(f"{d['label']} {d['score']:.2f}" for d in found[:8]) + (" ..." if len(found) > 8 else ""))
        return results

    def finish(self, results, out_dir, args):
        """detections.json: COCO style (images, categories, annotations with scores)."""
        images, annotations = [], []
        for i, r in enumerate(results, 1):
            images.append({"id": i, "file_name": r["input"], "height": r["height"], "width": r["width"]})
            for d in r["detections"]:
                x0, y0, x1, y1 = d["bbox_xyxy"]
                annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": d["category_id"],
                                    "bbox": [x0, y0, round(x1 - x0, 2), round(y1 - y0, 2)],
                                    "area": round((x1 - x0) * (y1 - y0), 2), "score": d["score"]})
        categories = [{"id": self.category_id(k), "name": name} for k, name in enumerate(self.classes or [])
                      if k > 0 and not name.startswith(("unused_", "N/A"))]
        write_json(os.path.join(out_dir, "detections.json"),
                   {"images": images, "categories": categories, "annotations": annotations})


def _weights_categories(weights):
    """Category names stored with torchvision weights (e.g. SSDLite320_..._Weights.COCO_V1), else None."""
    if not weights or os.path.exists(str(weights)):
        return None
    from torchvision.models import get_weight
    try:
        return list(get_weight(weights).meta["categories"])
    except (ValueError, KeyError, AttributeError):
        return None
