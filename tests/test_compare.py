"""evaluate.py --compare on reports that evaluate.py wrote (tests/real_outputs.py): every metric's
change, the TIDE error types that improved and worsened most, per-class changes sorted, Markdown + HTML;
figures in points (one decimal), changes signed, each report named by its checkpoint and epoch; refuses
other data sets and IoU types, warns about other config changes."""
import json
import os
import re
import shutil

import pytest

import evaluate
from evaluators.compare import CompareError, compare_reports
from helpers import edit_json
from real_outputs import quiet

pytestmark = pytest.mark.slow  # each task's reports come from a tiny training run (seconds)

SIGNED = re.compile(r"^(n/a|0\.0|[+-]\d+\.\d)$")  # a change as shown: signed, one decimal
POINTS = re.compile(r"^(n/a|\d+\.\d)$")


def load(path):
    with open(path) as f:
        return json.load(f)


def write(folder, report):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "report.json")
    with open(path, "w") as f:
        json.dump(report, f)
    return path


def copy(report, folder):
    """A copy of a real report.json (the fixture's are shared: edit the copy)."""
    os.makedirs(folder, exist_ok=True)
    return shutil.copy(report, os.path.join(folder, "report.json"))


def per_class_sections(folder):
    """{measure: {class: [A, B, change]}} of compare.json's per-class tables (the cells as shown)."""
    out = {}
    for s in load(os.path.join(folder, "compare.json"))["analysis"]:
        if s["title"].startswith("per-class change of "):
            measure = s["title"].removeprefix("per-class change of ").split(" (A -> ")[0]
            out[measure] = {row[0]: row[1:] for row in s["tables"][0]["rows"]}
    return out


def shown(value, scale=100):
    """A report's value as the comparison shows it: points, one decimal (fractions x 100)."""
    return "n/a" if value is None else f"{value * scale:.1f}"


def change(a, b, scale=100):
    """B - A as shown: the difference of the values on the page, signed."""
    if a is None or b is None:
        return "n/a"
    d = round(b * scale, 1) - round(a * scale, 1)
    return "0.0" if d == 0 else f"{d:+.1f}"


def expected(a, b, scale=100):
    """{class: [A, B, B - A]} as shown, of two {class: value} read from the reports themselves."""
    return {c: [shown(a[c], scale), shown(b.get(c), scale), change(a[c], b.get(c), scale)] for c in a}


def by_name(rows, key):
    return {r["name"]: r[key] for r in rows}


def section_titled(folder, title):
    return next(s for s in load(os.path.join(folder, "compare.json"))["analysis"] if s["title"] == title)


@pytest.mark.slow
def test_compare_of_two_real_detection_reports_shows_the_per_class_changes(real_outputs, tmp_path):
    """Issue 39 (8): the per-class section of two detection reports evaluate.py wrote, with their own
    per-category AP (report["per_category"]["bbox"]); it was missing when compare read another place."""
    a, b = real_outputs.reports("detection")
    out = tmp_path / "cmp"
    quiet(evaluate, ["--compare", a, b, "--report-dir", str(out)])
    ra, rb = load(a), load(b)
    sections = per_class_sections(out)
    assert sections.keys() >= {"bbox/AP", "bbox/AP50", "bbox/AP75"}, "no per-class section"
    figures = load(out / "compare.json")["figures"]["per_class"]
    for key in ("AP", "AP50"):  # COCO's per-category AP (report["per_category"]["bbox"])
        pa, pb = by_name(ra["per_category"]["bbox"], key), by_name(rb["per_category"]["bbox"], key)
        assert sections[f"bbox/{key}"] == expected(pa, pb)
        assert figures[f"bbox/{key}"] == {c: [pa[c], pb[c]] for c in pa}  # the numbers behind, unrounded
    assert set(sections["bbox/AP75"]) == {c for c in ra["dataset"]["classes"] if c != "__background__"}
    rows = {c: None if None in v else round(100 * v[1], 1) - round(100 * v[0], 1) for c, v in figures["bbox/AP50"].items()}
    assert list(sections["bbox/AP50"]) == sorted(rows, key=lambda c: (rows[c] is None, -(rows[c] or 0)))  # best first
    md = (out / "compare.md").read_text()
    assert "per-class change of bbox/AP50 (A -> B), sorted" in md
    assert "bbox: error analysis (TIDE): change of each error type's dAP" in md
    metrics = section_titled(out, "every metric")["tables"][0]["rows"]
    ap50 = [ra["metrics"]["bbox/AP50"], rb["metrics"]["bbox/AP50"]]
    assert ["bbox/AP50", shown(ap50[0]), shown(ap50[1]), change(*ap50)] in metrics
    # A was evaluated after one epoch, B after a resumed second: the configs differ in train.epochs only
    warnings = load(out / "compare.json")["warnings"]
    assert len(warnings) == 1 and "train.epochs (1 -> 2)" in warnings[0] and "output_dir" not in warnings[0]
    page = (out / "compare.html").read_text()
    assert "per-class change of bbox/AP50" in page and page.count("data:image/png;base64,") >= 2
    best = next(iter(sections["bbox/AP50"]))
    cell = r"<td[^>]*>{}</td>\s*"  # the row as shown, whatever the cells' attributes
    assert re.search((cell * 4).format(*map(re.escape, [best, *sections["bbox/AP50"][best]])), page)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classification", "segmentation", "panoptic"])
def test_compare_of_two_real_reports_of_each_other_task_shows_the_per_class_changes(real_outputs, tmp_path, task):
    a, b = real_outputs.reports(task)
    quiet(evaluate, ["--compare", a, b, "--report-dir", str(tmp_path)])
    ra, rb = load(a), load(b)
    if task == "classification":  # per cent already: shown as it is
        figures = {"top1": (lambda r: r["per_class_accuracy"], 1)}
    elif task == "segmentation":
        figures = {"IoU": (lambda r: r["per_class_iou"], 100)}
    else:  # the composite report: its detection part ("") and its panoptic part with the semantic branch
        figures = {"panoptic/PQ": (lambda r: {c["name"]: c["pq"] for c in r["parts"]["panoptic"]["panoptic"]["per_class"].values()}, 100),
                   "panoptic/semantic IoU": (lambda r: r["parts"]["panoptic"]["semantic"]["per_class_iou"], 100),
                   "bbox/AP": (lambda r: by_name(r["parts"][""]["per_category"]["bbox"], "AP"), 100),
                   "segm/AP50": (lambda r: by_name(r["parts"][""]["per_category"]["segm"], "AP50"), 100)}
    sections = per_class_sections(tmp_path)
    for measure, (read, scale) in figures.items():
        assert sections[measure] == expected(read(ra), read(rb), scale), measure


@pytest.mark.slow
def test_compare_names_each_report_by_its_checkpoint_and_epoch_and_signs_every_change(real_outputs, tmp_path):
    """Issue 39 (9): A and B named by the checkpoint and epoch their reports record, not only by the
    reports' paths; every change signed, every AP in points; the metrics and the TIDE dAPs drawn on
    charts of their own (AP50 beside the dAPs made most bars slivers)."""
    a, b = real_outputs.reports("detection")
    report, md = compare_reports([a, b], str(tmp_path))
    page = (tmp_path / "compare.html").read_text()
    for letter, path in zip("AB", (a, b)):
        ck = load(path)["checkpoint"]
        label = f"{ck['path']} (epoch {ck['epoch']}, step {ck['step']})"
        assert f"- {letter}: {label}" in md and f"<li>{letter}: {label}" in page
    assert "(epoch 1, " in report["compared"][0] and "(epoch 2, " in report["compared"][1]  # counted from 1
    for s in report["analysis"]:  # detection: every figure is an AP, AR or dAP
        for t in s.get("tables", []):
            for i, column in enumerate(t["columns"]):
                pattern = {"A": POINTS, "B": POINTS, "B - A": SIGNED}.get(column)
                assert pattern is None or all(pattern.match(row[i]) for row in t["rows"]), (s["title"], column)
    ap = [load(p)["metrics"]["bbox/AP"] for p in (a, b)]
    assert report["headline"][0] == (f"bbox/AP from A (epoch 1) to B (epoch 2): {shown(ap[0])} → {shown(ap[1])} "
                                     f"({change(*ap)} points)")
    plots = {p["title"]: p["labels"] for s in report["analysis"] for p in s.get("plots", [])}
    dap = {title: labels for title, labels in plots.items() if "dAP" in title}
    assert sorted(dap.values()) == [["FP", "FN"], ["cls", "loc", "both", "dupe", "bkg", "miss"]]
    assert "AP50" in plots["bbox metrics (points)"] and not any("dAP" in x for x in plots["bbox metrics (points)"])
    # the page right-aligns the figures, written as text ("+1.2", "n/a"), as it does numbers; words stay left
    cells = re.findall(r"<td( class=t)?>([^<]*)</td>", page)
    assert [text for left, text in cells if left and (POINTS.match(text) or SIGNED.match(text))] == []
    assert any(left and text in ("better", "worse", "same") for left, text in cells)


def tide_of(report):
    return next(s for s in report["analysis"] if s["title"] == "bbox: error analysis (TIDE)")["metrics"]


def tide_line(report):
    """The headline's sentence of the bbox TIDE errors."""
    return next(line for line in report["headline"] if line.startswith("bbox: error analysis (TIDE)"))


def set_tide(path, figures):
    """Edit a real report's TIDE figures (fractions, as evaluate.py writes them), by the writer's names."""
    def change_it(report):
        tide = tide_of(report)
        assert {f"bbox/tide/dAP_{k}" for k in figures} <= set(tide)
        tide.update({f"bbox/tide/dAP_{k}": v for k, v in figures.items()})
    edit_json(path, change_it)


def test_compare_headline_names_an_error_type_improved_only_if_its_dap_fell(real_outputs, tmp_path):
    """Issue 39 (10): a dAP is AP lost, so a larger one is worse. SSDlite against Faster R-CNN gave
    "dAP_bkg improved most" for 0 -> 0.0013 with nothing else moving; the improved one is named only
    if one fell, the worsened one only if one grew; FP / FN are groupings, not error types."""
    real = real_outputs.reports("detection")
    a, b = copy(real[0], tmp_path / "a"), copy(real[1], tmp_path / "b")
    same = tide_of(load(a))
    set_tide(b, {k.removeprefix("bbox/tide/dAP_"): v for k, v in same.items() if "/dAP_" in k})
    set_tide(a, {"bkg": 0.0})
    set_tide(b, {"bkg": 0.0013, "FP": 0.0})  # only bkg moved among the six, and it grew
    report, md = compare_reports([a, b], str(tmp_path / "out"))
    assert tide_line(report) == ("bbox: error analysis (TIDE), A → B: no error type improved; the one that "
                                 "worsened most is **bkg** (background), dAP50 0.0 → 0.1 (+0.1 points)")
    assert "no error type improved" in (tmp_path / "out" / "compare.html").read_text()
    set_tide(a, {"cls": 0.05, "loc": 0.12, "miss": 0.08, "bkg": 0.02, "FP": 0.2})
    set_tide(b, {"cls": 0.04, "loc": 0.05, "miss": 0.07, "bkg": 0.03, "FP": 0.01})
    report, _ = compare_reports([a, b], str(tmp_path / "out"))
    assert tide_line(report).endswith(
        "the error type that improved most is **loc** (localisation), dAP50 12.0 → 5.0 (-7.0 points); "
        "the one that worsened most is **bkg** (background), dAP50 2.0 → 3.0 (+1.0 points)")
    set_tide(b, {"cls": 0.05, "loc": 0.12, "miss": 0.08, "bkg": 0.0201})  # +0.01 points: no change shown
    report, _ = compare_reports([a, b], str(tmp_path / "out"))
    assert tide_line(report).endswith("A → B: no error type improved; none worsened")


def test_compare_refuses_other_data_and_other_iou_types(real_outputs, tmp_path):
    detection, _ = real_outputs.reports("detection")
    segmentation, _ = real_outputs.reports("segmentation")
    with pytest.raises(CompareError, match=r"different data sets \(classes: .*; name: shapes vs shapes_semantic; "
                                           r"num_samples: 4 vs 3; .*compare reports of the same data"):
        compare_reports([detection, segmentation], str(tmp_path / "out"))
    with_masks = load(detection)
    with_masks["iou_types"] = ["bbox", "segm"]  # the same data scored with masks too
    with pytest.raises(CompareError, match=r"IoU types \['bbox'\].*\['bbox', 'segm'\]"):
        compare_reports([detection, write(tmp_path / "c", with_masks)], str(tmp_path / "out"))
    with pytest.raises(CompareError, match="report not found"):
        compare_reports([detection, str(tmp_path / "missing.json")], str(tmp_path / "out"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CompareError, match="not valid JSON"):
        compare_reports([detection, str(tmp_path / "bad.json")], str(tmp_path / "out"))
    with pytest.raises(SystemExit, match="drop --checkpoint"):
        evaluate.main(["--compare", detection, detection, "--checkpoint", "x.pt"])


@pytest.mark.slow
def test_compare_of_an_exports_report_with_its_checkpoints_shows_no_change(real_outputs, tmp_path):
    """evaluate.py --artifact's report (export.py's torch.export of the checkpoint) against evaluate.py
    --checkpoint's: the same data, the same config, every per-class figure unchanged."""
    checkpoint = real_outputs.reports("classification")[1]
    artifact = real_outputs.artifact_report()
    report, _ = compare_reports([checkpoint, artifact], str(tmp_path))
    assert report["warnings"] == []
    accuracy = per_class_sections(tmp_path)["top1"]
    assert set(accuracy) == set(load(checkpoint)["per_class_accuracy"])
    assert all(change == "0.0" for _, _, change in accuracy.values())
    assert all(a == b for a, b in report["figures"]["per_class"]["top1"].values())
    metrics = next(s for s in report["analysis"] if s["title"] == "every metric")["tables"][0]["rows"]
    assert [row[3] for row in metrics if row[0] == "top1"] == ["0.0"]
