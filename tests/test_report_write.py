"""Issue 32, item 14: report.json, report.md and report.html are replaced together or not at all. A
report.html that cannot be replaced (a folder of that name, an immutable file) is one `error:` line
naming it, and the old report's three files stay as they were (before: a traceback, and the new
report.json and report.md beside the old report.html)."""
import os
import shutil
import subprocess

import pytest

from datasets.shapes import ensure_shapes
from helpers import cli, panoptic_json

FILES = ("report.json", "report.md", "report.html")


def score(tmp_path, pred_json, report):
    """evaluate.py's --panoptic-* mode in a process: the shapes ground truth scored against `pred_json`
    (a copy of the ground truth: a perfect prediction)."""
    root = str(tmp_path / "data")
    gt_folder = os.path.join(root, "annotations", "panoptic_val2017")
    return cli(tmp_path, "evaluate.py", "--panoptic-gt-json", panoptic_json(root, "val"), "--panoptic-gt-folder",
               gt_folder, "--panoptic-pred-json", str(pred_json), "--panoptic-pred-folder", gt_folder,
               "--report-dir", str(report))


@pytest.fixture
def old_report(tmp_path):
    """A report written by a first evaluate.py run: (its folder, {file: (bytes, mtime)})."""
    root = ensure_shapes(str(tmp_path / "data"), seed=0, num_train=1, num_val=2, image_size=48)
    for name in ("first", "second"):
        shutil.copyfile(panoptic_json(root, "val"), tmp_path / f"{name}.json")
    report = tmp_path / "report"
    code, output, _ = score(tmp_path, tmp_path / "first.json", report)
    assert code == 0, output[-2000:]
    return report


def state(report):
    return {f: ((report / f).read_bytes(), os.stat(report / f).st_mtime_ns) for f in ("report.json", "report.md")}


def assert_refused(tmp_path, report, before):
    code, output, errors = score(tmp_path, tmp_path / "second.json", report)
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output[-2000:]
    assert str(report / "report.html") in errors[0] and "nothing written" in errors[0], errors[0]
    assert state(report) == before  # the old report.json and report.md, untouched
    assert b"first.json" in before["report.json"][0]  # (the new run's would name second.json)
    assert sorted(os.listdir(report)) == sorted(FILES)  # no temporary left behind


@pytest.mark.slow
def test_a_folder_named_report_html_refuses_the_whole_report(tmp_path, old_report):
    os.remove(old_report / "report.html")
    (old_report / "report.html").mkdir()
    assert_refused(tmp_path, old_report, state(old_report))
    assert (old_report / "report.html").is_dir()


@pytest.mark.slow
def test_an_immutable_report_html_refuses_the_whole_report(tmp_path, old_report):
    html = old_report / "report.html"
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root")
    if subprocess.run(["chattr", "+i", str(html)], capture_output=True).returncode != 0:
        pytest.skip(f"chattr +i is not supported on the file system of {tmp_path}")
    try:
        before_html = html.read_bytes()
        assert_refused(tmp_path, old_report, state(old_report))
        assert html.read_bytes() == before_html
    finally:
        subprocess.run(["chattr", "-i", str(html)], check=True)
