"""report.html in a real browser: headless Chromium (Debian's `chromium`; .ci/run installs it) opens
the page of an evaluation report offline, takes a screenshot; the page logs no console error, loads
nothing but its own data URIs, and its plots and images are drawn (not blank)."""
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(BROWSER is None, reason="headless Chromium not installed (apt-get install chromium; "
                                                         ".ci/run installs it when apt is available)")]
MATPLOTLIB_BLUE = np.array([31, 119, 180])  # the first colour of matplotlib's cycle: bars, curves


def screenshot(page, png, height=2600):
    """(console messages, chromium's stderr) of opening page headless, offline, with a screenshot."""
    out = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--no-first-run", "--disable-extensions", "--enable-logging=stderr", "--v=0",
                          f"--window-size=1280,{height}", "--virtual-time-budget=5000", f"--screenshot={png}",
                          f"file://{page}"], capture_output=True, text=True, timeout=180)
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    return console, out.stderr


def classification_and_segmentation_report(folder):
    from evaluators.classification import ClassificationEvaluator
    from evaluators.segmentation import SegmentationEvaluator
    from engine.evaluation import CompositeEvaluator, write_report
    g = torch.Generator().manual_seed(0)
    classes = ["circle", "square", "triangle"]
    labels = torch.randint(0, 3, (120,), generator=g)
    logits = torch.nn.functional.one_hot(labels, 3).float() * 2 + torch.randn(120, 3, generator=g) * 1.5
    cls = ClassificationEvaluator(classes)
    cls.update(logits, labels)
    seg = SegmentationEvaluator(["background"] + classes, num_worst=3)
    for _ in range(4):
        target = torch.randint(0, 4, (1, 24, 24), generator=g)
        pred = torch.where(torch.rand(1, 24, 24, generator=g) < 0.3, (target + 1) % 4, target)
        seg.update(torch.nn.functional.one_hot(pred, 4).permute(0, 3, 1, 2).float(), target)
    composite = CompositeEvaluator({"classification": cls, "segmentation": seg})
    report = composite.report()
    composite.save_artifacts(folder)
    write_report(folder, report, "# test\n", "browser test")
    return os.path.join(folder, "report.html")


def test_report_html_opens_in_chromium_without_errors_and_shows_its_plots(tmp_path):
    page = classification_and_segmentation_report(str(tmp_path))
    html = open(page, encoding="utf-8").read()
    sources = re.findall(r'\bsrc="([^"]*)"', html)
    assert len(sources) >= 6 and all(s.startswith("data:image/") for s in sources)  # self-contained
    console, stderr = screenshot(page, str(tmp_path / "shot.png"))
    assert console == [], console
    shot = np.asarray(Image.open(tmp_path / "shot.png").convert("RGB")).astype(int)
    assert shot.shape[:2] == (2600, 1280), stderr[-2000:]
    blue = (np.abs(shot - MATPLOTLIB_BLUE).sum(-1) < 30).sum()  # bars and curves of the decoded plot PNGs
    assert blue > 5000
    ink = (shot.sum(-1) < 600).mean()  # anything but white: text, tables, plots
    assert 0.02 < ink < 0.9


def test_the_console_check_catches_errors(tmp_path):
    """The check above is not vacuous: a page with a failing script is caught."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><p>x</p><script>undefined_function();</script></body></html>')
    console, _ = screenshot(str(page), str(tmp_path / "shot.png"), height=200)
    assert any("undefined_function" in line for line in console)
