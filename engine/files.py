"""Files written whole or not at all, and nested dicts as dotted keys."""
import json
import os
import tempfile


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, write, binary=False):
    """Call write(f) on a temporary file in the same folder, fsync it, then os.replace it over `path`:
    never a half-written file. The file gets the permissions of any file the user writes (umask), not
    mkstemp's 0600. OSError propagates, with the temporary removed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path, obj, indent=1):
    atomic_write(path, lambda f: json.dump(obj, f, indent=indent))


def flatten(d, prefix=""):
    """{"a": {"b": 1}, "c": {}} -> {"a.b": 1, "c": {}}: nested dicts as dotted keys (an empty dict is a value)."""
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
