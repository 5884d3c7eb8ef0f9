"""tune.py's own cost per trial (issue 38, acceptance 6), reported in docs/tuning.md:

    python -m benchmarks.tune_overhead [--config tests/configs/tiny.yaml] [--trials 6] [--set KEY=VALUE ...]

The same config N times as plain `train.py` runs, one after another, then as a study of N trials whose
space has one point (every trial trains the same config). Both in this one run, on this machine:
(study wall time - the N runs' wall time) / N is what tune.py adds to each trial (its start-up, the
config checks, the storage, the report after each trial, the process start of each trial)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(cmd):
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - start


def measure(config, trials, sets, folder):
    plain = [timed([sys.executable, os.path.join(ROOT, "train.py"), "--config", config, "--output-dir",
                    os.path.join(folder, f"plain_{i}"), "--set", "train.log_every=20", *sets]) for i in range(trials)]
    space = os.path.join(folder, "space.yaml")
    with open(space, "w") as f:  # one point: every trial is the plain run's config
        f.write("train.log_every: {choice: [20]}\n")
    study = timed([sys.executable, os.path.join(ROOT, "tune.py"), "--config", config, "--space", space, "--trials",
                   str(trials), "--sampler", "random", "--pruner", "none", "--study-dir", os.path.join(folder, "study"),
                   "--set", "train.log_every=20", *sets])
    return {"config": config, "trials": trials, "plain_seconds": [round(s, 2) for s in plain],
            "study_seconds": round(study, 2), "overhead_per_trial_s": round((study - sum(plain)) / trials, 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "tests", "configs", "tiny.yaml"))
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="folder of the runs (default: a temporary one)")
    args = p.parse_args(argv)
    folder = args.out or tempfile.mkdtemp(prefix="tune-overhead-")
    result = measure(args.config, args.trials, args.set, folder)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
