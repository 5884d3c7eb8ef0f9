"""A toy family kept outside the repository's packages, as a user's own would be: a per-pixel
classifier, its data set and evaluator, and the export adapter of its task. It is plugged in by a
config's `imports: [toy_stripes]` alone (tests/test_new_family.py): no file of the zoo is edited.

The task: which pixels belong to a bright vertical stripe on a noisy background.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from datasets.base import DataSplits
from engine import dist
from engine.evaluation import Evaluator
from engine.registry import DATASETS, MODELS, Range
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


@DATASETS.register(inputs="image", ranges={"train_samples": Range(ge=1, le=10_000),
                                          "val_samples": Range(ge=1, le=10_000)})
def toy_stripes(train_samples=64, val_samples=32):
    return DataSplits(train=Stripes(train_samples, 0), val=Stripes(val_samples, 10_000),
                      evaluator=PixelAccuracy, model_defaults={"num_classes": 2},
                      classes=["background", "stripe"])


class PixelClassifier(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, num_classes, 1))

    def forward(self, images, masks=None):
        logits = self.body(images)
        if self.training:
            return {"loss_ce": F.cross_entropy(logits, masks)}
        return logits


@MODELS.register(task="semantic_segmentation", ranges={"num_classes": Range(ge=2)})
def toy_pixel_classifier(num_classes=2):
    return PixelClassifier(num_classes)


@EXPORTERS.register(task="semantic_segmentation", inputs="image")
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
