"""HTML reports: self-contained, escaped, and rendered by a real headless Chromium without console errors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.display.html import analyze_html, run_html
from oomguard.oom.analyze import analyze_paths

from helpers import ROOT, run_oomguard

MiB = 2**20
REPORT = {
    "status": "stable",
    "message": "stable after 1 out-of-memory attempt(s) <script>alert('x')</script>",
    "command": ["python", "train.py"],
    "device": {"simulate_gpu": 300 * MiB},
    "attempts": [
        {"index": 1, "kind": "probe", "outcome": "oom", "seconds": 17.8, "peak_bytes": 80 * MiB,
         "climbed": "shorter_sequences", "skipped": [{"remedy": "expandable_segments", "reason": "no fragmentation"}],
         "oom": {"source": "crash", "line": 1, "backend": "cuda", "kind": "impossible", "phase": "forward",
                 "requested_bytes": 424 * MiB, "capacity_bytes": 300 * MiB, "allocated_bytes": 42 * MiB,
                 "evidence": ["The single request of 424.00 MiB is larger than the whole device."],
                 "remedies": [{"name": "shorter_sequences", "reason": "halves the width", "frees_bytes": 212 * MiB}]}},
        {"index": 2, "kind": "run", "outcome": "ok", "seconds": 12.2, "peak_bytes": 157 * MiB},
    ],
    "diff": [{"knob": "max_completion_length", "from": 256, "to": 64, "remedy": "shorter_sequences"}],
    "original": {},
}
BREAKDOWN = {"weights": 12 * MiB, "optimizer": 23 * MiB, "activations": 4 * MiB, "logits": 107 * MiB,
             "overhead": 39 * MiB}


def test_run_page_is_self_contained_and_escaped():
    page = run_html(REPORT, BREAKDOWN)
    assert "<script>alert('x')</script>" not in page and "&lt;script&gt;alert(" in page
    assert 'id="peak-chart"' in page and 'id="breakdown-chart"' in page and 'id="timeline-chart"' in page
    assert 'id="diff"' in page and "max_completion_length" in page
    assert not re.search(r'(src|href)="https?://', page)  # nothing to fetch


def test_the_page_says_what_the_experiment_kept_and_what_else_fits():
    report = {**REPORT, "experiment": {"kept": ["8 generations per prompt", "a full fine-tune"], "changed": [
        {"remedy": "micro_batch", "cost": "speed", "change": "2 micro-steps of 4 rows per step (yours: 1 of 8)",
         "slowdown": 0.04}]},
        "alternatives": [{"avoids": ["speed"], "keeps": ["no speed change <b>"], "trades": ["bf16 weights (precision)"],
                          "predicted_bytes": 200 * MiB, "versus_choice": -0.1, "overrides": {"dtype": "bfloat16"},
                          "lock": "alt-1.lock.json"}]}
    page = run_html(report)
    assert 'id="experiment"' in page and "kept: 8 generations per prompt, a full fine-tune" in page
    assert "(speed, about +4% time per step predicted)" in page and "about 10% faster" in page
    assert "no speed change &lt;b&gt;" in page and "--config alt-1.lock.json" in page
    assert 'id="experiment"' not in run_html(REPORT)  # nothing to say without a stable choice


def test_analyze_page_and_cli(tmp_path):
    page = analyze_html(analyze_paths([str(ROOT / "examples" / "logs")]))
    assert "fragmentation" in page and "vllm-reservation" in page and page.count('class="figures-chart"') == 3
    out = subprocess.run([sys.executable, "-m", "oomguard", "analyze", "--html", str(tmp_path / "a.html"),
                          str(ROOT / "examples" / "logs")], capture_output=True, text=True)
    assert out.returncode == 0 and (tmp_path / "a.html").read_text().startswith("<!DOCTYPE html>")


def test_run_writes_html(tmp_path):
    _out, rep = run_oomguard(tmp_path, "--html", str(tmp_path / "r.html"), "--", sys.executable, "-c", "print(1)")
    assert rep["status"] == "stable"
    assert 'id="timeline-chart"' in (tmp_path / "r.html").read_text()


def _chromium() -> str | None:
    for name in (os.environ.get("CHROME"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def render(page: Path, tmp: Path, *extra: str) -> tuple[str, str]:
    """Headless Chromium: (the DOM after scripts ran, its log). The flags keep it off the network."""
    chrome = _chromium()
    if chrome is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs Chromium for the browser test (apt-get install chromium)")
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    cmd = [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'chrome-profile'}", "--enable-logging=stderr", "--v=0", *extra,
           page.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return out.stdout, out.stderr


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_the_browser_test_notices_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    _, log = render(bad, tmp_path, "--dump-dom")
    assert any("Uncaught ReferenceError" in e for e in console_errors(log))


@pytest.mark.parametrize("kind", ["run", "analyze"])
def test_reports_render_in_chromium_without_console_errors(tmp_path, kind):
    page = tmp_path / f"{kind}.html"
    page.write_text(run_html(REPORT, BREAKDOWN) if kind == "run"
                    else analyze_html(analyze_paths([str(ROOT / "examples" / "logs")])))
    dom, log = render(page, tmp_path, "--dump-dom")
    assert console_errors(log) == []
    rendered = re.search(r'data-rendered="(\d+)"', dom)
    assert rendered and int(rendered.group(1)) > 0  # the page's script ran to the end
    chart = re.search(r'<svg id="(peak-chart|figures-\d+)".*?</svg>', dom, re.S)
    assert chart and chart.group(0).count("<rect") >= 2
    shot = tmp_path / f"{kind}.png"
    render(page, tmp_path, f"--screenshot={shot}", "--window-size=1100,900")
    assert shot.exists() and shot.stat().st_size > 10_000
