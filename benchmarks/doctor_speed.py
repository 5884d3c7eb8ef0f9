"""The data doctor's acceptance measurements (issue 22), run once and reported in docs/doctor.md:

    python -m benchmarks.doctor_speed [--out /tmp/doctor_bench] [--workers 2] [--skip-labels] [--only-digits-leaks]

1. shapes (1000 + 200 images, 192 px) copied, the issue's faults injected (inject_faults): every
   integrity fault found? leak recall and precision; label errors of the flipped instances.
2. digits with 5% of the labels flipped (flipped_digits): label-error recall and precision.
3. integrity + stats + leaks on the 1,200 shapes images: seconds and images/s per worker, on shapes,
   digits and coco6 (when ../shared/data is there).
4. digits with 3 exact and 3 resized val images put into train (plant_digit_leaks): leaks found, false
   leaks, and the false leaks of the untouched digits; then 42 resized copies (WIDE: 12 to 64 px, PIL's
   filters, PNG and JPEG) (--only-digits-leaks: this one alone).
The fault injector is also the test fixture of tests/test_doctor.py (on a small shapes set)."""
import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from PIL import Image

from datasets.shapes import ensure_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared", "data"))


def _load(path):
    with open(path) as f:
        return json.load(f)


def _dump(path, data):
    with open(path, "w") as f:
        json.dump(data, f)


def inject_faults(root, seed=0, leaks=20, flip_fraction=0.05):
    """The issue's faults in a shapes root (changed in place: give it a copy). -> what was injected:
    {"truncated": [files], "outside": [annotation ids], "negative": [id], "unknown_category": [id],
     "panoptic_missing": [png], "leaks": [(train file, val file)], "flipped": [annotation ids]}."""
    rng = np.random.default_rng(seed)
    ann_dir = os.path.join(root, "annotations")
    train_json, val_json = (os.path.join(ann_dir, f"instances_{s}2017.json") for s in ("train", "val"))
    pan_train = os.path.join(ann_dir, "panoptic_train2017.json")
    train, val, pan = _load(train_json), _load(val_json), _load(pan_train)
    images = train["images"]
    by_image = {}
    for a in train["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    order = [int(i) for i in rng.permutation(len(images))]
    out = {k: [] for k in ("truncated", "outside", "negative", "unknown_category", "panoptic_missing", "leaks",
                           "flipped")}
    used = set()

    def take(need_annotations=0):
        for k in order:
            if k not in used and len(by_image.get(images[k]["id"], [])) >= need_annotations:
                used.add(k)
                return images[k]
        raise ValueError("shapes set too small for the faults")

    # 3 truncated PNGs: the image saved as PNG (both JSONs name it), then cut in half
    pan_images = {im["id"]: im for im in pan["images"]}
    for _ in range(3):
        info = take()
        old = os.path.join(root, "train2017", info["file_name"])
        new_name = info["file_name"].rsplit(".", 1)[0] + ".png"
        Image.open(old).save(os.path.join(root, "train2017", new_name))
        os.remove(old)
        data = open(os.path.join(root, "train2017", new_name), "rb").read()
        with open(os.path.join(root, "train2017", new_name), "wb") as f:
            f.write(data[: len(data) // 2])
        info["file_name"] = pan_images[info["id"]]["file_name"] = new_name
        out["truncated"].append(os.path.join(root, "train2017", new_name))
    # 2 boxes outside their image (one partly, one wholly), 1 negative width, 1 unknown category
    info = take(1)
    a = by_image[info["id"]][0]
    a["bbox"][0] = info["width"] - a["bbox"][2] / 2 + 5
    out["outside"].append(a["id"])
    info = take(1)
    a = by_image[info["id"]][0]
    a["bbox"][0], a["bbox"][1] = info["width"] + 10, info["height"] + 10
    out["outside"].append(a["id"])
    info = take(1)
    a = by_image[info["id"]][0]
    a["bbox"][2] = -a["bbox"][2]
    out["negative"].append(a["id"])
    info = take(1)
    a = by_image[info["id"]][0]
    a["category_id"] = 99
    out["unknown_category"].append(a["id"])
    # 1 panoptic segment id missing from the JSON
    info = take()
    pan_ann = next(p for p in pan["annotations"] if p["image_id"] == info["id"])
    pan_ann["segments_info"] = pan_ann["segments_info"][:-1]
    out["panoptic_missing"].append(os.path.join(ann_dir, "panoptic_train2017", pan_ann["file_name"]))
    # 5% of the (other) instance labels flipped to another class
    cats = sorted(c["id"] for c in train["categories"])
    faulty = set(out["outside"] + out["negative"] + out["unknown_category"])
    candidates = [a for a in train["annotations"] if a["id"] not in faulty]
    for k in rng.choice(len(candidates), int(round(flip_fraction * len(candidates))), replace=False):
        a = candidates[int(k)]
        a["category_id"] = int(rng.choice([c for c in cats if c != a["category_id"]]))
        out["flipped"].append(a["id"])
    # 20 training images copied into val: half as they are, half re-encoded (JPEG q80) and resized by 10%
    next_image = max(im["id"] for im in val["images"]) + 1
    next_ann = max([a["id"] for a in val["annotations"] + train["annotations"]]) + 1
    for n in range(leaks):
        info = take(1)
        src = os.path.join(root, "train2017", info["file_name"])
        name = f"leak_{n:03d}.jpg"
        dst = os.path.join(root, "val2017", name)
        scale = 1.0
        if n % 2 == 0:
            shutil.copyfile(src, dst)
            width, height = info["width"], info["height"]
        else:
            scale = 0.9
            image = Image.open(src).convert("RGB")
            width, height = int(round(info["width"] * scale)), int(round(info["height"] * scale))
            buffer = io.BytesIO()
            image.resize((width, height), Image.BILINEAR).save(buffer, "JPEG", quality=80)
            open(dst, "wb").write(buffer.getvalue())
        val["images"].append({"id": next_image, "file_name": name, "width": width, "height": height, "license": 0})
        for a in by_image[info["id"]]:
            if a["id"] in faulty:
                continue
            val["annotations"].append({"id": next_ann, "image_id": next_image, "category_id": a["category_id"],
                                       "iscrowd": 0, "area": a["area"] * scale ** 2,
                                       "bbox": [v * scale for v in a["bbox"]], "segmentation": [
                                           [v * scale for v in a["segmentation"][0]]]})
            next_ann += 1
        next_image += 1
        out["leaks"].append((src, dst))
    _dump(train_json, train)
    _dump(val_json, val)
    _dump(pan_train, pan)
    return out


def flipped_digits(source, target, fraction=0.05, seed=0):
    """An ImageFolder copy (symbolic links) of digits with `fraction` of each split's files in another
    class folder. -> [the relinked files' new paths]."""
    rng = np.random.default_rng(seed)
    flipped = []
    for split in ("train", "val"):
        classes = sorted(os.listdir(os.path.join(source, split)))
        files = [(c, f) for c in classes for f in sorted(os.listdir(os.path.join(source, split, c)))]
        chosen = set(rng.choice(len(files), int(round(fraction * len(files))), replace=False).tolist())
        for c in classes:
            os.makedirs(os.path.join(target, split, c), exist_ok=True)
        for k, (c, f) in enumerate(files):
            label = c
            if k in chosen:
                label = str(rng.choice([x for x in classes if x != c]))
            dst = os.path.join(target, split, label, f)
            os.symlink(os.path.abspath(os.path.join(source, split, c, f)), dst)
            if k in chosen:
                flipped.append(dst)
    return flipped


SIZES = (12, 16, 24, 28, 32, 48, 64)
WIDE = ([(size, how) for size in SIZES for how in ("nearest", "bilinear", "bicubic", "lanczos")]
        + [(size, how, quality) for size in SIZES for how, quality in (("bilinear", 90), ("bicubic", 75))])


def plant_digit_leaks(source, target, exact=3, resized=((16, "bilinear"), (12, "bicubic"), (16, "nearest")), seed=0):
    """A copy of the digits ImageFolder (source) in target with val images put into train: `exact` of
    them copied as they are, one per entry of `resized` resized ((size px, PIL filter[, JPEG quality]))
    and saved as PNG (or JPEG), each into its own class folder. -> [(train copy, val original)]."""
    shutil.copytree(source, target)
    rng = np.random.default_rng(seed)
    files = sorted(os.path.join(c, f) for c in os.listdir(os.path.join(target, "val"))
                   for f in os.listdir(os.path.join(target, "val", c)))
    chosen = [files[int(k)] for k in rng.choice(len(files), exact + len(resized), replace=False)]
    out = []
    for k, rel in enumerate(chosen):
        original = os.path.join(target, "val", rel)
        copy = os.path.join(target, "train", os.path.dirname(rel), f"leak_{k}.png")
        if k < exact:
            shutil.copyfile(original, copy)
        else:
            size, how, *quality = resized[k - exact]
            if quality:
                copy = copy[:-4] + ".jpg"
            with Image.open(original) as im:
                small = im.resize((size, size), getattr(Image, how.upper()))
            small.save(copy, **({"quality": quality[0]} if quality else {}))
        out.append((copy, original))
    return out


def digits_leaks(out, workers=2):
    """4. Leaks of small images: the real digits with 3 exact and 3 resized val images in train
    (plant_digit_leaks), and the untouched digits (every leak there is a false one)."""
    digits = os.path.join(SHARED, "digits")
    if not os.path.isdir(digits):
        return {"skipped": f"{digits} not found"}
    truth = {tuple(p) for p in plant_digit_leaks(digits, os.path.join(out, "digits_planted"))}
    cfg = ["--config", "configs/mobilenet_v3_small_digits.yaml", "--workers", str(workers), "--checks", "leaks"]
    _, report, seconds = doctor(cfg + ["--set", f"data.root={out}/digits_planted"], os.path.join(out, "planted_r"))
    found = {(x["a"]["file"], x["b"]["file"]) for x in report["leaks"]["leak_pairs"]}
    _, clean, _ = doctor(cfg + ["--set", f"data.root={digits}"], os.path.join(out, "digits_r"))
    wide = {tuple(p) for p in plant_digit_leaks(digits, os.path.join(out, "digits_wide"), exact=0, resized=WIDE)}
    _, report_w, seconds_w = doctor(cfg + ["--set", f"data.root={out}/digits_wide"], os.path.join(out, "wide_r"))
    found_w = {(x["a"]["file"], x["b"]["file"]) for x in report_w["leaks"]["leak_pairs"]}
    return {"planted": len(truth), "found": len(found & truth), "false_leaks": len(found - truth),
            "duplicates": report["leaks"]["duplicates"], "seconds": round(seconds, 1),
            "untouched_leaks": clean["leaks"]["leaks"], "untouched_duplicates": clean["leaks"]["duplicates"],
            "wide": {"planted": len(wide), "found": len(found_w & wide), "false_leaks": len(found_w - wide),
                     "missed": sorted(os.path.basename(a) for a, _ in wide - found_w),
                     "duplicates": report_w["leaks"]["duplicates"], "seconds": round(seconds_w, 1)}}


def recall_precision(found, truth):
    found, truth = set(found), set(truth)
    hit = len(found & truth)
    return hit / max(len(truth), 1), hit / max(len(found), 1)


def doctor(args, out, *extra, env=None):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "doctor.py"), *args, "--report-dir", out, *extra],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 2):
        raise RuntimeError(proc.stderr[-3000:])
    return proc.returncode, _load(os.path.join(out, "report.json")), seconds


def load():
    return os.getloadavg()[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/doctor_bench")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--skip-labels", action="store_true")
    p.add_argument("--only-digits-leaks", action="store_true", help="only 4. (the small-image leaks on digits)")
    args = p.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    if args.only_digits_leaks:
        results = digits_leaks(args.out, args.workers)
        print(json.dumps(results, indent=1))
        return
    settings = dict(num_train=1000, num_val=200, image_size=192)
    clean_root = ensure_shapes(None, **settings)
    faulty = os.path.join(args.out, "shapes_faulty")
    shutil.copytree(clean_root, faulty)
    truth = inject_faults(faulty)
    results = {"load_before": load()}
    w = ["--workers", str(args.workers)]
    sets = ["--set", f"data.root={faulty}"]
    # 1. integrity, stats, leaks on the faulty shapes (timed: acceptance 4), detection config
    rc, report, seconds = doctor(["--config", "configs/shapes_demo.yaml", *sets, *w, "--checks",
                                  "integrity,stats,leaks"], os.path.join(args.out, "faulty_det"))
    results["faulty_det"] = {"exit": rc, "seconds_total": round(seconds, 1), "speed": report["speed"],
                             "by_kind": report["summary"]["by_kind"], "load": load()}
    leak_pairs = {(x["a"]["file"], x["b"]["file"]) for x in report["leaks"]["leak_pairs"]}
    truth_pairs = {tuple(p) for p in truth["leaks"]}
    results["leak_recall"], results["leak_precision"] = recall_precision(leak_pairs, truth_pairs)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    found_files = {f.get("file") for f in errors}
    results["truncated_found"] = sum(any(t in (f.get("message") or "") for f in errors) for t in truth["truncated"])
    text = "\n".join(f["message"] for f in errors)
    results["boxes_found"] = {k: [a for a in truth[k] if f"annotation {a} " in text]
                              for k in ("outside", "negative", "unknown_category")}
    del found_files
    # panoptic config on the same root: the missing segment id
    rc_p, report_p, seconds_p = doctor(["--config", "configs/shapes_panoptic.yaml", "--set", f"data.root={faulty}",
                                        "data.image_size=192", *w, "--checks", "integrity"],
                                       os.path.join(args.out, "faulty_pan"))
    results["faulty_pan"] = {"exit": rc_p, "by_kind": report_p["summary"]["by_kind"],
                             "panoptic_missing_found": any(truth["panoptic_missing"][0] in f["message"]
                                                           for f in report_p["findings"])}
    # write-clean, then every sample of the clean copy through the training builder: no skip
    clean = os.path.join(args.out, "shapes_clean")
    subprocess.run([sys.executable, "doctor.py", "--config", "configs/shapes_demo.yaml", *sets, *w, "--checks",
                    "integrity", "--report-dir", os.path.join(args.out, "faulty_det2"), "--write-clean", clean],
                   cwd=ROOT, check=False, capture_output=True)
    rc_c, report_c, _ = doctor(["--config", "configs/shapes_demo.yaml", "--set", f"data.root={clean}", *w,
                                "--checks", "integrity"], os.path.join(args.out, "clean_det"))
    results["clean"] = {"exit": rc_c, "integrity_errors": report_c["summary"]["integrity_errors"]}
    train = subprocess.run([sys.executable, "train.py", "--config", "configs/shapes_demo.yaml", "--set",
                            f"data.root={clean}", "data.skip_bad_samples=true", "train.epochs=1",
                            "train.max_steps_per_epoch=3", "data.workers=0", f"output_dir={args.out}/run_clean"],
                           cwd=ROOT, capture_output=True, text=True)
    output = train.stdout + train.stderr
    results["clean_train"] = {"exit": train.returncode, "skip_lines": [l for l in output.splitlines() if "skip" in l][:5]}
    # the same integrity + stats + leaks on the clean shapes (speed on unmodified data)
    rc_s, report_s, seconds_s = doctor(["--config", "configs/shapes_demo.yaml", *w], os.path.join(args.out, "shapes"))
    results["shapes_speed"] = {"seconds_total": round(seconds_s, 1), "speed": report_s["speed"], "load": load()}
    # labels: shapes instances (flipped 5%) and digits (flipped 5%)
    if not args.skip_labels:
        rc, report, seconds = doctor(["--config", "configs/shapes_demo.yaml", *sets, *w, "--checks", "labels",
                                      "--labels-anyway"], os.path.join(args.out, "faulty_labels"))
        found = [int(s["record"].split("annotation ")[1].split()[0]) for s in report["labels"].get("suspects", [])]
        recall, precision = recall_precision(found, truth["flipped"])
        results["shapes_labels"] = {"recall": recall, "precision": precision, "flipped": len(truth["flipped"]),
                                    "suspects": len(found), "seconds": round(seconds, 1),
                                    **{k: v for k, v in report["labels"].items() if k != "suspects"}}
    digits = os.path.join(SHARED, "digits")
    if os.path.isdir(digits):
        rc, report, seconds = doctor(["--config", "configs/mobilenet_v3_small_digits.yaml", "--set",
                                      f"data.root={digits}", *w], os.path.join(args.out, "digits"))
        results["digits_speed"] = {"seconds_total": round(seconds, 1), "speed": report["speed"], "load": load()}
        if not args.skip_labels:
            flipped = flipped_digits(digits, os.path.join(args.out, "digits_flipped"))
            rc, report, seconds = doctor(["--config", "configs/mobilenet_v3_small_digits.yaml", "--set",
                                          f"data.root={args.out}/digits_flipped", *w, "--checks", "labels",
                                          "--labels-anyway"], os.path.join(args.out, "digits_labels"))
            found = [s["record"].split(",")[0] for s in report["labels"].get("suspects", [])]
            recall, precision = recall_precision(found, flipped)
            results["digits_labels"] = {"recall": recall, "precision": precision, "flipped": len(flipped),
                                        "suspects": len(found), "seconds": round(seconds, 1),
                                        **{k: v for k, v in report["labels"].items() if k != "suspects"}}
    results["digits_leaks"] = digits_leaks(args.out, args.workers)
    coco6 = os.path.join(SHARED, "coco6")
    if os.path.isdir(coco6):
        rc, report, seconds = doctor(["--config", "configs/ssdlite320.yaml", "--set", f"data.root={coco6}",
                                      "data.train_split=val", "--splits", "val", *w], os.path.join(args.out, "coco6"))
        results["coco6_speed"] = {"seconds_total": round(seconds, 1), "speed": report["speed"], "load": load()}
    print(json.dumps(results, indent=1))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
