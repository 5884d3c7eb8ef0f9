"""Files written whole or not at all, a file's SHA-256, and nested dicts as dotted keys."""
import hashlib
import json
import os
import tempfile

from engine.errors import UserError


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


class NotWritten(UserError):
    """Files written together (write_together) that could not all be replaced: none was."""


def write_together(texts):
    """{path: str or bytes}: every file replaced, or none. Each is written to a temporary beside it
    first; a folder in the way, or a file that cannot be replaced (immutable, read-only folder), is a
    NotWritten naming the path, with every old file as it was."""
    paths = list(texts)
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            raise NotWritten(f"{path} is a folder, not a file that can be replaced: nothing written "
                             f"({', '.join(map(os.path.basename, paths))} are as they were)")
    temps, moved = {}, []  # moved: (path, backup or None) already replaced, undone on failure
    current = None
    try:
        for path in paths:
            current = path
            data = texts[path]
            binary = isinstance(data, bytes)
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            fd, temps[path] = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(path)[1])
            with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(temps[path], 0o666 & ~_umask())
        for path in paths:
            current, backup = path, None
            if os.path.lexists(path):  # kept aside (a hard link where it can be) until all are replaced
                backup = temps[path] + ".old"
                try:
                    os.link(path, backup, follow_symlinks=False)
                except OSError:
                    os.rename(path, backup)
            moved.append((path, backup))
            os.replace(temps.pop(path), path)
    except BaseException as e:
        for path, backup in reversed(moved):  # undone: the old files back in place
            if backup is not None:
                os.replace(backup, path)
            elif os.path.lexists(path):
                os.remove(path)
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.remove(tmp)
        if not isinstance(e, OSError):
            raise
        raise NotWritten(f"{current}: cannot be written or replaced ({e.strerror or e}): nothing written "
                         f"({', '.join(map(os.path.basename, paths))} are as they were)") from None
    for _, backup in moved:
        if backup is not None and os.path.lexists(backup):
            os.remove(backup)


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def flatten(d, prefix=""):
    """{"a": {"b": 1}, "c": {}} -> {"a.b": 1, "c": {}}: nested dicts as dotted keys (an empty dict is a value)."""
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
