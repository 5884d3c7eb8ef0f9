"""The commands README.md and docs/*.md show (issue 39): every one names a script that exists, with
arguments its own parser accepts, a config that loads with its --set, and reads runs/ folders that a
command before it in the same page writes (the README's QAT example once read runs/digits_qat/ while
its command wrote runs/mobilenet_v3_small_qat_digits/). Running them all would take hours of training:
the parsers, configs and paths are what goes stale."""
import glob
import importlib
import os
import re
import shlex

import pytest
import torch.distributed.run

import datasets, models, recipes  # noqa: E401,F401  (the registries a config is checked against)
from conftest import ROOT
from engine.config import load_config

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
SCRIPTS = ("train", "evaluate", "export", "predict", "doctor", "quantize", "benchmark", "tune", "evaluate_onnx",
           "average_checkpoints")
PLACEHOLDER = re.compile(r"runs/[A-Za-z](/|$)|\.\.\.")  # runs/X/best.pt, runs/A/report.json, .../val2017: a user's own
DEMO_DIR = re.search(r"^DEMO_DIR \?= (\S+)", open(os.path.join(ROOT, "Makefile")).read(), re.M)[1]
READS = ("--checkpoint", "--artifact", "--compare", "--resume", "--config")


def commands(page):
    """(line number, argv) of each command in the page's fenced code blocks, continuation lines joined,
    comments dropped: `cat x | python predict.py ...` and `for ...; do python ...; done` give the python
    part (shell variables as 0), `make demo` itself; a synopsis ([--flag ...]) is left out."""
    found, fenced, text, start = [], False, "", 0
    for number, line in enumerate(open(os.path.join(ROOT, page)), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        if not text:
            start = number
        text += line.strip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line.strip()
        if line.rstrip().endswith("\\"):
            continue
        line_text, text = text, ""
        line_text = line_text.split(" #")[0].split("|")[-1]
        line_text = next((part for part in line_text.split(";") if re.search(r"\b(python|torchrun)\b", part)), line_text)
        try:
            argv = shlex.split(re.sub(r"\$\w+", "0", line_text), comments=True)
        except ValueError:
            continue
        argv = argv[argv.index("python"):] if "python" in argv else argv
        if argv[:2] == ["make", "demo"] or (argv and argv[0] in ("python", "torchrun")
                                            and not any(a.startswith("[") for a in argv)):
            found.append((start, argv))
    return found


def split(argv):
    """(launcher arguments or None, script module name, script arguments)."""
    if argv[0] == "torchrun" or argv[1] == "launch.py":
        at = next(i for i, a in enumerate(argv) if a.endswith(".py") and a != "launch.py")
        return argv[1 if argv[0] == "torchrun" else 2:at], argv[at][:-3], argv[at + 1:]
    if argv[1] == "-m":
        return None, argv[2], argv[3:]
    return None, argv[1][:-3], argv[2:]


def values(args, flag):
    """The values given to `flag` (--compare takes several, the others one)."""
    out = []
    for i, a in enumerate(args):
        if a == flag:
            rest = args[i + 1:]
            given = rest[:next((j for j, v in enumerate(rest) if v.startswith("--")), len(rest))]
            out += given if flag == "--compare" else given[:1]
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def overrides(args):
    if "--set" not in args:
        return []
    rest = args[args.index("--set") + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def run_folder(path):
    m = re.match(r"(runs/[^/]+)", path)
    return m[1] if m else None


def written(script, args):
    """The runs/ folders this command writes."""
    if script == "make demo":
        return {DEMO_DIR}
    folders = set()
    if script in ("train", "tune"):
        flag = "--output-dir" if script == "train" else "--study-dir"
        out = values(args, flag)
        config = (values(args, "--config") or [""])[0]
        stem = os.path.splitext(os.path.basename(config))[0]
        folders.add(run_folder(out[0]) if out else (os.path.dirname(config) if config.startswith("runs/") else
                                                   f"runs/{stem}" + ("-tune" if script == "tune" else "")))
    return {f for f in folders if f}


def made_by(page):
    """The runs/ folders the page's commands write."""
    made = set()
    for _, argv in commands(page):
        made |= written("make demo", []) if argv[0] == "make" else written(*split(argv)[1:])
    return made


@pytest.mark.parametrize("page", PAGES)
def test_every_command_shown_parses_loads_its_config_and_reads_what_a_command_before_it_writes(page):
    """A page reads what the commands before it wrote; docs/ pages also what the README's commands write."""
    problems, made = [], set() if page == "README.md" else made_by("README.md")
    for number, argv in commands(page):
        where = f"{page}:{number}: {' '.join(argv)}"
        if argv[0] == "make":
            made |= written("make demo", [])
            continue
        launcher, script, args = split(argv)
        if launcher is not None:
            try:
                torch.distributed.run.get_args_parser().parse_args(launcher + [f"{script}.py"])
            except SystemExit:
                problems.append(f"{where}: torchrun refuses its arguments")
        module_file = os.path.join(ROOT, *script.split(".")) + ".py"
        if not os.path.isfile(module_file):
            problems.append(f"{where}: no {os.path.relpath(module_file, ROOT)}")
            continue
        if script in SCRIPTS and "--help" not in args and "--list" not in args:
            try:
                importlib.import_module(script).parse_args(args)
            except SystemExit:
                problems.append(f"{where}: {script}.py's parser refuses these arguments")
        elif script not in SCRIPTS:  # a benchmark module: its flags are in its source
            source = open(module_file).read()
            problems += [f"{where}: {a} is not an option of {script}" for a in args
                         if a.startswith("--") and f'"{a.split("=")[0]}"' not in source]
        for config in values(args, "--config"):
            if config.startswith("configs/"):
                try:
                    load_config(os.path.join(ROOT, config), overrides(args))
                except Exception as e:  # noqa: BLE001  (a config error of any kind is the finding)
                    problems.append(f"{where}: {config} does not load: {str(e).splitlines()[0]}")
        reads = [v for flag in READS for v in values(args, flag)] + [
            o.split("=", 1)[1] for o in overrides(args) if o.startswith("model.weights=")]
        for path in reads:
            folder = run_folder(path)
            if folder and not PLACEHOLDER.search(path) and folder not in made and folder not in written(script, args):
                problems.append(f"{where}: reads {path}, but no command before it in {page} writes {folder}")
        made |= written(script, args)
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_command_that_reads_a_folder_nothing_wrote(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\npython train.py --config configs/mobilenet_v3_small_qat_digits.yaml --set data.root=D\n"
                    "python evaluate.py --artifact runs/digits_qat/model_int8.pt --set data.root=D\n"
                    "python train.py --config configs/demo.yaml --no-such-flag\n```\n")
    with pytest.raises(AssertionError) as e:
        test_every_command_shown_parses_loads_its_config_and_reads_what_a_command_before_it_writes(str(page))
    assert "reads runs/digits_qat/model_int8.pt, but no command before it" in str(e.value)
    assert "train.py's parser refuses these arguments" in str(e.value)
