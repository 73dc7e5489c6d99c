"""The per-machine calibration store: where it lives, what it learns, and that no run's entry or file is ever lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.memory.calibration import (
    KEEP,
    Calibration,
    builtin_description,
    cache_dir,
    calibration_path,
    load_calibration,
    machine_key,
    model_key,
    record_run,
)
from oomguard.memory.device import gpu_name
from oomguard.memory.estimate import Coefficients, load_model_spec

GiB = 2**30
LLAMA = str(Path(__file__).resolve().parent / "fixtures" / "models" / "llama-3.2-1b")
H100 = machine_key("NVIDIA H100 80GB HBM3", simulated=False)


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_precedence(monkeypatch, tmp_path):
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("OOMGUARD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration_path() == tmp_path / "xdg" / "oomguard" / "calibration.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "oomguard"


def test_machine_key_names_gpu_and_versions_without_importing_torch():
    code = ("import sys; from oomguard.memory.calibration import machine_key; "
            "print(machine_key('NVIDIA  H100 80GB HBM3', simulated=False)); "
            "assert not {'torch', 'trl', 'transformers'} & set(sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    gpu, torch_v, trl_v = out.split("|")
    assert gpu == "NVIDIA H100 80GB HBM3" and torch_v.startswith("torch ") and trl_v.startswith("trl 1.")
    assert machine_key(None, simulated=True) != machine_key(None, simulated=False) != H100


def test_nothing_recorded_means_built_in():
    assert load_calibration(H100) is None
    assert not calibration_path().exists()  # reading never creates the file
    assert builtin_description() == "built-in: fitted to H100 measurements, 2026-11-22"


def test_record_and_reload_two_keys(store):
    other = machine_key("NVIDIA A100-SXM4-40GB", simulated=False)
    for measured in (9, 10, 11):
        record_run(H100, 10 * GiB, measured * GiB, int(measured * GiB * 1.05))
    record_run(other, 10 * GiB, 12 * GiB, None)
    h, a = load_calibration(H100), load_calibration(other)
    assert h.runs == 3 and h.alloc_ratio == pytest.approx(1.0) and h.frag == pytest.approx(0.05)
    assert a.runs == 1 and a.alloc_ratio == pytest.approx(1.2) and a.frag is None
    assert json.loads(calibration_path().read_text())["schema"] == "oomguard.calibration/1"
    assert [p.name for p in store.iterdir() if not p.name.endswith(".lock")] == ["calibration.json"]  # no temp left


def test_median_of_the_last_runs_resists_an_outlier():
    for _ in range(KEEP + 5):
        record_run(H100, 10 * GiB, int(10.3 * GiB), 11 * GiB)
    cal = record_run(H100, 10 * GiB, 40 * GiB, 41 * GiB)  # one broken measurement
    assert cal.runs == KEEP
    assert cal.alloc_ratio == pytest.approx(1.03, abs=1e-3)


def test_apply_scales_and_sets_the_margins():
    base = Coefficients()
    cal = Calibration(H100, ({"predicted": 100, "measured": 95, "reserved": 100, "expandable": False},
                             {"predicted": 100, "measured": 95, "reserved": 97, "expandable": True}))
    co = cal.apply(base)
    assert co.scale == pytest.approx(0.95) and co.f_frag == pytest.approx(100 / 95 - 1)
    assert co.f_frag_expandable == pytest.approx(97 / 95 - 1)
    assert (co.c_act, co.m_ctx) == (base.c_act, base.m_ctx)
    wild = Calibration(H100, ({"predicted": 100, "measured": 1000, "reserved": None, "expandable": False},))
    assert wild.apply(base).scale == 2.0 and wild.apply(base).f_frag == base.f_frag  # bounded; no reserved: kept


def test_expandable_runs_learn_their_own_margin():
    cal = record_run(H100, 10 * GiB, 10 * GiB, int(10.2 * GiB), expandable=True)
    assert cal.frag is None and cal.frag_expandable == pytest.approx(0.02)


@pytest.mark.parametrize("content", [b"{not json", b'{"schema": "something else"}',
                                     b'{"schema": "oomguard.calibration/1", "machines": {"k": {"runs": [{}]}}}',
                                     b"\xff\xfe\x00"])
def test_corrupt_file_warns_once_and_is_kept_aside(store, content):
    store.mkdir(parents=True)
    calibration_path().write_bytes(content)
    lines: list[str] = []
    assert load_calibration(H100, warn=lines.append) is None
    assert len(lines) == 1 and "calibration.json" in lines[0] and "\n" not in lines[0]
    aside = [p for p in store.iterdir() if p.name.startswith("calibration.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == content  # kept, byte for byte
    cal = record_run(H100, 10 * GiB, 9 * GiB, None, warn=lines.append)
    assert cal.runs == 1 and len(lines) == 1  # the fresh file is fine


def test_unwritable_cache_warns_and_goes_on(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(blocker / "cache"))
    lines: list[str] = []
    assert record_run(H100, 10 * GiB, 9 * GiB, None, warn=lines.append) is None
    assert len(lines) == 1 and "OOMGUARD_CACHE_DIR" in lines[0]
    assert blocker.read_text() == "not a directory"


def test_concurrent_runs_keep_every_entry():
    per = KEEP // 2
    code = ("import sys; from oomguard.memory.calibration import record_run; "
            f"[record_run({H100!r}, 100, 90 + int(sys.argv[1]), None) for _ in range({per})]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)]) for i in range(2)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    cal = load_calibration(H100)
    assert cal.runs == 2 * per
    assert sorted({e["measured"] for e in cal.entries}) == [90, 91]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomguard", "plan", "--model", LLAMA, "--gpu", "24GiB",
                           "dtype=bfloat16", *args], capture_output=True, text=True)


def test_plan_says_which_calibration_it_used():
    text = plan()
    assert text.returncode == 0, text.stderr
    assert "calibration: built-in: fitted to H100 measurements, 2026-11-22" in text.stdout
    before = json.loads(plan("--json").stdout)
    assert before["calibration"] == {"source": "built-in", "description": builtin_description()}
    # a probe of another model on this machine teaches this one nothing
    key = machine_key(gpu_name(), simulated=False)
    record_run(key, 10 * GiB, 5 * GiB, int(5.5 * GiB), model="L2 h64 i256 a4/4x16 v1000")
    assert json.loads(plan("--json").stdout)["calibration"]["source"] == "built-in"
    # a probe of this model measured 10% less than the built-in model predicted: plan starts from that
    record_run(key, 10 * GiB, 9 * GiB, int(9.5 * GiB), model=model_key(load_model_spec(LLAMA)))
    after = json.loads(plan("--json").stdout)
    assert after["calibration"]["source"] == "machine" and after["calibration"]["runs"] == 1
    assert after["peak_bytes"] < before["peak_bytes"]
    assert "calibration: learned on this machine" in plan().stdout
