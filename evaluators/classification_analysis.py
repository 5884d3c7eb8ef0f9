"""The analysis sections of a classifier (images, text, audio): confusion matrix, per-class precision,
recall and F1, the top confusions, the most confidently wrong samples, calibration."""
import numpy as np

from engine.report import section, table
from evaluators.calibration import classifier_calibration

MAX_MATRIX_CLASSES = 60  # a larger matrix is not drawn (its counts stay in report.json)


def per_class_prf(cm):
    """(precision, recall, f1, support) arrays from a confusion matrix (rows: true, cols: predicted)."""
    cm = np.asarray(cm, dtype=np.float64)
    tp, true, predicted = np.diag(cm), cm.sum(1), cm.sum(0)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, true, out=np.zeros_like(tp), where=true > 0)
    denominator = precision + recall
    f1 = np.divide(2 * precision * recall, denominator, out=np.zeros_like(tp), where=denominator > 0)
    return precision, recall, f1, true.astype(np.int64)


def top_confusions(cm, classes, k=10):
    """[(true, predicted, count, share of the true class)] of the k largest off-diagonal counts."""
    cm = np.asarray(cm)
    off = cm.copy()
    np.fill_diagonal(off, 0)
    order = np.argsort(off, axis=None)[::-1][:k]
    rows = []
    for flat in order:
        i, j = divmod(int(flat), cm.shape[1])
        if off[i, j] == 0:
            break
        rows.append((classes[i], classes[j], int(off[i, j]), float(off[i, j] / max(cm[i].sum(), 1))))
    return rows


def classification_headline(metrics, cm, classes):
    """The report's first sentences: top-1 / top-5, the largest confusion, the class with the lowest F1."""
    lines = [f"top-1 {metrics['top1']:.1f}%, top-5 {metrics['top5']:.1f}% on {int(np.asarray(cm).sum())} samples"]
    top = top_confusions(cm, classes, 1)
    if top:
        true, pred, n, share = top[0]
        lines.append(f"most frequent error: {true} taken for {pred} ({n} samples, {100 * share:.1f}% of {true})")
    precision, recall, f1, support = per_class_prf(cm)
    present = np.flatnonzero(support > 0)
    if len(present) > 1:
        k = present[np.argmin(f1[present])]
        lines.append(f"lowest F1: {classes[k]} ({100 * f1[k]:.1f}; precision {100 * precision[k]:.1f}, "
                     f"recall {100 * recall[k]:.1f})")
    return lines


def confusion_section(cm, classes, k=10):
    plots = []
    if len(classes) <= MAX_MATRIX_CLASSES:
        plots.append({"kind": "matrix", "title": "confusion matrix (rows normalised)", "labels": list(classes),
                      "values": np.asarray(cm).tolist(), "normalise": True, "x_label": "predicted",
                      "y_label": "ground truth"})
    rows = [(t, p, n, round(100 * s, 2)) for t, p, n, s in top_confusions(cm, classes, k)]  # in per cent
    return section("confusion matrix and top confusions",
                   tables=[table(f"top {k} confusions", ["true", "predicted", "count", "% of true class"], rows)],
                   plots=plots)


def prf_section(cm, classes):
    precision, recall, f1, support = per_class_prf(cm)
    present = support > 0
    metrics = {"macro_precision": float(precision[present].mean()) if present.any() else 0.0,
               "macro_recall": float(recall[present].mean()) if present.any() else 0.0,
               "macro_F1": float(f1[present].mean()) if present.any() else 0.0}
    rows = sorted(zip(classes, precision.round(4).tolist(), recall.round(4).tolist(), f1.round(4).tolist(),
                      support.tolist()), key=lambda r: r[3])
    return section("per-class precision, recall and F1", metrics=metrics,
                   tables=[table("per class (sorted by F1, worst first)",
                                 ["class", "precision", "recall", "F1", "support"], rows)],
                   plots=[{"kind": "bars", "title": "per-class F1", "labels": list(classes), "y_label": "F1 (%)",
                           "y_range": [0, 1], "percent": "y", "series": [{"label": "F1", "values": f1.tolist()}]}])


def confidently_wrong_section(confidence, pred, true, classes, names, k=12):
    """The k wrong predictions with the highest confidence, each with its sample (file, text, index)."""
    confidence, pred, true = np.asarray(confidence), np.asarray(pred), np.asarray(true)
    wrong = np.flatnonzero(pred != true)
    order = wrong[np.argsort(-confidence[wrong], kind="stable")][:k]
    rows = [(int(i), names[i] if names is not None else f"sample #{i}", classes[true[i]], classes[pred[i]],
             round(float(confidence[i]), 4)) for i in order]
    return section("most confidently wrong samples",
                   tables=[table(f"the {len(rows)} wrong predictions with the highest confidence",
                                 ["#", "sample", "true", "predicted", "confidence (%)"], rows,
                                 units={"confidence (%)": "fraction"})])


def classification_sections(cm, classes, confidence, pred, true, names, logits=None, labels=None):
    """Every section: logits/labels (those kept for calibration) may be None (no calibration)."""
    out = [confusion_section(cm, classes), prf_section(cm, classes),
           confidently_wrong_section(confidence, pred, true, classes, names)]
    if logits is not None and len(logits):
        out.append(classifier_calibration(logits, labels, "calibration"))
    return out
