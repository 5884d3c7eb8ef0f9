"""Semantic segmentation scored without torch: the confusion counts of a label map against its
ground truth and the metrics read from them (mIoU over the classes present, pixel accuracy, mean
class accuracy). evaluators/segmentation.py scores with these too."""
import numpy as np

from engine.errors import DataError

IGNORE_INDEX = 255


def confusion_counts(pred, target, num_classes, ignore_index=IGNORE_INDEX):
    """[num_classes, num_classes] int64 counts of (true, predicted) over the pixels not ignored."""
    pred, target = np.asarray(pred).reshape(-1).astype(np.int64), np.asarray(target).reshape(-1).astype(np.int64)
    keep = target != ignore_index
    pred, target = pred[keep], target[keep]
    bad = (target < 0) | (target >= num_classes)
    if bad.any():
        raise DataError(f"target labels {sorted(set(target[bad].tolist()))[:5]} are outside 0..{num_classes - 1} "
                        f"(and not the ignore index {ignore_index}): does num_classes fit the data set?")
    return np.bincount(target * num_classes + pred, minlength=num_classes ** 2).reshape(num_classes, num_classes)


def segmentation_metrics(cm):
    """({'mIoU', 'pixel_accuracy', 'mean_accuracy'}, per-class IoU (None: class absent)) from a
    confusion matrix (any array: numpy, or a CPU torch tensor)."""
    cm = np.asarray(cm, dtype=np.float64)
    tp, true, predicted = np.diag(cm), cm.sum(1), cm.sum(0)
    union = true + predicted - tp
    iou = [float(t / u) if u > 0 else None for t, u in zip(tp, union)]
    acc = [float(t / n) for t, n in zip(tp, true) if n > 0]
    valid = [v for v in iou if v is not None]
    total = float(cm.sum())
    return ({"mIoU": float(np.mean(valid)) if valid else 0.0,
             "pixel_accuracy": float(tp.sum()) / total if total else 0.0,
             "mean_accuracy": float(np.mean(acc)) if acc else 0.0}, iou)
