"""Classification evaluation: top-1/top-5, per-class accuracy and the confusion matrix.

Used by every classifier family (images, text, audio).
"""
import torch

from engine import dist
from engine.evaluation import Evaluator


class ClassificationEvaluator(Evaluator):
    def __init__(self, classes):
        self.classes = list(classes)
        self._top5, self._pred, self._true = [], [], []
        self._all = None  # gathered from every process, once: later calls may run on rank 0 only

    def update(self, logits, targets):
        self._all = None
        logits = logits.float().cpu()
        k = min(5, logits.shape[1])
        topk = logits.topk(k, dim=1).indices
        targets = targets.cpu()
        self._pred += topk[:, 0].tolist()
        self._true += targets.tolist()
        self._top5 += (topk == targets[:, None]).any(1).tolist()

    def _gathered(self):
        if self._all is None:
            rows = dist.all_gather_list(list(zip(self._pred, self._true, self._top5)))
            pred, true, top5 = zip(*rows) if rows else ((), (), ())
            self._all = (torch.tensor(pred, dtype=torch.long), torch.tensor(true, dtype=torch.long),
                         torch.tensor(top5, dtype=torch.bool))
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
        return {"metrics": self.compute(), "num_samples": int(cm.sum()),
                "per_class_accuracy": dict(zip(self.classes, per_class)),
                "classes": self.classes, "confusion_matrix": cm.tolist()}

    def markdown(self, report):
        m = report["metrics"]
        lines = [f"**top-1** {m['top1']:.2f}%  **top-5** {m['top5']:.2f}%  on {report['num_samples']} samples",
                 "", "| class | accuracy (%) |", "|---|---|"]
        lines += [f"| {c} | {a:.2f} |" for c, a in report["per_class_accuracy"].items()]
        head = "| true \\ predicted | " + " | ".join(report["classes"]) + " |"
        lines += ["", "Confusion matrix (rows: true class)", "", head,
                  "|" + "---|" * (len(report["classes"]) + 1)]
        lines += [f"| {c} | " + " | ".join(map(str, row)) + " |"
                  for c, row in zip(report["classes"], report["confusion_matrix"])]
        return "\n".join(lines) + "\n"

    def log_extras(self, writer, step, prefix):
        cm = self.confusion_matrix().float()
        rows = cm / cm.sum(1, keepdim=True).clamp(min=1)
        cell = max(1, 256 // len(self.classes))
        image = rows.repeat_interleave(cell, 0).repeat_interleave(cell, 1)
        writer.add_image(f"{prefix}/confusion_matrix", image[None], step)  # rows: true, cols: predicted
