"""Property tests for the OOM parser: it never raises, streaming agrees with whole-text scanning, sizes round-trip.

Besides arbitrary text, inputs are built from fragments of the real messages in ``tests/fixtures/oom`` (cut at
sentence and clause boundaries, joined with random separators), which reach far deeper into the parser than random
characters do.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomguard.oom.parse import is_oom, parse_oom, scan_stream, scan_text
from oomguard.vocab.oomreport import BACKENDS, OOMReport
from oomguard.vocab.sizes import GiB, KiB, MiB, format_size, parse_size

FIXTURES = Path(__file__).parent / "fixtures" / "oom"


def _fragments() -> list[str]:
    pieces: set[str] = set()
    for path in sorted(FIXTURES.glob("*.txt")):
        for line in path.read_text(encoding="utf-8").replace("\r", "").split("\n"):
            if not line.strip() or line.startswith("#"):
                continue
            pieces.add(line)
            pieces.update(p for p in re.split(r"(?<=[.;,)])\s+", line) if p)
    pieces.update([
        "17179869184.00 GiB", "Tried to allocate", "more than 1EB memory.", "[rank3]: ", "[rank1]: ", "E   ",
        "(EngineCore pid=7) ERROR 01-02 03:04:05 [core.py:1] ", 'File "x.py", line 1, in f', '    raise ValueError("',
        "Traceback (most recent call last):", "MemoryError", "...", "(", ")", "'", '"', "0 bytes", "GPU 0", "of which",
        "Process 12 has", "memory in use.", "but unallocated.", "cached)", "\u2026",
    ])
    return sorted(pieces)


FRAGMENTS = _fragments()
# Fragments that carry the start of a message, drawn as often as all the others together.
HEADS = [f for f in FRAGMENTS if re.search(r"out of memory|ALLOC_FAILED|MemoryError|KV cache|cache blocks|oom.kill|"
                                            r"Killed process|less than desired|low on memory|Allocation on device|"
                                            r"THCudaCheck|Failed to CUDA calloc|Exception Type", f, re.IGNORECASE)]
SEPARATORS = ["\n", "", " ", "\r\n", "\r", "\n\n", "  "]

_piece = st.one_of(st.sampled_from(HEADS), st.sampled_from(FRAGMENTS))
fragment_text = st.lists(st.tuples(_piece, st.sampled_from(SEPARATORS)), max_size=30).map(
    lambda parts: "".join(a + b for a, b in parts)
)
any_text = st.one_of(st.text(max_size=400), fragment_text)

FIGURES = ("requested", "capacity", "free", "allocated", "reserved_unallocated", "process", "allowed", "private_pools")

# OOMGUARD_HYPOTHESIS_SCALE=20 runs twenty times as many examples (a longer bug hunt than CI needs).
SCALE = max(1, int(os.environ.get("OOMGUARD_HYPOTHESIS_SCALE", "1")))
fast = settings(max_examples=100 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
few = settings(max_examples=25 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_report(r: OOMReport) -> None:
    assert r.backend in BACKENDS
    assert r.message
    for f in FIGURES:
        v = getattr(r, f)
        assert v is None or (isinstance(v, int) and 0 <= v <= 2**60)
    for p in r.other_processes:
        assert p.bytes is None or 0 <= p.bytes < 2**60


@fast
@given(any_text)
def test_scan_text_never_raises(text: str) -> None:
    n_lines = text.count("\n") + 1
    last = 0
    for hit in scan_text(text):
        assert last < hit.line <= n_lines
        last = hit.line
        _check_report(hit.report)


@fast
@given(any_text)
def test_parse_oom_never_raises(text: str) -> None:
    r = parse_oom(text)
    if r is not None:
        _check_report(r)
    is_oom(RuntimeError(text))


@fast
@given(any_text, st.integers(min_value=1, max_value=300))
def test_scan_stream_matches_scan_text(text: str, chunk_size: int) -> None:
    data = text.encode("utf-8")
    assert list(scan_stream(io.BytesIO(data), chunk_size=chunk_size)) == scan_text(text)


@few
@given(st.lists(st.sampled_from(sorted(p.name for p in FIXTURES.glob("*.txt"))), min_size=1, max_size=4),
       st.integers(min_value=16, max_value=4096))
def test_scan_stream_matches_scan_text_on_concatenated_fixtures(names: list[str], chunk_size: int) -> None:
    data = b"".join((FIXTURES / n).read_bytes() for n in names)
    assert list(scan_stream(io.BytesIO(data), chunk_size=chunk_size)) == scan_text(data.decode("utf-8"))


def _unit(n: int) -> int:
    a = abs(n)
    return 1 if a <= 1024 else KiB if a <= MiB else MiB if a <= GiB else GiB


@settings(max_examples=300 * SCALE, deadline=None)
@given(st.one_of(st.integers(min_value=0, max_value=2**50),
                 st.sampled_from([0, 1, 1023, 1024, 1025, MiB - 1, MiB, MiB + 1, GiB - 1, GiB, GiB + 1, 2**50])))
def test_format_parse_round_trip(n: int) -> None:
    text = format_size(n)
    assert re.fullmatch(r"\d+ bytes|\d+\.\d\d (?:KiB|MiB|GiB)", text)
    back = parse_size(text)
    # two decimals of the unit, plus parse_size's rounding to whole bytes
    assert abs(back - n) <= 0.005 * _unit(n) + 1


# --------------------------------------------------------------------------------------------------------------
# The forms added for issue 12: their figures read back whatever the values, however the lines wrap.

_sizes = st.integers(min_value=0, max_value=2**44)
_wraps = st.sampled_from(["\n", " ", "\n  ", ""])


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}GB"


@fast
@given(st.integers(1, 2**40), st.floats(0.01, 0.99), st.floats(0.5, 1.0), st.integers(1, 2**22), st.integers(1, 2**37),
       st.booleans(), _wraps)
def test_ray_kill_figures_read_back(total, used_share, threshold, pid, task_bytes, old_wording, wrap):
    used = int(total * used_share)
    head = ("Task was killed" if old_wording else "3 worker(s) were killed") + " due to the node running low on memory."
    text = (f"ray.exceptions.OutOfMemoryError: {head}{wrap}Memory on the node (IP: 10.0.0.1, ID: ab) where the task "
            f"(task ID: cd, name=f, pid={pid}, memory used={_gb(task_bytes)}) was running was {_gb(used)} /{wrap}"
            f"{_gb(total)} ({used / total:.6f}), which exceeds the memory usage threshold of {threshold:.2f}.")
    (hit,) = scan_text(text)
    r = hit.report
    assert (r.backend, r.origin, r.pid) == ("host", "ray", pid)
    cap, u = parse_size(_gb(total)), parse_size(_gb(used))
    assert (r.capacity, r.free, r.process) == (cap, max(0, cap - u), parse_size(_gb(task_bytes)))
    assert r.allowed == round(float(f"{threshold:.2f}") * cap)
    assert parse_oom(r.message) == r


@fast
@given(_sizes, _sizes, _sizes, _sizes, st.integers(0, 7), st.booleans())
def test_cuda_malloc_async_figures_read_back(allocated, requested, total, free, device, fraction):
    limit = format_size(total // 2) if fraction else "17179869184.00 GiB"
    text = "\n".join([
        f"torch.cuda.OutOfMemoryError: Allocation on device {device} would exceed allowed memory. (out of memory)",
        f"Currently allocated     : {format_size(allocated)}", f"Requested               : {format_size(requested)}",
        f"Device limit            : {format_size(total)}", f"Free (according to CUDA): {format_size(free)}",
        "PyTorch limit (set by user-supplied memory fraction)", f"                        : {limit}",
    ])
    (hit,) = scan_text(text)
    r = hit.report
    assert (r.origin, r.backend, r.device) == ("async-allocator", "cuda", device)
    assert r.allocated == parse_size(format_size(allocated)) and r.requested == parse_size(format_size(requested))
    assert r.capacity == parse_size(format_size(total)) and r.free == parse_size(format_size(free))
    expect_allowed = parse_size(limit) if fraction and parse_size(limit) < parse_size(format_size(total)) else None
    assert r.allowed == expect_allowed
    assert parse_oom(r.message) == r


@fast
@given(st.integers(1, 2**40), st.lists(st.sampled_from(["", "host:1:2 [0] NCCL INFO proxy.cc:1303 -> 1"]), max_size=2))
def test_nccl_size_is_read_from_the_calloc_line(n, between):
    text = "\n".join(["host:1:2 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'", *between,
                      f"host:1:2 [3] include/alloc.h:185 NCCL WARN Failed to CUDA calloc {n} bytes",
                      "host:1:2 [3] NCCL INFO transport/p2p.cc:204 -> 1"])
    (hit,) = scan_text(text)
    assert (hit.line, hit.report.origin, hit.report.requested) == (1, "nccl", n)
    assert parse_oom(hit.report.message).requested == n


@fast
@given(st.integers(1, 10**7), st.integers(0, 10**7), _wraps)
def test_vllm_max_seq_len_token_counts_read_back(seq, kv, wrap):
    text = (f"ValueError: The model's max seq len ({seq}) is larger than the maximum number of tokens that can be "
            f"stored in KV cache ({kv}).{wrap}Try increasing `gpu_memory_utilization` or decreasing `max_model_len`.")
    hits = scan_text(text)
    assert len(hits) == 1
    r = hits[0].report
    assert (r.origin, r.backend, r.max_seq_len, r.kv_cache_tokens) == ("vllm-kv", "vllm", seq, kv)


@fast
@given(st.lists(st.integers(100, 120), min_size=0, max_size=4), st.integers(0, 3), st.randoms(use_true_random=False))
def test_one_finding_per_host_kill(pids, slurm_lines, rnd):
    kills = [f"kernel: Out of memory: Killed process {p} (python) total-vm:1kB, anon-rss:4kB" for p in pids]
    step = "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=7.batch cgroup."
    lines = kills + [step] * slurm_lines + ["step 1 loss 0.5"] * 3
    rnd.shuffle(lines)
    hits = scan_text("\n".join(lines))
    expected = len(set(pids)) or (1 if slurm_lines else 0)
    assert len(hits) == expected
    assert {h.report.pid for h in hits if h.report.origin != "slurm"} <= set(pids)  # one may have joined Slurm's
    assert list(scan_stream(io.BytesIO("\n".join(lines).encode()), chunk_size=32)) == hits


@fast
@given(st.integers(0, 30))
def test_thc_line_and_its_runtime_error_are_one_finding(gap):
    thc = "THCudaCheck FAIL file=/pytorch/THCStorage.cu line=58 error=2 : out of memory"
    err = "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/THCStorage.cu:58"
    lines = [thc, *[f"  File \"t.py\", line {i}, in f" for i in range(gap)], err]
    hits = scan_text("\n".join(lines))
    assert len(hits) == 1
    assert hits[0].line == (gap + 2 if gap + 1 <= 14 else 1)  # the RuntimeError, when close enough to see
    assert list(scan_stream(io.BytesIO("\n".join(lines).encode()), chunk_size=40)) == hits
