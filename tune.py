"""Search a config's hyperparameters with Optuna: each trial a real train.py run, pruned by its own
evaluations, the study resumable and shared by processes and machines (docs/tuning.md).

    python tune.py --config configs/X.yaml --space space.yaml --trials 16 [--trial-budget 45s]
                   [--study-dir runs/X-tune] [--storage URL] [--jobs K] [--sampler tpe|random|grid]
                   [--pruner median|hyperband|none] [--max-failures 3] [--set KEY=VALUE ...] [--force]

The space maps config keys to distributions (uniform, log_uniform, int, log_int, choice):

    optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}
    optim.weight_decay: {uniform: [0, 0.1]}
    recipes: {choice: [[amp], [amp, ema]]}

The study folder gets a run folder per trial (trial_NNN), study.md, study.html, best.yaml (train it with
train.py as it is) and TensorBoard's hparams view (tensorboard/). --storage: an SQLite file in the study
folder by default; postgresql://user:password@host/db or journal:PATH (a shared file system) for the same
command on many machines, which then share one study. The same command after a kill continues the
study. Exit codes: 0 done, 1 error (or --max-failures failed trials in a row), 75 stopped by
SIGTERM/SIGINT with the running trials' checkpoints written.
"""
import argparse

import commands.tune

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders: the configs are checked)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config of the trials (may inherit through _base_)")
    p.add_argument("--space", required=True, help="YAML search space: config keys to distributions")
    p.add_argument("--trials", type=int, required=True, help="trials of the study, over all its processes")
    p.add_argument("--trial-budget", metavar="TIME", help="each trial's wall time (e.g. 45s, 3m): train.budget; "
                   "default: the config's epochs (or budget)")
    p.add_argument("--study-dir", help="the study's folder (default: runs/<config>-tune)")
    p.add_argument("--study-name", help="the study's name in its storage (default: the study folder's name)")
    p.add_argument("--storage", metavar="URL", help="default: sqlite in the study folder; postgresql://... or "
                   "journal:PATH for many machines")
    p.add_argument("--jobs", type=int, default=1, help="trials at once in this process; the cores are split "
                   "between them")
    p.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe")
    p.add_argument("--pruner", choices=("median", "hyperband", "none"), default="median")
    p.add_argument("--max-failures", type=int, default=3, help="stop after this many failed trials in a row")
    p.add_argument("--seed", type=int, help="the sampler's seed (default: random)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys of every trial")
    p.add_argument("--force", action="store_true", help="go on with a study folder or study made for another "
                   "config, space, budget or number of trials")
    args = p.parse_args(argv)
    if args.trials < 1 or args.jobs < 1 or args.max_failures < 1:
        p.error("--trials, --jobs and --max-failures take a positive number")
    return args


def main(argv=None):
    return commands.tune.main(parse_args(argv))


if __name__ == "__main__":
    main()
