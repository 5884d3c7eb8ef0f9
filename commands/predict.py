"""predict.py's body: a checkpoint, artifact or config with its weights run on the user's files
(folders and globs listed by engine.paths.walk_files), each result's line printed by its task's
adapter (exporters), predictions.json written, and the inputs that failed named."""
import fnmatch
import glob
import os
import sys

from artifacts.load import load_artifact, load_config_runner
from commands.cli import run_or_exit
from engine.config import ConfigError, load_config
from engine.errors import UserError
from engine.files import write_json
from engine.logger import progress
from engine.paths import walk_files
from exporters import AUDIO_EXTENSIONS, IMAGE_EXTENSIONS


def load_model(args):
    """artifacts.load.Loaded(runner, adapter, spec): the checkpoint or artifact (with --config / --set
    under artifacts.config's policy), or a config alone with the weights it names."""
    if args.checkpoint:
        return load_artifact(args.checkpoint, args.config, args.set, args.force, args.trust_artifact)
    if not args.config:
        raise ConfigError("--checkpoint (a checkpoint or an exported artifact) or --config is required")
    return load_config_runner(load_config(args.config, args.set), os.getcwd())


# ---------------------------------------------------------------- the inputs

def expand(inputs, kind, follow_symlinks=False):
    """Files to read (or text lines), and (input, error) for inputs that name nothing readable. Folders
    and globs are listed by engine.paths.walk_files."""
    if kind == "text":
        items, failed = [], []
        for name in inputs or ["-"]:
            try:
                lines = sys.stdin.read().splitlines() if name == "-" else open(name, encoding="utf-8").read().splitlines()
            except (OSError, UnicodeDecodeError) as e:
                failed.append((name, f"cannot read text file ({type(e).__name__}: {e})"))
                continue
            items += [line for line in lines if line.strip()]
        return items, failed
    extensions = IMAGE_EXTENSIONS if kind == "image" else AUDIO_EXTENSIONS
    items, failed = [], []
    for name in inputs:
        if os.path.isdir(name):
            found = walk_files(name, extensions, follow_symlinks)
            if not found:
                failed.append((name, f"no {kind} files ({', '.join(extensions)}) in this folder"))
            items += found
        elif os.path.isfile(name):
            items.append(name)
        elif glob.has_magic(name):
            found = glob_files(name, follow_symlinks)
            if not found:
                failed.append((name, "the pattern matches no file"))
            items += found
        else:
            failed.append((name, "no such file or folder"))
    if not inputs:
        failed.append(("(no input)", f"give {kind} files, folders or globs"))
    return items, failed


def glob_files(pattern, follow_symlinks=False):
    """The files a glob names (glob.glob(recursive=True)'s rules: `**` is any number of folders, `*` and
    `**` match no hidden name), listed by walking the pattern's folder with engine.paths.walk_files:
    glob.glob follows directory symlinks, and through a loop it gave one image 41 times."""
    parts = pattern.split(os.sep)
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    top, rest = os.sep.join(parts[:fixed]), parts[fixed:]
    if fixed and not top:  # /*.png
        top = os.sep
    folder = top or "."
    if not os.path.isdir(folder):
        return []
    found = walk_files(folder, follow_symlinks=follow_symlinks, max_depth=None if "**" in rest else len(rest) - 1)
    return [path if top else os.path.relpath(path, folder) for path in found
            if _matches(os.path.relpath(path, folder).split(os.sep), rest)]


def _matches(names, parts):
    """Whether the path names match the glob's parts, as glob.glob(recursive=True) matches them."""
    if not parts:
        return not names
    if parts[0] == "**":
        return _matches(names, parts[1:]) or bool(names) and not names[0].startswith(".") and _matches(names[1:], parts)
    if not names or names[0].startswith(".") and not parts[0].startswith("."):
        return False
    return fnmatch.fnmatch(names[0], parts[0]) and _matches(names[1:], parts[1:])


def predict(args):
    loaded = load_model(args)
    runner, adapter, limit = loaded.runner, loaded.adapter, loaded.batch_limit
    items, failed = expand(args.inputs, adapter.input_kind, args.follow_symlinks)
    os.makedirs(args.output, exist_ok=True)
    batch_size = min(args.batch_size, limit or args.batch_size)
    results, pending = [], []

    def flush():
        names, samples = zip(*pending)
        outputs = runner(*adapter.collate(list(samples)))
        presented = adapter.present(outputs, list(names), list(samples), args.output, args)
        for line in filter(None, map(adapter.summary, presented)):
            print(line)
        results.extend(presented)
        pending.clear()

    bar = progress(total=len(items), desc="predict", disable=len(items) <= batch_size, tty_only=True)
    for item in items:
        try:
            sample = adapter.load(item)
        except UserError as e:  # engine.errors.BadSample: the file named, the others still run
            failed.append((item, str(e)))
            print(f"error: {e}", file=sys.stderr)
            bar.update()
            continue
        if pending and (len(pending) == batch_size or adapter.batch_key(sample) != adapter.batch_key(pending[0][1])):
            flush()
        pending.append((item, sample))
        bar.update()
    if pending:
        flush()
    bar.close()
    adapter.after_predictions(results, args.output, args)
    write_json(os.path.join(args.output, "predictions.json"), {"predictions": results, "failed": [
        {"input": name, "error": why} for name, why in failed]})
    print(f"{len(results)} predicted, {len(failed)} failed; results in {args.output}/")
    for name, why in failed:
        print(f"  failed: {name}: {why}")
    return results, failed


def main(args):
    """predict.py's parsed arguments: the results; exit status 1 when an input failed."""
    results, failed = run_or_exit(predict, args)
    if failed:
        sys.exit(1)
    return results
