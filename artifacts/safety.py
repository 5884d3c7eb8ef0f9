"""What an exported artifact may hold, checked before anything of it is opened: opening or running
an artifact never runs code from the file and never reaches a file outside the artifact's folder.
artifacts.load calls these checks; they read zip entries, JSON and protobuf as data only.

  every zip archive     read as torch's reader reads it: each name is one entry (torch's reader looks
                        a name up ignoring ASCII case and returns the copy its search lands on,
                        zipfile the last), relative, without '..', backslashes, NUL or control
                        characters, in the archive's one folder and in the layout of its format,
                        and the central directory lies where the end record says (zipfile shifts
                        the offsets of an archive with bytes before it; torch's reader does not).
                        Checked before any entry is read, so the checks below and the loader see
                        the same bytes.
  .pt2 (torch.export)   every entry is one that torch.export.save writes for plain tensors: no pickled
                        weight or constant ("use_pickle": true), no TorchScript custom object, no
                        AOTInductor shared library, no legacy pickled state dict; the sample inputs
                        load with weights_only; the graph calls no operator that reaches files or
                        other processes (FILE_OPS, REMOTE_NAMESPACES).
  int8 TorchScript .pt  the code (the zip's code/ entries, compiled and run by torch.jit.load, even
                        at load time through __setstate__) calls no such operator either.
  .onnx                 no tensor keeps its data outside the artifact's folder (external data: a
                        regular file beside the model, each key of its external_data once, since
                        ONNX readers differ in which of two they take), and no ORT session options
                        are taken from the model ("ort_config" metadata).

Integrity (verify_digests) is another matter: the SHA-256 recorded by export.py in the description
catches a corrupted or swapped file, not an attacker, who rewrites the description too. These
checks hold whatever the description says, with or without --trust-artifact.
"""
import io
import json
import os
import re
import tokenize
import zipfile

import torch

from engine.errors import ArtifactError, UnsafeArtifact  # noqa: F401
from engine.paths import inside
from runtime.integrity import (EXTERNAL_DATA_KEYS, HINT, _node_tensors, _tensors, onnx_external_files,  # noqa: F401
                               refused, sha256, verify_files)

# Operators that reach the file system (torch 2.11's registry, scanned for string arguments naming a
# file: tests/test_artifact_security.py keeps this list complete), and namespaces that reach other
# processes or machines (collectives, RPC).
FILE_OPS = {
    "aten::save": "writes a file (torch.save)",
    "aten::from_file": "maps a file into a tensor (reads it; with shared=True, writes it)",
    "debugprims::load_tensor": "reads a tensor from a file store",
}
REMOTE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem",
                     "dist_c10d", "dist_rpc", "debugprims")
MAX_JSON_BYTES = 1 << 30  # an entry parsed as JSON here (configs, the graph): larger is refused, not read


def denied_op(namespace, name):
    """Why operator namespace::name may not run from an artifact, or None."""
    qualified = f"{namespace}::{name}"
    if qualified in FILE_OPS:
        return FILE_OPS[qualified]
    if namespace in REMOTE_NAMESPACES:
        return "reaches other processes or machines"
    return None


def check_artifact(path, kind):
    """UnsafeArtifact (naming the file and the entry, tensor or call) when the artifact of `kind`
    could run code or reach other files once opened; ArtifactError when it is not that kind of file."""
    if kind == "torch_export":
        check_pt2(path)
    elif kind == "torchscript":
        check_torchscript(path)
    elif kind == "onnx":
        onnx_external_files(path)


# ---------------------------------------------------------------- zip archives

ARCHIVES = {"torch_export": "a torch.export .pt2 archive", "torchscript": "a TorchScript archive",
            "checkpoint": "a checkpoint of torch.save"}


def _archive(path, kind):
    """(zip file, root folder, {entry relative to the root: ZipInfo}) of an archive of `kind`, its
    names checked (check_names) before anything reads an entry."""
    what = ARCHIVES[kind]
    try:
        archive = zipfile.ZipFile(path)
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ArtifactError(f"{path}: not {what} (not a zip archive: {e})") from None
    try:
        root = check_names(path, archive, kind)
    except BaseException:
        archive.close()
        raise
    return archive, root, {info.filename[len(root) + 1:]: info for info in infos}


def check_archive(path, kind):
    """check_names of the zip archive at path (kind: torch_export, torchscript or checkpoint)."""
    archive, _, _ = _archive(path, kind)
    archive.close()


def check_names(path, archive, kind):
    """The archive's root folder, once every entry is shown to be read alike by zipfile and torch's
    reader and to be one of the layout of its kind (none for a checkpoint: torch.load(weights_only=True)
    runs no code whatever it holds); UnsafeArtifact naming the entry otherwise. torch's reader
    (caffe2's PyTorchStreamReader, miniz) finds a name ignoring ASCII case and compares it whole, by a
    binary search that lands on one copy of a name (the first of two code entries of this project's
    int8 archive, the second of two graphs of its .pt2); zipfile cuts a name at a NUL and reads the
    last copy."""
    infos = archive.infolist()
    if not infos:
        raise ArtifactError(f"{path}: not {ARCHIVES[kind]} (an empty zip archive)")
    writer = "train.py" if kind == "checkpoint" else "export.py"
    end = zipfile._EndRecData(archive.fp)  # the end record as zipfile reads it (private, there since Python 2)
    if end is None or end[zipfile._ECD_OFFSET] != archive.start_dir:
        raise refused(path, "its central directory", "is not where its end record says (bytes before the "
                      "archive shift zipfile's offsets, not torch's reader's)", writer)
    root = infos[0].orig_filename.split("/", 1)[0]
    seen = {}
    for info in infos:
        name = info.orig_filename  # info.filename is cut at a NUL; torch's reader compares the whole name
        entry = f"entry {name!r}"
        if name.startswith("/") or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise refused(path, entry, "is not a plain relative name (an absolute name, a backslash, NUL or a "
                                       "control character)", writer)
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise refused(path, entry, "has '..', '.' or an empty part in its name", writer)
        if len(parts) < 2 or parts[0] != root:
            raise refused(path, entry, f"lies outside the archive's folder '{root}/'", writer)
        key = name.encode("utf-8" if info.flag_bits & 0x800 else "cp437").lower()  # what torch's reader compares
        if key in seen:
            other = "" if seen[key] == name else f" (as {seen[key]!r}: torch's reader ignores case)"
            raise refused(path, entry, f"appears twice in the archive{other}: torch's reader loads one copy of a "
                                       f"name and zipfile reads the last, so the checks could read other bytes than "
                                       f"the loader runs", writer)
        seen[key] = name
    for info in infos:
        why = LAYOUTS[kind](info.filename[len(root) + 1:])
        if why:
            raise refused(path, f"entry {info.filename!r}", why, writer)
    return root


def _read_json(archive, info, path):
    if info.file_size > MAX_JSON_BYTES:
        raise refused(path, f"entry '{info.filename}'", f"is {info.file_size} bytes of JSON")
    try:
        return json.loads(archive.read(info).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, zipfile.BadZipFile, OSError) as e:
        raise ArtifactError(f"{path}: entry '{info.filename}' is not valid JSON ({e})") from None


# ---------------------------------------------------------------- torch.export .pt2

PT2_ENTRIES = re.compile(r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
                         r"|models/\w+\.json|data/weights/\w+_weights_config\.json|data/weights/weight_\d+"
                         r"|data/constants/\w+_constants_config\.json|data/constants/tensor_\d+"
                         r"|data/sample_inputs/\w+\.pt|extra/[^/]+", re.ASCII)
PT2_REFUSED = [
    (re.compile(r"data/aotinductor/"), "is AOTInductor compiled code (a shared library torch.export.load loads "
                                       "into this process)"),
    (re.compile(r"data/constants/custom_obj_\d+"), "is a TorchScript custom object, unpickled when the archive "
                                                   "is opened"),
    (re.compile(r"data/(weights|constants)/\w+\.pt|serialized_\w+\.(pt|json)"),
     "is a pickled state dict of an older torch.export format, unpickled with the full pickle machinery"),
]


def _pt2_layout(name):
    """Why an entry (relative to the root) is not one torch.export.save writes for plain tensors, or None."""
    if PT2_ENTRIES.fullmatch(name):
        return None
    return next((why for pattern, why in PT2_REFUSED if pattern.match(name)),
                "is not an entry torch.export.save writes for an exported program of plain tensors")


def check_pt2(path):
    """A .pt2 of torch.export.save refused before torch.export.load when any entry could run code."""
    archive, root, entries = _archive(path, "torch_export")
    with archive:
        for name, info in entries.items():
            kind = re.fullmatch(r"data/(weights|constants)/\w+_(weights|constants)_config\.json", name)
            if kind:
                _check_payload_config(path, archive, info, kind.group(1), entries, root)
            elif re.fullmatch(r"data/sample_inputs/\w+\.pt", name):
                _check_sample_inputs(path, archive, info)
            elif re.fullmatch(r"models/\w+\.json", name):
                _check_graph(path, info.filename, _read_json(archive, info, path))


def _check_payload_config(path, archive, info, folder, entries, root):
    config = _read_json(archive, info, path)
    items = config.get("config") if isinstance(config, dict) else None
    if not isinstance(items, dict):
        raise ArtifactError(f"{path}: entry '{info.filename}' is not a torch.export payload config "
                            f"(no 'config' mapping)")
    prefix = "weight_" if folder == "weights" else "tensor_"
    for fqn, meta in items.items():
        if not isinstance(meta, dict):
            raise ArtifactError(f"{path}: entry '{fqn}' of '{info.filename}' is not a payload description")
        if meta.get("use_pickle") is not False:
            raise refused(path, f"entry '{fqn}' of '{info.filename}'",
                          f"is pickled (\"use_pickle\": {json.dumps(meta.get('use_pickle'))}, data in "
                          f"'{root}/data/{folder}/{meta.get('path_name')}'): torch.export.load would unpickle it "
                          f"with the full pickle machinery, which can run any code the file holds")
        name = meta.get("path_name")
        if not (isinstance(name, str) and re.fullmatch(prefix + r"\d+", name) and f"data/{folder}/{name}" in entries):
            raise ArtifactError(f"{path}: entry '{fqn}' of '{info.filename}' names no {prefix}N entry of the archive "
                                f"(path_name {json.dumps(name)})")


def _check_sample_inputs(path, archive, info):
    """torch.export.load unpickles the sample inputs with weights_only, then, when that fails,
    without: refused unless they load with weights_only."""
    try:
        torch.load(io.BytesIO(archive.read(info)), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (whatever weights_only refuses, or a corrupt entry)
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = (f"pickled Python objects ({found.group(1)})" if found
                else f"data weights_only cannot load ({type(e).__name__})")
        raise refused(path, f"entry '{info.filename}'",
                      f"holds {what}: torch.export.load retries a failed weights_only load with the full pickle "
                      f"machinery, which can run any code the file holds") from None


def _targets(node):
    """Every "target" string in a serialized graph (subgraphs included)."""
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("target"), str):
                yield x["target"]
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _check_graph(path, entry, graph):
    for target in _targets(graph):
        parts = target.split(".")
        if parts[:2] == ["torch", "ops"] and len(parts) >= 4:
            why = denied_op(parts[2], parts[3])
            if why:
                raise refused(path, f"entry '{entry}'", f"calls {parts[2]}::{parts[3]}, which {why}")


# ---------------------------------------------------------------- TorchScript

# What torch.jit.save writes (torch 2.11, and the records of earlier versions' archives).
TORCHSCRIPT_ENTRIES = re.compile(r"data\.pkl|constants\.pkl|version|\.data/version|\.data/serialization_id|byteorder"
                                 r"|\.format_version|\.storage_alignment|(data|constants)/\d+"
                                 r"|code/(\w+/)*\w+\.py(\.debug_pkl)?|extra/[^/]+", re.ASCII)
LAYOUTS = {
    "torch_export": _pt2_layout,
    "torchscript": lambda name: (None if TORCHSCRIPT_ENTRIES.fullmatch(name)
                                 else "is not an entry torch.jit.save writes"),
    "checkpoint": lambda name: None,
}


def code_entries(path):
    """{entry relative to the archive's root: bytes} of a TorchScript archive's code/ folder."""
    archive, _, entries = _archive(path, "torchscript")
    with archive:
        return {name: archive.read(info) for name, info in sorted(entries.items()) if name.startswith("code/")}


def extra_file(path, name):
    """The text of an extra file (torch.jit.save's _extra_files) of a TorchScript archive, or None."""
    archive, _, entries = _archive(path, "torchscript")
    with archive:
        info = entries.get(f"extra/{name}")
        return None if info is None else archive.read(info).decode("utf-8", "replace")


def check_torchscript(path):
    """A TorchScript archive refused before torch.jit.load when its code calls an operator that
    reaches files or other processes (torch.save, torch.from_file, ...): torch.jit.load compiles the
    code and runs the __setstate__ methods it defines; calling the model runs the rest."""
    for name, data in code_entries(path).items():
        if not name.endswith(".py"):
            continue  # .debug_pkl: source ranges, read by TorchScript's own restricted unpickler
        for call, why in _denied_calls(path, name, data):
            raise refused(path, f"entry 'code/{name[5:]}'", f"calls {call}, which {why}")


def _dotted_names(path, name, data):
    """The dotted names (a.b.c) of TorchScript source, with comments, strings, spacing and line
    breaks (inside brackets, or after a backslash) left out."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(data.decode("utf-8")).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError, UnicodeDecodeError) as e:
        raise refused(path, f"entry '{name}'", f"is not TorchScript source ({type(e).__name__})") from None
    skipped = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    chain, dot = [], False
    for tok in tokens:
        if tok.type in skipped:
            continue
        if tok.type == tokenize.NAME and dot:
            chain.append(tok.string)
            dot = False
        elif tok.type == tokenize.OP and tok.string == "." and chain and not dot:
            dot = True
        else:
            if chain:
                yield chain
            chain, dot = ([tok.string] if tok.type == tokenize.NAME else []), False
    if chain:
        yield chain


def _denied_calls(path, name, data):
    for chain in _dotted_names(path, name, data):
        if chain[0] == "__torch__":
            chain = chain[1:]
        if len(chain) >= 3 and chain[0] == "torch" and chain[1] == "classes":
            namespace, op = chain[2], chain[3] if len(chain) > 3 else ""
        elif len(chain) >= 4 and chain[:2] == ["torch", "ops"]:
            namespace, op = chain[2], chain[3]
        elif len(chain) >= 3 and chain[0] == "ops":
            namespace, op = chain[1], chain[2]
        elif len(chain) >= 2 and chain[0] == "torch":
            namespace, op = "aten", chain[1]  # torch.<name> in TorchScript is the builtin aten::<name>
        else:
            continue
        why = denied_op(namespace, op)
        if why:
            yield ".".join(chain), why


# ---------------------------------------------------------------- integrity (ONNX's checks: runtime/integrity.py)

def code_digests(path):
    """{code entry: SHA-256} of a TorchScript archive (what write_int8_artifact records)."""
    return {name: sha256(data) for name, data in code_entries(path).items()}


def verify_digests(path, spec, where, trust=False):
    """Stop, naming the file, when the artifact, the files beside it (runtime.integrity.verify_files)
    or, for TorchScript, its code differ from the SHA-256 recorded in its description `where`; trust
    (--trust-artifact): skip. Returns the names of what was verified."""
    if trust:
        return []
    checked = verify_files(path, spec, where)
    if "code_sha256" in spec:
        hint = HINT.format(where=where)
        found, recorded = code_digests(path), spec["code_sha256"]
        for name in sorted(set(found) | set(recorded)):
            if name not in found:
                raise ArtifactError(f"{path}: code entry '{name}' is missing; it is in the code {hint}")
            if name not in recorded:
                raise ArtifactError(f"{path}: code entry '{name}' is not in the code {hint}")
            if found[name] != recorded[name]:
                raise ArtifactError(f"{path}: code entry '{name}': its SHA-256 is not the one {hint}")
        checked.append("code/")
    return checked
