"""Classifiers: logits compared top-1 and within LOGITS_ATOL, top-k presented; the image classifier
with its torchvision eval transform written as a spec and rebuilt from it."""
import logging

import torch
from torchvision.transforms import InterpolationMode, v2 as T

from exporters.base import EXPORTERS, LOGITS_ATOL, Adapter, ExportError
from exporters.inputs import read_image

log = logging.getLogger(__name__)


class LogitsAdapter(Adapter):
    """Outputs: logits [B, K]."""

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
        return results

    def summary(self, result):
        item = result["input"]
        shown = item if len(str(item)) <= 60 else str(item)[:57] + "..."
        return f"{shown}: " + ", ".join(f"{t['label']} {t['probability']:.3f}" for t in result["top"])


def preprocessing_spec(transform, where):
    """Resize / CenterCrop / Normalize settings of a torchvision eval transform (v2 Compose), as JSON."""
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


def transform_from_spec(p):
    """The eval transform (PIL image -> float tensor) that preprocessing_spec described."""
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


@EXPORTERS.register(task="classification", inputs="image")
class ImageClassifier(LogitsAdapter):
    """images [B, 3, H, W] -> logits [B, K]; also the int8 TorchScript artifact."""
    task = "classification"

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        if data is None:
            raise ExportError(f"model {cfg['model']['name']}: the evaluation pre-processing and class names come "
                              f"from the data set ({cfg['data']['name']}), which could not be built")
        return {"classes": list(data.classes),
                "preprocessing": preprocessing_spec(getattr(data.val, "transform", None), cfg["data"]["name"])}

    def transform(self):
        return transform_from_spec(self.spec["preprocessing"])

    def load(self, item):
        if not hasattr(self, "_transform"):
            self._transform = self.transform()
        return self._transform(read_image(item))
