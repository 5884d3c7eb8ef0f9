"""Train any model of the zoo from a YAML config.

    python train.py --config configs/demo.yaml [--set optim.lr=0.1 data.batch_size=32]
                    [--output-dir runs/x] [--resume [PATH]]
    torchrun --nproc_per_node=N train.py --config ...
"""
import argparse
import os
import sys

from engine.config import ConfigError, load_config
from engine.registry import RegistryError
from datasets.base import DataError

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (may inherit through _base_)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    p.add_argument("--output-dir", help="run folder (default: output_dir of the config, else runs/<config>)")
    p.add_argument("--resume", nargs="?", const="last", metavar="PATH",
                   help="continue a run from PATH (default: <output-dir>/last.pt)")
    return p.parse_args(argv)


def output_dir_for(args, cfg):
    return args.output_dir or cfg.output_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0])


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except (ConfigError, RegistryError) as e:
        sys.exit(f"error: {e}")
    output_dir = output_dir_for(args, cfg)
    resume = os.path.join(output_dir, "last.pt") if args.resume == "last" else args.resume
    from engine.loop import train
    try:
        train(cfg, output_dir, resume)
    except (FileNotFoundError, ConfigError, DataError) as e:  # bad data / num_classes, named
        sys.exit(f"error: {e}")
    finally:
        from engine import dist
        dist.cleanup()


if __name__ == "__main__":
    main()
