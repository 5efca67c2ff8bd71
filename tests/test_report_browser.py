"""The drift report renders in a real browser, offline: headless Debian Chromium draws every plot.

Chromium runs with every name lookup mapped to NOTFOUND, so a page that needed the network (a CDN
plotly.js, a web font) would render without its plots and fail here. The screenshot is kept under
``test-artifacts/`` at the repository root for a person to look at. Without /usr/bin/chromium the test
fails (a skipped browser test would hide a broken report): install Debian's ``chromium`` package.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tasks import report
from tests.test_report import FAILING, FIRST_DRIFT, synthetic

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def chromium(*args: str, profile: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium); the report's "
                    "browser rendering test must run, not skip")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}",
           "--window-size=1400,2400", "--virtual-time-budget=10000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def report_file(tmp_path_factory) -> Path:
    d = synthetic()
    page = report.build_report(d["verdict"], d["provider_errors"], d["rule"], d["identity"])
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


@pytest.mark.service
def test_plots_render_offline(report_file, tmp_path):
    run = chromium("--dump-dom", report_file.as_uri(), profile=tmp_path / "profile")
    dom = run.stdout
    assert run.returncode == 0 and "</html>" in dom, f"chromium failed (rc {run.returncode}): {run.stderr[-2000:]}"
    # plotly adds these only when it has drawn a plot: one per figure
    assert dom.count('class="plot-container plotly"') == 3, run.stderr[-2000:]
    assert len(re.findall(r'<svg class="main-svg"', dom)) >= 6
    for div in ("h3-errors", "h3-heatmap", "h3-calibration"):
        drawn = re.search(rf'<div id="{div}" class="plotly-graph-div js-plotly-plot"', dom)
        assert drawn, f"{div} was not drawn"
    assert 'class="hm"' in dom or "heatmaplayer" in dom  # the heatmap layer exists
    assert "first drift: " + FIRST_DRIFT in dom  # the annotation, drawn as svg text
    assert FAILING in dom


@pytest.mark.service
def test_screenshot(report_file, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    png = ARTIFACTS / "report.png"
    png.unlink(missing_ok=True)
    run = chromium(f"--screenshot={png}", report_file.as_uri(), profile=tmp_path / "profile")
    assert run.returncode == 0 and png.exists(), f"chromium wrote no screenshot (rc {run.returncode}): {run.stderr}"
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 2400)
    assert len(data) > 150_000, "a blank or plot-less page compresses to far less"
    shutil.copy(report_file, ARTIFACTS / "report.html")
