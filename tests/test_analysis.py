"""The evaluation analysis (issue 20): calibration, the classification / segmentation / panoptic
sections, the renderer and report.html, the training switch."""
import glob
import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from conftest import shared_data
from engine.report import plots
from evaluators.calibration import ece, fit_temperature, reliability_bins
from engine.evaluation import evaluate, write_report


def test_reliability_bins_and_ece_by_hand():
    # two bins used: (0.6, 0.667] holds 0.65 x2 (one right), (0.933, 1] holds 0.95 x2 (both right)
    conf, hit = [0.65, 0.65, 0.95, 0.95], [1, 0, 1, 1]
    value, bins = reliability_bins(conf, hit)
    assert len(bins) == 15 and sum(b["count"] for b in bins) == 4
    used = [b for b in bins if b["count"]]
    assert [(b["count"], b["accuracy"]) for b in used] == [(2, 0.5), (2, 1.0)]
    assert value == pytest.approx(0.5 * abs(0.5 - 0.65) + 0.5 * abs(1.0 - 0.95))
    assert ece([1.0, 1.0], [1, 1]) == 0.0 and reliability_bins([1.0], [1])[1][-1]["count"] == 1  # (lo, hi]


def test_fitted_temperature_recovers_the_one_that_made_labels_overconfident():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 5, generator=g) * 2
    labels = torch.multinomial(logits.softmax(1), 1, generator=g)[:, 0]  # calibrated by construction
    assert fit_temperature(logits * 3, labels) == pytest.approx(3.0, rel=0.1)
    assert fit_temperature(logits, labels) == pytest.approx(1.0, rel=0.1)


def _digits_features(split):
    root = shared_data("digits")
    files = sorted(glob.glob(os.path.join(root, split, "*", "*.png")))
    x = torch.tensor(np.stack([np.asarray(Image.open(f).convert("L"), dtype=np.float32) / 255 for f in files]))
    x = torch.nn.functional.avg_pool2d(x[:, None], 2).flatten(1)  # 4x4: a classifier that errs (~90%)
    y = torch.tensor([int(os.path.basename(os.path.dirname(f))) for f in files])
    return x, y, files


def test_temperature_lowers_the_ece_of_an_overconfident_digits_classifier(tmp_path):
    """Acceptance 4: a softmax regression trained on 4x4 digits, its logits x 3 on the held-out split:
    the fitted temperature lowers the ECE, in-sample (as reported) and on a held-out half."""
    from evaluators.classification import ClassificationEvaluator
    x, y, _ = _digits_features("train")
    torch.manual_seed(0)
    net = torch.nn.Linear(x.shape[1], 10)
    opt = torch.optim.LBFGS(net.parameters(), max_iter=200)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss
    opt.step(closure)
    xv, yv, files = _digits_features("val")
    with torch.no_grad():
        logits = net(xv) * 3  # deliberately overconfident
    evaluator = ClassificationEvaluator([str(i) for i in range(10)])
    evaluator.attach_dataset(type("Files", (), {"files": files})(), list(range(len(files))))
    for i in range(0, len(yv), 64):
        evaluator.update(logits[i:i + 64], yv[i:i + 64])
    report = evaluator.report()
    assert report["metrics"]["top1"] > 85
    cal = next(s for s in report["analysis"] if s["title"] == "calibration")
    m = cal["metrics"]
    assert m["ECE"] > 0.06 and m["ECE_after_temperature"] < m["ECE"] / 2 and m["temperature"] > 2
    assert m["NLL_after_temperature"] < m["NLL"]
    diagram = cal["plots"][0]
    assert diagram["kind"] == "reliability" and diagram["ece"] == m["ECE"]
    assert diagram["after"]["ece"] == m["ECE_after_temperature"]
    # held out: T fitted on the even samples lowers the ECE of the odd ones
    t = fit_temperature(logits[::2], yv[::2])
    odd = logits[1::2]
    hits = (odd.argmax(1) == yv[1::2]).numpy()
    assert ece((odd / t).softmax(1).max(1).values.numpy(), hits) < ece(odd.softmax(1).max(1).values.numpy(), hits)
    # the diagram shows it: its two bar series differ, and the wrong predictions name their files
    image = plots.rgb(diagram)
    assert image.std() > 10
    wrong = next(s for s in report["analysis"] if s["title"] == "most confidently wrong samples")["tables"][0]["rows"]
    assert wrong and all(row[1].endswith(".png") and os.path.isfile(row[1]) for row in wrong)
    assert all(a[4] >= b[4] for a, b in zip(wrong, wrong[1:]))


def test_classification_sections_match_sklearn():
    from sklearn.metrics import precision_recall_fscore_support
    from evaluators.classification_analysis import per_class_prf, top_confusions
    rng = np.random.default_rng(0)
    true = rng.integers(0, 4, 300)
    pred = np.where(rng.random(300) < 0.7, true, rng.integers(0, 4, 300))
    cm = np.zeros((4, 4), int)
    np.add.at(cm, (true, pred), 1)
    p, r, f1, support = per_class_prf(cm)
    sp, sr, sf, ss = precision_recall_fscore_support(true, pred, labels=range(4), zero_division=0)
    np.testing.assert_allclose(p, sp)
    np.testing.assert_allclose(r, sr)
    np.testing.assert_allclose(f1, sf)
    top = top_confusions(cm, list("abcd"), k=3)
    off = cm.copy()
    np.fill_diagonal(off, 0)
    assert [t[2] for t in top] == sorted(off.ravel())[::-1][:3]
    # each row names its cell (true row, predicted column): a swapped pair would differ
    assert all(t != p and n == cm["abcd".index(t), "abcd".index(p)] for t, p, n, _ in top)


class _Files(torch.utils.data.Dataset):
    """Images as 3-value vectors whose first values are the logits; `files` names them."""

    def __init__(self, n=60):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 3, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)
        self.files = [f"/data/val/img_{i:03d}.png" for i in range(n)]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _ece_by_definition(conf, hit, bins=15):
    """Expected calibration error: sum over 15 equal bins (lo, hi] of share x |accuracy - confidence|."""
    total = 0.0
    for b in range(bins):
        inside = (conf > b / bins) & (conf <= (b + 1) / bins)
        if inside.any():
            total += inside.sum().item() * abs(hit[inside].mean().item() - conf[inside].mean().item())
    return total / len(conf)


def test_evaluate_names_the_most_confidently_wrong_files_and_html_embeds_everything(tmp_path):
    from evaluators.classification import ClassificationEvaluator
    data = _Files()
    evaluator = evaluate(torch.nn.Identity(), DataLoader(data, batch_size=7), ClassificationEvaluator(list("abc")),
                         torch.device("cpu"), show_progress=False, streams=1)
    report = evaluator.report()
    rows = next(s for s in report["analysis"] if "confidently wrong" in s["title"])["tables"][0]["rows"]
    conf = data.x.softmax(1).max(1).values
    wrong = (data.x.argmax(1) != data.y).nonzero()[:, 0]
    expected = wrong[conf[wrong].argsort(descending=True)][:len(rows)].tolist()
    assert [r[0] for r in rows] == expected and rows[0][1] == data.files[expected[0]]
    write_report(str(tmp_path), report, "# test\n")
    page = open(tmp_path / "report.html", encoding="utf-8").read()
    # the headline first (issue 39): top-1, then the largest confusion, in per cent
    first = re.search(r"</h1>\s*<section class=headline[^>]*>(.*?)</section>", page, re.S)
    top1 = f"{report['metrics']['top1']:.1f}"
    assert first and f"top1: <b>{top1}</b>" in first.group(1) and "most frequent error:" in first.group(1)
    assert len(re.findall(r'<img class=plot [^>]*src="data:image/png;base64,', page)) == 3  # cm, F1, reliability
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from a network
    assert "most confidently wrong samples" in open(tmp_path / "report.md").read()
    saved = json.load(open(tmp_path / "report.json"))
    cal = next(s for s in saved["analysis"] if s["title"] == "calibration")
    hits = (data.x.argmax(1) == data.y).double()
    assert cal["metrics"]["ECE"] == pytest.approx(_ece_by_definition(conf.double(), hits), abs=1e-6)


def test_plots_draw_every_kind_and_refuse_an_unknown_one():
    kinds = [{"kind": "curves", "title": "pr", "series": [{"label": "a", "x": [0, 1], "y": [1, 0]}]},
             {"kind": "matrix", "title": "cm", "labels": ["a", "b"], "values": [[3, 1], [0, 2]], "normalise": True},
             {"kind": "matrix", "title": "with background", "labels": ["a", "bg"], "col_labels": ["a", "b", "bg"],
              "values": [[3, 1, 0], [0, 2, 1]]},
             {"kind": "bars", "title": "iou", "labels": ["a", "b"], "series": [{"values": [0.5, None]}]},
             {"kind": "reliability", "title": "r", "ece": 0.1, "bins": reliability_bins([0.9, 0.8], [1, 0])[1]}]
    for plot in kinds:
        assert plots.png(plot)[:4] == b"\x89PNG" and plots.rgb(plot).std() > 5
    with pytest.raises(plots.PlotError, match="kind 'pie'"):
        plots.png({"kind": "pie", "title": "x"})


def test_segmentation_worst_images_are_the_lowest_miou_and_are_drawn(tmp_path):
    from evaluators.segmentation import SegmentationEvaluator
    evaluator = SegmentationEvaluator(["bg", "a", "b"], num_worst=2)
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 3, (6, 16, 16), generator=g)
    noise = [0.0, 0.9, 0.1, 0.6, 0.2, 0.3]  # share of pixels predicted wrong per image
    for t, n in zip(targets, noise):
        wrong = torch.rand(16, 16, generator=g) < n
        pred = torch.where(wrong, (t + 1) % 3, t)
        evaluator.update(torch.nn.functional.one_hot(pred, 3).permute(2, 0, 1)[None].float(), t[None])
    report = evaluator.report()
    worst = report["analysis"][1]["images"]
    assert [w["title"] for w in worst] == ["val image 1", "val image 3"]  # noise 0.9 then 0.6
    assert worst[0]["score"] < worst[1]["score"]
    evaluator.save_artifacts(str(tmp_path))
    drawn = Image.open(tmp_path / worst[0]["path"])
    assert drawn.size == (16 * 2 + 4, 16)  # ground truth | gap | prediction
    bars = report["analysis"][0]["plots"][0]
    assert bars["series"][0]["values"] == [report["per_class_iou"][c] for c in ["bg", "a", "b"]]
    worst_class = min(report["per_class_iou"], key=report["per_class_iou"].get)  # the headline names it
    assert report["headline"][0].startswith(f"mIoU {100 * report['metrics']['mIoU']:.1f}, pixel accuracy")
    assert report["headline"][1].startswith(f"lowest IoU: {worst_class} ")


def test_analysis_off_adds_no_section(tmp_path):
    from evaluators.classification import ClassificationEvaluator
    from evaluators.segmentation import SegmentationEvaluator
    ev = ClassificationEvaluator(list("ab")).set_analysis(False)
    ev.update(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
    assert "analysis" not in ev.report() and ev._logits == []
    seg = SegmentationEvaluator(list("ab")).set_analysis(False)
    seg.update(torch.zeros(1, 2, 4, 4), torch.zeros(1, 4, 4, dtype=torch.long))
    assert "analysis" not in seg.report() and seg.save_artifacts(str(tmp_path)) == {}


@pytest.mark.parametrize("analysis", [True, False])
def test_training_writes_each_evaluation_report_and_tensorboard_extras_unless_turned_off(tmp_path, analysis):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from engine.config import config_from_data
    from engine.loop import train
    cfg = config_from_data({"seed": 0, "device": "cpu", "optim": {"name": "adamw", "lr": 0.003},
                            "model": {"name": "mobilenet_v3_small", "dropout": 0.0},
                            "data": {"name": "synthetic_classification", "num_classes": 3, "train_size": 16,
                                     "val_size": 12, "image_size": 32, "workers": 0, "batch_size": 8},
                            "train": {"epochs": 1, "max_steps_per_epoch": 1, "log_every": 100, "analysis": analysis}})
    train(cfg, str(tmp_path))
    folder = tmp_path / "reports" / "epoch_001" / "val"
    assert folder.is_dir() == analysis
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "images": 0}).Reload()
    assert ("val/ECE" in events.Tags()["scalars"]) == analysis
    assert any("pr_curve" in t for t in events.Tags()["tensors"]) == analysis
    if analysis:
        report = json.load(open(folder / "report.json"))
        assert report["epoch"] == 1 and report["dataset"]["num_samples"] == 12
        assert [s["title"] for s in report["analysis"]][-1] == "calibration"
        assert "data:image/png;base64," in open(folder / "report.html").read()


def test_panoptic_sections_count_segment_errors_and_draw_the_worst_image_first(tmp_path):
    from evaluators.panoptic import PanopticEvaluator
    from evaluators.panoptic_ids import id_to_rgb
    cats = [{"id": 1, "name": "a", "isthing": 1}, {"id": 3, "name": "sky", "isthing": 0}]
    ids = np.array([[1, 1, 3, 3], [1, 1, 3, 3], [3, 3, 3, 3]], np.int32)
    segments = [{"id": 1, "category_id": 1, "iscrowd": 0, "area": 4}, {"id": 3, "category_id": 3, "iscrowd": 0, "area": 8}]
    os.makedirs(tmp_path / "gt")
    anns = []
    for image_id in (7, 8, 9):
        Image.fromarray(id_to_rgb(ids)).save(tmp_path / "gt" / f"{image_id}.png")
        anns.append({"image_id": image_id, "file_name": f"{image_id}.png", "segments_info": segments})
    evaluator = PanopticEvaluator({"categories": cats, "annotations": anns}, str(tmp_path / "gt"), {1: 1, 3: 3},
                                  num_worst=2)
    for image_id in (7, 8, 9):
        pred = torch.from_numpy(ids.copy())
        info = [{"id": 1, "category_id": 1, "isthing": True, "score": 1.0, "area": 4},
                {"id": 3, "category_id": 3, "isthing": False, "score": 1.0, "area": 8}]
        if image_id == 8:  # the thing is missed (predicted as sky): a FN of "a", sky's IoU drops
            pred[pred == 1] = 3
            info = info[1:]
        evaluator.update([{"panoptic": pred, "segments_info": info}], [{"image_id": image_id}])
    report = evaluator.report()
    classes, worst = report["analysis"][0], report["analysis"][1]
    rows = {r[0]: r for r in classes["tables"][0]["rows"]}
    assert list(rows["a"][5:]) == [2, 0, 1]  # TP, FP, FN
    assert [i["title"] for i in worst["images"]] == ["image 8", "image 7"]
    assert report["headline"] == [f"PQ {100 * report['metrics']['PQ']:.1f} (things "
                                  f"{100 * report['metrics']['PQ_th']:.1f}, stuff {100 * report['metrics']['PQ_st']:.1f}), "
                                  f"SQ {100 * report['metrics']['SQ']:.1f}, RQ {100 * report['metrics']['RQ']:.1f} on 3 images",
                                  f"lowest PQ: a ({100 * rows['a'][2]:.1f}; 2 segments found, 1 missed, 0 spurious)"]
    fn_bars = classes["plots"][1]["series"][1]
    assert fn_bars["label"] == "FN" and fn_bars["values"] == [1, 0]
    evaluator.save_artifacts(str(tmp_path / "report"))
    assert Image.open(tmp_path / "report" / worst["images"][0]["path"]).size == (4 * 2 + 4, 3)  # gt | gap | pred
