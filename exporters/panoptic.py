"""Panoptic FPN: the model up to its panoptic fusion exported as one ONNX graph of ONE image of any
size (resize, normalisation, RPN, RoI heads, mask pasting, the semantic head at the input's size),
through the TorchScript-based exporter as torchvision exports Mask R-CNN (the numbers of proposals
and detections depend on the data). The fusion runs outside the graph, in numpy
(runtime/panoptic.py: `fuse`), for evaluate.py --artifact, predict.py and a torch-free consumer
alike. Compared with the eager model box by box, mask by mask and pixel by pixel; presented as a
picture per image and COCO panoptic PNGs + JSON that the panoptic scorer reads."""
import colorsys
import logging
import os

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torch import nn
from torchvision.ops import box_iou
from torchvision.transforms.v2 import functional as TF

from engine.files import write_json
from exporters.base import EXPORTERS, Adapter, ExportError
from exporters.inputs import read_image
from exporters.rcnn import rcnn_postprocessing, rcnn_preprocessing
from exporters.ssd_static import match_detections
from runtime.panoptic import OUTPUTS, fuse, fusion_settings, named_outputs, png_bytes

log = logging.getLogger(__name__)

# exported vs eager, measured (shapes demo, 16 val images at their size; 4 photos resized inside): masks up
# to 1.5e-4 and sem_prob 2.4e-5 apart; sem_label equal but on 2-3 of ~250k photo pixels (ties); allowed: atol
# (export.py's 1e-3) for masks and sem_prob, and this fraction of an image's pixels for sem_label and panoptic
PIXEL_FRACTION = 1e-3  # of an image's pixels: sem_label or panoptic category may differ there
PNG_FOLDER, JSON_FILE = "panoptic", "panoptic.json"  # predict.py's COCO panoptic output in its folder
DRAW_MIN_SIDE = 384  # pictures of smaller images are scaled up so that their labels stay readable


@EXPORTERS.register(task="panoptic", inputs="image")
class PanopticSegmenter(Adapter):
    """image [3, H, W] (RGB in [0, 1], any size) -> boxes [N, 4] (xyxy, input pixels), scores [N],
    labels [N] (thing labels 1..T), masks [N, 1, H, W] (instance mask probabilities pasted into the
    image), sem_prob [H, W] and sem_label [H, W] (the semantic head's softmax maximum and its category
    label at the input's size). The fusion (runtime.panoptic.fuse) turns them into the panoptic map."""
    task = "panoptic"
    input_names = ("image",)
    output_names = OUTPUTS
    onnx_exporter = "torchscript"
    one_image = True

    def __init__(self, spec, folder):
        super().__init__(spec, folder)
        self._stems = set()  # predict's file names so far (one run)

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        classes, label_to_cat, categories = _categories(model, data)
        return {"classes": classes, "label_to_category_id": {str(k): v for k, v in label_to_cat.items()},
                "preprocessing": rcnn_preprocessing(model),
                "postprocessing": {"in_model": {**rcnn_postprocessing(model), "semantic_classes": model.semantic_classes},
                                   "outputs": {"boxes": "xyxy in the input image's pixels",
                                               "labels": "thing labels 1..T (label_to_category_id)",
                                               "masks": "[N, 1, H, W] mask probabilities pasted into the image",
                                               "sem_prob": "[H, W] the semantic head's softmax maximum",
                                               "sem_label": "[H, W] its category label (0: things)"},
                                   "fusion": dict(model.fusion), "stuff_labels": list(model.stuff_labels),
                                   "categories": categories,
                                   "panoptic": "runtime.panoptic.fuse: ids R + 256 G + 256^2 B in the PNG"}}

    # ---- export
    def module(self, model):
        if not callable(getattr(model, "unfused", None)):
            raise ExportError(f"model {self.spec['model']}: a panoptic model exports through its `unfused(images)` "
                              f"(the eval forward up to the fusion, models.panoptic.PanopticFPN), which it lacks")
        return Unfused(model).eval()

    def dynamic_shapes(self, dynamic_batch):
        return None  # torch.export is not declared (models/panoptic.py's not_exported)

    def dynamic_axes(self, dynamic_batch):
        found = {"boxes": {0: "detections"}, "scores": {0: "detections"}, "labels": {0: "detections"},
                 "masks": {0: "detections", 2: "height", 3: "width"}, "sem_prob": {0: "height", 1: "width"},
                 "sem_label": {0: "height", 1: "width"}}
        return {"image": {1: "height", 2: "width"}, **found}

    def compare(self, ref, got, atol=1e-3):
        """Per image: the detections matched (exporters.ssd_static.match_detections), the masks of matched
        pairs and sem_prob within atol, sem_label and the fused panoptic categories equal on all but
        PIXEL_FRACTION of the pixels."""
        ref, got = [[named_outputs(o, self.spec) for o in side] for side in (ref, got)]
        in_model = self.spec["postprocessing"]["in_model"]
        keys = ("boxes", "scores", "labels")
        result = match_detections(*[[{k: torch.as_tensor(o[k]) for k in keys} for o in side] for side in (ref, got)],
                                  min_score=min(0.05, in_model["box_score_thresh"]),  # all, when the model keeps all
                                  capacity=in_model["box_detections_per_img"])
        mask_diff = prob_diff = 0.0
        label_px = panoptic_px = worst_label = worst_panoptic = 0
        for r, g in zip(ref, got):
            mask_diff = max(mask_diff, _matched_mask_diff(r, g))
            prob_diff = max(prob_diff, float(np.abs(r["sem_prob"] - g["sem_prob"]).max(initial=0.0)))
            pixels = r["sem_label"].size
            differ = int((r["sem_label"] != g["sem_label"]).sum())
            fused = int((self.category_map(r) != self.category_map(g)).sum())
            label_px, panoptic_px = label_px + differ, panoptic_px + fused
            worst_label, worst_panoptic = max(worst_label, differ / pixels), max(worst_panoptic, fused / pixels)
        ok = (result["ok"] and mask_diff <= atol and prob_diff <= atol and worst_label <= PIXEL_FRACTION
              and worst_panoptic <= PIXEL_FRACTION)
        return {**result, "samples": len(ref), "max_mask_diff": mask_diff, "max_sem_prob_diff": prob_diff,
                "sem_label_pixels_differ": label_px, "panoptic_pixels_differ": panoptic_px,
                "tolerance": {**result["tolerance"], "mask": atol, "sem_prob": atol,
                              "pixel_fraction": PIXEL_FRACTION}, "ok": bool(ok)}

    def category_map(self, outputs):
        """[H, W] the fused panoptic map as (COCO category id, thing instance or 0) codes: comparable
        when two sides number their segments alike or not."""
        ids, segments = fuse(outputs, self.spec, self.folder)
        code = np.zeros(len(segments) + 1, np.int64)
        for s in segments:
            code[s["id"]] = s["category_id"] * 1000 + (s["id"] if s["isthing"] else 0)
        return code[ids]

    def eval_model(self, runner, where):
        return RunnerAsPanoptic(runner, self.spec, where)

    # ---- predict
    def load(self, item):
        return TF.to_dtype(TF.pil_to_tensor(read_image(item)), torch.float32, scale=True)

    def categories(self):
        """{COCO category id: {id, name, isthing, color?}} of the description."""
        return {int(c["id"]): c for c in self.spec["postprocessing"].get("categories", [])}

    def present(self, outputs, items, samples, out_dir, args):
        if len(items) != 1:
            raise ValueError(f"{type(self).__name__}: its graph takes one image, got {len(items)}")
        path, image = items[0], samples[0]
        ids, segments = fuse([o.cpu().numpy() for o in outputs], self.spec, self.folder)
        stem = self._unique_stem(os.path.splitext(os.path.basename(path))[0])
        os.makedirs(os.path.join(out_dir, PNG_FOLDER), exist_ok=True)
        png = os.path.join(out_dir, PNG_FOLDER, stem + ".png")
        with open(png, "wb") as f:
            f.write(png_bytes(ids))
        pixels = (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        drawn = os.path.join(out_dir, stem + "_panoptic.png")
        draw_panoptic(pixels, ids, segments, self.categories()).save(drawn)
        names = self.categories()
        found = [{"id": s["id"], "category_id": s["category_id"], "isthing": s["isthing"], "area": s["area"],
                  "score": round(s["score"], 4), "label": names.get(s["category_id"], {}).get("name",
                                                                                             str(s["category_id"]))}
                 for s in segments]
        return [{"input": path, "drawn": drawn, "panoptic_png": png, "image_id": int(stem) if stem.isdigit() else stem,
                 "height": int(image.shape[1]), "width": int(image.shape[2]), "segments": found}]

    def _unique_stem(self, stem):
        """The file stem, with a suffix when another input of this run had it."""
        name, k = stem, 1
        while name in self._stems:
            k += 1
            name = f"{stem}_{k}"
        self._stems.add(name)
        return name

    def summary(self, result):
        found = result["segments"]
        shown = [f"{s['label']} {s['score']:.2f}" if s["isthing"] else s["label"] for s in found]
        return (f"{result['input']}: {len(found)} segments" + (": " if found else "") + ", ".join(shown[:10])
                + (" ..." if len(shown) > 10 else ""))

    def after_predictions(self, results, out_dir, args):
        """panoptic.json: COCO panoptic (annotations with segments_info, images, categories), its PNGs in
        panoptic/ (evaluate.py --panoptic-pred-json / --panoptic-pred-folder read them)."""
        annotations = [{"image_id": r["image_id"], "file_name": os.path.basename(r["panoptic_png"]),
                        "segments_info": [{k: s[k] for k in ("id", "category_id", "isthing", "area", "score")}
                                          for s in r["segments"]]} for r in results]
        images = [{"id": r["image_id"], "file_name": r["input"], "height": r["height"], "width": r["width"]}
                  for r in results]
        write_json(os.path.join(out_dir, JSON_FILE), {"annotations": annotations, "images": images,
                                                      "categories": list(self.categories().values())})


class Unfused(nn.Module):
    """The exported graph: one image -> the model's `unfused` outputs of it, in OUTPUTS' order."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, image):
        found = self.model.unfused([image])[0]
        return (found["boxes"], found["scores"], found["labels"], found["masks"], found["sem_prob"],
                found["sem_seg"])


class RunnerAsPanoptic(nn.Module):
    """A panoptic runner where the engine expects the eager model: the val loader's images (a list of
    [3, H, W] tensors) in, per image the eager PanopticFPN's eval dict out (boxes, labels, scores, masks,
    sem_seg, panoptic, segments_info with labels as category_id), the fusion run in numpy
    (runtime.panoptic.fuse). Each image runs alone; ONNX Runtime sessions are safe across threads."""

    def __init__(self, runner, spec, where):
        super().__init__()
        self.runner, self.spec, self.where = runner, spec, where
        _, _, to_cat = fusion_settings(spec, where)
        self.to_label = {c: label for label, c in to_cat.items()}

    def forward(self, images):
        if not isinstance(images, (list, tuple)):
            raise ExportError(f"{self.where}: a panoptic artifact is evaluated on panoptic batches (a list of images), "
                              f"this data set gives {type(images).__name__}: evaluate the checkpoint")
        return [self.one(image) for image in images]

    def one(self, image):
        out = dict(zip(self.spec["outputs"], self.runner(image.cpu())))
        ids, segments = fuse([out[k].numpy() for k in self.spec["outputs"]], self.spec, self.where)
        segments = [{"id": s["id"], "category_id": self.to_label[s["category_id"]], "isthing": bool(s["isthing"]),
                     "score": s["score"], "area": s["area"]} for s in segments]
        return {"boxes": out["boxes"], "labels": out["labels"], "scores": out["scores"], "masks": out["masks"],
                "sem_seg": out["sem_label"], "panoptic": torch.from_numpy(ids), "segments_info": segments}


def _categories(model, data):
    """(classes, label -> COCO category id, COCO categories [{id, name, isthing, color?}]) from the data's
    panoptic categories, else (no data at hand) numbered from the model's thing and stuff counts."""
    val = getattr(data, "val", None)
    label_to_cat = dict(getattr(getattr(val, "categories", None), "label_to_cat", None) or {})
    coco = {int(c["id"]): c for c in (getattr(val, "data", None) or {}).get("categories", [])}
    num_labels = model.num_things + model.num_stuff
    if data is not None and len(label_to_cat) == num_labels and set(label_to_cat.values()) <= set(coco):
        classes = list(data.classes)
        categories = [{"id": c, "name": coco[c].get("name", str(c)), "isthing": int(label <= model.num_things),
                       **({"color": list(coco[c]["color"])} if coco[c].get("color") else {})}
                      for label, c in sorted(label_to_cat.items())]
        return classes, label_to_cat, categories
    label_to_cat = {label: label for label in range(1, num_labels + 1)}
    categories = [{"id": label, "name": str(label), "isthing": int(label <= model.num_things)}
                  for label in label_to_cat]
    return ["__background__"] + [str(label) for label in label_to_cat], label_to_cat, categories


def _matched_mask_diff(r, g):
    """The largest mask difference between the detections of r and g paired by label and best box IoU
    (pairs under IoU 0.9 are match_detections' business)."""
    if not len(r["boxes"]) or not len(g["boxes"]):
        return 0.0
    iou = box_iou(torch.as_tensor(r["boxes"]).float(), torch.as_tensor(g["boxes"]).float()).numpy()
    iou = iou * (r["labels"][:, None] == g["labels"][None])
    best = iou.argmax(1)
    diffs = [np.abs(r["masks"][i] - g["masks"][j]).max() for i, j in enumerate(best) if iou[i, j] >= 0.9]
    return float(max(diffs, default=0.0))


# ---------------------------------------------------------------- the picture

def segment_colours(segments, categories):
    """{segment id: (r, g, b)}: stuff in its category's colour, each thing instance a colour of its own."""
    colours = {}
    for k, s in enumerate(segments):
        if s["isthing"]:  # golden-ratio hues: neighbouring instances far apart
            colours[s["id"]] = tuple(int(255 * v) for v in colorsys.hsv_to_rgb((0.13 + 0.618 * k) % 1, 0.85, 0.95))
        else:
            colour = categories.get(s["category_id"], {}).get("color")
            colours[s["id"]] = tuple(colour) if colour else \
                tuple(int(v) for v in np.random.default_rng(s["category_id"]).integers(40, 216, 3))
    return colours


def draw_panoptic(pixels, ids, segments, categories, alpha=0.55):
    """PIL image: uint8 pixels [H, W, 3] with each segment blended in its colour (segment_colours),
    outlined, and labelled with its class name (things with their score) on a filled background."""
    scale = max(1, -(-DRAW_MIN_SIDE // max(1, min(ids.shape))))  # small images drawn larger
    if scale > 1:
        pixels, ids = pixels.repeat(scale, 0).repeat(scale, 1), ids.repeat(scale, 0).repeat(scale, 1)
    colours = segment_colours(segments, categories)
    palette = np.zeros((max(colours, default=0) + 1, 3), np.float32)
    for i, c in colours.items():
        palette[i] = c
    out = pixels.astype(np.float32)
    on = ids > 0
    out[on] = (1 - alpha) * out[on] + alpha * palette[ids[on]]
    edge = np.zeros(ids.shape, bool)  # segment boundaries
    edge[:, 1:] |= ids[:, 1:] != ids[:, :-1]
    edge[1:] |= ids[1:] != ids[:-1]
    out[edge] = 255
    picture = Image.fromarray(out.round().clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default(size=max(11, min(ids.shape) // 28))
    placed = []  # the labels' boxes so far: a label that would cover one moves down (or up)
    for s in segments:
        ys, xs = np.nonzero(ids == s["id"])
        if not len(ys):
            continue
        k = np.argmin((ys - ys.mean()) ** 2 + (xs - xs.mean()) ** 2)  # the segment's pixel nearest its centre
        name = categories.get(s["category_id"], {}).get("name", str(s["category_id"]))
        text = f"{name} {s['score']:.2f}" if s["isthing"] else name
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        w, h = right - left + 6, bottom - top + 4
        x = int(np.clip(xs[k] - w // 2, 0, max(0, picture.width - w)))
        y = _free_row(int(ys[k] - h // 2), x, w, h, placed, picture.height)
        placed.append((x, y, x + w, y + h))
        fill = tuple(int(v * 0.6) for v in colours[s["id"]])
        draw.rectangle((x, y, x + w, y + h), fill=fill, outline=(255, 255, 255))
        draw.text((x + 3 - left, y + 2 - top), text, fill=(255, 255, 255), font=font)
    return picture


def _free_row(y, x, w, h, placed, height):
    """The row nearest y (inside the picture) where a w x h label at x covers none of the placed ones."""
    def clear(top):
        return not any(x < x1 and x + w > x0 and top < y1 and top + h > y0 for x0, y0, x1, y1 in placed)
    rows = [min(max(0, y), max(0, height - h))]
    for step in range(1, 8):
        rows += [y + step * (h + 1), y - step * (h + 1)]
    for top in rows:
        if 0 <= top <= max(0, height - h) and clear(top):
            return top
    return rows[0]
