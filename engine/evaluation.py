"""The evaluator interface and what every family shares: composition, report writing, scorers.

A dataset builder chooses the evaluator of its task, so the loop never branches on the family.
The families' evaluators live with them (datasets/*_eval.py).
"""
import copy
import json
import os

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval


def write_report(report_dir, report, markdown):
    """report.json and report.md: what evaluate.py writes in each of its modes."""
    os.makedirs(report_dir, exist_ok=True)
    with open(os.path.join(report_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(report_dir, "report.md"), "w") as f:
        f.write(markdown)


def _conv_bn_pairs(model):
    """(sequential, conv name, bn name) for each Conv2d directly followed by a BatchNorm2d inside an
    nn.Sequential (only there does the order of the children say that one feeds the other); exact
    types only, so quantization-aware and frozen variants stay as they are, and none with hooks."""
    pairs = []
    for seq in model.modules():
        if not isinstance(seq, nn.Sequential):
            continue
        names = list(seq._modules)
        for a, b in zip(names, names[1:]):
            conv, bn = seq._modules[a], seq._modules[b]
            if (type(conv) is nn.Conv2d and type(bn) is nn.BatchNorm2d and bn.running_mean is not None
                    and conv.out_channels == bn.num_features and not (conv._forward_hooks or bn._forward_hooks
                                                                      or bn._forward_pre_hooks)):
                pairs.append((seq, a, b))
    return pairs


def fold_batch_norms(model):
    """For evaluation: a copy of an eval-mode model with each Conv2d -> BatchNorm2d pair folded
    into one Conv2d (torch's fuse_conv_bn_eval): the same function up to float rounding, without
    a pass of the normalisation over every activation (about a sixth of SSDlite's CPU time). The
    model itself comes back when there is nothing to fold, when it trains, or when it is compiled
    or scripted (a copy would not be what runs)."""
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if (plain.training or hasattr(plain, "_orig_mod") or isinstance(plain, torch.jit.ScriptModule)
            or not _conv_bn_pairs(plain)):
        return model
    folded = copy.deepcopy(plain)
    for seq, conv, bn in _conv_bn_pairs(folded):
        seq._modules[conv] = fuse_conv_bn_eval(seq._modules[conv], seq._modules[bn])
        seq._modules[bn] = nn.Identity()
    return folded


class Evaluator:
    """Interface. compute() returns flat {name: float}; report() returns a JSON-able dict."""

    def update(self, predictions, targets):
        raise NotImplementedError

    def compute(self):
        raise NotImplementedError

    def report(self):
        return {"metrics": self.compute()}

    def metric_names(self):
        """The names compute() can return, so that train.best_metric is checked before training
        (None: not known before evaluating)."""
        return None

    def markdown(self, report):
        rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in report["metrics"].items())
        return f"| metric | value |\n|---|---|\n{rows}\n"

    def log_extras(self, writer, step, prefix):
        """Images etc. for TensorBoard (optional)."""

    def save_artifacts(self, folder):
        """Files next to the report (optional), e.g. detections in COCO results format: {name: path}."""
        return {}


class CompositeEvaluator(Evaluator):
    """Several evaluators on one prediction stream; each one's metrics get its name as a prefix
    ({"panoptic": pq} -> panoptic/PQ; the name "" adds none, e.g. for COCO's own bbox/AP, segm/AP)."""

    def __init__(self, evaluators):
        self.evaluators = dict(evaluators)

    @staticmethod
    def _prefixed(name, metrics):
        return {(f"{name}/{k}" if name else k): v for k, v in metrics.items()}

    def update(self, predictions, targets):
        for e in self.evaluators.values():
            e.update(predictions, targets)

    def compute(self):
        out = {}
        for name, e in self.evaluators.items():
            out.update(self._prefixed(name, e.compute()))
        return out

    def metric_names(self):
        names = [e.metric_names() for e in self.evaluators.values()]
        if any(n is None for n in names):
            return None
        return [k for name, part in zip(self.evaluators, names) for k in self._prefixed(name, dict.fromkeys(part))]

    def report(self):
        parts = {name: e.report() for name, e in self.evaluators.items()}
        metrics = {}
        for name, part in parts.items():
            metrics.update(self._prefixed(name, part["metrics"]))
        return {"metrics": metrics, "parts": parts}

    def markdown(self, report):
        return "\n".join(f"## {name or 'main'}\n\n" + e.markdown(report["parts"][name])
                         for name, e in self.evaluators.items())

    def log_extras(self, writer, step, prefix):
        for name, e in self.evaluators.items():
            e.log_extras(writer, step, f"{prefix}/{name}" if name else prefix)

    def save_artifacts(self, folder):
        out = {}
        for e in self.evaluators.values():
            out.update(e.save_artifacts(folder))
        return out


class ResultsScorer:
    """A scoring-only mode of evaluate.py: score a predictions file written by any tool, with no
    model. A family registers one in engine.registry.SCORERS; evaluate.py adds its options."""

    options = ()  # ((flag, argparse kwargs), ...): giving any of them selects this mode

    def add_arguments(self, parser):
        for flag, kwargs in self.options:
            parser.add_argument(flag, **kwargs)

    def selected(self, args):
        return any(getattr(args, flag.lstrip("-").replace("-", "_")) not in (None, False)
                   for flag, kwargs in self.options if "default" not in kwargs)

    def score(self, args):
        """-> (report dict with "metrics", markdown text, default report folder)."""
        raise NotImplementedError
