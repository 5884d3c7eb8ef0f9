"""The evaluator interface, what every family shares (composition, report writing, scorers), and
the runner that feeds a model's predictions to an evaluator.

A dataset builder chooses the evaluator of its task, so the loop never branches on the family.
The families' evaluators are in evaluators/; the report format (sections, report.html) in engine/report/.
"""
import collections
import contextlib
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import BatchSampler

from engine import dist
from engine.build import to_device
from engine.checkpoint import METRICS_LOG
from engine.errors import Preempted, UserError
from engine.files import write_together
from engine.fusion import fold_batch_norms
from engine.logger import progress
from engine.report import sections_markdown
from engine.report.html import report_html

log = logging.getLogger(__name__)


def write_report(report_dir, report, markdown, title="Evaluation report"):
    """report.json, report.md and report.html (engine.report.html: every section's tables, plots and
    images embedded): what evaluate.py writes in each of its modes, and training at each evaluation.
    The three are replaced together or not at all (engine.files.NotWritten names the path in the way)."""
    markdown += sections_markdown(report)
    html = report_html(report, os.path.abspath(report_dir), title).encode("utf-8")
    write_together({os.path.join(report_dir, "report.json"): json.dumps(report, indent=2),
                    os.path.join(report_dir, "report.md"): markdown, os.path.join(report_dir, "report.html"): html})


class Evaluator:
    """Interface. compute() returns flat {name: float}; report() returns a JSON-able dict, which may
    hold "analysis": a list of sections (engine/report/__init__.py, docs/evaluation.md) when `analysis`
    is on (set_analysis; train.analysis turns it off during training)."""

    analysis = True

    def set_analysis(self, on):
        self.analysis = bool(on)
        return self

    def attach_dataset(self, dataset, indices):
        """The evaluation's dataset and, per sample fed to update() in order, its index in it (None
        when not known), so that an analysis can name samples (e.g. the most confidently wrong files)."""

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

    def set_analysis(self, on):
        self.analysis = bool(on)
        for e in self.evaluators.values():
            e.set_analysis(on)
        return self

    def attach_dataset(self, dataset, indices):
        for e in self.evaluators.values():
            e.attach_dataset(dataset, indices)

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


# ---------------------------------------------------------------- the runner

def eval_streams(model, device, recipes=None, run=None):
    """How many batches evaluate() runs at once: on CPU, one per intra-op thread (each then runs on
    one thread), unless the model is compiled or a recipe's forward context changes the model
    rather than the thread's state (autocast is per thread; pausing QAT observers is not), or DDP's
    forward would run collectives (its buffer broadcast) from several threads at once. A model's
    eval forward must therefore be safe in threads: process-wide switches it flips need a lock and a
    count (models.transformer's fast-path switch)."""
    if (device.type != "cpu" or torch.get_num_threads() < 2 or hasattr(model, "_orig_mod")
            or isinstance(model, torch.nn.parallel.DistributedDataParallel)):
        return 1
    contexts = [r.forward_context(run) for r in (recipes or ())]
    return torch.get_num_threads() if all(isinstance(c, (contextlib.nullcontext, torch.autocast))
                                          for c in contexts) else 1


def evaluate(model, loader, evaluator, device, recipes=None, run=None, show_progress=True, streams=None):
    """Predictions for every batch of the loader, fed to the evaluator in the loader's order. On CPU
    with several threads, `streams` batches run at once on one thread each (the reference evaluation
    runs one thread): one batch's Python (post-processing, the evaluator) overlaps the others'
    kernels, and no team of OpenMP threads spin-waits on a busy machine."""
    if len(getattr(loader, "dataset", loader)) == 0:
        raise UserError("the evaluation split has no samples: its metrics would be meaningless (COCO's AP would "
                        "read -1); check the data config's val split / annotation file")
    model.eval()
    model = fold_batch_norms(model)  # a folded copy: the trained model stays as it is
    batch_sampler = getattr(loader, "batch_sampler", None)  # samples in a plain sampler's order: their indices
    plain = isinstance(batch_sampler, BatchSampler) and batch_sampler.sampler is loader.sampler
    if hasattr(evaluator, "attach_dataset"):
        evaluator.attach_dataset(loader.dataset, list(loader.sampler) if plain else None)
    streams = streams or eval_streams(model, device, recipes, run)

    def predict(inputs):
        with torch.no_grad():  # per thread, as autocast is
            inputs = to_device(inputs, device)
            if not recipes:
                return model(inputs)
            inputs = recipes.prepare_inputs(inputs)
            with recipes.forward_context(run):
                return model(inputs)

    def stop_requested():  # a training run's stop request: honoured at the next batch
        if run is not None and run.stop_signal:
            raise Preempted(f"{run.stop_signal} during evaluation", agreed=False)

    batches = progress(loader, desc="eval", leave=False, disable=not show_progress, tty_only=True)
    if streams == 1:
        for inputs, targets in batches:
            stop_requested()
            evaluator.update(predict(inputs), targets)
        return evaluator
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the pool's threads take it up on their first kernel
    try:
        with ThreadPoolExecutor(streams) as pool:
            pending = collections.deque()
            for inputs, targets in batches:
                stop_requested()
                pending.append((pool.submit(predict, inputs), targets))
                if len(pending) > streams:  # one more queued than running: no thread waits for the loader
                    future, done = pending.popleft()
                    evaluator.update(future.result(), done)
            for future, done in pending:
                evaluator.update(future.result(), done)
    finally:
        torch.set_num_threads(threads)
    return evaluator


# data settings that change how batches are made, not which samples are evaluated
LOADING_KEYS = ("batch_size", "eval_batch_size", "workers", "augmentation", "auto_augment", "random_erase",
                "hflip_prob", "skip_bad_samples", "num_train", "bucket_batches", "spec_augment", "mixup_alpha",
                "cutmix_alpha")


def dataset_identity(cfg, data):
    """What names the evaluated data (report["dataset"]): evaluate.py --compare refuses reports whose
    data differ. The data set's name, its defining settings, its classes and its sample count."""
    settings = {k: v for k, v in cfg.data.model_dump(mode="json").items() if k not in LOADING_KEYS and k != "name"}
    identity = {"name": cfg.data.name, "settings": settings,
                "classes": list(data.classes) if data.classes is not None else None, "num_samples": len(data.val)}
    identity["id"] = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return identity


def write_eval_report(run, evaluator, prefix):
    """With train.analysis: the evaluation's report (json, md, html with its analysis) in
    <run>/reports/epoch_<N>/<prefix>/; the metrics. Every process takes part (the report gathers)."""
    report = evaluator.report()
    folder = os.path.join(run.output_dir, "reports", f"epoch_{run.epoch + 1:03d}", prefix)
    if dist.is_main():
        os.makedirs(folder, exist_ok=True)
    report["artifacts"] = evaluator.save_artifacts(folder)
    report.update(epoch=run.epoch + 1, step=run.step, dataset=dataset_identity(run.cfg, run.data),
                  config={"model": run.cfg.model.name, "data": run.cfg.data.name,
                          "resolved": run.cfg.model_dump(mode="json")})
    if dist.is_main():
        write_report(folder, report, f"# Evaluation report: {prefix}, epoch {run.epoch + 1}, step {run.step}\n\n"
                     + evaluator.markdown(report), f"{prefix}, epoch {run.epoch + 1}")
    return report["metrics"]


def append_metrics(output_dir, epoch, step, metrics):
    """One line per evaluation in <run folder>/metrics.jsonl ({"epoch" (from 1), "step", "metrics"}): what a
    process watching the run reads while it trains (tune.py's pruner), without TensorBoard's files."""
    line = json.dumps({"epoch": epoch, "step": step, "metrics": metrics}) + "\n"
    with open(os.path.join(output_dir, METRICS_LOG), "a") as f:
        f.write(line)


def evaluate_all(run):
    """Evaluate the trained model and every extra model recipes offer (EMA, int8, ...); with
    train.analysis, a report of each (write_eval_report)."""
    run.recipes.before_eval(run)
    results = {}
    analysis = getattr(run.cfg.train, "analysis", True)
    for suffix, model in {"": run.model, **run.recipes.eval_models(run)}.items():
        prefix = "val" if not suffix else f"val_{suffix}"
        evaluator = run.data.evaluator()
        if hasattr(evaluator, "set_analysis"):  # an engine.evaluation.Evaluator (a plugin's may not be)
            evaluator.set_analysis(analysis)
        evaluator = evaluate(model, run.val_loader, evaluator, run.device, run.recipes, run)
        metrics = write_eval_report(run, evaluator, prefix) if analysis else evaluator.compute()
        run.tb.scalars(metrics, run.step, prefix)
        run.tb.evaluator_extras(evaluator, run.step, prefix)
        results.update({f"{prefix}/{k}": v for k, v in metrics.items()})
    log.info("epoch %d: %s", run.epoch + 1, "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
    return results
