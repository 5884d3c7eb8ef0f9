"""doctor.py's body: the checks of datasets/doctor/ run on a config's data, their summary printed,
and the exit status (0: no integrity error, 2: some, the CI gate)."""
import os
import sys

from commands.cli import run_or_exit
from datasets.doctor.clean import check_target, write_clean
from datasets.doctor.run import CHECKS, diagnose
from engine.config import load_config

SHOWN = 10  # integrity errors printed on the console; report.md and report.html have them all
FIRST = 3   # findings of each other check printed (leaks, statistics, label errors)
TITLES = {"integrity": "integrity warnings", "stats": "statistics", "leaks": "leaks and duplicates",
          "labels": "likely label errors, most likely first"}


def console(report, report_dir):
    """What doctor.py prints: the headline, how the data was built, the integrity errors in full (a
    missing folder with its expected layout), the first findings of each other check, where the rest is."""
    lines = list(report["headline"])
    for split, why in (report.get("not_checked") or {}).items():
        lines.append(f"{split}: not checked ({why})")
    findings = report["findings"]
    errors = [f["message"] for f in findings if f["severity"] == "error"]
    lines += [f"error: {m}" for m in errors[:SHOWN]]
    if len(errors) > SHOWN:
        lines.append(f"... {len(errors) - SHOWN} more errors in report.md and report.html")
    for check, title in TITLES.items():
        found = [f for f in findings if f["check"] == check and f["severity"] == "warning"]
        if not found:
            continue
        lines.append(f"{title} ({len(found)}):")
        shown = found if check == "integrity" and all(f["kind"].startswith("symlink") for f in found) else found[:FIRST]
        lines += [f"  {f['message']}" for f in shown]
        if len(found) > len(shown):
            lines.append(f"  ... {len(found) - len(shown)} more in report.md and report.html")
    info = sorted({f["kind"] for f in findings if f["severity"] == "info"})
    if info:
        lines.append(f"notes ({sum(f['severity'] == 'info' for f in findings)}): {', '.join(info)} (in report.md)")
    page = os.path.join(report_dir, "report.html")
    lines.append(f"report: {page if report.get('html') else os.path.join(report_dir, 'report.md')}"
                 f"  (also report.md, report.json{', plots/' if report.get('plots') else ''})")
    return lines


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
    print("\n".join(console(report, args.report_dir)))
    if args.write_clean:
        how = run_or_exit(write_clean, report, args.write_clean, args.clean_leaks, args.clean_labels)
        print(how)
    return 2 if report["summary"]["integrity_errors"] else 0
