"""The benchmark scripts (benchmarks/*.py), each run once at a tiny size: they still run on today's code,
and what each reports beside its timings holds (the timings themselves are printed, never asserted)."""
import json
import os
import re

import pytest

from benchmarks import export_check, quant_latency, ssd_scaling, transformer_fastpath, tune_overhead


@pytest.mark.slow
def test_quant_latency_times_fp32_and_int8_eager_and_as_torchscript(tmp_path, capsys):
    out = tmp_path / "q.json"
    quant_latency.main(["--size", "48", "--batch-size", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
                        "--json", str(out)])
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["fp32", "fp32+script", "int8", "int8+script"]
    for r in result["variants"].values():
        assert "train" not in r and r["infer_1"]["median"] > 0 and r["infer_batch"]["median"] > 0
        assert r["batch"] == 2  # --batch-size reached the timed batches
    assert "mobilenet_v3_large" in capsys.readouterr().out


def test_ssd_scaling_times_every_phase_of_a_step_at_each_size(tmp_path, capsys):
    out = tmp_path / "s.json"
    ssd_scaling.main(["--sizes", "64,96", "--batch-size", "2", "--steps", "1", "--rounds", "1", "--json", str(out),
                      "--set", f"data.root={tmp_path / 'shapes'}", "data.num_train=4", "data.num_val=2",
                      "data.image_size=64"])
    result = json.loads(out.read_text())
    assert result["sizes"] == [64, 96]
    for size in ("64", "96"):
        assert len(result["step_s"][size]) == 1 and set(result["phases_s"][size]) == set(ssd_scaling.PHASES)
    # SSDlite's default boxes: 6 per location on its 6 feature maps, of side ceil(size / 16), then halved
    # (rounded up): 64 px: 4, 2, 1, 1, 1, 1 -> 6 x 24; 96 px: 6, 3, 2, 1, 1, 1 -> 6 x 52
    assert result["default_boxes"] == {"64": 6 * 24, "96": 6 * 52}
    assert "| 96 | 2.25x |" in capsys.readouterr().out  # the table, its pixels relative to the first size


def test_transformer_fastpath_variants_give_the_same_logits(capsys):
    ratios = transformer_fastpath.main(["--batch-size", "4", "--max-len", "16", "--vocab-size", "50", "--dim", "16",
                                        "--depth", "1", "--heads", "2", "--ff-dim", "32", "--repeats", "1"])
    assert set(ratios) == {"ragged", "full"} and all(r > 0 for r in ratios.values())
    diffs = [float(d) for d in re.findall(r"max \|logit diff\| (\S+)", capsys.readouterr().out)]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs  # the fast path and nested tensors change no logit


@pytest.mark.slow
def test_export_check_scores_the_onnx_detector_like_evaluate_py_in_a_process_without_torch(tmp_path, real_outputs):
    """benchmarks/export_check.py on a tiny SSDlite and its exports (tests/real_outputs.py): evaluate.py and
    benchmarks/onnx_coco_eval.py (ONNX Runtime, no torch) give the same box AP."""
    work = tmp_path / "work"
    (work / "export").mkdir(parents=True)
    for fmt in ("onnx", "torch_export"):
        artifact, spec = real_outputs.export("detection", fmt)
        for path in (artifact, spec):
            os.symlink(path, work / "export" / os.path.basename(path))
    result = export_check.main(["--checkpoint", real_outputs.checkpoint("detection"), "--work", str(work),
                                "--latency-images", "2", "--skip-export"])
    # the tiny detector's AP is ~0.001, under the script's own 0.005 tolerance even with every class swapped
    # (ONNX 0.00016 against 0.0012): the two agree within a quarter of it instead (8% apart here)
    ap, ap50 = result["bbox_AP"], result["bbox_AP50"]
    assert result["val_images"] == 4 and ap["evaluate.py"] > 0, result
    for scores in (ap, ap50):
        assert abs(scores["onnxruntime"] - scores["evaluate.py"]) <= 0.25 * scores["evaluate.py"], result
    assert result["onnx_process_imported_torch_or_project"] == [], result
    assert all(check["ok"] for check in result["export_checks"].values()), result["export_checks"]


@pytest.mark.slow
def test_tune_overhead_times_plain_runs_and_a_study_of_the_same_config(tmp_path, capsys):
    result = tune_overhead.main(["--trials", "1", "--out", str(tmp_path), "--set", "train.epochs=1"])
    assert len(result["plain_seconds"]) == 1 and result["study_seconds"] > 0
    assert os.path.isfile(tmp_path / "study" / "trial_000" / "last.pt")  # the study trained the same config
    assert '"overhead_per_trial_s"' in capsys.readouterr().out
