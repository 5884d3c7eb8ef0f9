"""Paths that come from data, and the one file walker.

A name read from a file we did not write (a record's `file_name`, a category name, an image id, an
archive entry) is kept inside its folder: `inside` tells, `join_inside` joins or refuses. Every loader,
the doctor and predict's folders and globs list files with `walk_files`: directory symlinks are not
followed unless asked, and when they are, a loop is skipped and named and each file counts once."""
import fnmatch
import logging
import os

from engine.errors import UserError

log = logging.getLogger(__name__)


class OutsideFolder(UserError, ValueError):
    """A path built from a data set's or an artifact's record that would leave its folder."""


def inside(folder, name, resolve=True):
    """Whether `name` (relative, from a file we did not write) names a path within `folder`: never
    absolute or with '..'; with `resolve`, also after symlinks are resolved."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\0" in name \
            or ".." in name.split("/"):
        return False
    if not resolve:
        return True
    real = os.path.realpath(folder)
    return os.path.commonpath([real, os.path.realpath(os.path.join(real, name))]) == real


def join_inside(folder, name, where, resolve=True):
    """os.path.join(folder, name), or OutsideFolder naming `where` (the file and record the name came
    from) when the name is absolute or has '..', or (with `resolve`) leads out of `folder` through a
    symlink. Reading a data set's files passes resolve=False: a symlink in the folder is its owner's
    layout (DVC, git-annex, links to a shared copy), which no record can make; a write resolves."""
    if not inside(folder, name, resolve):
        raise OutsideFolder(f"{where}: {name!r} is not a relative file name inside {folder} "
                            f"(an absolute path{', a symlink leading out' if resolve else ''} or '..'): refused")
    return os.path.join(folder, name)


class Walk(list):
    """The files found (sorted paths), with what was left out: `not_followed` (directory symlinks
    not entered) and `loops` (directory symlinks that lead back to a folder already walked, or to one
    holding the root)."""
    not_followed: list
    loops: list


def walk_files(root, suffixes=None, follow_symlinks=False, pattern=None, max_depth=None):
    """Every regular file under `root` (itself included when it is a file), sorted. `suffixes`: keep
    names ending so (case-insensitive); `pattern`: keep paths that match this fnmatch pattern;
    `max_depth`: how many folder levels below `root` are entered (None: all).

    Directory symlinks are listed in `.not_followed` and not entered unless `follow_symlinks`. Then
    the real folders are walked first and the links after them, so a folder reached both ways keeps
    its real path (a link from one class folder into another does not move the other's files); a
    link to a folder already walked (a loop, or two links to one folder, by device and inode) or to
    one holding `root` is entered never and named in `.loops`; a file reached twice (hard links,
    links to one file) counts once. A file symlink is a file."""
    found = Walk()
    found.not_followed, found.loops = [], []
    suffixes = tuple(s.lower() for s in suffixes) if suffixes else None
    seen_dirs, seen_files = set(), set()
    root_real = os.path.realpath(root)

    def keep(path):
        name = os.path.basename(path)
        if suffixes and not name.lower().endswith(suffixes):
            return False
        return pattern is None or fnmatch.fnmatch(path, pattern)

    def claim(folder):  # False when the folder was walked already
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen_dirs:
            return False
        seen_dirs.add((st.st_dev, st.st_ino))
        return True

    def visit(folder, depth, links):
        """The files of `folder` and of the real folders under it; the directory symlinks met go to links."""
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            log.warning("%s: cannot list (%s); left out", folder, e.strerror or e)
            return
        for entry in entries:
            try:
                is_dir = entry.is_dir()
                link = entry.is_symlink()
            except OSError:
                continue
            if is_dir:
                if max_depth is not None and depth >= max_depth:
                    continue
                if link:
                    links.append((entry.path, depth + 1))
                elif claim(entry.path):
                    visit(entry.path, depth + 1, links)
                else:  # a bind mount of a folder already walked
                    found.loops.append(entry.path)
            elif entry.is_file() and keep(entry.path):
                try:
                    fst = os.stat(entry.path)
                except OSError:
                    continue
                if (fst.st_dev, fst.st_ino) not in seen_files:
                    seen_files.add((fst.st_dev, fst.st_ino))
                    found.append(entry.path)

    if os.path.isfile(root):
        if keep(root):
            found.append(root)
    elif os.path.isdir(root):
        claim(root)
        links = []
        visit(root, 0, links)
        while links:  # the links of the real tree, then those found inside their targets
            if not follow_symlinks:
                found.not_followed += [path for path, _ in links]
                break
            later = []
            for path, depth in links:
                real = os.path.realpath(path)
                if os.path.commonpath([real, root_real]) == real or not claim(path):  # holds root, or walked
                    found.loops.append(path)
                else:
                    visit(path, depth, later)
            links = later
    found.sort()
    if found.loops:
        log.warning("%s: %d directory symlink(s) lead back to a folder already walked or to one holding it (a "
                    "loop), skipped so that each file counts once: %s", root, len(found.loops), ", ".join(found.loops[:5]))
    if found.not_followed:
        log.warning("%s: %d directory symlink(s) not followed (set follow_symlinks to enter them; loops are "
                    "then skipped): %s", root, len(found.not_followed), ", ".join(found.not_followed[:5]))
    return found
