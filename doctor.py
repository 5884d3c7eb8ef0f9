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

import commands.doctor
from datasets.doctor.run import CHECKS

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)


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
    return commands.doctor.main(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
