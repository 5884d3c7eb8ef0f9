"""The data doctor (issue 22): every loader's integrity checks with a failing case each, the exit
code, leaks, statistics, --write-clean, on small copies of the data (the heavy measurements are
benchmarks/doctor_speed.py)."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import wave
from html import escape

import numpy as np
import pytest
from PIL import Image

from benchmarks.doctor_speed import inject_faults, plant_digit_leaks
from conftest import ROOT, shared_data
from datasets.base import Skipped
from datasets.shapes import ensure_shapes
from datasets.doctor.run import diagnose
from engine.build import build_data
from engine.config import config_from_data
from helpers import commands_in_one_process, image_folder

SMALL = dict(num_train=60, num_val=20, image_size=64)


def cfg_of(name, checks_cfg=None, **data):
    return config_from_data({"model": {"name": "mobilenet_v3_small"}, "data": {"name": name, "batch_size": 2, **data},
                             "optim": {"lr": 0.1}, "train": {"epochs": 1}, **({"doctor": checks_cfg} if checks_cfg else {})})


def errors(report, kind=None):
    return [f for f in report["findings"] if f["severity"] == "error" and (kind is None or f["kind"] == kind)]


@pytest.fixture(scope="module")
def shapes_small(tmp_path_factory):
    return ensure_shapes(str(tmp_path_factory.mktemp("shapes") / "clean"), **SMALL)


@pytest.fixture
def faulty(shapes_small, tmp_path):
    root = str(tmp_path / "faulty")
    shutil.copytree(shapes_small, root)
    return root, inject_faults(root, leaks=10)


def test_every_injected_fault_of_the_shapes_copy_is_found_and_named(faulty, tmp_path):
    root, truth = faulty
    report = diagnose(cfg_of("shapes", root=root, **SMALL), report_dir=str(tmp_path / "r"), workers=2,
                      checks=("integrity", "stats", "leaks"))
    found = errors(report)
    messages = "\n".join(f["message"] for f in found)
    for path in truth["truncated"]:
        assert any(f["kind"] == "unreadable_image" and f["file"] == path for f in found), path
    for kind, code in (("outside", "box_outside"), ("negative", "box_negative_size"),
                       ("unknown_category", "unknown_category")):
        for ann in truth[kind]:
            assert any(f["kind"] == code and f"annotation {ann} " in f["message"] for f in found), (kind, messages)
    # nothing else is an error: 3 images, 2 + 1 boxes, 1 category
    assert len(found) == 7, messages
    leaks = {(x["a"]["file"], x["b"]["file"]) for x in report["leaks"]["leak_pairs"]}
    assert {tuple(p) for p in truth["leaks"]} <= leaks  # the 10 copies, re-encoded and resized ones included
    assert len(leaks) <= 12  # precision >= 80%
    assert report["stats"]["train"]["samples"] == 60 and report["stats"]["val"]["samples"] == 30
    assert set(report["stats"]["train"]["object_sizes"]) == {"small", "medium", "large"}
    md = (tmp_path / "r" / "report.md").read_text()  # the written report names the count and each bad file
    assert "7 integrity errors" in md and all(path in md for path in truth["truncated"]), md[:3000]
    with Image.open(tmp_path / "r" / "plots" / "per_class.png") as plot:  # a real image, not an empty file
        assert plot.format == "PNG" and min(plot.size) > 50
    written = json.load(open(tmp_path / "r" / "report.json"))
    assert written["summary"]["integrity_errors"] == 7


@pytest.mark.slow
def test_the_doctors_html_shows_what_doctor_py_found(real_outputs):
    """report.html of a doctor.py run (tests/real_outputs.py: a shapes copy with injected faults) names
    every integrity finding and every leak of its report.json, and embeds each leak's pair and plot."""
    folder, faults = real_outputs.doctor_report()
    report = json.load(open(os.path.join(folder, "report.json")))
    page = open(os.path.join(folder, "report.html"), encoding="utf-8").read()
    findings = [f for f in report["findings"] if f["check"] == "integrity"]
    assert len(findings) >= 7 and {f["file"] for f in findings} >= set(faults["truncated"])
    for f in findings:
        assert escape(f["message"]) in page, f["message"]
    pairs = report["leaks"]["leak_pairs"]
    assert {tuple(p) for p in faults["leaks"]} <= {(x["a"]["file"], x["b"]["file"]) for x in pairs}
    for x in pairs:
        assert escape(f"{x['a']['file']} and {x['b']['file']}: {x['how']}") in page
    assert page.count('src="data:image/jpeg;base64,') == len(pairs) + len(report["plots"])
    assert f"<td>integrity errors</td><td>{report['summary']['integrity_errors']}</td>" in page


def test_panoptic_png_id_missing_from_the_json_and_a_truncated_png(faulty, tmp_path):
    root, truth = faulty
    png = os.path.join(root, "annotations", "panoptic_val2017", sorted(os.listdir(
        os.path.join(root, "annotations", "panoptic_val2017")))[0])
    data = open(png, "rb").read()
    open(png, "wb").write(data[: len(data) // 2])
    for name in ("shapes_panoptic", "shapes_semantic"):
        report = diagnose(cfg_of(name, root=root, **SMALL), report_dir=str(tmp_path / name), workers=1,
                          checks=("integrity",))
        found = errors(report)
        assert any(f["kind"] == "png_id_not_in_json" and truth["panoptic_missing"][0] in f["message"] for f in found)
        assert any(f["kind"] == "unreadable_png" and png in f["message"] for f in found), name
        assert any(f["kind"] == "unreadable_image" for f in found)  # the 3 truncated training images


def test_panoptic_segment_area_that_differs_from_its_pixels(shapes_small, tmp_path):
    root = str(tmp_path / "copy")
    shutil.copytree(shapes_small, root)
    path = os.path.join(root, "annotations", "panoptic_val2017.json")
    data = json.load(open(path))
    data["annotations"][0]["segments_info"][0]["area"] += 7
    json.dump(data, open(path, "w"))
    report = diagnose(cfg_of("shapes_panoptic", root=root, **SMALL), splits=("val",), report_dir=str(tmp_path / "r"),
                      workers=1, checks=("integrity",))
    assert [f["kind"] for f in errors(report)] == ["segment_area"]


@pytest.mark.slow
def test_exit_code_is_2_on_an_integrity_error_and_0_on_clean_data(faulty, shapes_small, tmp_path):
    import doctor
    root, _ = faulty
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"model": {"name": "ssdlite320_mobilenet_v3_large"}, "data": {
        "name": "shapes", "batch_size": 2, **SMALL}, "optim": {"lr": 0.1}, "train": {"epochs": 1}}))
    run = ["--config", str(cfg), "--checks", "integrity", "--workers", "1"]
    bad = subprocess.run([sys.executable, "doctor.py", *run, "--set", f"data.root={root}", "--report-dir",
                          str(tmp_path / "bad")], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "7 integrity errors" in bad.stdout
    assert doctor.main(run + ["--set", f"data.root={shapes_small}", "--report-dir", str(tmp_path / "good")]) == 0
    with pytest.raises(SystemExit) as wrong:
        doctor.main(run + ["--set", "data.nonsense=1"])
    assert str(wrong.value.code).startswith("error:") and "data.nonsense" in str(wrong.value.code)


def test_write_clean_gives_data_that_trains_without_a_skip(faulty, tmp_path):
    root, truth = faulty
    before = {p: os.path.getmtime(os.path.join(d, p)) for d, _, files in os.walk(root) for p in files}
    report = diagnose(cfg_of("shapes", root=root, **SMALL), report_dir=str(tmp_path / "r"), workers=1,
                      checks=("integrity", "leaks"))
    from datasets.doctor.clean import write_clean
    clean = str(tmp_path / "clean")
    write_clean(report, clean, leaks=True)
    after = {p: os.path.getmtime(os.path.join(d, p)) for d, _, files in os.walk(root) for p in files}
    assert before == after  # the user's files untouched
    excluded = open(os.path.join(clean, "excluded.txt")).read()
    assert all(os.path.basename(p) in excluded for p in truth["truncated"])
    data = build_data(cfg_of("shapes", root=clean, skip_bad_samples=True, **SMALL), None)
    for split in (data.train, data.val):
        assert not any(isinstance(split[i], Skipped) for i in range(len(split)))
    assert len(data.val) == 20  # the leaked copies left out of validation
    assert diagnose(cfg_of("shapes", root=clean, **SMALL), report_dir=str(tmp_path / "r2"), workers=1,
                    checks=("integrity",))["summary"]["integrity_errors"] == 0


@pytest.mark.slow
def test_imagefolder_truncated_image_and_a_leak(tmp_path):
    image_folder(tmp_path / "d", size=40)
    bad = tmp_path / "d" / "train" / "a" / "0.png"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    shutil.copyfile(tmp_path / "d" / "train" / "b" / "1.png", tmp_path / "d" / "val" / "b" / "copy.png")
    report = diagnose(cfg_of("imagefolder", root=str(tmp_path / "d")), report_dir=str(tmp_path / "r"), workers=1)
    assert [(f["kind"], f["file"]) for f in errors(report)] == [("unreadable_image", str(bad))]
    assert [(x["a"]["file"], x["b"]["file"]) for x in report["leaks"]["leak_pairs"]] == [
        (str(tmp_path / "d" / "train" / "b" / "1.png"), str(tmp_path / "d" / "val" / "b" / "copy.png"))]
    assert report["stats"]["val"]["samples_per_class"] == {"a": 6, "b": 7}


def write_wav(path, samples, rate=8000):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.asarray(samples) * 20000).astype("<i2").tobytes())


def test_audio_unreadable_non_finite_and_other_rate(tmp_path):
    import soundfile as sf
    rng = np.random.default_rng(0)
    for c in ("yes", "no"):
        os.makedirs(tmp_path / "a" / c)
        for k in range(5):
            write_wav(tmp_path / "a" / c / f"s{k}_{k}.wav", rng.uniform(-1, 1, 800))
    (tmp_path / "a" / "yes" / "s0_0.wav").write_bytes(b"not a wav at all")
    sf.write(tmp_path / "a" / "no" / "s1_1.wav", np.array([0.1, np.nan, 0.2] * 100, dtype=np.float32), 8000,
             subtype="FLOAT")
    write_wav(tmp_path / "a" / "no" / "s2_2.wav", rng.uniform(-1, 1, 1600), rate=16000)
    shutil.copyfile(tmp_path / "a" / "no" / "s3_3.wav", tmp_path / "a" / "no" / "s9_9.wav")
    report = diagnose(cfg_of("audio_folder", root=str(tmp_path / "a"), sample_rate=8000, val_fraction=0.4),
                      report_dir=str(tmp_path / "r"), workers=1)
    kinds = sorted((f["kind"], os.path.basename(f["file"])) for f in errors(report))
    assert kinds == [("non_finite_audio", "s1_1.wav"), ("unreadable_audio", "s0_0.wav")]
    assert any(f["kind"] == "sample_rate" and f["file"].endswith("s2_2.wav") for f in report["findings"])
    pairs = report["leaks"]["leak_pairs"] + report["leaks"]["duplicate_pairs"]
    assert [sorted(os.path.basename(x[k]["file"]) for k in "ab") for x in pairs] == [["s3_3.wav", "s9_9.wav"]]


def test_csv_bad_rows_unbalanced_quote_and_duplicates(tmp_path):
    os.makedirs(tmp_path / "t")
    rows = [f'"{1 + k % 2}","text number {k}"' for k in range(40)]
    rows[5] = '"7","a label out of range"'
    rows[8] = '"2","Same  text, again!"'
    rows[9] = '"1","same text again"'
    (tmp_path / "t" / "train.csv").write_text("\n".join(rows) + "\n")
    unquoted = [f'{1 + k % 2},val {k}' for k in range(30)]
    unquoted[3] = '1,"an open quote that never closes'
    (tmp_path / "t" / "test.csv").write_text("\n".join(unquoted) + "\n")
    report = diagnose(cfg_of("csv_text", root=str(tmp_path / "t"), classes=["a", "b"], vocab_size=100),
                      report_dir=str(tmp_path / "r"), workers=1)
    found = {f["kind"]: f for f in errors(report)}
    assert set(found) == {"unknown_label", "unbalanced_quote"}
    assert "train.csv" in found["unknown_label"]["file"] and "row 6" in found["unknown_label"]["message"]
    assert "line 4" in found["unbalanced_quote"]["message"]
    dupes = report["leaks"]["duplicate_pairs"]
    assert [(x["a"]["record"], x["b"]["record"]) for x in dupes] == [("row 9", "row 10")]


def test_voc_mask_value_outside_the_classes(tmp_path):
    from helpers import voc
    voc(tmp_path / "voc", bad_values={"b": 50})
    report = diagnose(cfg_of("voc_segmentation", root=str(tmp_path / "voc")), report_dir=str(tmp_path / "r"), workers=1,
                      checks=("integrity", "stats"))
    assert [(f["kind"], "[50]" in f["message"]) for f in errors(report)] == [("mask_value", True)]


def test_coco_size_mismatch_is_an_error_unless_allowed(tmp_path):
    src = shared_data("coco6")
    root = tmp_path / "coco"
    shutil.copytree(src, root)
    path = root / "annotations" / "instances_val2017.json"
    data = json.load(open(path))
    data["images"][0]["width"] += 10
    json.dump(data, open(path, "w"))
    cfg = dict(root=str(root), train_split="val")
    report = diagnose(cfg_of("coco_detection", **cfg), splits=("val",), report_dir=str(tmp_path / "r"), workers=1,
                      checks=("integrity",))
    assert {f["kind"] for f in errors(report)} == {"size_mismatch"}
    assert any(data["images"][0]["file_name"] in f["message"] for f in errors(report, "size_mismatch"))
    allowed = diagnose(cfg_of("coco_detection", allow_size_mismatch=True, **cfg), splits=("val",),
                       report_dir=str(tmp_path / "r2"), workers=1, checks=("integrity",))
    assert errors(allowed) == [] and any(f["kind"] == "size_mismatch" for f in allowed["findings"])


def test_real_data_sets_have_no_integrity_error(tmp_path):
    """Acceptance 2, small and fast: coco6 and coco_panoptic2 (digits, ag_news and fsdd in the benchmark).
    Both have a val split only: --splits val checks them as they are (issue 39, item 13: the builder
    wanted train2017 too)."""
    coco6, pan = shared_data("coco6"), shared_data("coco_panoptic2")
    r = diagnose(cfg_of("coco_detection", root=coco6), splits=("val",), report_dir=str(tmp_path / "a"), workers=1,
                 checks=("integrity", "stats"))
    assert errors(r) == [], errors(r)
    assert r["built_with"] == ["data.train_split=val"] and list(r["stats"]) == ["val"]
    assert "built with data.train_split=val" in r["headline"][1]
    r = diagnose(cfg_of("coco_panoptic", root=pan), splits=("val",), report_dir=str(tmp_path / "b"), workers=1,
                 checks=("integrity",))
    assert errors(r) == [], errors(r)
    # issue 39, item 14: coco6's 80 classes, 72 absent: the chart has the 8 present ones, most first, the height
    # they need; the per-class table (8 rows) comes after the plots, the absent classes folded into one line
    md = (tmp_path / "a" / "report.md").read_text()
    assert "| bottle | 14 |\n| person | 10 |" in md and "| bicycle | 0 |" not in md
    assert "72 classes with none in any split: bicycle, airplane" in md
    [chart] = [p for p in json.load(open(tmp_path / "a" / "report.json"))["plots"] if "per class" in p["title"]]
    with Image.open(tmp_path / "a" / chart["path"]) as im:
        assert im.height >= 8 * 20 and im.width <= 640, im.size  # 8 rows of >= 20 px, fits the page unscaled
    page = (tmp_path / "a" / "report.html").read_text(encoding="utf-8")
    assert page.index("data:image/") < page.index("instances per class, most first</h4>")


def test_label_errors_are_ranked_and_left_out_of_the_clean_copy(tmp_path):
    rng = np.random.default_rng(0)
    colours = {"red": (200, 30, 30), "blue": (30, 30, 200)}
    for split, n in (("train", 20), ("val", 6)):
        for name, colour in colours.items():
            os.makedirs(tmp_path / "d" / split / name)
            for k in range(n):
                pixels = np.clip(np.array(colour) + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / "d" / split / name / f"{name}{k}.png")
    wrong = tmp_path / "d" / "train" / "blue" / "red0.png"
    shutil.move(tmp_path / "d" / "train" / "red" / "red0.png", wrong)  # a red image labelled blue
    report = diagnose(cfg_of("imagefolder", root=str(tmp_path / "d")), report_dir=str(tmp_path / "r"), workers=1,
                      checks=("integrity", "labels"))
    suspects = report["labels"]["suspects"]
    assert suspects[0]["record"] == str(wrong) and (suspects[0]["given"], suspects[0]["suggested"]) == ("blue", "red")
    assert len(suspects) <= 2
    from datasets.doctor.clean import write_clean
    write_clean(report, str(tmp_path / "clean"), labels=True)
    assert not os.path.lexists(tmp_path / "clean" / "train" / "blue" / "red0.png")
    assert os.path.islink(tmp_path / "clean" / "train" / "blue" / "blue0.png")
    page = (tmp_path / "r" / "report.html").read_text(encoding="utf-8")  # the page shows the suspect first
    assert escape(str(wrong)) in page and "#1: given blue, likely red" in page


def doctor_config(tmp_path, root):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"model": {"name": "mobilenet_v3_small"}, "data": {
        "name": "imagefolder", "root": str(root), "batch_size": 2}, "optim": {"lr": 0.1}, "train": {"epochs": 1}}))
    return str(cfg)


@pytest.mark.slow
def test_write_clean_refuses_a_folder_inside_the_data_and_an_existing_path(tmp_path):
    """Issue 32, items 4 and 13: doctor.py run as on the command line; each refused with one error line naming the
    path (no traceback), nothing written."""
    image_folder(tmp_path / "d", per_class=2, size=40)
    os.symlink(tmp_path / "d", tmp_path / "alias")
    (tmp_path / "notes.txt").write_text("mine")
    os.makedirs(tmp_path / "full")
    (tmp_path / "full" / "x").write_text("mine")
    cfg = doctor_config(tmp_path, "d")
    targets = (("d/train/newfolder", "inside the data"), ("alias/val/new", "inside the data"),
               ("notes.txt", "exists and is not a folder"), ("full", "exists and is not empty"))
    runs = [("doctor.py", "--config", cfg, "--workers", "1", "--report-dir", "r", "--write-clean", target)
            for target, _ in targets]
    for (target, why), done in zip(targets, commands_in_one_process(runs, tmp_path)):
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].startswith(f"error: --write-clean {target}: ") and why in done.stderr
    assert sorted(os.listdir(tmp_path / "d" / "train")) == ["a", "b"] and not os.path.exists(tmp_path / "d" / "val" / "new")
    assert (tmp_path / "notes.txt").read_text() == "mine" and os.listdir(tmp_path / "full") == ["x"]


def test_write_clean_keeps_nested_files_and_refuses_the_folder_a_class_link_leads_to(tmp_path):
    from engine.errors import DataError
    from datasets.doctor.clean import write_clean
    image_folder(tmp_path / "d", per_class=2, size=40)
    os.makedirs(tmp_path / "d" / "train" / "a" / "sub")
    shutil.move(tmp_path / "d" / "train" / "a" / "0.png", tmp_path / "d" / "train" / "a" / "sub" / "0.png")
    shutil.move(tmp_path / "d" / "val" / "b", tmp_path / "disk2")
    os.symlink(tmp_path / "disk2", tmp_path / "d" / "val" / "b")  # a class folder kept elsewhere
    report = diagnose(cfg_of("imagefolder", root=str(tmp_path / "d")), report_dir=str(tmp_path / "r"), workers=1,
                      checks=("integrity",))
    with pytest.raises(DataError, match=f"--write-clean {tmp_path / 'disk2' / 'new'}: .*inside the data"):
        write_clean(report, str(tmp_path / "disk2" / "new"))
    assert os.listdir(tmp_path / "disk2") == ["0.png", "1.png"]
    write_clean(report, str(tmp_path / "clean"))
    assert os.path.islink(tmp_path / "clean" / "train" / "a" / "sub" / "0.png")
    assert os.path.islink(tmp_path / "clean" / "val" / "b" / "1.png")
    data = build_data(cfg_of("imagefolder", root=str(tmp_path / "clean")), None)
    assert (len(data.train), len(data.val)) == (4, 4)


@pytest.mark.slow
def test_a_missing_root_prints_the_path_and_the_expected_layout(tmp_path):
    """Issue 32, item 13: the error itself on the console, not only in report.md."""
    cfg = doctor_config(tmp_path, tmp_path / "nowhere")
    done = subprocess.run([sys.executable, "doctor.py", "--config", cfg, "--workers", "1", "--report-dir",
                           str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: imagefolder: data folder not found: {tmp_path / 'nowhere' / 'train'}" in done.stdout
    assert "expected layout:\n  ROOT/train/<class>/*.png|jpg\n  ROOT/val/<class>/*.png|jpg" in done.stdout


@pytest.fixture(scope="module")
def planted_digits(tmp_path_factory):
    """doctor.py (in process) on a copy of the real digits with 3 val images copied into train as they are
    and 3 resized (8 -> 16 bilinear, 8 -> 12 bicubic, 8 -> 16 nearest) and saved as PNG (issue 39)."""
    import doctor
    folder = tmp_path_factory.mktemp("planted")
    truth = plant_digit_leaks(shared_data("digits"), str(folder / "digits"))
    cfg = doctor_config(folder, folder / "digits")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = doctor.main(["--config", cfg, "--workers", "1", "--report-dir", str(folder / "r")])
    return truth, out.getvalue(), folder / "r", code


def test_resized_copies_of_small_images_are_leaks(planted_digits):
    """Issue 39, item 16 (acceptance): 8x8 images have no perceptual hash; before, only the 3 exact copies
    were found. At least 5 of the 6, at most 1 false leak (untouched digits: 0, docs/doctor.md)."""
    truth, _, folder, code = planted_digits
    report = json.load(open(folder / "report.json"))
    found = {(x["a"]["file"], x["b"]["file"]) for x in report["leaks"]["leak_pairs"]}
    planted = {tuple(p) for p in truth}
    assert len(found & planted) >= 5 and len(found - planted) <= 1, (found - planted, planted - found)
    resized = [x["how"] for x in report["leaks"]["leak_pairs"] if x["a"]["file"].endswith(("leak_3.png", "leak_4.png"))]
    assert all(h.startswith("near-duplicate small image (8x8 resized to") for h in resized), resized
    assert code == 0  # leaks are warnings, not integrity errors


def test_the_console_prints_the_first_findings_and_where_the_rest_is(planted_digits):
    """Issue 39, item 12: not only counts: the first leaks in full, how many more, and report.html."""
    truth, printed, folder, _ = planted_digits
    lines = printed.splitlines()
    assert lines[0] == "0 integrity errors; samples: train 1448, val 355; warnings: leak 6", printed
    assert "leaks and duplicates (6):" in lines
    first = [line for line in lines if line.startswith("  leak between train and val: ")]
    assert len(first) == 3 and all(any(a in line and b in line for a, b in truth) for line in first), printed
    assert "  ... 3 more in report.md and report.html" in lines
    assert lines[-1].startswith(f"report: {folder / 'report.html'}"), printed


def test_small_images_in_the_gallery_are_enlarged_pixel_for_pixel(planted_digits):
    """Issue 39, item 14: an 8x8 digit is shown as 96x96 whole pixels (nearest), not as an 8-px speck."""
    _, _, folder, _ = planted_digits
    report = json.load(open(folder / "report.json"))
    original = report["leaks"]["leak_pairs"][0]["b"]["file"]  # an 8x8 val image
    with Image.open(sorted((folder / "gallery").glob("leak_*"))[0]) as im:
        pair = np.asarray(im.convert("L"))
    assert pair.shape[0] >= 96, pair.shape
    right = pair[:96, -96:]  # the val image, x12: each 12x12 block one grey level, the original's
    with Image.open(original) as im:
        assert np.array_equal(right[::12, ::12], np.asarray(im.convert("L")))
    assert np.array_equal(right, np.kron(right[::12, ::12], np.ones((12, 12), dtype=right.dtype)))


def test_report_md_gives_statistics_as_tables(planted_digits):
    """Issue 39, item 15: Markdown tables, not pretty-printed JSON."""
    _, _, folder, _ = planted_digits
    md = (folder / "report.md").read_text()
    assert "```" not in md and '"samples"' not in md
    assert ("|  | train | val |\n|---|---|---|\n| samples | 1448 | 355 |\n"
            "| classes with a sample | 10 of 10 | 10 of 10 |") in md
    assert "| image width (px) | 8-16 (mean 8.01, median 8) | 8 (all) |" in md, md


def test_resize_of_the_small_image_check_is_pils(tmp_path):
    """leaks.resize (every image of a size at once) gives PIL's resize to rounding, for each filter."""
    from datasets.doctor.leaks import FILTERS, resize
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 8, 8), dtype=np.uint8)
    pil = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "lanczos": Image.LANCZOS,
           "box": Image.BOX, "hamming": Image.HAMMING}
    for size in ((12, 12), (16, 16), (28, 20), (5, 5)):
        for how in FILTERS:
            if how in pil:
                want = np.stack([np.asarray(Image.fromarray(a).resize(size, pil[how])) for a in images])
                assert np.abs(resize(images, size, how) - want).max() <= 2, (size, how)
    floor = resize(images, (12, 12), "nearest-floor")  # OpenCV's / torch's: index floor(i * 8 / 12)
    assert np.array_equal(floor[:, 1, 1:3], images[:, 0, [0, 1]])
