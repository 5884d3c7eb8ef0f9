"""Classification evaluation: top-1/top-5, per-class accuracy and the confusion matrix, and the
analysis (evaluators/classification_analysis.py): per-class precision / recall / F1, top confusions, the most
confidently wrong samples with their files, calibration (ECE, reliability, fitted temperature).

Used by every classifier family (images, text, audio).
"""
import torch

from engine import dist
from engine.evaluation import Evaluator
from engine.report import headline_markdown, plots
from evaluators.calibration import ece
from evaluators.classification_analysis import (MAX_MATRIX_CLASSES, classification_headline, classification_sections,
                                                confusion_section)

MAX_KEPT_LOGITS = 20_000_000  # logits kept for calibration and PR curves (floats, all processes)


def sample_name(dataset, index):
    """What names a validation sample: its file (ImageFolder, audio), the start of its text, or None."""
    while hasattr(dataset, "indices") and hasattr(dataset, "dataset"):  # torch Subset
        dataset, index = dataset.dataset, dataset.indices[index]
    if hasattr(dataset, "samples") and isinstance(dataset.samples[index], (tuple, list)):
        return str(dataset.samples[index][0])
    if hasattr(dataset, "files"):
        return str(dataset.files[index])
    if hasattr(dataset, "texts"):
        text = " ".join(str(dataset.texts[index]).split())
        return f"text {index}: {text[:100]}{'...' if len(text) > 100 else ''}"
    return None


class ClassificationEvaluator(Evaluator):
    def __init__(self, classes):
        self.classes = list(classes)
        self._top5, self._pred, self._true, self._conf, self._logits = [], [], [], [], []
        self._kept = 0
        self._dataset, self._indices = None, None
        self._all = None  # gathered from every process, once: later calls may run on rank 0 only

    def attach_dataset(self, dataset, indices):
        self._dataset, self._indices = dataset, indices

    def update(self, logits, targets):
        self._all = None
        logits = logits.float().cpu()
        k = min(5, logits.shape[1])
        topk = logits.topk(k, dim=1).indices
        targets = targets.cpu()
        self._pred += topk[:, 0].tolist()
        self._true += targets.tolist()
        self._top5 += (topk == targets[:, None]).any(1).tolist()
        if self.analysis:
            self._conf += logits.softmax(1).max(1).values.tolist()
            if self._kept + logits.numel() <= MAX_KEPT_LOGITS // dist.world_size():
                self._logits.append(logits)
                self._kept += logits.numel()

    def _names(self):
        """Each gathered sample's name, in the gathered order (None when they cannot be told)."""
        seen = len(self._pred)
        indices = list(self._indices) if self._indices is not None else None
        ok = self._dataset is not None and indices is not None and len(indices) == seen  # skipped samples: no
        names = [sample_name(self._dataset, i) for i in indices] if ok else None
        gathered = dist.all_gather_list([names])
        return None if any(n is None or None in n for n in gathered) else [x for n in gathered for x in n]

    def _gathered(self):
        if self._all is None:
            rows = dist.all_gather_list(list(zip(self._pred, self._true, self._top5)))
            pred, true, top5 = zip(*rows) if rows else ((), (), ())
            self._all = (torch.tensor(pred, dtype=torch.long), torch.tensor(true, dtype=torch.long),
                         torch.tensor(top5, dtype=torch.bool))
            if self.analysis:
                kept = len(torch.cat(self._logits)) if self._logits else 0
                logits = dist.all_gather_list([torch.cat(self._logits) if self._logits else torch.zeros(0, 0)])
                labels = dist.all_gather_list([torch.tensor(self._true[:kept], dtype=torch.long)])
                self._extra = {"conf": torch.tensor(dist.all_gather_list(self._conf)), "names": self._names(),
                               "logits": torch.cat([x for x in logits if x.numel()]) if any(x.numel() for x in logits)
                               else None, "labels": torch.cat(labels)}
        return self._all

    def confusion_matrix(self):
        pred, true, _ = self._gathered()
        n = len(self.classes)
        return torch.bincount(true * n + pred, minlength=n * n).reshape(n, n)

    def compute(self):
        pred, true, top5 = self._gathered()
        if len(true) == 0:
            raise ValueError("evaluation saw no samples: is the validation split empty?")
        return {"top1": (pred == true).float().mean().item() * 100, "top5": top5.float().mean().item() * 100}

    def metric_names(self):
        return ["top1", "top5"]

    def report(self):
        cm = self.confusion_matrix()
        per_class = (cm.diag() / cm.sum(1).clamp(min=1) * 100).tolist()
        report = {"metrics": self.compute(), "num_samples": int(cm.sum()),
                  "per_class_accuracy": dict(zip(self.classes, per_class)),
                  "classes": self.classes, "confusion_matrix": cm.tolist(), "main_metric": "top1"}
        report["headline"] = classification_headline(report["metrics"], cm.numpy(), self.classes)
        if self.analysis:
            pred, true, _ = self._gathered()
            e = self._extra
            report["analysis"] = classification_sections(cm.numpy(), self.classes, e["conf"].numpy(), pred.numpy(),
                                                         true.numpy(), e["names"], e["logits"], e["labels"])
        return report

    def markdown(self, report):
        m = report["metrics"]
        lines = [headline_markdown(report),
                 f"**top-1** {m['top1']:.2f}%  **top-5** {m['top5']:.2f}%  on {report['num_samples']} samples",
                 "", "| class | accuracy (%) |", "|---|---|"]
        lines += [f"| {c} | {a:.1f} |" for c, a in report["per_class_accuracy"].items()]
        head = "| true \\ predicted | " + " | ".join(report["classes"]) + " |"
        lines += ["", "Confusion matrix (rows: true class)", "", head,
                  "|" + "---|" * (len(report["classes"]) + 1)]
        lines += [f"| {c} | " + " | ".join(map(str, row)) + " |"
                  for c, row in zip(report["classes"], report["confusion_matrix"])]
        return "\n".join(lines) + "\n"

    def log_extras(self, writer, step, prefix):
        cm = self.confusion_matrix().float()
        if not self.analysis:  # the plain heat map: rows true, columns predicted
            rows = cm / cm.sum(1, keepdim=True).clamp(min=1)
            cell = max(1, 256 // len(self.classes))
            image = rows.repeat_interleave(cell, 0).repeat_interleave(cell, 1)
            writer.add_image(f"{prefix}/confusion_matrix", image[None], step)
            return
        pred, true, _ = self._gathered()
        e = self._extra
        if len(self.classes) <= MAX_MATRIX_CLASSES:
            writer.add_image(f"{prefix}/confusion_matrix", plots.rgb(confusion_section(cm.numpy(), self.classes)
                                                                      ["plots"][0]), step, dataformats="HWC")
        writer.add_scalar(f"{prefix}/ECE", ece(e["conf"].numpy(), (pred == true).numpy()), step)
        if e["logits"] is not None:  # one-vs-rest PR curve per class (the first 20 classes)
            probs = e["logits"].softmax(1)
            for c, name in list(enumerate(self.classes))[:20]:
                writer.add_pr_curve(f"{prefix}/pr_curve/{name}", e["labels"] == c, probs[:, c], step)
