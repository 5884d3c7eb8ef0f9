"""doctor.py's body: the checks of datasets/doctor/ run on a config's data, their summary printed,
and the exit status (0: no integrity error, 2: some, the CI gate)."""
import os
import sys

from commands.cli import run_or_exit
from datasets.doctor.clean import check_target, write_clean
from datasets.doctor.run import CHECKS, diagnose
from engine.config import load_config

SHOWN = 10  # integrity errors printed on the console; report.md has them all


def main(args):
    """doctor.py's parsed arguments: its exit status."""
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
