"""A toy family kept outside the repository's packages, as a user's own would be: a per-pixel
classifier (quantizable: a QuantStub variant with fuse_model), its data set (with its doctor source)
and evaluator, and the export adapter of its task. It is plugged in by a config's
`imports: [toy_stripes]` alone (tests/test_new_family.py): no file of the zoo is edited.

The task: which pixels belong to a bright vertical stripe on a noisy background.
"""
import hashlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from datasets.base import DataSplits
from datasets.doctor.findings import ERROR
from datasets.doctor.sources import Source
from engine import dist
from engine.evaluation import Evaluator
from engine.registry import DATASETS, DOCTOR_SOURCES, MODELS, Range
from exporters import EXPORTERS, Adapter, TupleOutput, read_image

SIZE = 16


def stripe_sample(seed):
    rng = np.random.default_rng(seed)
    image = rng.uniform(0.0, 0.4, (3, SIZE, SIZE)).astype(np.float32)
    left = int(rng.integers(0, SIZE - 4))
    image[:, :, left:left + 4] += 0.6
    mask = np.zeros((SIZE, SIZE), dtype=np.int64)
    mask[:, left:left + 4] = 1
    return torch.from_numpy(image), torch.from_numpy(mask)


class Stripes(Dataset):
    deterministic = True  # each sample depends on its index only
    transform = None  # no augmentation: int8 calibration with the evaluation transform reads the same samples

    def __init__(self, n, offset):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return stripe_sample(self.offset + i)


class PixelAccuracy(Evaluator):
    def __init__(self):
        self.correct, self.total = 0, 0

    def update(self, logits, masks):
        self.correct += int((logits.argmax(1).cpu() == masks).sum())
        self.total += masks.numel()

    def compute(self):
        parts = dist.all_gather_list([(self.correct, self.total)])  # one pair per process
        correct, total = sum(c for c, _ in parts), sum(t for _, t in parts)
        return {"pixel_acc": 100.0 * correct / max(total, 1)}

    def metric_names(self):
        return ["pixel_acc"]


@DOCTOR_SOURCES.register("toy_stripes")
class StripesSource(Source):
    """The doctor's reading of a split: each sample's pixels finite and in [0, 1], mask values 0 or 1."""
    kind = "toy_stripes"

    def __init__(self, split, dataset, cfg_data, features=False):
        super().__init__(split, dataset, cfg_data, features)
        self.classes = ["background", "stripe"]

    def __len__(self):
        return len(self.dataset)

    def check(self, i):
        image, mask = self.dataset[i]
        record = f"{self.split} sample {i}"
        out = {"file": "", "record": record, "problems": [], "labels": sorted(set(mask.unique().tolist())),
               "width": image.shape[2], "height": image.shape[1],
               "content": hashlib.sha1(image.numpy().tobytes()).hexdigest()}
        if not bool(torch.isfinite(image).all()) or image.min() < 0 or image.max() > 1:
            out["problems"].append((ERROR, "pixel_range", f"{record}: pixels outside [0, 1]"))
        if not set(out["labels"]) <= {0, 1}:
            out["problems"].append((ERROR, "mask_values", f"{record}: mask values {out['labels']}, expected 0 or 1"))
        return out


@DATASETS.register(inputs="image", doctor="toy_stripes", ranges={"train_samples": Range(ge=1, le=10_000),
                                          "val_samples": Range(ge=1, le=10_000)})
def toy_stripes(train_samples=64, val_samples=32):
    return DataSplits(train=Stripes(train_samples, 0), val=Stripes(val_samples, 10_000),
                      evaluator=PixelAccuracy, model_defaults={"num_classes": 2},
                      classes=["background", "stripe"])


class PixelClassifier(nn.Module):
    """quantize: QuantStub / DeQuantStub around the body and fuse_model, for torch.ao's eager int8."""

    def __init__(self, num_classes, quantize=False):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, num_classes, 1))
        stubs = (torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()) if quantize else ()
        self.quant, self.dequant = stubs or (nn.Identity(), nn.Identity())

    def forward(self, images, masks=None):
        logits = self.dequant(self.body(self.quant(images)))
        if self.training:
            return {"loss_ce": F.cross_entropy(logits, masks)}
        return logits

    def fuse_model(self, is_qat=False):
        fuse = torch.ao.quantization.fuse_modules_qat if is_qat else torch.ao.quantization.fuse_modules
        fuse(self.body, [["0", "1"]], inplace=True)


@MODELS.register(task="semantic_segmentation", quantizable=True, exports=("onnx", "torch_export", "torchscript"),
                 export_adapter="StripeSegmenter", ranges={"num_classes": Range(ge=2)})
def toy_pixel_classifier(num_classes=2, quantize=False):
    return PixelClassifier(num_classes, quantize)


@EXPORTERS.register(task="semantic_segmentation", inputs="image", by_name=True)  # the zoo's task has Segmenter
class StripeSegmenter(Adapter):
    """images [B, 3, 16, 16] -> logits [B, K, 16, 16]; predict writes each input's stripe pixels."""
    task = "semantic_segmentation"
    output_names = ("logits",)

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        return {"classes": data.classes if data else None, "preprocessing": {"size": SIZE}}

    def module(self, model):
        return TupleOutput(model).eval()

    def compare(self, ref, got, atol=1e-4):
        diff = (ref[0].float() - got[0].float()).abs().max().item()
        return {"samples": len(ref[0]), "max_abs_logit_diff": diff, "tolerance": {"max_abs_logit_diff": atol},
                "ok": diff <= atol}

    def load(self, item):
        size = self.spec["preprocessing"]["size"]
        image = read_image(item).resize((size, size))
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1).contiguous()

    def present(self, outputs, items, samples, out_dir, args):
        results = []
        for item, logits in zip(items, outputs[0]):
            columns = sorted(set((logits.argmax(0) == 1).nonzero()[:, 1].tolist()))
            results.append({"input": item, "stripe_columns": columns})
            print(f"{item}: stripe at columns {columns}")
        return results
