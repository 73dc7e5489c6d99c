"""One launch when the memory model is sure, end to end with real TRL on the simulated device (issue 38's done-when).

The same GRPO config (the tiny model, 2 steps) on a device four times its peak starts the real run at once: one
launch, stable, the real run's own output directory written. On a device 10% above its peak it is probed first
(its worst case, in oomguard's scratch directory), then run. The decision's parts are tests/test_probe_decision.py's.
"""

from __future__ import annotations

import pytest

from helpers import grpo_tiny, run_oomguard

pytestmark = [pytest.mark.e2e, pytest.mark.core]


def launches(rep: dict) -> list[tuple[str, str]]:
    return [(a["kind"], a["outcome"]) for a in rep["attempts"]]


def test_a_config_far_under_its_device_is_one_launch_and_near_the_edge_it_is_probed_first(tmp_path, tiny_model):
    far = tmp_path / "far"
    far.mkdir()
    out, rep = run_oomguard(far, "--simulate-gpu", "320MiB", "--", *grpo_tiny(tiny_model, far / "out"))
    assert out.returncode == 0 and rep["status"] == "stable", out.stderr[-3000:]
    assert launches(rep) == [("run", "ok")]
    first = rep["attempts"][0]
    assert first["probe_decision"]["decided"] == "run" and first["step"] == 2
    assert "this launch is the real run, no probe first" in out.stderr
    peak = first["peak_bytes"]
    assert 4 * peak <= 320 * 2**20 * 1.1  # the device really is about four times the peak

    near = tmp_path / "near"
    near.mkdir()
    out, rep = run_oomguard(near, "--simulate-gpu", str(int(peak * 1.1)), "--", *grpo_tiny(tiny_model, near / "out"))
    assert out.returncode == 0 and rep["status"] == "stable", out.stderr[-3000:]
    assert launches(rep) == [("probe", "ok"), ("run", "ok")]
    assert rep["attempts"][0]["probe_decision"]["decided"] == "probe"
    assert "a 2-step worst-case probe first" in out.stderr
    assert rep["diff"] == []  # nothing changed: the probe only verified the user's config
