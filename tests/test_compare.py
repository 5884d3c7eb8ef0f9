"""evaluate.py --compare on reports that evaluate.py wrote (tests/real_outputs.py): every metric's
change, the TIDE error type that moved most, per-class changes sorted, Markdown + HTML; refuses other
data sets and IoU types, warns about other config changes."""
import json
import os

import pytest

import evaluate
from evaluators.compare import CompareError, compare_reports
from real_outputs import quiet

pytestmark = pytest.mark.slow  # each task's reports come from a tiny training run (seconds)


def load(path):
    with open(path) as f:
        return json.load(f)


def write(folder, report):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "report.json")
    with open(path, "w") as f:
        json.dump(report, f)
    return path


def per_class_sections(folder):
    """{measure: {class: [A, B, change]}} of compare.json's per-class sections."""
    out = {}
    for s in load(os.path.join(folder, "compare.json"))["analysis"]:
        if s["title"].startswith("per-class change of "):
            measure = s["title"].removeprefix("per-class change of ").split(" (A -> ")[0]
            out[measure] = {row[0]: row[1:] for row in s["tables"][0]["rows"]}
    return out


def expected(a, b):
    """{class: [A, B, B - A]} of two {class: value} read from the reports themselves."""
    return {c: [a[c], b.get(c), None if a[c] is None or b.get(c) is None else pytest.approx(b[c] - a[c])] for c in a}


def by_name(rows, key):
    return {r["name"]: r[key] for r in rows}


@pytest.mark.slow
def test_compare_of_two_real_detection_reports_shows_the_per_class_changes(real_outputs, tmp_path):
    a, b = real_outputs.reports("detection")
    out = tmp_path / "cmp"
    quiet(evaluate, ["--compare", a, b, "--report-dir", str(out)])
    ra, rb = load(a), load(b)
    sections = per_class_sections(out)
    for key in ("AP", "AP50"):  # COCO's per-category AP (report["per_category"]["bbox"])
        assert sections[f"bbox/{key}"] == expected(by_name(ra["per_category"]["bbox"], key),
                                                   by_name(rb["per_category"]["bbox"], key))
    assert set(sections["bbox/AP75"]) == {c for c in ra["dataset"]["classes"] if c != "__background__"}
    rows = sections["bbox/AP50"]  # sorted: the best gain first
    changes = [r[2] for r in rows.values() if r[2] is not None]
    assert changes == sorted(changes, reverse=True)
    md = (out / "compare.md").read_text()
    assert "per-class change of bbox/AP50 (A -> B), sorted" in md
    assert "bbox: error analysis (TIDE): change of each error type's dAP" in md
    metrics = next(s for s in load(out / "compare.json")["analysis"] if s["title"] == "every metric")
    assert ["bbox/AP50", ra["metrics"]["bbox/AP50"], rb["metrics"]["bbox/AP50"],
            pytest.approx(rb["metrics"]["bbox/AP50"] - ra["metrics"]["bbox/AP50"])] in metrics["tables"][0]["rows"]
    # A was evaluated after one epoch, B after a resumed second: the configs differ in train.epochs only
    warnings = load(out / "compare.json")["warnings"]
    assert len(warnings) == 1 and "train.epochs (1 -> 2)" in warnings[0] and "output_dir" not in warnings[0]
    page = (out / "compare.html").read_text()
    assert "per-class change of bbox/AP50" in page and page.count("data:image/png;base64,") >= 2


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classification", "segmentation", "panoptic"])
def test_compare_of_two_real_reports_of_each_other_task_shows_the_per_class_changes(real_outputs, tmp_path, task):
    a, b = real_outputs.reports(task)
    quiet(evaluate, ["--compare", a, b, "--report-dir", str(tmp_path)])
    ra, rb = load(a), load(b)
    if task == "classification":
        figures = {"accuracy": lambda r: r["per_class_accuracy"]}
    elif task == "segmentation":
        figures = {"IoU": lambda r: r["per_class_iou"]}
    else:  # the composite report: its detection part ("") and its panoptic part with the semantic branch
        figures = {"panoptic/PQ": lambda r: {c["name"]: c["pq"] for c in r["parts"]["panoptic"]["panoptic"]["per_class"].values()},
                   "panoptic/semantic IoU": lambda r: r["parts"]["panoptic"]["semantic"]["per_class_iou"],
                   "bbox/AP": lambda r: by_name(r["parts"][""]["per_category"]["bbox"], "AP"),
                   "segm/AP50": lambda r: by_name(r["parts"][""]["per_category"]["segm"], "AP50")}
    sections = per_class_sections(tmp_path)
    for measure, read in figures.items():
        assert sections[measure] == expected(read(ra), read(rb)), measure


def test_compare_names_the_error_type_that_improved_most(real_outputs, tmp_path):
    """Real reports whose TIDE figures are set so that the ranking is decided: FP is a grouping, not
    one of the six error types, so loc's -0.07 is the largest drop, and bkg grew."""
    reports = [load(p) for p in real_outputs.reports("detection")]
    for report, figures in zip(reports, ({"cls": 0.05, "loc": 0.12, "miss": 0.08, "bkg": 0.02, "FP": 0.2},
                                         {"cls": 0.04, "loc": 0.05, "miss": 0.07, "bkg": 0.03, "FP": 0.01})):
        tide = next(s for s in report["analysis"] if s["title"] == "bbox: error analysis (TIDE)")
        assert {f"bbox/tide/dAP_{k}" for k in figures} <= set(tide["metrics"])  # the writer's names
        tide["metrics"].update({f"bbox/tide/dAP_{k}": v for k, v in figures.items()})
    a, b = write(tmp_path / "a", reports[0]), write(tmp_path / "b", reports[1])
    report, md = compare_reports([a, b], str(tmp_path / "out"))
    assert "**dAP_loc**" in md and "0.12 -> 0.05" in md and "dAP_bkg (+0.01)" in md
    assert "improved most" in (tmp_path / "out" / "compare.html").read_text()


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
    accuracy = per_class_sections(tmp_path)["accuracy"]
    assert set(accuracy) == set(load(checkpoint)["per_class_accuracy"])
    assert all(change == pytest.approx(0) for _, _, change in accuracy.values())
    metrics = next(s for s in report["analysis"] if s["title"] == "every metric")["tables"][0]["rows"]
    assert [row[3] for row in metrics if row[0] == "top1"] == [pytest.approx(0)]
