"""The description of an exported artifact (`<artifact>.json`, format "zoo-export/1") read as data:
parsed strictly (every field type-checked, unknown fields and formats refused with an error naming
the file), never evaluated. Torch-free, so a consumer of an ONNX artifact reads it without torch;
artifacts/spec.py writes it (write_spec, describe) and documents its fields."""
import json
import os
import re

from engine.errors import ArtifactError, ArtifactNotFound

SPEC_FORMAT = "zoo-export/1"  # the export description's format (written by exporters.Adapter.create)
SPEC_FILE = "spec.json"  # its name inside an int8 TorchScript archive
ARTIFACT_FORMATS = {"onnx": ".onnx", "torch_export": ".pt2", "torchscript": ".pt"}
INT8_METHODS = ("qat", "ptq")


def spec_path(artifact):
    return artifact + ".json"


# ---------------------------------------------------------------- field types

def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None  # NaN / None: no value


def _is_json(v, depth=0):
    if depth > 32:
        return False
    if v is None or isinstance(v, (str, bool, int)):
        return True
    if isinstance(v, float):
        return True
    if isinstance(v, list):
        return all(_is_json(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json(x, depth + 1) for k, x in v.items())
    return False


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _optional(check):
    return lambda v: v is None or check(v)


def _mapping(key_check, value_check):
    return lambda v: isinstance(v, dict) and all(key_check(k) and value_check(x) for k, x in v.items())


_str = lambda v: isinstance(v, str)  # noqa: E731
_json_object = _mapping(_str, _is_json)
_sha256 = lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None  # noqa: E731
# a file beside the artifact: a plain name in its folder, never a path
_file_name = lambda v: (isinstance(v, str) and v not in ("", ".", "..")  # noqa: E731
                        and not any(c in v for c in "/\\\0"))
_code_entry = lambda v: (isinstance(v, str) and v.startswith("code/") and ".." not in v.split("/")  # noqa: E731
                         and "\\" not in v and "\0" not in v)

# field -> (check, expected type in words)
FIELDS = {
    "format": (_str, "a string"),
    "adapter": (_str, "a string (an exporters adapter class)"),
    "task": (_str, "a string"),
    "model": (_str, "a string (the model's registered name)"),
    "imports": (_list_of(lambda m: isinstance(m, str) and all(p.isidentifier() for p in m.split("."))),
                "a list of module names (the config's imports)"),
    "inputs": (_list_of(_str), "a list of input names"),
    "outputs": (_list_of(_str), "a list of output names"),
    "classes": (_optional(_list_of(lambda c: isinstance(c, str) or _is_int(c))), "a list of class names"),
    "preprocessing": (_json_object, "a mapping of JSON values"),
    "postprocessing": (_json_object, "a mapping of JSON values"),
    "label_to_category_id": (_mapping(_str, _is_int), "a mapping of label (string) -> category id (integer)"),
    "artifact": (_str, "a file name"),
    "artifact_format": (lambda v: v in ARTIFACT_FORMATS, f"one of {', '.join(ARTIFACT_FORMATS)}"),
    "dynamic_batch": (lambda v: isinstance(v, bool), "true or false"),
    "opset": (_optional(_is_int), "an integer or null"),
    "torch": (_str, "a version string"),
    "method": (lambda v: v in INT8_METHODS, f"one of {', '.join(INT8_METHODS)}"),
    "backend": (_str, "a quantization backend name"),
    "calibration_batches": (_is_int, "an integer"),
    "calibration_transform": (_str, "a string"),
    "epoch": (_optional(_is_int), "an integer or null"),
    "input_shape": (_list_of(_is_int), "a list of integers"),
    "metrics": (_mapping(_str, _is_number), "a mapping of metric name -> number"),
    "check": (_json_object, "a mapping of JSON values"),
    "source": (_json_object, "a mapping of JSON values"),
    "export_seconds": (_is_number, "a number"),
    "config": (_json_object, "a mapping (the training config)"),
    # integrity (artifacts.safety.verify_digests): SHA-256 of what the writer wrote
    "artifact_sha256": (_sha256, "a SHA-256 (64 hexadecimal digits)"),
    "files_sha256": (_mapping(_file_name, _sha256), "a mapping of file name (beside the artifact) -> SHA-256"),
    "code_sha256": (_mapping(_code_entry, _sha256), "a mapping of TorchScript code entry (code/...) -> SHA-256"),
}
REQUIRED = ("format", "adapter", "task", "model", "inputs", "outputs", "preprocessing")


def parse_spec(spec, where):
    """The spec if every field is what it should be, else an ArtifactError naming `where` and the field."""
    if not isinstance(spec, dict):
        raise ArtifactError(f"{where}: an artifact description is a JSON object, got {type(spec).__name__}")
    if spec.get("format") != SPEC_FORMAT:
        raise ArtifactError(f"{where}: not an artifact description of this project (format "
                            f"{str(spec.get('format'))[:80]!r}, expected {SPEC_FORMAT!r})")
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise ArtifactError(f"{where}: unknown field(s) {', '.join(repr(k[:80]) for k in unknown[:5])} in a "
                            f"{SPEC_FORMAT} description (a task's settings go under preprocessing / postprocessing)")
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise ArtifactError(f"{where}: missing field(s) {', '.join(missing)} of a {SPEC_FORMAT} description")
    for key, value in spec.items():
        check, words = FIELDS[key]
        if not check(value):
            raise ArtifactError(f"{where}: field '{key}' must be {words}, got {_shown(value)}")
    return spec


def _shown(value):
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return f"{type(value).__name__} {repr(value)[:60]}"


def read_spec(path, artifact=None):
    """The parsed `<artifact>.json` at path."""
    if not os.path.isfile(path):
        beside = f" beside {artifact}" if artifact else ""
        raise ArtifactNotFound(f"{path}: the description written by export.py{beside} is missing "
                               f"(pre-processing, classes, inputs)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: cannot read the artifact description ({type(e).__name__}: {e})") from None
    return parse_spec(loads(text, path), path)


def loads(text, where):
    """JSON text as data: plain values only (no object hooks), NaN allowed in metrics."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{where}: not valid JSON ({e})") from None
