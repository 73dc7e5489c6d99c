"""`oomguard analyze` reads a run's memory trace back (oomguard/oom/trace_log.py) from oomguard's events, metric logs
(verl's console, transformers' printed dicts, trainer_state.json) and printed memory, and says leak, long sample or
fragmentation in the same words as the live trend (tests/fixtures/trace/)."""

from __future__ import annotations

import io
import json
import subprocess

import pytest

from oomguard.oom.analyze import analyze_paths
from oomguard.oom.trace_log import read_traces
from oomguard.vocab.sizes import GiB, MiB

from helpers import PYTHON, ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "trace"


def _trends(name: str) -> list[dict]:
    return analyze_paths([str(FIXTURES / name)]).trends


def _kinds(t: dict) -> list[str]:
    return [v["kind"] for v in t["verdicts"]]


def test_oomguard_events_one_trace_per_process() -> None:
    first, second = _trends("events.jsonl")
    assert (first["pid"], first["steps"], second["pid"], second["steps"]) == (101, 9, 202, 4)
    (leak,) = first["verdicts"]
    assert leak["kind"] == "leak" and leak["rate"] == 6 * MiB and leak["runs_out_at"] == 10
    assert leak["limit"] == 112 * MiB  # the device's size, as the training process sent it
    assert second["verdicts"] == []  # four steps after a restart: too few to judge


def test_a_users_prints_show_a_leak_and_the_oom_after_it_says_so() -> None:
    result = analyze_paths([str(FIXTURES / "user_prints.log")])
    (t,) = result.trends
    (leak,) = t["verdicts"]
    assert leak["kind"] == "leak" and abs(leak["rate"] - 64 * MiB) < 0.05 * 64 * MiB
    assert t["capacity_bytes"] == round(16.80 * GiB)  # from the OOM message in the same log
    assert leak["runs_out_at"] == 42
    (oom,) = result.findings
    assert oom["trend"] == ["leak"]
    assert oom["evidence"][-1] == leak["evidence"]
    assert oom["evidence"][-1].startswith("Leak: the memory kept at the end of each step grew by 63.")


def test_verl_console_a_long_sample_and_the_machines_memory_creeping() -> None:
    (t,) = _trends("verl_console.log")
    assert _kinds(t) == ["host-leak", "long-sample"]
    host, long = t["verdicts"]
    assert host["basis"] == "used" and abs(host["rate"] - 512 * MiB) < 0.05 * 512 * MiB
    assert host["evidence"].startswith("Host leak: the machine's used host memory grew by")
    assert (long["step"], long["tokens"], long["prompt_tokens"], long["completion_tokens"]) == (21, 4608, 512, 4096)


def test_deepspeed_see_memory_usage_cache_growing_is_fragmentation() -> None:
    (t,) = _trends("deepspeed_see_memory.log")
    assert _kinds(t) == ["fragmentation-growth"]
    assert abs(t["verdicts"][0]["rate"] - 100 * MiB) < 0.05 * 100 * MiB
    assert t["samples"][0] == {"step": 1, "kept": round(18.10 * GiB), "peak": round(27.41 * GiB),
                               "reserved": round(30.10 * GiB)}


def test_trainer_state_log_history() -> None:
    (t,) = _trends("trainer_state.json")
    assert t["input"] == "trace-metrics" and _kinds(t) == ["leak"] and t["verdicts"][0]["rate"] == 32 * MiB


def test_trl_logs_without_memory_are_no_trace() -> None:
    result = analyze_paths([str(FIXTURES / "trl_lengths_only.log")])
    assert result.trends == [] and result.files_read == 1


@pytest.mark.parametrize(("line", "expected"), [
    ("[MEM] [GRPO step 003/009] after training inner loop (peak = training VRAM): current=11.95GB  "
     "peak_since_reset=21.38GB", {"kept": round(11.95 * GiB), "peak": round(21.38 * GiB)}),
    ("2024-05-01 12:00:00,123 - INFO - step 1234 gpu_mem_allocated=12.3GiB peak_memory=14.1GiB",
     {"kept": round(12.3 * GiB), "peak": round(14.1 * GiB)}),
    ("Step 7: memory allocated: 812.5 MB, max memory allocated: 1024 MB, memory reserved: 1.5 GB, rss 3.2 GB",
     {"kept": round(812.5 * MiB), "peak": GiB, "reserved": round(1.5 * GiB), "host_rss": round(3.2 * GiB)}),
    ("[INFO] [utils.py:782:see_memory_usage] global_step=12 MA 12.34 GB         Max_MA 14.5 GB         CA 16.0 GB  "
     "       Max_CA 16 GB",
     {"kept": round(12.34 * GiB), "peak": round(14.5 * GiB), "reserved": 16 * GiB}),
    ("{'loss': 0.01, 'oomguard/kept_gib': 2.0, 'oomguard/step_peak_gib': 3.5, 'completions/max_length': 256.0}",
     {"kept": 2 * GiB, "peak": round(3.5 * GiB), "completion_tokens": 256}),
])
def test_printed_memory_lines(line: str, expected: dict) -> None:
    (trace,) = read_traces(io.BytesIO(line.encode() + b"\n"))
    (sample,) = trace.samples
    assert {k: v for k, v in sample.to_event().items() if k != "step"} == expected


def test_lines_that_are_not_memory_are_left_alone() -> None:
    text = (b"using GPU 0 to perform barrier as devices used by this process are currently unknown\n"
            b"step 3 loss 0.12 lr 1e-6\n"
            b"INFO Model loading took 2.88 GiB memory and 3.12 seconds\n"
            b"{'loss': 0.0132, 'completions/max_length': 256.0, 'epoch': 0.12}\n")
    assert read_traces(io.BytesIO(text)) == []


def test_a_restart_starts_a_new_trace_and_a_step_over_several_lines_is_one_sample() -> None:
    lines = [f"step {s} after generation: allocated {10 + s} GB, peak {20 + s} GB\nstep {s} after backward: "
             f"allocated {11 + s} GB, peak {25 + s} GB" for s in (1, 2, 3, 1, 2)]
    first, second = read_traces(io.BytesIO("\n".join(lines).encode()))
    assert [s.step for s in first.samples] == [1, 2, 3] and [s.step for s in second.samples] == [1, 2]
    assert first.samples[0].kept == 12 * GiB and first.samples[0].peak == 26 * GiB  # the last kept, the largest peak
    assert second.first_line == 7


def test_a_big_log_is_read_in_chunks_the_same() -> None:
    text = b"".join(b"noise line %d\nstep %d | allocated %d MiB | max allocated %d MiB\n" % (i, i, 100 + i, 200 + i)
                    for i in range(1, 400))
    whole = read_traces(io.BytesIO(text))
    chunked = read_traces(io.BytesIO(text), chunk_size=37)
    assert [s for t in chunked for s in t.samples] == [s for t in whole for s in t.samples]
    assert chunked[0].first_line == whole[0].first_line == 2 and chunked[0].last_line == whole[0].last_line


def test_analyze_cli_prints_the_trace_and_json_has_trends() -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    out = subprocess.run([PYTHON, "-m", "oomguard", "analyze", str(FIXTURES / "events.jsonl")], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "memory trace, 9 steps" in out.stdout and "Leak: the memory kept at the end of each step grew by 6.00 MiB" \
        in out.stdout
    js = subprocess.run([PYTHON, "-m", "oomguard", "analyze", "--json", str(FIXTURES / "verl_console.log")],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    data = json.loads(js.stdout)
    assert [v["kind"] for v in data["trends"][0]["verdicts"]] == ["host-leak", "long-sample"]
    assert data["findings"][0]["trend"] == ["host-leak", "long-sample"]
