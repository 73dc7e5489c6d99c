"""A memory trace as a picture (oomguard/display/trace_chart.py): well-formed SVG with the kept memory, the peak, the
device's line and a leak's projected crossing, and the analyze HTML report showing it."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from oomguard.display.html import analyze_html
from oomguard.display.trace_chart import trace_svg
from oomguard.oom.analyze import analyze_paths

from helpers import ROOT

MiB = 1 << 20
NS = "{http://www.w3.org/2000/svg}"


def test_the_chart_draws_kept_peak_the_device_and_the_crossing() -> None:
    samples = [{"step": s, "kept": (40 + 6 * s) * MiB, "peak": (70 + 6 * s) * MiB, "reserved": (80 + 6 * s) * MiB}
               for s in range(1, 12)]
    svg = trace_svg(samples, capacity=160 * MiB, oom_step=12, verdicts=[
        {"kind": "leak", "rate": 6 * MiB, "until": 11, "end": 106 * MiB, "runs_out_at": 15},
        {"kind": "long-sample", "step": 7, "peak": 150 * MiB}])
    root = ET.fromstring(svg)
    classes = {el.get("class") for el in root.iter() if el.get("class")}
    assert {"kept", "peak", "reserved", "device", "projection", "oom", "long-sample"} <= classes
    texts = " ".join(t.text or "" for t in root.iter(f"{NS}text"))
    assert "device 160.00 MiB" in texts and "full by step 15 at this rate" in texts
    assert "out of memory at step 12" in texts


def test_a_crossing_far_beyond_the_trace_is_not_drawn_and_nothing_from_a_log_is_trusted() -> None:
    samples = [{"step": s, "kept": s * MiB, "peak": 2 * s * MiB} for s in range(1, 6)]
    svg = trace_svg(samples, capacity=80 << 30, title="<script>x</script>",
                    verdicts=[{"kind": "leak", "rate": MiB, "until": 5, "end": 5 * MiB, "runs_out_at": 80_000}])
    assert "projection" not in svg and "<script>" not in svg
    ET.fromstring(svg)
    assert trace_svg([]) == ""


def test_the_analyze_report_shows_each_trace() -> None:
    result = analyze_paths([str(ROOT / "tests" / "fixtures" / "trace" / "grpo_leak_160mib.jsonl")])
    page = analyze_html(result)
    assert page.count('class="trace-chart"') == 1 and "Memory trace in" in page
    assert "list `CACHE` of module `leaky_rewards` holds 12.00 MiB more between steps 9 and 11" in page  # the census
    assert "Leak: the memory kept at the end of each step grew by 6.00 MiB per step" in page
