"""Issue 32, item 1: an archive is read the way its loader reads it.

torch's zip reader (miniz) looks a name up ignoring ASCII case, compares the whole name (a NUL
included) and, of two entries of a name, returns the one its binary search over the sorted names
lands on; Python's zipfile cuts a name at a NUL and reads the last entry of a name. A crafted copy of
this project's own export with `models/model.json` (.pt2) or the model's `code/__torch__/...py` (int8
TorchScript) twice, the harmful copy not last, passed the old checks (they read the last, harmless
one) while torch ran the harmful one: shown here in a child process.
Every such archive is refused before any check or load, naming the file and the entry, through
predict.py, evaluate.py --artifact, benchmark.py and export.py, and nothing is written or read
outside the artifact.

ONNX has no zip entries; what a reader picks one of two from is a tensor's external_data keys
(ONNX Runtime 1.32 refuses a second `location`, onnx takes the last, the old check took the first).
So for ONNX a duplicate is a key given twice in one tensor's external_data; a key ONNX does not
define, and a location that is not a regular file inside the model's folder, are refused too. Two
tensors of one name hide nothing: each tensor's location is checked on its own.
"""
import json
import os
import re
import shutil
import warnings
import zipfile

import numpy as np
import pytest

from artifacts import ArtifactError
from artifacts.load import artifact_kind, load_artifact, read_checkpoint
from artifacts.safety import UnsafeArtifact, check_artifact
from engine.files import file_sha256
from helpers import exported  # noqa: F401  (a fixture)
from helpers import child, commands_in_one_process, one_error_line

SECRET = b"TOPSECRET-" * 64


# ---------------------------------------------------------------- crafted files

def model_code(path):
    """The entry of an int8 TorchScript archive that holds the model's code (forward)."""
    with zipfile.ZipFile(path) as z:
        return next(n for n in z.namelist() if "/code/__torch__/models/" in n and n.endswith(".py"))


def copy_zip(src, dst, edit):
    """A copy of the zip archive src whose entries are edit(name, bytes) -> [(name, bytes), ...]. Names
    are relative to the archive's root folder, but for one starting with '/' (written as it is) or '!'
    (written without the '!', outside the root); a name may come twice, and keeps a NUL."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile's "Duplicate name"
        root = zin.infolist()[0].filename.split("/", 1)[0]
        for info in zin.infolist():
            for name, data in edit(info.filename[len(root) + 1:], zin.read(info)):
                entry = zipfile.ZipInfo("x", info.date_time)
                entry.filename = name if name[0] == "/" else name[1:] if name[0] == "!" else f"{root}/{name}"
                zout.writestr(entry, data)  # filename set after ZipInfo() would cut it at a NUL: kept
    return str(dst)


def copies(target, evil, at, n=2):
    """An edit for copy_zip: the entry `target` n times, evil(bytes) at index `at`, the original elsewhere."""
    def edit(name, data):
        if name != target:
            return [(name, data)]
        return [(name, evil(data) if i == at else data) for i in range(n)]
    return edit


def from_file_graph(marker):
    """A .pt2 graph edit: a first node aten::from_file(marker, shared=True), which creates the file."""
    def evil(data):
        graph = json.loads(data)
        g = graph["graph_module"]["graph"]
        g["nodes"].insert(0, {"target": "torch.ops.aten.from_file.default", "metadata": {},
                              "inputs": [{"name": "filename", "arg": {"as_string": marker}, "kind": 1},
                                         {"name": "shared", "arg": {"as_bool": True}, "kind": 1},
                                         {"name": "size", "arg": {"as_int": 4}, "kind": 1},
                                         {"name": "dtype", "arg": {"as_scalar_type": 1}, "kind": 2}],
                              "outputs": [{"as_tensor": {"name": "evil_file"}}]})
        g["tensor_values"]["evil_file"] = dict(next(iter(g["tensor_values"].values())), dtype=1, requires_grad=False,
                                               sizes=[{"as_int": 4}], strides=[{"as_int": 1}])
        return json.dumps(graph).encode()
    return evil


def torch_save_code(marker):
    """A TorchScript code edit: the model's forward first calls torch.save(inputs, marker)."""
    def evil(data):
        text, signature = data.decode(), "inputs: Tensor) -> Tensor:\n"
        assert signature in text
        return text.replace(signature, f'{signature}    torch.save(inputs, "{marker}")\n', 1).encode()
    return evil


def shipped(path, src):
    """src's description beside path, with path's SHA-256: what an attacker ships (the digest catches a
    swapped file, not an attacker, who rewrites the description too)."""
    spec = json.load(open(src + ".json"))
    spec["artifact_sha256"] = file_sha256(path)
    json.dump(spec, open(path + ".json", "w"))
    return path


def onnx_with_external_data(src, folder, entries):
    """(path, tensor name) of export.py's ONNX model saved with its largest tensor's data in
    model.onnx.data beside it, that tensor's external_data then set to `entries` (key, value) with
    {data} standing for its own location, offset and length."""
    import onnx
    os.makedirs(folder, exist_ok=True)
    model = onnx.load(src)
    name = max(model.graph.initializer, key=lambda t: len(t.raw_data)).name
    path = os.path.join(folder, "model.onnx")
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data")
    model = onnx.load(path, load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    own = [(e.key, e.value) for e in tensor.external_data]
    del tensor.external_data[:]
    for key, value in [kv for e in entries for kv in (own if e == "{data}" else [e])]:
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    onnx.save(model, path)
    return path, name


@pytest.fixture(scope="module")
def crafted(exported, tmp_path_factory):
    """{(kind, 'first' | 'last'): (path, entry named in the error)} of copies of export.py's artifacts
    with a harmful duplicate entry first or last, each in its own folder; the marker file the harm
    creates and a secret file, both outside every artifact's folder."""
    root = tmp_path_factory.mktemp("dup")
    outside = root / "outside"
    outside.mkdir()
    marker, secret = str(outside / "MARKER"), outside / "secret.bin"
    secret.write_bytes(SECRET)
    files = {}
    for first in (True, False):
        where = "first" if first else "last"
        folder = root / f"pt2_{where}"
        folder.mkdir()
        path = copy_zip(exported["torch_export"], folder / "model.pt2",
                        copies("models/model.json", from_file_graph(marker), 0 if first else 1))
        files["pt2", where] = shipped(path, exported["torch_export"]), "model/models/model.json"
        folder = root / f"int8_{where}"
        folder.mkdir()
        code = model_code(exported["torchscript"])
        path = copy_zip(exported["torchscript"], folder / "model_int8.pt",
                        copies(code.split("/", 1)[1], torch_save_code(marker), 0 if first else 1))
        files["int8", where] = path, code  # its description inside, as the qat recipe's model_int8.pt
        location = ("location", str(secret))
        path, tensor = onnx_with_external_data(exported["onnx"], root / f"onnx_{where}",
                                               [location, "{data}"] if first else ["{data}", location])
        files["onnx", where] = shipped(path, exported["onnx"]), f"tensor '{tensor}'"
    return {"files": files, "marker": marker, "secret": str(secret), "root": str(root)}


def tree(folder):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs)


# ---------------------------------------------------------------- the hole is real

@pytest.mark.slow
def test_plain_torch_runs_a_copy_the_old_checks_never_read(exported, crafted, tmp_path):
    """The hole is real: torch's reader returns the copy its binary search over the sorted names lands
    on (for these files: the first of two TorchScript code entries; the second of two, or the middle of
    three, .pt2 graphs), zipfile always the last, which the old checks read. With the harmful copy
    anywhere but last, plain torch.export.load / torch.jit.load runs it for at least one arrangement,
    and the marker appears outside the artifact. So does a .pt2 whose harmless copy's name ends in a
    NUL (zipfile cuts the name, so the old checks read that copy; torch's reader sees another name)."""
    marker, evil = crafted["marker"], from_file_graph(crafted["marker"])
    pt2 = [copy_zip(exported["torch_export"], tmp_path / f"{at}of{n}.pt2", copies("models/model.json", evil, at, n))
           for at, n in ((0, 2), (0, 3), (1, 3))]
    nul = copy_zip(exported["torch_export"], tmp_path / "nul.pt2", lambda name, data: [(name, data)] if
                   name != "models/model.json" else [(name, evil(data)), (name + "\0", data)])
    code = ("import os, sys, torch\n"
            "marker, x = sys.argv[1], torch.rand(1, 3, 32, 32)\n"
            "for path in sys.argv[2:]:\n"
            "    (torch.jit.load(path) if path.endswith('.pt') else torch.export.load(path).module())(x)\n"
            "    print(os.path.basename(path), os.path.exists(marker))\n"
            "    os.path.exists(marker) and os.remove(marker)\n")
    plain = child(code, marker, *pt2, nul, crafted["files"]["int8", "first"][0], cwd=tmp_path)
    ran = dict(line.split() for line in plain.stdout.splitlines())
    assert len(ran) == 5, plain.stderr[-3000:]
    assert "True" in [ran[os.path.basename(p)] for p in pt2] and ran["nul.pt2"] == "True", ran
    assert ran["model_int8.pt"] == "True", ran
    for path in (*pt2, nul):
        with pytest.raises(UnsafeArtifact, match=r"entry 'model/models/model.json(\\x00)?' (appears twice|is not a "
                                                 r"plain relative name)"):
            check_artifact(path, "torch_export")


# ---------------------------------------------------------------- refused through every command

def run_refused(crafted, tmp_path, kind, where, scripts):
    from PIL import Image
    path, entry = crafted["files"][kind, where]
    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((40, 40, 3), 128, dtype=np.uint8)).save(photo)
    commands = {"predict.py": ["--checkpoint", path, str(photo), "--output", str(tmp_path / "p")],
                "evaluate.py": ["--artifact", path],
                "benchmark.py": ["--checkpoint", path],
                "export.py": ["--checkpoint", path, "--output", str(tmp_path / "e")]}
    before = tree(crafted["root"]), tree(tmp_path)
    for script, out in zip(scripts, commands_in_one_process([(s, *commands[s]) for s in scripts], tmp_path)):
        line = one_error_line(out)
        assert line.startswith(f"error: {path}: refused: ") and entry in line and "twice" in line, (script, line)
        assert SECRET[:10].decode() not in out.stdout + out.stderr, script
    assert not os.path.exists(crafted["marker"])  # by none of the commands
    assert (tree(crafted["root"]), tree(tmp_path)) == before  # nothing written anywhere


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pt2", "int8", "onnx"])
def test_a_harmful_first_duplicate_is_refused_by_every_command(crafted, tmp_path, kind):
    """Acceptance 2: the harmful copy first: predict, evaluate --artifact, benchmark and export each exit
    1 with one `error:` line naming the file and the entry; no file appears or changes anywhere (the
    marker outside), and the secret's bytes are in no output."""
    run_refused(crafted, tmp_path, kind, "first", ["predict.py", "evaluate.py", "benchmark.py", "export.py"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pt2", "int8", "onnx"])
def test_a_harmful_last_duplicate_is_refused_as_a_duplicate(crafted, tmp_path, kind):
    """Acceptance 2, the harmful copy last: the same four commands, and the library's doors behind them
    (load_artifact: evaluate --artifact, with and without trust; read_checkpoint: benchmark and export)."""
    run_refused(crafted, tmp_path, kind, "last", ["predict.py", "evaluate.py", "benchmark.py", "export.py"])
    path, entry = crafted["files"][kind, "last"]
    for door in (read_checkpoint, load_artifact, lambda p: load_artifact(p, trust=True)):
        with pytest.raises(UnsafeArtifact, match="twice") as e:
            door(path)
        assert str(e.value).startswith(f"{path}: refused: ") and entry in str(e.value)
    assert not os.path.exists(crafted["marker"])


# ---------------------------------------------------------------- names zipfile and torch read apart

@pytest.mark.parametrize("name, words", [
    ("UPPER", r"appears twice in the archive \(as '.*': torch's reader ignores case"),
    ("/archive/code/x.py", "is not a plain relative name"),
    ("code/../../x.py", "has '..', '.' or an empty part"),
    ("code\\__torch__\\x.py", "is not a plain relative name"),
    ("code/x.py\0", "is not a plain relative name"),
    ("!other/code/x.py", "lies outside the archive's folder 'archive/'"),
    ("notes.txt", "is not an entry torch.jit.save writes"),
])
def test_names_torch_and_zipfile_read_apart_are_refused(exported, tmp_path, name, words):
    """An int8 TorchScript archive with one more entry (a copy of the model's code, harmless here) under a
    name that torch's reader and zipfile resolve differently, or that no writer of the format writes."""
    target = model_code(exported["torchscript"]).split("/", 1)[1]
    extra = "code/" + target[5:].upper() if name == "UPPER" else name  # UPPER: the same name to torch's reader
    path = copy_zip(exported["torchscript"], tmp_path / "model_int8.pt",
                    lambda n, data: [(n, data), (extra, data)] if n == target else [(n, data)])
    with pytest.raises(UnsafeArtifact, match=words) as e:
        artifact_kind(path)
    assert str(e.value).startswith(f"{path}: refused: entry ")
    with pytest.raises(UnsafeArtifact, match=words):
        check_artifact(path, "torchscript")


def test_bytes_before_an_archive_are_refused(exported, tmp_path):
    """zipfile reads an archive with bytes before it at shifted offsets; torch's reader at the recorded
    ones, so the two could read two central directories."""
    for src, name in ((exported["torchscript"], "model_int8.pt"), (exported["torch_export"], "model.pt2")):
        path = tmp_path / name
        path.write_bytes(b"\0" * 64 + open(src, "rb").read())
        with pytest.raises(UnsafeArtifact, match="its central directory is not where its end record says"):
            check_artifact(str(path), "torchscript" if name.endswith(".pt") else "torch_export")


def test_a_checkpoint_with_two_entries_of_a_name_is_refused(exported, tmp_path):
    """A checkpoint of train.py with data.pkl twice: torch.load would read one of them, so refused by name
    too (no layout: torch.load(weights_only=True) runs no code whatever entries it holds)."""
    path = copy_zip(exported["checkpoint"], tmp_path / "last.pt", copies("data.pkl", lambda data: data, 0))
    with pytest.raises(UnsafeArtifact, match=r"^.*last.pt: refused: entry 'archive/data.pkl' appears twice") as e:
        read_checkpoint(path)
    assert "train.py never writes this" in str(e.value)
    assert read_checkpoint(exported["checkpoint"])["model"]  # the checkpoint itself still loads


# ---------------------------------------------------------------- ONNX external data

@pytest.mark.parametrize("entries, words", [
    (["{data}", ("offset", "0")], "has the external data key 'offset' twice"),
    (["{data}", ("location", "model.onnx.data")], "has the external data key 'location' twice"),
    (["{data}", ("basepath", "/etc")], "has the external data key 'basepath' \\(ONNX defines"),
])
def test_onnx_external_data_keys_are_each_given_once(exported, tmp_path, entries, words):
    path, tensor = onnx_with_external_data(exported["onnx"], tmp_path / "m", entries)
    with pytest.raises(UnsafeArtifact, match=words) as e:
        check_artifact(path, "onnx")
    assert str(e.value).startswith(f"{path}: refused: tensor '{tensor}'")


def test_onnx_external_data_must_be_a_file_of_the_folder(exported, tmp_path):
    """A location that is a folder or a FIFO of the artifact's folder (ONNX Runtime would block reading
    a FIFO) is no file of the artifact."""
    path, _ = onnx_with_external_data(exported["onnx"], tmp_path / "m", ["{data}"])
    check_artifact(path, "onnx")
    data = os.path.join(os.path.dirname(path), "model.onnx.data")
    os.remove(data)
    os.mkfifo(data)
    words = re.escape(f"{path}: tensor '") + r".*' \(graph\) keeps its data in \"model\.onnx\.data\", which is not"
    with pytest.raises(ArtifactError, match=words):
        check_artifact(path, "onnx")
    os.remove(data)
    os.mkdir(data)
    with pytest.raises(ArtifactError, match="which is not a file in the artifact's folder"):
        check_artifact(path, "onnx")
    shutil.rmtree(data)
