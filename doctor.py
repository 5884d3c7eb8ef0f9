"""The data doctor: check a config's data set before training (docs/doctor.md).

    python doctor.py --config configs/X.yaml [--set data.root=...] [--splits train,val]
                     [--report-dir D] [--checks integrity,stats,leaks,labels] [--workers 2]
                     [--write-clean DIR [--clean-leaks] [--clean-labels]] [--labels-anyway]

It reads the data through the training builders (the config's own paths and options) and writes
report.json, report.md and plots to --report-dir. Exit status: 0 when no integrity error was found,
2 when one was (a CI gate), 1 on a config error.
"""
import argparse
import os
import sys

from commands.cli import run_or_exit
from datasets.doctor.clean import check_target, write_clean
from datasets.doctor.run import CHECKS, diagnose
from engine.config import load_config

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)

SHOWN = 10  # integrity errors printed on the console; report.md has them all


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the training config whose data is checked")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    p.add_argument("--splits", default="train,val", help="comma-separated splits (default train,val)")
    p.add_argument("--checks", default="integrity,stats,leaks",
                   help=f"comma-separated, of {','.join(CHECKS)} (default integrity,stats,leaks)")
    p.add_argument("--report-dir", default="doctor_report", help="where report.json, report.md and plots go")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="reading processes")
    p.add_argument("--write-clean", metavar="DIR", help="write a filtered copy of the annotations (and a list of "
                   "what was left out) to DIR, without the samples that fail the integrity checks")
    p.add_argument("--clean-leaks", action="store_true", help="with --write-clean: leave out the validation side "
                   "of every leak, and the second of each duplicate")
    p.add_argument("--clean-labels", action="store_true", help="with --write-clean: leave out the likely label errors")
    p.add_argument("--labels-anyway", action="store_true", help="run the label check even when its estimated time "
                   "is over doctor.label_time_limit_s")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        sys.exit(f"error: --checks: unknown {unknown} (choose from {', '.join(CHECKS)})")
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    cfg = run_or_exit(load_config, args.config, args.set)
    if args.write_clean:  # refused before the checks run; again after them, with every sample's folder
        run_or_exit(check_target, args.write_clean, [cfg.data.model_extra.get("root")])
    report = run_or_exit(diagnose, cfg, splits, checks, args.report_dir, args.workers, args.labels_anyway)
    s = report["summary"]
    print(f"{s['integrity_errors']} integrity errors; " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_kind"].items())))
    if report.get("stats"):
        print("samples: " + ", ".join(f"{split} {st.get('samples')}" for split, st in report["stats"].items()))
    errors = [f["message"] for f in report["findings"] if f["severity"] == "error"]
    for message in errors[:SHOWN]:
        print(f"error: {message}")
    if len(errors) > SHOWN:
        print(f"... {len(errors) - SHOWN} more errors in report.md")
    for f in report["findings"]:  # what was not counted: a symlink loop skipped, a directory symlink not followed
        if f["kind"] in ("symlink_loop", "symlink_not_followed"):
            print(f"warning: {f['message']}")
    print(f"report: {os.path.join(args.report_dir, 'report.json')}  report.md" + ("  report.html" if report["html"] else ""))
    if args.write_clean:
        how = run_or_exit(write_clean, report, args.write_clean, args.clean_leaks, args.clean_labels)
        print(how)
    return 2 if s["integrity_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
