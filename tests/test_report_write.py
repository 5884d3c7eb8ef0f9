"""Issue 32, item 14: report.json, report.md and report.html are replaced together or not at all. A
report.html that cannot be replaced (a folder of that name, an immutable file) is one `error:` line
naming it, and the old report's three files stay as they were (before: a traceback, and the new
report.json and report.md beside the old report.html).

Issue 39, items 1-3: what a real report (evaluate.py on a real detection checkpoint, tests/real_outputs.py)
reads: the headline first, the provenance last, one unit, no -1 nor 7.2e-05, the TIDE figures once."""
import json
import os
import re
import shutil
import subprocess

import pytest

from datasets.shapes import ensure_shapes
from engine.report import plots
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


# ---------------------------------------------------------------- what a real report page reads (issue 39, 1-3)

def real_detection_report(real_outputs):
    """(report.json, report.html, report.md) written by evaluate.py for a real detection checkpoint."""
    path = real_outputs.reports("detection")[0]
    folder = os.path.dirname(path)
    with open(path) as f:
        report = json.load(f)
    return (report, open(os.path.join(folder, "report.html"), encoding="utf-8").read(),
            open(os.path.join(folder, "report.md"), encoding="utf-8").read())


@pytest.mark.slow  # a tiny training run and evaluate.py (tests/real_outputs.py), once per process
def test_a_real_report_leads_with_its_headline_and_ends_with_its_provenance(real_outputs):
    report, page, md = real_detection_report(real_outputs)
    first = re.search(r"</h1>\s*(<section[^>]*>.*?</section>)", page, re.S)  # what follows the title
    assert first and "class=headline" in first.group(1), page[page.index("<body>"):][:600]
    assert "bbox/AP" in first.group(1) and "most AP50 is lost to" in first.group(1)
    sha = report["checkpoint"]["sha256"]
    last_section = page.rindex("</section>")
    assert last_section < page.index("Appendix: provenance") < page.index(sha) and page.count(sha) == 1
    titles = re.findall(r"^## (.+)$", md, re.M)  # report.md: its sections
    assert titles[0] == "Headline" and titles[-1] == "Appendix: provenance", titles
    assert sha in md.split("## Appendix: provenance")[1]


@pytest.mark.slow
def test_a_real_report_shows_one_unit_and_never_minus_one_or_scientific_notation(real_outputs):
    report, page, md = real_detection_report(real_outputs)
    assert report["bbox"]["APl"] == -1  # COCO's "undefined": no large object in 96-px images
    text = re.sub(r'data:[^"]+', "", page)  # the page without its embedded images
    assert "n/a (no large objects)" in md and "n/a (no large objects)" in text
    cells = [c.strip() for c in re.findall(r"<td[^>]*>([^<]*)</td>", text) + re.findall(r"(?<=\|)([^|\n]+)(?=\|)", md)]
    assert not [c for c in cells if re.fullmatch(r"-1(\.0+)?|-100(\.0+)?", c)]
    assert not re.search(r"\de[-+]\d", text + md)
    # one unit: the per-class AP50 of the analysis table (html) is the same number as report.md's per cent
    per_class = next(s for s in report["analysis"] if s["title"] == "bbox: precision-recall")["tables"][0]
    for row in per_class["rows"]:
        shown = f"{100 * row[per_class['columns'].index('AP50')]:.1f}"
        assert re.search(rf"<td[^>]*>{re.escape(row[0])}</td><td>\d+</td><td>{re.escape(shown)}</td>", text), row
        assert re.search(rf"\| {re.escape(row[0])} \| \d+ \| [\d.]+ \| {re.escape(shown)} \|", md), row


@pytest.mark.slow
def test_the_tide_section_shows_each_dap_once_and_its_chart_no_empty_legend(real_outputs):
    report, page, _ = real_detection_report(real_outputs)
    start = page.index("bbox: error analysis (TIDE)</h3>")
    tide_html = page[start:page.index("<section>", start)]
    assert "dAP_cls" not in tide_html and tide_html.count("<table>") == 1  # the table, no metrics beside it
    tide = next(s for s in report["analysis"] if "TIDE" in s["title"])
    shown = f"{100 * tide['metrics']['bbox/tide/dAP_loc']:.1f}"
    assert re.search(rf"<td[^>]*>loc</td><td[^>]*>[^<]*</td><td>{re.escape(shown)}</td>", tide_html)
    assert plots.figure(tide["plots"][0]).axes[0].get_legend() is None
