"""The diagnose report: HTML opened in a real headless Chromium (every plot image loads), the
Markdown form with its PNG files, and the benchmark's smoke run."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spikeguard as sg
from spikeguard.diagnose import diagnose, write_report
from spikeguard.record import metrics_record
from spikeguard.testing import scenarios as sc

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "screenshots"  # git-ignored


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    path = tmp_path_factory.mktemp("drift") / "metrics.jsonl"
    sink = sg.JsonlSink(path, mode="w", defer=False)
    for m in sc.logit_drift(0).metrics:
        sink.log(metrics_record(m), m.step)
    sink.close()
    return diagnose(path, ckpt_every=1000, compare={"grad_k": 5.0})


def test_html_report_in_headless_chromium(drift, tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("playwright")
    from tests.browser import chromium_page

    report = write_report(drift, tmp_path / "report.html")
    assert drift.timings["report"] > 0
    html = report.read_text()
    assert html.count("data:image/png;base64,") == 5  # loss, grad norm, log Z, ratio, 1 zoom
    SHOTS.mkdir(exist_ok=True)
    with chromium_page(width=1280, height=900) as page:
        page.goto(report.as_uri())
        page.screenshot(path=str(SHOTS / "diagnose_report.png"), full_page=True)
        images = page.evaluate("Array.from(document.images).map(i => "
                               "[i.alt, i.complete, i.naturalWidth, i.naturalHeight])")
        cells = page.evaluate("Array.from(document.querySelectorAll('table tr')).map("
                              "r => r.innerText)")
    assert [name for name, *_ in images] == ["loss", "grad_norm", "log_z", "loss_ema_ratio",
                                             "spike1"]
    assert all(done and w > 0 and h > 0 for _, done, w, h in images), images
    assert any("57,000" in c and "rollback" in c and "log_z" in c for c in cells), cells
    assert (SHOTS / "diagnose_report.png").stat().st_size > 10_000


def test_markdown_report_writes_its_plots_beside_it(drift, tmp_path):
    pytest.importorskip("matplotlib")
    report = write_report(drift, tmp_path / "triage.md")
    text = report.read_text()
    links = re.findall(r"!\[(\w+)\]\(([^)]+)\)", text)
    assert [name for name, _ in links] == ["loss", "grad_norm", "log_z", "loss_ema_ratio", "spike1"]
    for _, rel in links:
        assert (tmp_path / rel).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1 | 57,184 |" in text or "| 1 | 57," in text
    with pytest.raises(ValueError, match="must end in .html or .md"):
        write_report(drift, tmp_path / "report.pdf")


def test_benchmark_smoke(sub_env):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_diagnose.py"), "--smoke"],
                       capture_output=True, text=True, timeout=600, env=sub_env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    numbers = {
        "parse+search": r"parse\+search: [\d,]+ records .* in ([\d.]+) s",
        "rss": r"peak RSS: ([\d.]+) MiB",
        "ratio": r"ratio ([\d.]+)x CPU",
        "whatif": r"whatif .*: ([\d.]+) s",
        "report": r"report \(HTML.*\): ([\d.]+) s",
    }
    for name, pattern in numbers.items():
        m = re.search(pattern, out)
        assert m, (name, out)
        assert math.isfinite(float(m.group(1))) and float(m.group(1)) > 0, (name, out)
