"""What the command lines share: the four options of a checkpoint, and one way to end on a user's
mistake (one `error: ...` line, exit status 1; under torchrun at once)."""
import sys

from engine import dist
from engine.errors import UserError


def add_checkpoint_options(p, verb, checkpoint_help, required=True):
    """--checkpoint, --config, --set and --force, under artifacts.config's one policy."""
    p.add_argument("--checkpoint", required=required, help=checkpoint_help)
    p.add_argument("--config", help="YAML config (default: the config saved in the checkpoint)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config keys (of --config, or of the checkpoint's config)")
    p.add_argument("--force", action="store_true", help=f"{verb} although --config or --set differ from the "
                   "checkpoint's config in model, data or preprocessing")
    return p


def exit_with_error(e):
    """One `error: ...` line and exit status 1. Under torchrun this process ends at once, with no
    barrier or teardown that would wait for peers (engine.dist.exit_on_failure)."""
    dist.exit_on_failure(f"error: {e}")
    sys.exit(f"error: {e}")


def run_or_exit(fn, *args):
    """fn(*args); a UserError ends the command with exit_with_error (any other exception is a bug and
    keeps its traceback)."""
    try:
        return fn(*args)
    except UserError as e:
        exit_with_error(e)
