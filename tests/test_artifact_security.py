"""Issue 24, security half: opening an artifact never runs code from it, whatever its kind.

The malicious files are built for real, from this project's own exports: a .pt2 whose weight,
constant or sample inputs are pickles that would `touch` a marker file, a .pt2 whose graph maps a
file, a TorchScript archive whose code calls torch.save (at load time through __setstate__, and when
called), an ONNX model with external data at ../../etc/passwd. Each is first shown to do harm where
it can (a plain torch.export.load / torch.jit.load in a child process creates the marker), then
refused by artifacts.load, through the command lines too, with the marker never created and the
error naming the file and the entry. Then integrity (SHA-256 in the description, --trust-artifact),
the files that only look like data (average_checkpoints.py's inputs, a run's tokenizer), and the
grep that keeps torch.export.load / torch.jit.load / pickle.load inside artifacts/load.py."""
import ast
import io
import json
import os
import shutil
import sys
import zipfile

import numpy as np
import pytest
import torch

import export
from artifacts import ArtifactError
from artifacts.load import _open_torch_export, load_artifact, load_int8, load_program
from artifacts.safety import FILE_OPS, UnsafeArtifact, _denied_calls, check_artifact, denied_op
from artifacts.spec import parse_spec
from conftest import ROOT
from helpers import exported  # noqa: F401  (a fixture)
from helpers import child, commands_in_one_process, one_error_line
import hashlib


# ---------------------------------------------------------------- helpers

class Touch:
    """A pickle payload: unpickling it runs `touch marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def pickled(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rewrite(src, dst, edit, extra=()):
    """A copy of the zip archive src with edit(relative name, bytes) -> bytes applied, plus extra
    (relative name, bytes) entries."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        root = zin.infolist()[0].filename.split("/", 1)[0]
        for info in zin.infolist():
            zout.writestr(info, edit(info.filename[len(root) + 1:], zin.read(info)))
        for name, data in extra:
            zout.writestr(f"{root}/{name}", data)
    return str(dst)


def pickle_one_payload(src, dst, folder, payload):
    """(path, entry, config) of a copy of src with one entry of its data/<folder> config set to
    "use_pickle": true and its data replaced by `payload` (what torch.export.save writes for a tensor
    subclass). An export without a tensor constant (a classifier's) gets one such entry added."""
    config_name = f"data/{folder}/model_{folder}_config.json"
    with zipfile.ZipFile(src) as z:
        root = z.infolist()[0].filename.split("/", 1)[0]
        config = json.loads(z.read(f"{root}/{config_name}"))
    extra = []
    if config["config"]:
        fqn = next(iter(config["config"]))
        config["config"][fqn]["use_pickle"] = True
    else:
        fqn = "lifted_tensor_0"
        config["config"][fqn] = {"path_name": "tensor_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
        extra = [(f"data/{folder}/tensor_0", payload)]
    data_name = f"data/{folder}/{config['config'][fqn]['path_name']}"
    rewrite(src, dst, lambda name, data: (json.dumps(config).encode() if name == config_name
                                          else payload if name == data_name else data), extra)
    return str(dst), fqn, config_name


def images(n=2, seed=0):
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- .pt2: pickled weight, constant, sample inputs

def evil_pt2(exported, tmp_path, where):
    """(path, entry named in the error, marker) of a crafted copy of export.py's model.pt2."""
    marker = str(tmp_path / "MARKER")
    src, dst = exported["torch_export"], tmp_path / "evil_model.pt2"
    if where == "sample_inputs":
        rewrite(src, dst, lambda name, data: pickled(((Touch(marker),), {})) if name.startswith("data/sample_inputs/")
                else data)
        entry = "data/sample_inputs/model.pt"
    else:
        _, entry, _ = pickle_one_payload(src, dst, where, pickled(Touch(marker)))
    shutil.copyfile(src + ".json", str(dst) + ".json")  # its description too, as a user would receive it
    return str(dst), entry, marker


@pytest.mark.slow
@pytest.mark.parametrize("where", ["weights", "constants", "sample_inputs"])
def test_crafted_pt2_runs_code_under_plain_torch_and_is_refused_here(exported, tmp_path, where):
    """The crafted archive is real: a plain torch.export.load runs its payload (in a child process).
    artifacts.load refuses it, naming the file and the entry, and runs nothing."""
    path, entry, marker = evil_pt2(exported, tmp_path, where)
    plain = child("import sys, torch; torch.export.load(sys.argv[1])", path, cwd=tmp_path)
    assert os.path.exists(marker), f"the payload did not run under torch.export.load: {plain.stderr[-2000:]}"
    os.remove(marker)

    with pytest.raises(UnsafeArtifact) as e:
        load_artifact(path)
    assert str(e.value).startswith(f"{path}: refused: ") and entry in str(e.value)
    assert ("use_pickle" in str(e.value)) == (where != "sample_inputs")
    with pytest.raises(UnsafeArtifact, match=entry):  # the library's other doors
        load_program(path, "torch_export", {"inputs": ["images"]})
    with pytest.raises(UnsafeArtifact, match=entry):
        load_artifact(path, trust=True)  # --trust-artifact skips the SHA-256, never this
    assert not os.path.exists(marker)


@pytest.mark.slow
def test_torch_export_load_runs_under_forced_weights_only(exported, tmp_path):
    """The second line: TORCH_FORCE_WEIGHTS_ONLY_LOAD reaches torch 2.11's torch.export.load (its
    weights_only=False loads of pickled payloads, and the sample inputs' fallback): with the archive
    check bypassed, the crafted files still run nothing."""
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    for where in ("weights", "constants", "sample_inputs"):
        path, _, marker = evil_pt2(exported, tmp_path, where)
        with pytest.raises(ArtifactError, match="not a loadable torch.export program"):
            _open_torch_export(path)
        assert not os.path.exists(marker), where
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == before  # restored


@pytest.mark.slow
def test_the_issues_pt2_through_predict_evaluate_benchmark_and_export_runs_nothing(exported, tmp_path):
    """Acceptance 1: the crafted .pt2 given to each command: exit 1, one `error:` line naming the file
    and the entry, the marker never created."""
    from PIL import Image
    path, entry, marker = evil_pt2(exported, tmp_path, "weights")
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((40, 40, 3), 128, dtype=np.uint8)).save(photo)
    runs = [("predict.py", "--checkpoint", path, str(photo), "--output", str(tmp_path / "p")),
            ("predict.py", "--checkpoint", path, str(photo), "--trust-artifact"),
            ("evaluate.py", "--artifact", path),
            ("evaluate.py", "--checkpoint", path),
            ("benchmark.py", "--checkpoint", path),
            ("export.py", "--checkpoint", path, "--output", str(tmp_path / "e"))]
    for (script, *_), out in zip(runs, commands_in_one_process(runs, tmp_path)):
        line = one_error_line(out)
        assert path in line and entry in line and "refused" in line and "use_pickle" in line, (script, line)
    assert not os.path.exists(marker)  # by none of the commands


@pytest.mark.parametrize("entry, words", [
    ("data/aotinductor/model/model.so", "AOTInductor compiled code"),
    ("data/constants/custom_obj_0", "TorchScript custom object"),
    ("data/weights/model.pt", "older torch.export format"),
    ("notes/readme.txt", "not an entry torch.export.save writes")])
def test_pt2_entries_that_load_code_are_refused_by_name(exported, tmp_path, entry, words):
    path = rewrite(exported["torch_export"], tmp_path / "x.pt2", lambda name, data: data, extra=[(entry, b"\0")])
    with pytest.raises(UnsafeArtifact, match=words) as e:
        check_artifact(path, "torch_export")
    assert entry in str(e.value) and str(e.value).startswith(path)


@pytest.mark.slow
def test_pt2_graph_that_maps_a_file_is_refused(tmp_path):
    """No pickle needed: a .pt2 graph may call any registered operator. aten::from_file reads any file
    (with shared=True, writes it): shown in a child process, refused here by the operator's name."""
    class Full(torch.nn.Module):
        def forward(self, x):
            return (x + torch.ops.aten.full.default([4], 7, dtype=torch.uint8),)

    victim = tmp_path / "secret.txt"
    victim.write_text("TOPSECRET")
    torch.export.save(torch.export.export(Full(), (torch.zeros(4),)), str(tmp_path / "full.pt2"))

    def edit(name, data):
        if name != "models/model.json":
            return data
        graph = json.loads(data)
        node = graph["graph_module"]["graph"]["nodes"][0]
        assert node["target"] == "torch.ops.aten.full.default"
        node["target"] = "torch.ops.aten.from_file.default"
        node["inputs"] = [{"name": "filename", "arg": {"as_string": str(victim)}, "kind": 1},
                          {"name": "shared", "arg": {"as_bool": False}, "kind": 1},
                          {"name": "size", "arg": {"as_int": 4}, "kind": 1},
                          {"name": "dtype", "arg": {"as_scalar_type": 1}, "kind": 2}]
        return json.dumps(graph).encode()

    path = rewrite(tmp_path / "full.pt2", tmp_path / "evil.pt2", edit)
    plain = child("import sys, torch; print(bytes(torch.export.load(sys.argv[1]).module()(torch.zeros(4))[0]"
                  ".to(torch.uint8).tolist()))", path, cwd=tmp_path)
    assert "TOPS" in plain.stdout, plain.stderr[-2000:]  # the file's first 4 bytes came out as the output
    with pytest.raises(UnsafeArtifact, match=r"entry '.*models/model.json' calls aten::from_file") as e:
        load_program(path, "torch_export", {"inputs": ["x"]})
    assert str(e.value).startswith(path)


# ---------------------------------------------------------------- TorchScript

class SavesOnLoadAndCall(torch.nn.Module):
    """TorchScript whose __setstate__ (run by torch.jit.load) and forward call torch.save."""

    def __init__(self, on_load: str, on_call: str):
        super().__init__()
        self.w = torch.ones(1)
        self.on_load, self.on_call = on_load, on_call

    def forward(self, x):
        torch.save(x, self.on_call)
        return x * self.w

    @torch.jit.export
    def __getstate__(self):
        return (self.w, self.on_load, self.on_call, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[torch.Tensor, str, str, bool]):
        torch.save(state[0], state[1])
        self.w, self.on_load, self.on_call, self.training = state


@pytest.mark.slow
def test_torchscript_can_write_files_and_is_refused_by_its_code(exported, tmp_path):
    """Finding: a TorchScript archive's code can write any file (torch.save) at torch.jit.load
    (__setstate__) and when called, and read any file (torch.from_file); it reaches no process.
    The crafted archive carries the int8 artifact's own description, so only its code gives it away."""
    on_load, on_call = str(tmp_path / "LOADED"), str(tmp_path / "CALLED")
    files = {"spec.json": json.dumps(load_int8(exported["torchscript"])[1])}  # the real artifact's description
    path = str(tmp_path / "evil_int8.pt")
    torch.jit.save(torch.jit.script(SavesOnLoadAndCall(on_load, on_call)), path, _extra_files=files)
    plain = child("import sys, torch; m = torch.jit.load(sys.argv[1]); print('loaded'); m(torch.ones(1))", path,
                  cwd=tmp_path)
    assert "loaded" in plain.stdout and os.path.exists(on_load) and os.path.exists(on_call), plain.stderr[-2000:]
    os.remove(on_load)
    os.remove(on_call)

    for load in (lambda: load_artifact(path), lambda: load_int8(path), lambda: load_artifact(path, trust=True)):
        with pytest.raises(UnsafeArtifact) as e:
            load()
        assert str(e.value).startswith(f"{path}: refused: entry 'code/") and "calls torch.save" in str(e.value)
    assert not os.path.exists(on_load) and not os.path.exists(on_call)


def test_torchscript_code_scan_sees_through_spacing_comments_and_spelling():
    def calls(src):
        return [c for c, _ in _denied_calls("x.pt", "code/x.py", src.encode())]

    assert calls("def f(x):\n  return torch.add(x, 1)\n") == []
    assert calls("def f(x):\n  _0 = torch . save(x, 'a')\n") == ["torch.save"]
    assert calls("def f(x):\n  _0 = (torch.  # c\n     from_file)('p', True, 4)\n") == ["torch.from_file"]
    assert calls("def f(x):\n  _0 = ops.aten.save(x, '#')\n") == ["ops.aten.save"]
    assert calls("def f(x):\n  return torch.ops.c10d.allreduce_(x)\n") == ["torch.ops.c10d.allreduce_"]
    assert calls("def f(x):\n  s = 'torch.save(x)'\n  return x  # torch.save\n") == []  # strings, comments
    assert calls("def f(x):\n  return ops.quantized.conv2d(x, CONSTANTS.c0, 0.1, 3)\n") == []


def test_file_operators_of_torch_are_all_refused():
    """FILE_OPS is complete for this torch: every registered operator with a string argument naming a
    file or path is refused (a torch upgrade that adds one fails here)."""
    import torch._C as C
    reaching = set()
    for schema in C._jit_get_all_schemas():
        for a in schema.arguments:
            if "str" in str(a.type) and any(w in a.name.lower() for w in ("file", "path")):
                reaching.add(schema.name)
    assert reaching and all(denied_op(*name.split("::")) for name in reaching), reaching - set(FILE_OPS)


def test_int8_code_that_differs_from_the_recorded_sha256_stops_unless_trusted(exported, tmp_path):
    """The code entries' SHA-256, recorded inside the archive and beside it: a changed entry stops the
    load naming it (the qat recipe's model_int8.pt, opened by its inside description) or the file (with
    its description beside it); --trust-artifact opens it."""
    src = exported["torchscript"]
    spec = json.load(open(src + ".json"))
    assert spec["code_sha256"] and all(k.startswith("code/") for k in spec["code_sha256"])
    target = next(k for k in spec["code_sha256"] if k.endswith(".py"))
    path = rewrite(src, tmp_path / "model_int8.pt",
                   lambda name, data: data + b"\n# edited\n" if name == target else data)
    with pytest.raises(ArtifactError, match=f"code entry '{target}': its SHA-256 is not the one recorded") as e:
        load_artifact(path)  # no description beside it: the one inside
    assert str(e.value).startswith(path) and "--trust-artifact" in str(e.value)
    runner, _, _ = load_artifact(path, trust=True)
    expected = load_artifact(src).runner(images())[0]
    torch.testing.assert_close(runner(images())[0], expected)
    shutil.copyfile(src + ".json", path + ".json")
    with pytest.raises(ArtifactError, match=f"{path}: its SHA-256 is not the one recorded in {path}.json"):
        load_artifact(path)


# ---------------------------------------------------------------- ONNX

def test_onnx_external_data_outside_the_folder_is_refused_before_a_session(exported, tmp_path, monkeypatch):
    """An ONNX model whose first initializer keeps its data at ../../etc/passwd: refused naming the file
    and the tensor before ONNX Runtime sees it. (ONNX Runtime 1.32 refuses it too, on its own.)"""
    import onnx
    import onnxruntime
    from onnx import TensorProto
    folder = tmp_path / "a" / "b"
    folder.mkdir(parents=True)
    model = onnx.load(exported["onnx"])
    tensor = model.graph.initializer[0]
    nbytes = len(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../../etc/passwd"), ("offset", "0"), ("length", str(nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path = str(folder / "model.onnx")
    onnx.save(model, path)
    shutil.copyfile(exported["onnx"] + ".json", path + ".json")
    sessions = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: sessions.append(a))
    for load in (lambda: load_artifact(path), lambda: load_artifact(path, trust=True),
                 lambda: load_program(path, "onnx", {"inputs": ["images"]})):
        with pytest.raises(UnsafeArtifact) as e:
            load()
        assert str(e.value).startswith(f"{path}: refused: tensor '{tensor.name}'")
        assert '"../../etc/passwd"' in str(e.value)
    assert sessions == []


def test_onnx_external_data_inside_the_folder_still_opens(exported, tmp_path):
    import onnx
    model = onnx.load(exported["onnx"])
    path = str(tmp_path / "ext.onnx")
    onnx.save(model, path, save_as_external_data=True, location="ext.onnx.data")  # weights over 1 KiB
    runner = load_program(path, "onnx", {"inputs": ["images"]})
    torch.testing.assert_close(runner(images(1))[0], load_artifact(exported["onnx"]).runner(images(1))[0])


# ---------------------------------------------------------------- integrity

@pytest.mark.slow
def test_every_file_written_is_recorded_and_a_swap_stops_unless_trusted(exported, tmp_path):
    """export.py records the SHA-256 of each file it writes; a loader that finds another file stops and
    names it, unless --trust-artifact. (Corruption and accidental swaps: an attacker rewrites both.)"""
    import predict
    for fmt in ("torch_export", "onnx", "torchscript"):
        spec = json.load(open(exported[fmt] + ".json"))
        assert spec["artifact_sha256"] == export_sha(exported[fmt]), fmt
    folder = tmp_path / "swapped"
    shutil.copytree(exported["folder"], folder)
    path = str(folder / "model.pt2")
    other, _ = export.main(["--checkpoint", exported["checkpoint"], "--format", "torch_export", "--dynamic-batch",
                            "--output", str(tmp_path / "other"), "--check-samples", "2"])
    shutil.copyfile(other, path)  # another export of the same model, under the first one's description
    with pytest.raises(SystemExit) as e:
        predict.main(["--checkpoint", path, "--output", str(tmp_path / "p"), str(tmp_path / "none.png")])
    assert str(e.value.code).startswith(f"error: {path}: its SHA-256 is not the one recorded in {path}.json")
    assert "--trust-artifact" in str(e.value.code)
    loaded = load_artifact(path, trust=True)
    expected = load_artifact(exported["torch_export"]).runner(images(1))[0]
    torch.testing.assert_close(loaded.runner(images(1))[0], expected)
    # a file beside the artifact (a tokenizer, external data) is verified the same way
    spec = json.load(open(exported["onnx"] + ".json"))
    (folder / "notes.txt").write_text("as exported")
    spec["files_sha256"] = {"notes.txt": export_sha(str(folder / "notes.txt"))}
    json.dump(spec, open(folder / "model.onnx.json", "w"))
    load_artifact(str(folder / "model.onnx"))
    (folder / "notes.txt").write_text("changed")
    with pytest.raises(ArtifactError, match=f"{folder / 'notes.txt'}: its SHA-256 is not the one recorded"):
        load_artifact(str(folder / "model.onnx"))


def export_sha(path):
    """SHA-256 of the whole file by hashlib itself, not the project's engine.files.file_sha256."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_the_integrity_fields_are_parsed_strictly(exported):
    good = json.load(open(exported["onnx"] + ".json"))
    for change, words in [({"artifact_sha256": "abc"}, "field 'artifact_sha256' must be a SHA-256"),
                          ({"files_sha256": {"../x": "0" * 64}}, "field 'files_sha256'"),
                          ({"files_sha256": {"/etc/passwd": "0" * 64}}, "field 'files_sha256'"),
                          ({"code_sha256": {"code/../../x": "0" * 64}}, "field 'code_sha256'")]:
        with pytest.raises(ArtifactError, match=words):
            parse_spec(dict(good, **change), "x.json")


def test_files_named_by_a_description_stay_in_the_artifacts_folder(exported, tmp_path):
    """A description whose tokenizer (or any file of the adapter) points outside the folder is refused."""
    folder = tmp_path / "t"
    shutil.copytree(exported["folder"], folder)
    spec = json.load(open(folder / "model.onnx.json"))
    spec["adapter"], spec["task"] = "TextClassifier", "text_classification"
    spec["preprocessing"] = {"tokenizer": "../../etc/passwd", "max_length": 8, "pad_id": 0, "unk_token": "[UNK]",
                             "max_positions": 8}
    json.dump(spec, open(folder / "model.onnx.json", "w"))
    with pytest.raises(UnsafeArtifact, match="names the file '../../etc/passwd', outside the artifact's folder"):
        load_artifact(str(folder / "model.onnx"))


def test_a_descriptions_imports_never_name_a_program(exported, tmp_path):
    """exporters.adapter_from_spec imports a spec's `imports` only for an adapter not registered yet, and
    never a standard-library module or a __main__ (importing some runs a program); a saved config's
    imports follow the same rule (engine.config.import_family)."""
    from engine.config import ConfigError, config_from_data, load_config
    from exporters import adapter_from_spec
    spec = json.load(open(exported["onnx"] + ".json"))
    saved = load_config(os.path.join(ROOT, "configs", "demo.yaml")).model_dump(mode="json")
    for name in ("antigravity", "unittest.__main__", "idlelib.idle"):
        assert name not in sys.modules
        adapter_from_spec(dict(spec, imports=[name]), str(tmp_path))  # a known adapter: nothing imported
        with pytest.raises(ConfigError, match=f"description: imports: '{name}' is not a model family's module"):
            adapter_from_spec(dict(spec, adapter="SomeoneElses", imports=[name]), str(tmp_path))
        with pytest.raises(ConfigError, match=f"imports: '{name}' is not a model family's module"):
            config_from_data({**saved, "imports": [name]})
        assert name not in sys.modules


# ---------------------------------------------------------------- files that only look like data

def test_average_checkpoints_reads_its_inputs_as_data(exported, tmp_path):
    import average_checkpoints
    marker = tmp_path / "MARKER"
    good = exported["checkpoint"]
    (tmp_path / "text.pt").write_text("not a checkpoint")
    torch.save({"model": {"w": Touch(str(marker))}}, tmp_path / "evil.pt")
    torch.save({"model": {"w": 3}}, tmp_path / "values.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "state_dict.pt")
    for name, words in [("text.pt", r"not a checkpoint of train.py \(not a file of torch.save"),
                        ("evil.pt", r"refused: the file holds a pickled Python object \((posix|os)\.system\)"),
                        ("values.pt", r"model\.w is a int, not a tensor"),
                        ("state_dict.pt", "not a checkpoint of train.py"),
                        (exported["torch_export"], "an exported torch_export artifact, not a checkpoint")]:
        path = str(tmp_path / name) if not os.path.isabs(name) else name
        with pytest.raises(SystemExit, match=f"^error: {path}: {words}"):
            average_checkpoints.main([good, path, "--output", str(tmp_path / "avg.pt")])
    assert not marker.exists() and not (tmp_path / "avg.pt").exists()


def test_a_runs_tokenizer_file_that_is_not_one_is_a_data_error_naming_it(tmp_path):
    from engine.errors import DataError
    from datasets.text import run_tokenizer
    texts = ["the cat sat on the mat", "a dog ran in the park", "the sun is bright today"] * 4
    args = (texts, "wordpiece", 60, True, 1, str(tmp_path))
    good = run_tokenizer(*args)  # trained and saved in the run folder
    assert run_tokenizer(*args).get_vocab() == good.get_vocab()  # loaded back
    tokenizer = tmp_path / "tokenizer.json"
    for content in (b"{not json", b'{"version": "1.0"}', b"\x89PNG\r\n\x1a\n" + bytes(range(256))):
        tokenizer.write_bytes(content)
        with pytest.raises(DataError, match=f"^{tokenizer}: not a tokenizer file of the tokenizers library"):
            run_tokenizer(*args)
    (tmp_path / "tokenizer_meta.json").write_text("[1, 2")
    with pytest.raises(DataError, match=f"^{tmp_path / 'tokenizer_meta.json'}: not a readable JSON file"):
        run_tokenizer(*args)


# ---------------------------------------------------------------- acceptance 4: one module opens programs

LOADERS = {"torch.export.load", "torch.jit.load", "pickle.load", "pickle.loads", "pickle.Unpickler",
           "torch._C._pickle_load_obj", "torch.export.pt2_archive._package.load_pt2", "_pickle.load", "_pickle.loads"}


def loader_calls(source, filename="<text>"):
    """(line, dotted name) of calls of LOADERS in Python source, through import aliases too."""
    tree = ast.parse(source, filename)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(f):
        parts = []
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name):
            return None
        return ".".join([aliases.get(f.id, f.id), *reversed(parts)])

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name in LOADERS or (name or "").endswith(".load_pt2"):
                found.append((node.lineno, name))
    return found


def test_only_artifacts_load_opens_exported_programs_or_pickles():
    """torch.export.load, torch.jit.load and pickle.load(s) are called in artifacts/load.py only. The tests
    are not code paths (they hold the crafted attacks and a plain-PyTorch consumer, run in child
    processes), but tests/plugins (a family, imported like one) is."""
    assert loader_calls("import pickle as p\nfrom torch import jit\nimport torch\n"
                        "p.loads(b'')\njit.load('x')\ntorch.export.load('y')\n") == \
        [(4, "pickle.loads"), (5, "torch.jit.load"), (6, "torch.export.load")]  # the grep finds what it should
    offenders, allowed = [], os.path.join("artifacts", "load.py")
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "data", "__pycache__")]
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), ROOT)
            if name.endswith(".py") and (not rel.startswith("tests" + os.sep) or rel.startswith(
                    os.path.join("tests", "plugins") + os.sep)):
                path = os.path.join(folder, name)
                for line, call in loader_calls(open(path, encoding="utf-8").read(), path):
                    if rel != allowed:
                        offenders.append(f"{rel}:{line}: {call}")
    assert not offenders, offenders
    assert {c for _, c in loader_calls(open(os.path.join(ROOT, allowed)).read())} == {"torch.export.load",
                                                                                      "torch.jit.load"}
