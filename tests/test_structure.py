"""The layering rules of docs/architecture.md, checked on the source so that they hold by themselves.

engine/ is the bottom layer and imports no family; models never read data; datasets and recipes
never reach into the loop; scripts are thin command lines that import libraries, never each other.
"""
import ast
import dataclasses
import glob
import importlib
import os
import subprocess
import sys

from conftest import ROOT

FAMILY_PACKAGES = ("models", "datasets", "recipes", "exporters", "artifacts", "commands", "evaluators", "runtime",
                   "tuning")
SCRIPTS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "*.py")))
LIBRARY_PACKAGES = ("engine", "models", "datasets", "recipes", "exporters", "artifacts", "commands", "evaluators",
                    "runtime", "tuning", "benchmarks")


def source_files(packages=LIBRARY_PACKAGES, scripts=True):
    """Repository-relative paths of the product's Python files (tests excluded), every package read
    recursively (datasets/doctor/, engine/report/ too)."""
    paths = [f"{s}.py" for s in SCRIPTS] if scripts else []
    for package in packages:
        paths += package_tree(package)
    return paths


def imports_of(path):
    """[(line, module)] for every import in the file, function-level ones included."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def offenders(paths, forbidden):
    """Imports of any module in `forbidden` (or below it) from `paths`."""
    return [f"{p}:{line} imports {m}" for p in paths for line, m in imports_of(p)
            if any(m == f or m.startswith(f + ".") for f in forbidden)]


def test_engine_source_imports_no_family_package():
    assert not offenders(source_files(("engine",), scripts=False), FAMILY_PACKAGES)


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


def test_only_train_py_imports_the_loop():
    paths = [p for p in source_files() if not p.startswith("engine/") and p != "train.py"]
    assert not offenders(paths, ("engine.loop",))


def test_datasets_and_recipes_never_import_the_loop():
    assert not offenders(source_files(("datasets", "recipes"), scripts=False), ("engine.loop",))


def test_models_never_import_datasets():
    assert not offenders(source_files(("models",), scripts=False), ("datasets",))


def test_no_script_imports_another():
    assert not offenders(source_files(), SCRIPTS)


def test_only_commands_print():
    """The libraries return values and log; the console is commands/'s (and the root scripts',
    benchmarks/' and tests'). Every package of the repository, at any depth."""
    allowed_dirs = ("commands", "benchmarks", "tests")
    counts = {}
    for d, subdirs, files in os.walk(ROOT):
        rel = os.path.relpath(d, ROOT)
        subdirs[:] = [s for s in subdirs if os.path.isfile(os.path.join(d, s, "__init__.py"))
                      and (rel != "." or s not in allowed_dirs)]
        for f in files:
            if f.endswith(".py") and rel != ".":
                path = os.path.join(rel, f)
                tree = ast.parse(open(os.path.join(ROOT, path)).read())
                calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
                         and isinstance(n.func, ast.Name) and n.func.id == "print"]
                if calls:
                    counts[path] = calls
    assert counts == {}


def test_root_scripts_are_thin_entry_points():
    """Each command line but train.py (its own start-up and signals) and launch.py (torchrun's wrapper):
    a docstring, parse_args, and a main that calls commands.<name>.main; the body lives in commands/."""
    problems = []
    for script in sorted(set(SCRIPTS) - {"train", "launch"}):
        tree = ast.parse(open(os.path.join(ROOT, f"{script}.py")).read())
        defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if defs != {"parse_args", "main"}:
            problems.append(f"{script}.py defines {sorted(defs)}, not parse_args and main alone")
        main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), tree)
        if f"commands.{script}.main" not in {ast.unparse(n.func) for n in ast.walk(main) if isinstance(n, ast.Call)}:
            problems.append(f"{script}.py: main does not call commands.{script}.main")
    assert not problems, problems


def test_one_torchrun_aware_error_exit():
    """`error: ...` through engine.dist.exit_on_failure is written once (commands.cli.exit_with_error)."""
    found = [f"{p}:{n.lineno}" for p in source_files() for n in ast.walk(ast.parse(open(os.path.join(ROOT, p)).read()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "exit_on_failure"
             and n.args and ast.unparse(n.args[0]).lstrip("f").strip("'\"").startswith("error:")]
    assert [f.split(":")[0] for f in found] == ["commands/cli.py"], found


def test_nothing_edits_sys_path():
    found = [f"{p}:{n.lineno}" for p in source_files() for n in ast.walk(ast.parse(open(os.path.join(ROOT, p)).read()))
             if isinstance(n, ast.Attribute) and n.attr in ("insert", "append", "extend")
             and isinstance(n.value, ast.Attribute) and n.value.attr == "path"
             and isinstance(n.value.value, ast.Name) and n.value.value.id == "sys"]
    assert not found, found


def test_every_module_that_logs_has_its_own_logger():
    """`log = logging.getLogger(__name__)`, not a name shared with other modules nor a logger imported
    from one: a user can then silence or raise one module's messages. Listening to another module's
    logger (addHandler / removeHandler, as the doctor collects the loaders' warnings) is not logging."""
    problems = []
    for path in source_files():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        listening = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and n.attr in ("addHandler", "removeHandler")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                    and id(node) not in listening
                    and not (len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__")):
                problems.append(f"{path}:{node.lineno}: getLogger({ast.unparse(node.args[0]) if node.args else ''})")
            if isinstance(node, ast.ImportFrom) and any(a.name in ("log", "logger") for a in node.names):
                problems.append(f"{path}:{node.lineno}: imports another module's logger")
        calls_log = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "log"
                        for n in ast.walk(tree))
        defines_log = any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "log" for t in n.targets)
                          for n in tree.body)
        if calls_log and not defines_log:
            problems.append(f"{path}: uses `log` without defining its own")
    assert not problems, problems


def test_the_loop_reads_in_one_sitting_and_a_run_is_a_dataclass():
    assert len(open(os.path.join(ROOT, "engine", "loop.py")).read().splitlines()) < 350
    from engine.build import Run
    assert dataclasses.is_dataclass(Run)
    fields = {f.name for f in dataclasses.fields(Run)}
    assert {"cfg", "model", "recipes", "train_loader", "val_loader", "optimizer", "scaler", "step"} <= fields


def test_every_model_declares_its_task_and_every_data_set_its_inputs():
    from engine.registry import DATASETS, MODELS
    assert [m for m in MODELS.names() if not m.startswith("_") and not _declares(MODELS, m, "task")] == []
    assert [d for d in DATASETS.names() if not _declares(DATASETS, d, "inputs")] == []


def _declares(registry, name, key):
    try:
        return registry.declared(name, key)
    except (KeyError, AttributeError):
        return None


def test_export_and_predict_never_choose_by_model_name():
    """They choose by the model's declared task: no adapter matches on model names."""
    found = [f"{p}:{n.lineno}" for p in source_files() for n in ast.walk(ast.parse(open(os.path.join(ROOT, p)).read()))
             if isinstance(n, ast.FunctionDef) and n.name == "matches"]
    assert not found, found


# The exceptions of the product that are not a user's to fix, and why.
NOT_USER_ERRORS = {"Preempted": "a stop request honoured (exit 75), not an error",
                   "PlotError": "a plot the code described wrongly: a bug, shown as a note in report.html"}


def exception_classes():
    """{name: class} of every exception the product defines: each module of every package imported."""
    found = {}
    for path in source_files(scripts=False):
        module = importlib.import_module(path[:-3].replace("/", ".").removesuffix(".__init__"))
        found.update({name: c for name, c in vars(module).items() if isinstance(c, type)
                      and issubclass(c, BaseException) and c.__module__ == module.__name__})
    return found


def user_error_names():
    from engine.errors import UserError
    return sorted(name for name, c in exception_classes().items() if issubclass(c, UserError) and c is not UserError)


def test_every_error_a_user_can_fix_has_one_base():
    """Derived from the code, not a hand list: every exception class defined anywhere in the product
    is a UserError but those NOT_USER_ERRORS names with its reason."""
    from engine.errors import UserError
    classes = exception_classes()
    assert "ConfigError" in classes and "BadSample" in classes and "PanopticFormatError" in classes  # all read
    assert sorted(set(NOT_USER_ERRORS) - set(classes)) == []  # a listed one that is gone: drop it from the list
    assert sorted(n for n, c in classes.items() if not issubclass(c, UserError) and n not in NOT_USER_ERRORS) == []


def test_command_lines_catch_the_one_base_not_a_list_of_classes():
    """`except UserError`: one `error: ...` line; a ValueError from a bug keeps its traceback."""
    problems, listed = [], set(user_error_names() + ["ValueError", "TypeError", "FileNotFoundError", "KeyError"])
    for script in SCRIPTS:
        tree = ast.parse(open(os.path.join(ROOT, f"{script}.py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                caught = names & listed
                if caught:
                    problems.append(f"{script}.py:{node.lineno} catches {sorted(caught)}")
    assert not problems, problems


def package_tree(package):
    """Repository-relative paths of every Python file of a package, subpackages included."""
    return sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(os.path.join(ROOT, package))
                  for f in files if f.endswith(".py"))


def project_imports(paths):
    """[(path:line, top-level name)] of the imports of this repository's own packages and scripts,
    function-level ones included."""
    own = {n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))} | set(SCRIPTS)
    return sorted({(f"{p}:{line}", m.split(".")[0]) for p in paths for line, m in imports_of(p)
                   if m.split(".")[0] in own})


def test_engine_imports_only_engine():
    """The bottom layer, all of it (engine/report/ too), at any depth of a function: no arrow runs up."""
    bad = [f"{where} imports {top}" for where, top in project_imports(package_tree("engine")) if top != "engine"]
    assert package_tree("engine") and not bad, "\n".join(bad)


def test_evaluators_import_only_engine_and_evaluators():
    """Evaluation has one home: data sets build their evaluators from evaluators/, never the reverse
    (the torch-free PQ arithmetic they share with runtime/ lives there)."""
    bad = [f"{where} imports {top}" for where, top in project_imports(package_tree("evaluators"))
           if top not in ("engine", "evaluators", "runtime")]
    assert package_tree("evaluators") and not bad, "\n".join(bad)


RUNTIME_MAY_IMPORT = ("engine.errors", "engine.files", "engine.paths")


def test_runtime_imports_neither_torch_nor_the_rest_of_the_project():
    """runtime/ (and evaluate_onnx.py, its command line) runs an ONNX artifact where torch is not
    installed: each module imports in a process where importing torch fails, and of this project only
    RUNTIME_MAY_IMPORT and runtime/."""
    torch_free = package_tree("runtime") + ["commands/evaluate_onnx.py", "evaluate_onnx.py"]  # and its command line
    modules = [p[:-3].replace("/", ".").removesuffix(".__init__") for p in torch_free]
    assert "runtime.spec" in modules and "runtime.integrity" in modules
    own = [f"{p}:{line} imports {m}" for p in torch_free for line, m in imports_of(p)
           if m.split(".")[0] in LIBRARY_PACKAGES and m.split(".")[0] not in ("runtime", "commands")
           and not any(m == a or m.startswith(a + ".") for a in RUNTIME_MAY_IMPORT)]
    assert not own, "\n".join(own)
    for module in modules:
        code = (f"import sys; sys.modules['torch'] = None; sys.modules['torchvision'] = None\n"
                f"import {module}\n"
                f"assert not [m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in ('torch', 'torchvision')]")
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"{module}: {done.stderr[-600:]}"


def test_models_declare_quantizable_and_exports_and_data_sets_their_doctor_source():
    """Declarations instead of type tests (issue 33): quantize / benchmark read `quantizable`, export reads
    `exports` before anything is built, the doctor reads a data set's `doctor` source."""
    from engine.registry import DATASETS, DOCTOR_SOURCES, EXPORT_FORMATS, MODELS
    from artifacts.spec import ARTIFACT_FORMATS
    from exporters import EXPORTERS
    import datasets.doctor  # noqa: F401  (registers the doctor sources)
    assert set(ARTIFACT_FORMATS) == set(EXPORT_FORMATS)
    bad = []
    for m in [m for m in MODELS.names() if not m.startswith("_")]:  # "_": the tests' own models
        quantizable, exports = _declares(MODELS, m, "quantizable"), _declares(MODELS, m, "exports")
        if quantizable is None or exports is None:
            bad.append(f"model {m} declares quantizable={quantizable}, exports={exports}")
        elif quantizable and "quantize" not in (MODELS.arguments(m) or []):
            bad.append(f"model {m} declares quantizable=True, its builder takes no quantize=")
        elif ("torchscript" in exports) != quantizable:  # torchscript is the int8 artifact
            bad.append(f"model {m}: exports torchscript only when quantizable ({quantizable}, {exports})")
        elif exports and MODELS.declared(m, "task") not in EXPORTERS.tasks():
            bad.append(f"model {m} declares exports {exports}, no adapter serves its task")
    for d in DATASETS.names():
        source = _declares(DATASETS, d, "doctor")
        if source is None and not d.startswith("synthetic_"):  # generated in memory: no files to check
            bad.append(f"data set {d} declares no doctor source")
        elif source is not None and source not in DOCTOR_SOURCES.names():
            bad.append(f"data set {d} declares the doctor source {source}, which is not registered")
    assert not bad, "\n".join(bad)


def test_exporters_and_the_doctor_never_test_a_model_or_data_set_class():
    """They read what a model or data set declares: no isinstance on a class from models/, datasets/ or
    torchvision.models (a Faster R-CNN failed the SSD-only test after its data was built)."""
    bad = []
    for path in package_tree("exporters") + package_tree(os.path.join("datasets", "doctor")):
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        classes = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                   and n.module.split(".")[0] in ("models", "datasets", "torchvision") and
                   (n.module.split(".")[0] != "torchvision" or n.module.startswith("torchvision.models"))
                   for a in n.names}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance" and len(n.args) == 2:
                names = {x.id for x in ast.walk(n.args[1]) if isinstance(x, ast.Name)}
                if names & classes:
                    bad.append(f"{path}:{n.lineno} isinstance(..., {sorted(names & classes)})")
    assert not bad, "\n".join(bad)


def _whole_tree():
    """The product's Python files, every package at any depth, and the scripts."""
    return [f"{s}.py" for s in SCRIPTS] + [p for package in LIBRARY_PACKAGES for p in package_tree(package)]


def _called(node):
    return {getattr(c.func, "id", None) or getattr(c.func, "attr", None) for c in ast.walk(node)
            if isinstance(c, ast.Call)}


def test_a_checkpoint_is_opened_in_one_place():
    """artifacts.load.open_checkpoint is the one read_checkpoint + config_from_checkpoint pair, and a
    config comes from data through engine.config.config_from_data: no config_from_dict, no temporary
    YAML file for load_config to read."""
    bad = []
    for path in _whole_tree():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (path, fn.name) != \
                    ("artifacts/load.py", "open_checkpoint"):
                if {"read_checkpoint", "config_from_checkpoint"} <= _called(fn):
                    bad.append(f"{path}:{fn.lineno} {fn.name} reads a checkpoint and its config: use open_checkpoint")
                if {"load_config", "safe_dump"} <= _called(fn):  # yaml.safe_dump of a config, then read back
                    bad.append(f"{path}:{fn.lineno} {fn.name} writes a config for load_config: use config_from_data")
    for path in _whole_tree() + package_tree("tests"):
        if "config_from_dict" in open(os.path.join(ROOT, path)).read() and path != "tests/test_structure.py":
            bad.append(f"{path}: config_from_dict (gone: engine.config.config_from_data checks what a file is checked for)")
    assert not bad, "\n".join(bad)


def test_the_checkpoint_module_holds_checkpoints_and_the_run_folder_only():
    """file_sha256 lives in engine/files.py and the config-diff policy in engine/config_changes.py, whose
    `under` is the one prefix test of dotted keys (no private copy elsewhere)."""
    import engine.checkpoint
    import engine.config_changes
    import engine.files
    moved = ("file_sha256", "config_changes", "describe_changes", "RESUME_BREAKING", "RESUME_IGNORED",
             "EVAL_COMPARED", "EVAL_IGNORED", "_under", "under")
    assert not [n for n in moved if hasattr(engine.checkpoint, n)]
    assert callable(engine.files.file_sha256) and callable(engine.config_changes.under)
    bad = []
    for path in _whole_tree():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        bad += [f"{path}:{n.lineno} defines {n.name}" for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                and n.name in ("_under", "under") and path != "engine/config_changes.py"]
        bad += [f"{path}:{n.lineno} imports {n.module}.{a.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in LIBRARY_PACKAGES
                for a in n.names if a.name == "_under"]
    assert not bad, "\n".join(bad)


def test_files_are_replaced_whole_by_engine_files_only():
    """A file written in place of another goes through engine.files (a temporary, fsync, os.replace):
    no hand-written replace elsewhere. The run folder's moves (engine/checkpoint.py) and a generated
    data set's folder renamed into place (datasets/shapes.py) move folders and whole runs, not files."""
    allowed = {"engine/files.py", "engine/checkpoint.py", "datasets/shapes.py"}
    bad = []
    for path in _whole_tree():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        bad += [f"{path}:{n.lineno} os.{n.func.attr}" for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and n.func.attr in ("replace", "rename")
                and getattr(n.func.value, "id", None) == "os" and path not in allowed]
    assert not bad, "\n".join(bad)


def test_the_loop_asks_the_owner_not_its_parts():
    """The budget is reached through Limits (check_due, request_check) and the shuffle's generator
    through the training loader (start_epoch): no run.limits.budget.… or ….batch_sampler.sampler.generator."""
    chains = {("limits", "budget"): "engine/limits.py", ("sampler", "generator"): "engine/build.py"}
    bad = []
    for path in _whole_tree():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute):
                home = chains.get((n.value.attr, n.attr))
                if home and path != home:
                    bad.append(f"{path}:{n.lineno} ….{n.value.attr}.{n.attr} (ask {home}'s owner)")
    assert not bad, "\n".join(bad)


def own_names():
    """The top-level names of this repository's packages and scripts."""
    return {n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))} | set(SCRIPTS) | \
        set(LIBRARY_PACKAGES)


def test_no_package_circle():
    """The graph of the packages (scripts as leaves), every import at any depth of a function counted:
    no package reaches itself through another, so no import inside a function hides a circle."""
    edges = {}
    for path in _whole_tree():
        source = path.split("/")[0] if "/" in path else path[:-3]
        for _, module in imports_of(path):
            target = module.split(".")[0]
            if target in own_names() and target != source:
                edges.setdefault(source, set()).add(target)

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, seen + (n,))) for n in edges.get(start, ()))
    circles = sorted(f"{a} -> {b} -> ... -> {a}" for a in edges for b in edges[a] if reaches(b, a))
    assert edges and not circles, "\n".join(circles)


# Imports made inside a function, allowed where the module is an optional heavy dependency (imported only
# when its feature runs) or chosen at run time. Anything else is imported at the top of its module.
LATE_IMPORTS_OWN = {}  # (path, module) of this repository imported inside a function: none
LATE_IMPORTS = {"matplotlib": "plots: seconds to import, only when a report draws one",
                "onnx": "ONNX artifacts only", "onnxruntime": "ONNX artifacts only", "onnxscript": "ONNX export only",
                "imagehash": "the doctor's near-duplicates only", "cleanlab": "the doctor's label check only",
                "sklearn": "the doctor's label check only (seconds to import)", "optuna": "tuning only",
                "tidecv": "the detection analysis only",
                "faster_coco_eval": "the COCO backend, chosen at run time", "pycocotools": "the COCO backend, chosen at "
                "run time (its mask codec is imported at the top)"}


def late_imports(path):
    """[(line, module)] of the imports inside a function (at any depth) of one file."""
    found = []
    for fn in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    found.append((node.lineno, "." * node.level + (node.module or "")))
    return sorted(set(found))


def test_imports_at_the_top():
    """Imports of this repository's modules and of its ordinary dependencies at the top of the module,
    outside tests/: a late import of the project's own is listed in LATE_IMPORTS_OWN (at most 10,
    each with its reason; a listed one that is gone fails too), any other in LATE_IMPORTS."""
    own, late_own, bad = own_names(), {}, []
    for path in _whole_tree():
        for line, module in late_imports(path):
            top = module.split(".")[0]
            if top in own or module.startswith("."):
                late_own[(path, module)] = line
            elif top not in LATE_IMPORTS:
                bad.append(f"{path}:{line} imports {module} inside a function: import it at the top")
    bad += [f"{p}:{line} imports {m} inside a function: at the top, or listed with its reason"
            for (p, m), line in sorted(late_own.items()) if (p, m) not in LATE_IMPORTS_OWN]
    bad += [f"{p}: {m} is listed in LATE_IMPORTS_OWN but no longer imported late" for p, m in LATE_IMPORTS_OWN
            if (p, m) not in late_own]
    assert len(LATE_IMPORTS_OWN) <= 10 and not bad, "\n".join(bad)
