"""Likely label errors by confident learning (cleanlab): out-of-sample predicted probabilities from
K-fold cross-validation (doctor.folds) of a cheap model on small features, then
cleanlab.filter.find_label_issues. Features (sources.py): image thumbnails for image classification,
crops of each box for detection (an instance's label), the mean and spread of log-Mel bands for
audio, TF-IDF of words for text. The model is a logistic regression (scikit-learn) unless a
data set is too small for it. When the estimated time is over doctor.label_time_limit_s the check
is skipped, with the estimate, unless asked (doctor.py --labels-anyway)."""
import logging
import time

import numpy as np

from datasets.doctor.findings import WARNING, Finding

log = logging.getLogger(__name__)


def _model():
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=300, C=0.5))


def _text_model():
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    return make_pipeline(TfidfVectorizer(min_df=1, sublinear_tf=True), LogisticRegression(max_iter=300, C=4.0))


def out_of_sample_probabilities(features, labels, num_classes, folds, text=False, seed=0):
    """[N, num_classes] probabilities, each row from the model of the fold that left the sample out."""
    from sklearn.model_selection import StratifiedKFold
    labels = np.asarray(labels)
    counts = np.bincount(labels, minlength=num_classes)
    folds = int(min(folds, counts[counts > 0].min()))
    if folds < 2:
        raise ValueError("a class has a single sample: no cross-validation")
    probs = np.zeros((len(labels), num_classes))
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(np.zeros(len(labels)), labels):
        model = _text_model() if text else _model()
        x = [features[i] for i in train] if text else features[train]
        model.fit(x, labels[train])
        p = model.predict_proba([features[i] for i in test] if text else features[test])
        probs[np.ix_(test, model.classes_)] = p
    return probs


def estimate_seconds(features, labels, num_classes, folds, text=False, sample=400):
    """Time of the K folds, from one fit on a subsample scaled linearly (logistic regression's cost)."""
    n = len(labels)
    if n <= sample:
        return None
    idx = np.random.default_rng(0).choice(n, sample, replace=False)
    start = time.perf_counter()
    model = _text_model() if text else _model()
    model.fit([features[i] for i in idx] if text else features[idx], np.asarray(labels)[idx])
    return (time.perf_counter() - start) * n / sample * folds


def find(things, classes, folds, time_limit, anyway, what):
    """things: [(sample key, record, given label, feature)]. -> (findings, figures)."""
    from cleanlab.filter import find_label_issues
    if len(things) < 2 * folds or len(set(t[2] for t in things)) < 2:
        return [], {"skipped": f"too few labelled {what} ({len(things)}) for {folds}-fold cross-validation"}
    text = isinstance(things[0][3], str)
    features = [t[3] for t in things] if text else np.stack([t[3] for t in things])
    labels = np.array([t[2] for t in things])
    estimate = estimate_seconds(features, labels, len(classes), folds, text)
    if estimate is not None and estimate > time_limit and not anyway:
        return [], {"skipped": f"cross-validation of {len(things)} {what} would take about {estimate:.0f} s, over "
                               f"doctor.label_time_limit_s={time_limit:g}; run with --labels-anyway",
                    "estimated_seconds": round(estimate, 1)}
    start = time.perf_counter()
    try:
        probs = out_of_sample_probabilities(features, labels, len(classes), folds, text)
    except ValueError as e:
        return [], {"skipped": str(e)}
    issues = find_label_issues(labels, probs, return_indices_ranked_by="self_confidence")
    findings, suspects = [], []
    for rank, i in enumerate(issues.tolist()):
        key, record, given = things[i][0], things[i][1], int(labels[i])
        suggested = int(probs[i].argmax())
        suspects.append({"rank": rank + 1, "split": key[0], "index": key[1], "record": record,
                         "given": classes[given], "suggested": classes[suggested],
                         "given_probability": round(float(probs[i, given]), 4),
                         "suggested_probability": round(float(probs[i, suggested]), 4)})
        findings.append(Finding("labels", WARNING, "label_error", f"{record}: labelled {classes[given]!r}, "
                                f"likely {classes[suggested]!r} (out-of-sample p={probs[i, suggested]:.2f} against "
                                f"{probs[i, given]:.2f})", file=record.split(", ")[0], record=record, split=key[0]))
    accuracy = float((probs.argmax(1) == labels).mean())
    model = ("tf-idf + logistic regression" if text else "log-Mel band statistics + logistic regression"
             if what == "clips" else "thumbnail features + logistic regression")
    return findings, {"labelled": len(things), "folds": folds, "model": model, "out_of_sample_accuracy": round(accuracy, 4),
                      "suspects": suspects, "seconds": round(time.perf_counter() - start, 1)}
