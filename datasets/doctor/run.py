"""The doctor's run: build the data as training does, check every sample in worker processes, then
statistics, leaks, label errors; report.json, report.md and plots."""
import inspect
import json
import logging
import multiprocessing
import os
import time
from collections import Counter

import numpy as np

from datasets.base import collecting_problems
from engine.errors import DataError
from datasets.doctor import findings as F
from datasets.doctor import labels as label_check
from datasets.doctor import leaks as leak_check
from datasets.doctor import stats as stat_check
from datasets.doctor.gallery import write_html
from datasets.doctor.sources import sources_of
from engine.build import build_data
from engine.files import atomic_write
from engine.registry import DATASETS

log = logging.getLogger(__name__)

CHECKS = ("integrity", "stats", "leaks", "labels")
# the loggers of the file walker and of the class folders: their warnings (a symlink loop skipped, a
# directory symlink not followed) become findings of the report
WALK_LOGGERS = ("engine.paths", "datasets.classification")
FAST_OFF = ("preload", "cache_images")  # builder options that only read ahead: the doctor streams instead
SPLIT_KEYS = ("split", "set", "images", "annotations")  # train_X / val_X arguments naming a split's files
_SOURCES = []  # the sources, inherited by the forked workers


def _check(job):
    s, i = job
    source = _SOURCES[s]
    try:
        return s, i, source.check(i)
    except Exception as e:  # noqa: BLE001  (a reader's bug must not stop the whole check: reported as found)
        return s, i, {"file": "", "record": f"{source.split} sample {i}", "labels": [],
                      "problems": [(F.ERROR, "check_failed", f"{source.split} sample {i}: the check failed "
                                    f"({type(e).__name__}: {e})")]}


def stream(sources, workers):
    """(source index, sample index, result) of every sample, in worker processes (fork) when workers > 1."""
    global _SOURCES
    _SOURCES = sources
    jobs = [(s, i) for s, source in enumerate(sources) for i in range(len(source))]
    if workers <= 1 or len(jobs) < 64:
        yield from map(_check, jobs)
        return
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield from pool.imap_unordered(_check, jobs, chunksize=16)


def one_split(cfg, splits):
    """With one of train / val asked (--splits val), the builder is pointed at that split for both (the
    builders need two: a COCO folder with val2017 only could not be checked). -> [what was set]."""
    if len(set(splits) & {"train", "val"}) != 1:
        return []
    keep = "train" if "train" in splits else "val"
    other = "val" if keep == "train" else "train"
    builder = DATASETS.get(cfg.data.name)
    defaults = {k: p.default for k, p in inspect.signature(builder).parameters.items()}
    extra, out = cfg.data.model_extra, []
    for suffix in SPLIT_KEYS:
        mine, theirs = f"{keep}_{suffix}", f"{other}_{suffix}"
        if mine in defaults and theirs in defaults:
            value = extra.get(mine, defaults[mine])
            if value != extra.get(theirs, defaults[theirs]):
                extra[theirs] = value
                out.append(f"data.{theirs}={value}")
    return out


def build(cfg, splits=("train", "val")):
    """(DataSplits or None, [findings], [settings changed by one_split]) through engine.build.build_data,
    under collecting_problems."""
    cfg = cfg.model_copy(deep=True)
    accepted = DATASETS.arguments(cfg.data.name) or []
    for key in FAST_OFF:
        if key in accepted:
            cfg.data.model_extra[key] = False
    pointed = one_split(cfg, splits)
    found, walked = [], _Warnings()
    for name in WALK_LOGGERS:
        logging.getLogger(name).addHandler(walked)
    try:
        with collecting_problems() as problems:
            try:
                data = build_data(cfg, None)
            except DataError as e:  # a fault that stops the whole data set (not JSON, missing folder, empty split)
                data = None
                found.append(F.from_error(e))
    finally:
        for name in WALK_LOGGERS:
            logging.getLogger(name).removeHandler(walked)
    symlinks = [F.Finding("integrity", F.WARNING, F.kind_of(m), m, file=m.split(": ", 1)[0]) for m in walked.messages]
    return data, symlinks + [F.from_error(p) for p in problems] + found, pointed


class _Warnings(logging.Handler):
    """The messages of the warnings logged while the data set is built."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def diagnose(cfg, splits=("train", "val"), checks=CHECKS, report_dir="doctor_report", workers=2,
             labels_anyway=False):
    """Run the checks; -> the report (dict), also written to report_dir as report.json and report.md."""
    started = time.perf_counter()
    doc = cfg.doctor
    os.makedirs(report_dir, exist_ok=True)
    data, findings, pointed = build(cfg, splits)
    report = {"config": {"data": cfg.data.name, **{k: v for k, v in cfg.data.model_extra.items()
                                                  if isinstance(v, (str, int, float, bool, type(None)))}},
              "checks": list(checks), "splits": list(splits)}
    if pointed:
        report["built_with"] = pointed
    results, sources = {}, []
    if data is not None:
        need_features = "labels" in checks
        for split, source, why in sources_of(data, cfg.data.name, dict(cfg.data.model_extra), splits, need_features):
            if source is None:
                report.setdefault("not_checked", {})[split] = why
            else:
                sources.append(source)
        for source in sources:
            if "integrity" in checks:
                findings += source.annotation_findings()
        read_start = time.perf_counter()
        things = []
        for s, i, r in stream(sources, workers):
            source = sources[s]
            key = (source.split, i)
            for severity, kind, message in r.pop("problems"):
                if severity == F.ERROR:
                    r.setdefault("bad", message)
                if "integrity" in checks or severity != F.ERROR:
                    findings.append(F.Finding("integrity", severity, kind or F.kind_of(message), message,
                                              file=r["file"], record=r["record"], split=source.split))
            for thing_id, label, feature in r.pop("things", []):
                things.append(((source.split, i), source.thing_record(thing_id, r), label, feature))
            results[key] = r
        read_seconds = time.perf_counter() - read_start
        n = len(results)
        report["speed"] = {"samples": n, "seconds": round(read_seconds, 2), "workers": workers,
                           "samples_per_second": round(n / read_seconds, 1) if read_seconds else None,
                           "samples_per_second_per_worker": round(n / read_seconds / max(workers, 1), 1)
                           if read_seconds else None}
        if "stats" in checks:
            stats, values = {}, {}
            for source in sources:
                split_results = [results[(source.split, i)] for i in range(len(source)) if (source.split, i) in results]
                stats[source.split] = stat_check.split_stats(source, split_results)
                values[source.split] = _values(source, split_results)
            report["stats"] = stats
            findings += stat_check.balance_findings(stats, doc.imbalance_ratio)
            report["plots"] = [{"title": t, "path": p} for t, p in
                               stat_check.plots(stats, values, os.path.join(report_dir, "plots"))]
        if "leaks" in checks:
            leak_findings, report["leaks"] = leak_check.find(results, doc.near_duplicate_bits)
            findings += leak_findings
        if "labels" in checks:
            classes = sources[0].classes if sources else []
            what = {"coco": "instances", "audio": "clips"}.get(sources[0].kind if sources else "", "samples")
            label_findings, report["labels"] = label_check.find(things, classes, doc.folds, doc.label_time_limit_s,
                                                                labels_anyway, what)
            findings += label_findings
    seen = set()  # a PNG checked when the data set was built and again when read: one finding
    findings = [f for f in findings if not (f.message in seen or seen.add(f.message))]
    report["findings"] = [f.to_dict() for f in findings]
    errors = [f for f in findings if f.severity == F.ERROR]
    report["summary"] = {"integrity_errors": len(errors),
                         "by_kind": dict(Counter(f"{f.severity}:{f.kind}" for f in findings)),
                         "seconds": round(time.perf_counter() - started, 2)}
    report["headline"] = [headline(report)]
    if pointed:
        report["headline"].append(f"built with {', '.join(pointed)}: only {', '.join(splits)} asked (--splits); "
                                  f"the builder needs both splits, the other is not checked")
    write(report, report_dir)
    report["html"] = write_html(report, sources, report_dir)
    report["_results"], report["_sources"] = results, sources  # for --write-clean; not written
    return report


def _values(source, results):
    out = {}
    sizes = [(r["width"], r["height"]) for r in results if "width" in r]
    if sizes:
        out["aspect_ratio"] = np.array([w / h for w, h in sizes])
    out["length"] = [r["length"] for r in results if "length" in r]
    out["duration"] = [r["duration"] for r in results if "duration" in r]
    if source.kind == "coco":
        anns = source.coco.dataset["annotations"]
        out["area"] = np.log10([max(a.get("area") or a["bbox"][2] * a["bbox"][3], 1) for a in anns])
    return out


def write(report, folder):
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    text = json.dumps(public, indent=1, default=str)
    atomic_write(os.path.join(folder, "report.json"), lambda f: f.write(text))
    md = markdown(public)
    atomic_write(os.path.join(folder, "report.md"), lambda f: f.write(md))


def plural(n, word):
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


def headline(report):
    """One line: the integrity errors, the samples read, the warnings by kind (report.md, the console)."""
    s = report["summary"]
    warnings = {k.split(":", 1)[1]: v for k, v in s["by_kind"].items() if k.startswith("warning:")}
    line = plural(s["integrity_errors"], "integrity error")
    if report.get("stats"):
        line += "; samples: " + ", ".join(f"{split} {st['samples']}" for split, st in report["stats"].items())
    elif report.get("speed"):
        line += f"; {report['speed']['samples']} samples"
    if warnings:
        line += "; warnings: " + ", ".join(f"{k} {v}" for k, v in sorted(warnings.items()))
    return line


def _cell(value):
    return str(value).replace("|", "\\|")


def _table(columns, rows):
    """Markdown lines of a table, a blank line after it."""
    return (["| " + " | ".join(map(_cell, columns)) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(map(_cell, r)) + " |" for r in rows] + [""])


def markdown(report):
    s = report["summary"]
    lines = [f"# Data doctor: {report['config']['data']}", "", f"**{report['headline'][0]}**", "",
             f"checks: {', '.join(report['checks'])}; {s['seconds']} s", ""]
    if report.get("speed"):
        sp = report["speed"]
        lines += [f"{sp['samples']} samples read in {sp['seconds']} s with {plural(sp['workers'], 'worker')} "
                  f"({sp['samples_per_second']} samples/s)", ""]
    if len(report["headline"]) > 1:
        lines += report["headline"][1:] + [""]
    for split, why in (report.get("not_checked") or {}).items():
        lines += [f"- {split}: not checked ({why})"]
    if s["by_kind"]:
        lines += ["## Findings by kind", ""] + _table(["severity:kind", "count"], sorted(s["by_kind"].items()))
    for check in ("integrity", "stats", "leaks", "labels"):
        found = [f for f in report["findings"] if f["check"] == check]
        if found:
            lines += [f"## {check} ({len(found)})", ""]
            lines += [f"- **{f['severity']}** `{f['kind']}`: {f['message']}" for f in found[:200]]
            if len(found) > 200:
                lines.append(f"- ... {len(found) - 200} more in report.json")
            lines.append("")
    stats = report.get("stats")
    if stats:
        lines += ["## Statistics", ""] + _table(["", *stats], stat_check.summary_rows(stats))
        key, present, absent = stat_check.class_counts(stats)
        lines += [f"### {key.replace('_', ' ')}, most first", ""] + _table(["class", *stats], present)
        if absent:
            lines += [f"{plural(len(absent), 'class')} with none in any split: {', '.join(map(str, absent))}", ""]
    if report.get("labels"):
        lb = {k: v for k, v in report["labels"].items() if k != "suspects"}
        lines += ["## Label check", ""] + _table(["", ""], lb.items())
        suspects = report["labels"].get("suspects") or []
        if suspects:
            lines += _table(["rank", "record", "given", "suggested", "p(given)", "p(suggested)"], [
                [x["rank"], x["record"], x["given"], x["suggested"], x["given_probability"], x["suggested_probability"]]
                for x in suspects[:50]])
    if report.get("plots"):
        lines += ["## Plots", ""] + [f"![{plot['title']}]({plot['path']})" for plot in report["plots"]]
    return "\n".join(lines) + "\n"
