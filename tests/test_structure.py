"""The engine stands alone: it imports no family package, so it can be read and tested by itself."""
import ast
import os
import subprocess
import sys

from conftest import ROOT

FAMILY_PACKAGES = ("models", "datasets", "recipes")


def test_engine_source_imports_no_family_package():
    offenders = []
    for name in sorted(os.listdir(os.path.join(ROOT, "engine"))):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(ROOT, "engine", name)).read())
        for node in ast.walk(tree):  # function-level imports count too
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            else:
                continue
            offenders += [f"engine/{name}:{node.lineno} imports {m}" for m in mods
                          if m.split(".")[0] in FAMILY_PACKAGES]
    assert not offenders, offenders


def test_engine_modules_import_alone():
    code = ("import importlib, os, sys\n"
            "for f in sorted(os.listdir('engine')):\n"
            "    if f.endswith('.py'): importlib.import_module('engine.' + f[:-3])\n"
            f"bad = [m for m in sys.modules if m.split('.')[0] in {FAMILY_PACKAGES!r}]\n"
            "assert not bad, bad\n"
            "from engine.registry import MODELS, DATASETS, RECIPES, SCORERS\n"
            "assert not (MODELS.names() or DATASETS.names() or RECIPES.names() or SCORERS.names())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
