"""Memory snapshots: plain data only, both forms and spellings, a useful summary, findings for OOM events."""

import os
import pickle
import subprocess
import sys

import pytest

from oomguard.oom.analyze import analyze_paths
from oomguard.oom.snapshot import SnapshotError, load_snapshot_bytes, summarize

MiB = 2**20
FRAMES = [{"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
          {"filename": "/home/me/train.py", "line": 42, "name": "train_step"}]


def segment(total, blocks, kind="large", device=0):
    return {"device": device, "address": 0, "total_size": total, "allocated_size": 0, "active_size": 0,
            "requested_size": 0, "stream": 0, "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": blocks}


def block(size, state, frames=FRAMES):
    return {"address": 0, "size": size, "requested_size": size, "state": state, "frames": frames}


def snapshot(pending_spelling="active_pending_free"):
    segs = [
        segment(20 * MiB, [block(2 * MiB, "active_allocated"), block(18 * MiB, "inactive")]),
        segment(20 * MiB, [block(4 * MiB, pending_spelling), block(16 * MiB, "active_allocated")]),
        segment(2 * MiB, [block(512, "active_allocated", []), block(2 * MiB - 512, "inactive", [])], kind="small"),
    ]
    traces = [[{"action": "alloc", "addr": 1, "size": 10, "stream": 0, "frames": []},
               {"action": "oom", "device_free": 3 * MiB, "size": 30 * MiB, "stream": 0, "frames": FRAMES}]]
    return {"segments": segs, "device_traces": traces, "allocator_settings": {"expandable_segments": False}}


def test_summary_of_pools_blocks_and_fragmentation():
    s = summarize(load_snapshot_bytes(pickle.dumps(snapshot())))
    assert s.reserved == 42 * MiB
    assert s.allocated == 18 * MiB + 512
    assert s.pools["large"].segments == 2 and s.pools["small"].reserved == 2 * MiB
    assert s.largest_free == 18 * MiB
    assert 0 < s.fragmentation < 1
    top = s.largest_blocks[0]
    assert top.size == 16 * MiB and top.frame.name == "train_step"  # the first frame outside torch
    assert len(s.oom_events) == 1 and s.oom_events[0].size == 30 * MiB


@pytest.mark.parametrize("spelling", ["active_pending_free", "active_awaiting_free"])
def test_both_block_state_spellings_count_as_active(spelling):
    s = summarize(load_snapshot_bytes(pickle.dumps(snapshot(spelling))))
    assert s.pools["large"].active == 22 * MiB


def test_list_form_of_memory_snapshot():
    s = summarize(load_snapshot_bytes(pickle.dumps(snapshot()["segments"])))
    assert s.reserved == 42 * MiB and s.oom_events == []


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/oomguard-pwned",))


def test_code_in_a_pickle_is_refused_and_never_run(tmp_path):
    marker = "/tmp/oomguard-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    with pytest.raises(SnapshotError, match=r"refuses to load posix\.system"):
        load_snapshot_bytes(pickle.dumps({"segments": [], "x": Evil()}))
    assert not os.path.exists(marker)


def test_analyze_a_snapshot_gives_a_finding_per_oom_event(tmp_path):
    p = tmp_path / "snap.pickle"
    p.write_bytes(pickle.dumps(snapshot()))
    r = analyze_paths([str(p)])
    assert len(r.findings) == 1
    f = r.findings[0]
    assert f["requested_bytes"] == 30 * MiB and f["free_bytes"] == 3 * MiB and f["backend"] == "cuda"
    assert f["frames"][-1]["name"] == "forward"
    assert r.snapshots[0]["reserved_bytes"] == 42 * MiB


def test_cli_refuses_a_malicious_pickle_with_exit_2(tmp_path):
    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "x": Evil()}))
    out = subprocess.run([sys.executable, "-m", "oomguard", "analyze", str(p)], capture_output=True, text=True)
    assert out.returncode == 2
    assert "refuses to load posix.system" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_truncated_and_non_snapshot_pickles(tmp_path):
    with pytest.raises(SnapshotError, match="not a readable pickle"):
        load_snapshot_bytes(pickle.dumps(snapshot())[:50])
    with pytest.raises(SnapshotError, match="not a memory snapshot"):
        load_snapshot_bytes(pickle.dumps({"weights": [1, 2]}))


# --------------------------------------------------------------------------------------------------------------
# A real snapshot (H100, torch 2.11): a process capped at 4 GiB allocating 300 MiB blocks until one failed.

from pathlib import Path  # noqa: E402

GiB = 2**30
REAL = Path(__file__).parent / "fixtures" / "h100" / "snapshot-real-oom.pickle"


def test_real_snapshot_figures_and_the_inferred_allowance():
    s = summarize(load_snapshot_bytes(REAL.read_bytes()))
    # the message's figures, to its two decimals: "3.54 GiB is allocated ... 311.88 MiB is reserved ... unallocated"
    assert round(s.allocated / GiB, 2) == 3.54 and round(s.reserved_unallocated / MiB, 2) == 311.88
    (ev,) = s.oom_events
    assert ev.size == 300 * MiB and round(ev.device_free / GiB, 2) == 74.82
    low, high = s.allowance(ev)
    assert low <= 4 * GiB < high  # the real allowance was 4.00 GiB
    event = s.to_dict()["oom_events"][0]
    assert event["limited_by"] == "allowance"
    assert (event["allowed_min_bytes"], event["allowed_max_bytes"]) == (low, high)


def test_real_snapshot_is_a_shortfall_under_its_allowance_not_fragmentation():
    (f,) = analyze_paths([str(REAL)]).findings
    assert f["kind"] == "shortfall"
    assert f["allowed_min_bytes"] <= 4 * GiB < f["allowed_bytes"]
    text = " ".join(f["evidence"])
    assert "hit its own allowance of at least 3.85 GiB and below 4.14 GiB (inferred)" in text
    assert "74.82 GiB free" in text and "yet this is not fragmentation" in text


def test_a_full_device_infers_no_allowance(tmp_path):
    s = summarize(load_snapshot_bytes(pickle.dumps(snapshot())))  # 3 MiB free for a 30 MiB request
    assert s.allowance(s.oom_events[0]) is None
    assert s.to_dict()["oom_events"][0]["limited_by"] == "device"
    (f,) = analyze_paths([_write(snapshot(), tmp_path)]).findings
    assert f["allowed_bytes"] is None and "allowed_min_bytes" not in f


def _write(snap, where: Path) -> str:
    p = where / "snap.pickle"
    p.write_bytes(pickle.dumps(snap))
    return str(p)
