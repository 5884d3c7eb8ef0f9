"""What makes an ONNX artifact safe to open, without torch: no external data outside its folder, no
session options taken from the file (onnx_external_files, parsing the model without its data), and
its files against the SHA-256 its writer recorded in its description (verify_files). artifacts/safety.py
adds the checks of torch's own formats (.pt2, TorchScript); runtime/ and artifacts.load both use these."""
import hashlib
import json
import os

from engine.errors import ArtifactError, UnsafeArtifact
from engine.files import file_sha256
from engine.paths import inside

HINT = ("recorded in {where} when it was written: the file is corrupted or was replaced by another one. "
        "Export it again, or pass --trust-artifact if you know where it came from")


def refused(path, what, why, writer="export.py"):
    return UnsafeArtifact(f"{path}: refused: {what} {why} ({writer} never writes this; nothing of the file "
                          f"was run)")


def _tensors(graph, where="graph"):
    """(tensor proto, where) of every tensor of a graph: initializers, sparse initializers and node
    attributes, subgraphs included."""
    for t in graph.initializer:
        yield t, where
    for s in graph.sparse_initializer:
        yield s.values, where
        yield s.indices, where
    yield from _node_tensors(graph.node, where)


def _node_tensors(nodes, where):
    for node in nodes:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t, f"{where}, node {node.name or node.op_type}"
            for t in a.tensors:
                yield t, f"{where}, node {node.name or node.op_type}"
            if a.HasField("sparse_tensor"):
                yield a.sparse_tensor.values, where
                yield a.sparse_tensor.indices, where
            for s in a.sparse_tensors:
                yield s.values, where
                yield s.indices, where
            if a.HasField("g"):
                yield from _tensors(a.g, f"subgraph of node {node.name or node.op_type}")
            for g in a.graphs:
                yield from _tensors(g, f"subgraph of node {node.name or node.op_type}")


EXTERNAL_DATA_KEYS = ("location", "offset", "length", "checksum")


def onnx_external_files(path):
    """The external data files of an ONNX model (relative to its folder), each checked to be a file of
    the model's folder, named by one key of each; UnsafeArtifact naming the tensor otherwise. Parses the
    model without its data. Each tensor is checked on its own, so two of one name hide nothing."""
    import onnx
    from onnx import TensorProto
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # noqa: BLE001  (protobuf's DecodeError and friends)
        raise ArtifactError(f"{path}: not an ONNX model ({type(e).__name__}: {str(e)[:200]})") from None
    for prop in model.metadata_props:
        if prop.key == "ort_config":
            raise refused(path, "metadata 'ort_config'", "sets ONNX Runtime session options from the file (read "
                                                          "when ORT_LOAD_CONFIG_FROM_MODEL=1)")
    folder = os.path.dirname(os.path.abspath(path))
    files = []
    tensors = list(_tensors(model.graph))
    tensors += [t for f in model.functions for t in _node_tensors(f.node, f"function {f.name}")]
    for tensor, where in tensors:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        tensor_name = f"tensor '{tensor.name}' ({where})"
        keys = [e.key for e in tensor.external_data]
        for key in keys:
            if key not in EXTERNAL_DATA_KEYS:
                raise refused(path, tensor_name, f"has the external data key {key!r} (ONNX defines "
                                                 f"{', '.join(EXTERNAL_DATA_KEYS)})")
            if keys.count(key) > 1:
                raise refused(path, tensor_name, f"has the external data key {key!r} twice: ONNX readers differ in "
                                                 f"which they take (onnx the last), so the check and the reader "
                                                 f"could name other files")
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if not inside(folder, location):
            raise refused(path, f"tensor '{tensor.name}' ({where})",
                          f"keeps its data in {json.dumps(location)}, outside the artifact's folder {folder}: ONNX "
                          f"Runtime would read that file into the model")
        if not os.path.isfile(os.path.join(folder, location)):
            raise ArtifactError(f"{path}: {tensor_name} keeps its data in {json.dumps(location)}, which is not a file "
                                f"in the artifact's folder {folder}")
        if location not in files:
            files.append(location)
    return files


def sha256(data_or_path):
    if isinstance(data_or_path, bytes):
        return hashlib.sha256(data_or_path).hexdigest()
    return file_sha256(data_or_path)


def verify_files(path, spec, where):
    """Stop, naming the file, when the artifact or a file beside it differs from the SHA-256 recorded in
    its description `where` (artifact_sha256, files_sha256). Returns the names verified."""
    folder = os.path.dirname(os.path.abspath(path))
    hint = HINT.format(where=where)
    checked = []
    if "artifact_sha256" in spec:
        if sha256(path) != spec["artifact_sha256"]:
            raise ArtifactError(f"{path}: its SHA-256 is not the one {hint}")
        checked.append(os.path.basename(path))
    for name, digest in (spec.get("files_sha256") or {}).items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            raise ArtifactError(f"{file}: missing; {where} names it as a file of the artifact")
        if sha256(file) != digest:
            raise ArtifactError(f"{file}: its SHA-256 is not the one {hint}")
        checked.append(name)
    return checked
