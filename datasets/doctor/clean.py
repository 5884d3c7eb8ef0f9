"""--write-clean DIR: a copy of the data set's annotations without what failed the checks, the
user's files untouched. For a COCO-style root, DIR mirrors it: the filtered annotation files are
written, everything else (image folders, PNG folders, other files) is a symbolic link to the
original. For an image or audio folder, DIR holds links to the good files only; for CSV text, the
good rows. DIR/excluded.txt lists each sample left out and why. Train on it with the printed --set."""
import csv
import json
import os
from collections import defaultdict

from engine.errors import DataError
from datasets.doctor.findings import ERROR


def _excluded(report, leaks, labels):
    """{(split, index): reason} of the samples to leave out."""
    out = {}
    for key, r in report["_results"].items():
        if r.get("bad"):
            out[key] = r["bad"]
    if leaks and report.get("leaks"):
        for pair in report["leaks"]["leak_pairs"] + report["leaks"]["duplicate_pairs"]:
            b = pair["b"]
            out.setdefault((b["split"], b["index"]), f"{pair['how']} of {pair['a']['file']}")
    return out


def _excluded_things(report, labels):
    """{annotation id or (split, index)} of the label errors to leave out."""
    if not labels or not report.get("labels"):
        return set()
    return {(x["split"], x["index"], x["record"]) for x in report["labels"].get("suspects", [])}


def check_target(target, data_folders):
    """Refuse a --write-clean folder that exists (a file, or a folder that is not empty) or lies inside
    one of `data_folders` (after symlinks are resolved): the user's data is never written to."""
    if os.path.islink(target):
        raise DataError(f"--write-clean {target}: the path is a symbolic link; choose a new folder")
    if os.path.lexists(target) and not os.path.isdir(target):
        raise DataError(f"--write-clean {target}: the path exists and is not a folder; choose a new folder")
    if os.path.isdir(target) and os.listdir(target):
        raise DataError(f"--write-clean {target}: the folder exists and is not empty; choose a new one")
    real = os.path.realpath(target)
    for folder in sorted({os.path.realpath(f) for f in data_folders if f}):
        if os.path.commonpath([real, folder]) == folder:
            raise DataError(f"--write-clean {target}: the folder lies inside the data ({folder}), whose files are "
                            "never modified; choose a folder outside it")


def data_folders(report):
    """The data root of the config and the folders of every sample checked (symlinked class folders,
    image folders elsewhere): --write-clean writes into none of them."""
    folders = {report.get("config", {}).get("root")}
    for s in report.get("_sources") or []:
        folders |= {os.path.dirname(s.path(i)) for i in range(len(s))}
        if hasattr(s.dataset, "ann_file"):
            folders.add(os.path.dirname(os.path.dirname(os.path.abspath(s.dataset.ann_file))))
    return folders


def _mirror(root, target, written):
    """target/ mirrors root/ with symbolic links, but for the files in `written` {relative path: text}.
    os.walk does not enter directory symlinks: each is linked as a whole."""
    os.makedirs(target, exist_ok=True)
    folders = {os.path.dirname(p) for p in written}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel
        keep_dirs = []
        for d in dirnames:
            sub = os.path.join(rel, d)
            if any(f == sub or f.startswith(sub + os.sep) for f in folders):
                os.makedirs(os.path.join(target, sub), exist_ok=True)
                keep_dirs.append(d)
            else:
                os.symlink(os.path.abspath(os.path.join(dirpath, d)), os.path.join(target, sub))
        dirnames[:] = keep_dirs
        for name in filenames:
            sub = os.path.join(rel, name)
            if sub not in written:
                os.symlink(os.path.abspath(os.path.join(dirpath, name)), os.path.join(target, sub))
    for sub, text in written.items():
        os.makedirs(os.path.dirname(os.path.join(target, sub)), exist_ok=True)
        with open(os.path.join(target, sub), "w") as f:
            f.write(text)


def write_clean(report, target, leaks=False, labels=False):
    """Write the clean copy; -> what to run with it (one line)."""
    sources = report.get("_sources") or []
    if not sources:
        raise DataError("--write-clean: the data set could not be read at all; nothing to write (see the report)")
    check_target(target, data_folders(report))
    excluded = _excluded(report, leaks, labels)
    bad_things = _excluded_things(report, labels)
    if sources[0].kind != "coco":  # a classification sample's label error: the sample (coco: the annotation)
        for split, index, record in bad_things:
            excluded.setdefault((split, index), f"likely label error ({record})")
    listing = [f"{k[0]}\t{report['_results'][k]['file'] or report['_results'][k]['record']}\t{why}"
               for k, why in sorted(excluded.items())]
    kind = sources[0].kind
    if not all(s.clean_copy for s in sources):  # VOC and YOLO label folders: no rewritten copy
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, "excluded.txt"), "w") as f:
            f.write("\n".join(listing) + "\n")
        return (f"no clean copy of label folders (VOC, YOLO): {os.path.join(target, 'excluded.txt')} lists the "
                f"{len(listing)} samples to leave out of the split lists or folders")
    if kind in ("coco", "panoptic", "semantic") and all(hasattr(s.dataset, "ann_file") for s in sources):
        root = os.path.dirname(os.path.dirname(os.path.abspath(sources[0].dataset.ann_file)))
        written = {}
        for s in sources:
            data, dropped = _filtered_json(s, excluded, bad_things)
            listing += [f"{s.split}\t{s.dataset.ann_file}\t{why}" for why in dropped]
            rel = os.path.relpath(os.path.abspath(s.dataset.ann_file), root)
            if rel.startswith(".."):
                raise DataError(f"--write-clean: {s.dataset.ann_file} is not under {root}; give the annotation "
                                f"files in the COCO layout (ROOT/annotations/)")
            written[rel] = json.dumps(data)
        written["excluded.txt"] = "\n".join(listing) + "\n"
        _mirror(root, target, written)
        return f"clean copy: {target} ({len(listing)} left out, see excluded.txt); train with --set data.root={target}"
    os.makedirs(target, exist_ok=True)
    if kind in ("imagefolder", "audio"):
        for s in sources:
            for i in range(len(s)):
                if (s.split, i) in excluded:
                    continue
                path = s.path(i)
                if kind == "imagefolder":  # ROOT/<split folder>/<class>/...: the dataset's root is the split folder
                    rel = os.path.join(os.path.basename(s.dataset.root), os.path.relpath(path, s.dataset.root))
                else:  # ROOT/<class>/...
                    rel = os.path.relpath(path, s.dataset.root)
                os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
                if not os.path.lexists(os.path.join(target, rel)):
                    os.symlink(os.path.abspath(path), os.path.join(target, rel))
    elif kind == "text":
        rows = defaultdict(list)
        for s in sources:
            for i in range(len(s)):
                if (s.split, i) not in excluded:
                    file = s.path(i) or f"{s.split}.csv"
                    rows[os.path.basename(file)].append((s.dataset.labels[i] + 1, s.dataset.texts[i]))
        for name, items in rows.items():
            with open(os.path.join(target, name), "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
                csv.writer(f, quoting=csv.QUOTE_ALL).writerows(items)
    else:
        raise DataError(f"--write-clean: no clean copy for {kind} data; excluded.txt lists what to leave out")
    with open(os.path.join(target, "excluded.txt"), "w") as f:
        f.write("\n".join(listing) + "\n")
    return f"clean copy: {target} ({len(listing)} left out, see excluded.txt); train with --set data.root={target}"


def _filtered_json(source, excluded, bad_things):
    """(the annotation file's dict as the loader kept it, without excluded samples and bad annotations,
    [reasons])."""
    ds, dropped = source.dataset, []
    if source.kind == "coco":
        data = dict(ds.coco.dataset)
        bad_images = {source.ids[i] for (split, i) in excluded if split == source.split}
        bad_anns = {int(f.split("annotation ")[1].split()[0]) for f in source.bad_annotations}
        bad_anns |= {int(r.split("annotation ")[1].split()[0]) for split, _, r in bad_things
                     if split == source.split and "annotation " in r}
        data["images"] = [im for im in data["images"] if im["id"] not in bad_images]
        kept = [a for a in data["annotations"] if a["image_id"] not in bad_images and a["id"] not in bad_anns]
        dropped += [f"annotation {a['id']}: failed a check" for a in data["annotations"]
                    if a["id"] in bad_anns and a["image_id"] not in bad_images]
        data["annotations"] = kept
        return data, dropped
    # panoptic and semantic from panoptic: the annotations list of the loader's dict
    data = dict(getattr(ds, "data", None) or {"images": list(ds.images.values()), "annotations": ds.annotations,
                                                "categories": ds.categories})
    bad_images = {ds.annotations[i]["image_id"] for (split, i) in excluded if split == source.split}
    data["images"] = [im for im in data["images"] if im["id"] not in bad_images]
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] not in bad_images]
    return data, dropped


__all__ = ["write_clean", "ERROR"]
