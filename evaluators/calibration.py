"""Calibration: expected calibration error (ECE) over equal-width confidence bins, the reliability
bins behind the diagram, and a temperature fitted on the validation logits (reported with the ECE it
would give; nothing applies it to the model).

ECE = sum over bins of |accuracy - mean confidence| x (samples in bin / samples), bins (lo, hi] of
width 1/15 (Guo et al. 2017, "On Calibration of Modern Neural Networks"). The temperature T
minimises the negative log-likelihood of softmax(logits / T) (sigmoid(logit(score) / T) for
detection scores), found on log T in [-4, 4] by a grid and a golden-section search.
"""
import numpy as np
import torch
import torch.nn.functional as F

from engine.report import section

NUM_BINS = 15


def reliability_bins(confidence, correct, num_bins=NUM_BINS):
    """(ece, [{"lo", "hi", "confidence", "accuracy", "count"}]) of confidences in [0, 1] and 0/1 hits."""
    confidence = np.asarray(confidence, dtype=np.float64).reshape(-1)
    correct = np.asarray(correct, dtype=np.float64).reshape(-1)
    if confidence.shape != correct.shape:
        raise ValueError(f"{confidence.shape[0]} confidences for {correct.shape[0]} outcomes")
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    index = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, num_bins - 1)  # (lo, hi]
    counts = np.bincount(index, minlength=num_bins)
    conf_sum = np.bincount(index, confidence, minlength=num_bins)
    hit_sum = np.bincount(index, correct, minlength=num_bins)
    bins, ece = [], 0.0
    for b in range(num_bins):
        n = int(counts[b])
        conf = conf_sum[b] / n if n else 0.0
        acc = hit_sum[b] / n if n else 0.0
        ece += abs(acc - conf) * n
        bins.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "confidence": float(conf),
                     "accuracy": float(acc), "count": n})
    total = len(confidence)
    return (float(ece / total) if total else 0.0), bins


def ece(confidence, correct, num_bins=NUM_BINS):
    return reliability_bins(confidence, correct, num_bins)[0]


def _fit_log_temperature(nll, low=-4.0, high=4.0, tol=1e-5):
    """argmin over T = exp(u), u in [low, high], of nll(T): a coarse grid then golden-section search
    in numpy (the NLL is unimodal in u; no optimizer start-up, no thread team for tiny ops)."""
    grid = np.linspace(low, high, 33)
    values = [nll(np.exp(u)) for u in grid]
    k = int(np.argmin(values))
    a, b = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    ratio = (np.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = nll(np.exp(c)), nll(np.exp(d))
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = nll(np.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = nll(np.exp(d))
    return float(np.exp((a + b) / 2))


def _log_softmax(z):
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def fit_temperature(logits, labels):
    """T > 0 minimising the NLL of softmax(logits / T) against integer labels."""
    logits = np.asarray(torch.as_tensor(logits, dtype=torch.float64))
    labels = np.asarray(torch.as_tensor(labels, dtype=torch.long))
    if len(labels) == 0:
        return 1.0
    rows = np.arange(len(labels))
    return _fit_log_temperature(lambda t: -_log_softmax(logits / t)[rows, labels].mean())


def fit_temperature_binary(scores, correct, eps=1e-6):
    """T > 0 minimising the NLL of sigmoid(logit(score) / T) against 0/1 outcomes (detection scores)."""
    scores = np.clip(np.asarray(scores, dtype=np.float64), eps, 1 - eps)
    correct = np.asarray(correct, dtype=np.float64)
    if len(correct) == 0:
        return 1.0
    z = np.log(scores / (1 - scores))
    # -log sigmoid(x) = logaddexp(0, -x); -log(1 - sigmoid(x)) = logaddexp(0, x)
    return _fit_log_temperature(lambda t: (correct * np.logaddexp(0, -z / t)
                                           + (1 - correct) * np.logaddexp(0, z / t)).mean())


def scale_binary(scores, temperature, eps=1e-6):
    scores = np.clip(np.asarray(scores, dtype=np.float64), eps, 1 - eps)
    return 1 / (1 + np.exp(-np.log(scores / (1 - scores)) / temperature))


def reliability_plot(title, before, after=None):
    """The "reliability" PLOT of (ece, bins) pairs; after: (ece, bins, temperature) or None."""
    plot = {"kind": "reliability", "title": title, "x_label": "confidence", "y_label": "accuracy",
            "ece": before[0], "bins": before[1]}
    if after is not None:
        plot["after"] = {"ece": after[0], "bins": after[1], "temperature": after[2]}
    return plot


def classifier_calibration(logits, labels, title="calibration", fit_logits=None, fit_labels=None):
    """The calibration section of a classifier: ECE of its top-1 confidence, reliability bins, the
    fitted temperature and the ECE it would give. fit_logits/fit_labels: a subset to fit T on
    (default: all)."""
    logits = torch.as_tensor(logits, dtype=torch.float64)
    labels = torch.as_tensor(labels, dtype=torch.long)
    probs = logits.softmax(1)
    conf, pred = probs.max(1)
    before = reliability_bins(conf.numpy(), (pred == labels).numpy())
    t = fit_temperature(logits if fit_logits is None else fit_logits, labels if fit_labels is None else fit_labels)
    scaled = (logits / t).softmax(1)
    after = reliability_bins(scaled.max(1).values.numpy(), (pred == labels).numpy())
    nll = float(F.cross_entropy(logits, labels)) if len(labels) else 0.0
    nll_t = float(F.cross_entropy(logits / t, labels)) if len(labels) else 0.0
    metrics = {"ECE": before[0], "temperature": t, "ECE_after_temperature": after[0], "NLL": nll,
               "NLL_after_temperature": nll_t, "mean_confidence": float(conf.mean()) if len(conf) else 0.0}
    return section(title, metrics=metrics,
                   plots=[reliability_plot(f"{title}: reliability (15 bins)", before, (*after, t))])


def binary_calibration(scores, correct, title="calibration"):
    """The calibration section of scored decisions (e.g. detections: correct = matched a ground
    truth): ECE, reliability bins, the fitted temperature on logit(score) and its ECE."""
    scores = np.asarray(scores, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    before = reliability_bins(scores, correct)
    t = fit_temperature_binary(scores, correct)
    after = reliability_bins(scale_binary(scores, t), correct)
    metrics = {"ECE": before[0], "temperature": t, "ECE_after_temperature": after[0]}
    return section(title, metrics=metrics,
                   plots=[reliability_plot(f"{title}: reliability (15 bins)", before, (*after, t))])
