"""evaluate.py --compare: every metric's change, the TIDE error type that moved most, per-class changes
sorted, Markdown + HTML; refuses other data sets and IoU types, warns about other config changes."""
import json
import os

import pytest
import torch

from engine.report import section, table
from evaluators.compare import CompareError, compare_reports

DATASET = {"name": "shapes", "settings": {"root": "data/shapes", "num_val": 200}, "classes": ["circle", "square"],
           "num_samples": 200, "id": "abc"}


def detection_report(ap, tide, per_class, epochs=4, dataset=DATASET, iou_types=("bbox",)):
    tide_section = section("bbox: error analysis (TIDE)",
                           metrics={"bbox/tide/AP50": ap, **{f"bbox/tide/dAP_{k}": v for k, v in tide.items()}})
    pr = section("bbox: precision-recall", tables=[table("per class", ["class", "GT", "AP50", "AP75"],
                                                         [[c, 10, v, v / 2] for c, v in per_class.items()])])
    return {"metrics": {"bbox/AP": ap / 2, "bbox/AP50": ap}, "iou_types": list(iou_types), "dataset": dict(dataset),
            "config": {"resolved": {"train": {"epochs": epochs}, "output_dir": f"runs/{epochs}",
                                    "data": {"name": "shapes", "workers": 2}}},
            "analysis": [tide_section, pr]}


def write(folder, report):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "report.json")
    with open(path, "w") as f:
        json.dump(report, f)
    return path


def test_compare_names_the_error_type_that_improved_most_and_sorts_classes(tmp_path):
    a = write(tmp_path / "a", detection_report(0.50, {"cls": 0.05, "loc": 0.12, "miss": 0.08, "bkg": 0.02,
                                                      "FP": 0.2, "FN": 0.1}, {"circle": 0.4, "square": 0.6}))
    b = write(tmp_path / "b", detection_report(0.62, {"cls": 0.04, "loc": 0.05, "miss": 0.07, "bkg": 0.03,
                                                      "FP": 0.01, "FN": 0.05}, {"circle": 0.7, "square": 0.55},
                                               epochs=8))
    report, md = compare_reports([a, b], str(tmp_path / "out"))
    # FP is a grouping, not one of the six error types: loc's -0.07 is the largest drop
    assert "**dAP_loc**" in md and "0.12 -> 0.05" in md and "dAP_bkg (+0.01)" in md
    metrics = next(s for s in report["analysis"] if s["title"] == "every metric")["tables"][0]["rows"]
    assert ["bbox/AP50", 0.50, 0.62, pytest.approx(0.12)] == metrics[1]
    per_class = next(s for s in report["analysis"] if s["title"].startswith("per-class change of bbox/AP50"))
    assert [r[0] for r in per_class["tables"][0]["rows"]] == ["circle", "square"]  # best gain first
    assert per_class["tables"][0]["rows"][1][3] == pytest.approx(-0.05)
    # the configs differ in the epochs compared (a warning), not in output_dir or workers (quiet)
    assert len(report["warnings"]) == 1 and "train.epochs (4 -> 8)" in report["warnings"][0]
    assert "output_dir" not in report["warnings"][0]
    for name in ("compare.md", "compare.html", "compare.json"):
        assert os.path.getsize(tmp_path / "out" / name) > 200
    page = open(tmp_path / "out" / "compare.html").read()
    assert "improved most" in page and page.count("data:image/png;base64,") >= 2


def test_compare_refuses_other_data_and_other_iou_types(tmp_path):
    a = write(tmp_path / "a", detection_report(0.5, {"loc": 0.1}, {"circle": 0.4}))
    other = dict(DATASET, settings={"root": "data/shapes", "num_val": 100}, num_samples=100, id="def")
    b = write(tmp_path / "b", detection_report(0.5, {"loc": 0.1}, {"circle": 0.4}, dataset=other))
    with pytest.raises(CompareError, match=r"different data sets .*num_samples: 200 vs 100"):
        compare_reports([a, b], str(tmp_path / "out"))
    c = write(tmp_path / "c", detection_report(0.5, {"loc": 0.1}, {"circle": 0.4}, iou_types=("bbox", "segm")))
    with pytest.raises(CompareError, match=r"IoU types \['bbox'\].*\['bbox', 'segm'\]"):
        compare_reports([a, c], str(tmp_path / "out"))
    with pytest.raises(CompareError, match="report not found"):
        compare_reports([a, str(tmp_path / "missing.json")], str(tmp_path / "out"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CompareError, match="not valid JSON"):
        compare_reports([a, str(tmp_path / "bad.json")], str(tmp_path / "out"))


def test_evaluate_py_compares_two_classifier_reports_from_the_evaluator(tmp_path, capsys):
    """Through evaluate.py's command line, with reports the classification evaluator wrote."""
    import evaluate
    from evaluators.classification import ClassificationEvaluator
    from engine.evaluation import write_report
    paths = []
    for name, noise in (("a", 2.0), ("b", 0.5)):
        g = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 3, (90,), generator=g)
        logits = torch.nn.functional.one_hot(labels, 3).float() * 2 + torch.randn(90, 3, generator=g) * noise
        ev = ClassificationEvaluator(["cat", "dog", "fox"])
        ev.update(logits, labels)
        report = ev.report()
        report["dataset"] = DATASET
        write_report(str(tmp_path / name), report, "# x\n")
        paths.append(str(tmp_path / name / "report.json"))
    evaluate.main(["--compare", *paths, "--report-dir", str(tmp_path / "cmp")])
    out = capsys.readouterr().out
    assert "Comparison of 2 evaluation reports" in out
    md = open(tmp_path / "cmp" / "compare.md").read()
    assert "| top1 |" in md and "per-class change of accuracy" in md
    with pytest.raises(SystemExit, match="drop --checkpoint"):
        evaluate.main(["--compare", *paths, "--checkpoint", "x.pt"])
