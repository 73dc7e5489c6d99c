"""The OOM fixture corpus: every real-shaped message (and every trap) through scan_text and scan_stream.

Each file under ``tests/fixtures/oom/`` names its public source in a ``#`` comment on its first lines;
``expected.json`` lists the findings a reader of the text expects, in file order (see its ``_comment``).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard.oom.diagnose import diagnose
from oomguard.oom.parse import (
    Hit,
    is_oom,
    oom_in_chain,
    parse_oom,
    report_from_exception,
    scan_stream,
    scan_text,
    strip_prefix,
)
from oomguard.vocab.oomreport import OOMReport

FIXTURES = Path(__file__).parent / "fixtures" / "oom"
_DOC = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))
EXPECTED: dict[str, list[dict[str, Any]]] = {k: v for k, v in _DOC.items() if not k.startswith("_")}
NAMES = sorted(EXPECTED)
FIGURES = ("requested", "capacity", "free", "allocated", "reserved_unallocated", "process", "allowed", "private_pools")
OPTIONAL = ("device", "pid", "rank", "last_frame", "kind", "max_seq_len", "kv_cache_tokens")


def _bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def _text(name: str) -> str:
    return _bytes(name).decode("utf-8")


def summarise(hit: Hit, like: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields of a hit that expected.json talks about (optional keys only where the expectation has them)."""
    r = hit.report
    out: dict[str, Any] = {"line": hit.line, "backend": r.backend, "origin": r.origin}
    out.update({f: getattr(r, f) for f in FIGURES})
    out["other_processes"] = [[p.pid, p.bytes] for p in r.other_processes]
    optional = {
        "device": lambda: r.device,
        "pid": lambda: r.pid,
        "rank": lambda: hit.rank,
        "last_frame": lambda: hit.frames[-1].name if hit.frames else None,
        "kind": lambda: diagnose(r, hit.frames).kind,
        "max_seq_len": lambda: r.max_seq_len,
        "kv_cache_tokens": lambda: r.kv_cache_tokens,
    }
    for key in OPTIONAL:
        if like is not None and key in like:
            out[key] = optional[key]()
    return out


def _compare(hits: list[Hit], expected: list[dict[str, Any]]) -> None:
    got = [summarise(h, e) for h, e in zip(hits, expected, strict=False)]
    got += [summarise(h) for h in hits[len(expected):]]
    assert got == expected


# --------------------------------------------------------------------------------------------------------------
# The corpus itself.


def test_every_fixture_has_an_expectation() -> None:
    files = sorted(p.name for p in FIXTURES.glob("*.txt"))
    assert files == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_fixture_names_its_source(name: str) -> None:
    head = _text(name).splitlines()[0]
    assert head.startswith(("# source:", "# trap"))


@pytest.mark.parametrize("name", NAMES)
def test_scan_text(name: str) -> None:
    _compare(scan_text(_text(name)), EXPECTED[name])


@pytest.mark.parametrize("chunk_size", [64, 4 << 20])
@pytest.mark.parametrize("name", NAMES)
def test_scan_stream(name: str, chunk_size: int) -> None:
    _compare(list(scan_stream(io.BytesIO(_bytes(name)), chunk_size=chunk_size)), EXPECTED[name])


@pytest.mark.parametrize("name", [n for n in NAMES if EXPECTED[n]])
def test_message_parses_on_its_own(name: str) -> None:
    """The message a hit carries is self-contained: parsing it again gives the same report."""
    for hit in scan_text(_text(name)):
        again = parse_oom(hit.report.message)
        assert again is not None
        assert (again.backend, again.origin) == (hit.report.backend, hit.report.origin)
        assert [getattr(again, f) for f in FIGURES] == [getattr(hit.report, f) for f in FIGURES]
        assert again.other_processes == hit.report.other_processes


def test_traps_are_covered() -> None:
    traps = [n for n in NAMES if n.startswith("trap_")]
    assert len(traps) >= 8
    assert all(EXPECTED[n] == [] for n in traps)


def test_parse_oom_reads_the_seed_message() -> None:
    seed = next(ln for ln in _text("cuda_seed_rtx3080_grpo.txt").splitlines() if "Tried to allocate" in ln)
    r = parse_oom(seed)
    assert r is not None
    assert r.requested == round(1.90 * 2**30) and r.capacity == round(15.73 * 2**30) and r.free == round(1.28 * 2**30)
    assert r.process == round(14.43 * 2**30) and r.allocated == round(11.82 * 2**30)
    assert r.reserved_unallocated == round(2.41 * 2**30)


def test_report_round_trips_through_dict() -> None:
    hit = scan_text(_text("vllm_enginecore_cuda_oom.txt"))[0]
    assert OOMReport.from_dict(json.loads(json.dumps(hit.report.to_dict()))) == hit.report


def test_scan_stream_respects_max_bytes() -> None:
    data = _bytes("cuda_several_neighbours.txt")
    assert list(scan_stream(io.BytesIO(data), chunk_size=64, max_bytes=200)) == []


@pytest.mark.parametrize("data", [b"", b"\n", b"MemoryError", b"no newline at all and no oom"])
def test_scan_stream_edge_inputs(data: bytes) -> None:
    got = [(h.line, h.report.origin) for h in scan_stream(io.BytesIO(data), chunk_size=4)]
    assert got == [(h.line, h.report.origin) for h in scan_text(data.decode())]


CUDA_OOM = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 7.79 GiB of which 3.44 MiB is "
            "free. Of the allocated memory 7.12 GiB is allocated by PyTorch, and 41.77 MiB is reserved by PyTorch but "
            "unallocated.")
MPS_OOM = ("MPS backend out of memory (MPS allocated: 8.89 GB, other allocations: 172.98 MB, max allowed: 9.07 GB). "
           "Tried to allocate 6.25 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit "
           "for memory allocations (may cause system failure).")


def test_wrapped_message_skips_other_ranks_lines() -> None:
    text = "\n".join([
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total",
        "[rank0]: MemoryError",
        "[rank1]: capacity of 15.73 GiB of which 1.02 GiB is free. Of the allocated memory 13.10 GiB is allocated by",
        "[rank1]: PyTorch, and 1.21 GiB is reserved by PyTorch but unallocated.",
    ])
    hits = scan_text(text)
    assert [(h.line, h.rank, h.report.origin) for h in hits] == [(1, 1, "allocator"), (2, 0, "python")]
    r = hits[0].report
    assert (r.device, r.capacity, r.free) == (1, round(15.73 * 2**30), round(1.02 * 2**30))
    assert r.reserved_unallocated == round(1.21 * 2**30)


def test_quoted_head_in_source_line_is_not_the_message() -> None:
    text = "\n".join([
        "vllm-1  | ERROR 11-18 18:07:28 engine.py:366]   File \"/x/worker.py\", line 493, in raise_if_cache_size_invalid",
        "vllm-1  | ERROR 11-18 18:07:28 engine.py:366]     raise ValueError(\"No available memory for the cache blocks. \"",
        "vllm-1  | ERROR 11-18 18:07:28 engine.py:366] ValueError: No available memory for the cache blocks. Try "
        "increasing `gpu_memory_utilization` when initializing the engine.",
    ])
    assert [(h.line, h.report.origin, h.frames[-1].name) for h in scan_text(text)] == [
        (3, "vllm-kv", "raise_if_cache_size_invalid")]


def test_frames_of_an_unrelated_earlier_traceback_are_not_attached() -> None:
    text = "\n".join(
        ["Traceback (most recent call last):", '  File "a.py", line 1, in warmup', "    f()",
         "ValueError: harmless"] + [f"step {i} loss 0.1" for i in range(30)] + [MPS_OOM]
    )
    (hit,) = scan_text(text)
    assert hit.frames == ()


def test_hit_lines_count_newlines_only() -> None:
    text = "a\rb\r\nc\x0bd\x85e\u2028f\nMemoryError\n"
    assert [h.line for h in scan_text(text)] == [3]
    assert [h.line for h in scan_stream(io.BytesIO(text.encode()))] == [3]


# --------------------------------------------------------------------------------------------------------------
# Live exceptions.

class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError: matched by name, torch is not imported."""


class AcceleratorError(RuntimeError):
    """Stands in for torch.AcceleratorError."""


def _raised(make) -> BaseException:
    try:
        make()
    except BaseException as e:  # the test wants whatever was raised
        return e
    raise AssertionError("nothing raised")


def test_is_oom_memoryerror() -> None:
    def alloc() -> None:
        raise MemoryError()

    assert is_oom(_raised(alloc))
    assert report_from_exception(MemoryError()).backend == "host"


def test_is_oom_by_type_name_without_text() -> None:
    assert is_oom(OutOfMemoryError())


def test_is_oom_mps_runtimeerror() -> None:
    exc = RuntimeError(MPS_OOM)
    assert is_oom(exc)
    r = report_from_exception(exc)
    assert (r.backend, r.origin, r.requested) == ("mps", "mps", round(6.25 * 2**20))


def test_is_oom_accelerator_error() -> None:
    assert is_oom(AcceleratorError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs"))
    assert not is_oom(AcceleratorError("CUDA error: device-side assert triggered"))


def test_is_oom_through_cause() -> None:
    inner = RuntimeError(CUDA_OOM)

    def wrap() -> None:
        raise ValueError("compiled graph failed") from inner

    outer = _raised(wrap)
    assert outer.__cause__ is inner
    assert is_oom(outer)
    assert oom_in_chain(outer) is inner
    assert report_from_exception(outer).requested == 20 * 2**20


def test_is_oom_through_context() -> None:
    def handle() -> None:
        try:
            raise RuntimeError(CUDA_OOM)
        except RuntimeError:
            raise KeyError("cleanup failed")  # implicit chaining is what is tested

    outer = _raised(handle)
    assert outer.__cause__ is None and outer.__context__ is not None
    assert is_oom(outer)
    assert oom_in_chain(outer) is outer.__context__


def test_is_oom_looks_behind_a_cause_at_the_context() -> None:
    # ``raise X from Y`` inside ``except Z``: the OOM is the context of Y's raiser, not the cause.
    def handle() -> None:
        try:
            raise RuntimeError(CUDA_OOM)
        except RuntimeError:
            raise ValueError("wrapped") from KeyError("unrelated")

    outer = _raised(handle)
    assert is_oom(outer)


def test_is_oom_non_oom_chain() -> None:
    def wrap() -> None:
        try:
            raise KeyError("missing")
        except KeyError as e:
            raise ValueError("bad config") from e

    assert not is_oom(_raised(wrap))
    assert not is_oom(RuntimeError("Expandable segments are not compatible with memory pool."))
    assert not is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                                   "non-contiguous input."))
    assert not is_oom(None)


def test_is_oom_cycle_terminates() -> None:
    a, b = ValueError("a"), KeyError("b")
    a.__cause__ = b
    b.__context__ = a
    assert not is_oom(a)
    c = RuntimeError(CUDA_OOM)
    b.__cause__ = c
    c.__context__ = a
    assert is_oom(a)
    assert oom_in_chain(a) is c


def test_unsloth_standby_memoryerror_is_not_an_oom() -> None:
    def load() -> None:
        try:
            raise AssertionError("Standby mode is not supported with expandable segments.\nPlease set environment "
                                 "variable PYTORCH_CUDA_ALLOC_CONF without `expandable_segments:True`.\n")
        except AssertionError as e:
            raise MemoryError("Unsloth: Your GPU ran out of memory loading vLLM with standby mode enabled. Original "
                              f"error: {e}") from e

    assert not is_oom(_raised(load))


def test_str_that_raises_is_not_fatal() -> None:
    class Weird(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    assert not is_oom(Weird())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is 3.11+")
def test_is_oom_inside_exception_group() -> None:
    group = ExceptionGroup("rank failures", [ValueError("x"), RuntimeError(CUDA_OOM)])  # noqa: F821 - 3.11 builtin
    assert is_oom(group)


# --------------------------------------------------------------------------------------------------------------
# Prefixes.


@pytest.mark.parametrize(
    ("line", "stripped"),
    [
        ("[rank3]: torch.OutOfMemoryError: CUDA out of memory.", "torch.OutOfMemoryError: CUDA out of memory."),
        ("[rank12]:   File \"/w/train.py\", line 9, in <module>", "File \"/w/train.py\", line 9, in <module>"),
        ("[default0]:torch.OutOfMemoryError: x", "torch.OutOfMemoryError: x"),
        ("[1]<stderr>: RuntimeError: x", "RuntimeError: x"),
        ("(EngineCore pid=207) ERROR 01-02 03:04:05 [core.py:123] torch.OutOfMemoryError: x", "torch.OutOfMemoryError: x"),
        ("(EngineCore_DP0 pid=223840) ERROR 10-25 13:08:43 [core.py:708]   File \"/x.py\", line 1, in f",
         "File \"/x.py\", line 1, in f"),
        ("(RayWorkerWrapper pid=7106, ip=192.168.10.10) ERROR 02-24 20:21:58 [worker_base.py:620] ValueError: x",
         "ValueError: x"),
        ("[2026-02-24T20:21:58Z] (EngineCore_DP0 pid=6940) ValueError: x", "ValueError: x"),
        ("E       torch.OutOfMemoryError: x", "torch.OutOfMemoryError: x"),
        ("E   MemoryError", "MemoryError"),
        ("2025-11-14T08:52:38.3746210Z FAILED [0.0004s] test.py::t - x", "FAILED [0.0004s] test.py::t - x"),
        ("2024-04-29T14:55:41,679700+02:00 Out of memory: Killed process 1", "Out of memory: Killed process 1"),
        ("[ 4018.450000] Killed process 935 (python)", "Killed process 935 (python)"),
        ("2024-05-11 02:24:26,980 - es_kb_service.py[line:147] - ERROR: x", "es_kb_service.py[line:147] - ERROR: x"),
        ("ERROR    | 2024-08-22 02:25:32 | autotrain.trainers.common:wrapper:121 - HIP error: out of memory",
         "autotrain.trainers.common:wrapper:121 - HIP error: out of memory"),
        ("WARNING:root:CUDA out of memory. Tried to allocate 1.72 GiB", "CUDA out of memory. Tried to allocate 1.72 GiB"),
        ("INFO 12-05 16:02:41 model_runner.py:1072] Loading model weights", "Loading model weights"),
        ("vllm-1  | ERROR 11-18 18:07:28 engine.py:366] ValueError: x", "ValueError: x"),
        ("torch.OutOfMemoryError: CUDA out of memory.", "torch.OutOfMemoryError: CUDA out of memory."),
        ("    raise ValueError(", "    raise ValueError("),
    ],
)
def test_strip_prefix(line: str, stripped: str) -> None:
    assert strip_prefix(line) == stripped



# --------------------------------------------------------------------------------------------------------------
# Issue 12 §3: forms seen in public logs.


def test_one_host_kill_reported_twice_is_one_finding_two_kills_are_two() -> None:
    shell = "/var/spool/slurmd/job00191/slurm_script: line 28:  {pid} Killed                  python3 main.py"
    kernel = "kernel: Memory cgroup out of memory: Killed process {pid} (python3) total-vm:1kB, anon-rss:2048kB"
    step = ("slurmstepd: error: Detected 1 oom-kill event(s) in StepId=191.batch cgroup. Some of your processes may "
            "have been killed by the cgroup out-of-memory handler.")
    for lines in ([shell.format(pid=8156), step], [step, shell.format(pid=8156)], [kernel.format(pid=8156), step],
                  [kernel.format(pid=8156), shell.format(pid=8156), step]):
        assert len(scan_text("\n".join(lines))) == 1, lines
    two = scan_text("\n".join([kernel.format(pid=1), kernel.format(pid=2), step]))
    assert [h.report.pid for h in two] == [1, 2]


def test_thc_precursor_yields_to_the_runtime_error_that_follows() -> None:
    thc = "THCudaCheck FAIL file=/pytorch/torch/lib/THC/generic/THCStorage.cu line=58 error=2 : out of memory"
    err = "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/torch/lib/THC/generic/THCStorage.cu:58"
    assert [h.line for h in scan_text("\n".join([thc, "Traceback (most recent call last):", err]))] == [3]
    assert [h.line for h in scan_text(thc)] == [1]


def test_live_exceptions_of_the_new_forms() -> None:
    async_oom = OutOfMemoryError("Allocation on device ")
    assert is_oom(async_oom)
    r = report_from_exception(async_oom)
    assert (r.backend, r.origin) == ("cuda", "async-allocator")
    ray = RuntimeError("Task was killed due to the node running low on memory.\nMemory on the node (IP: 1.2.3.4, ID: "
                       "ab) where the task (task ID: cd, name=f, pid=548, memory used=12.18GB) was running was "
                       "21.91GB / 33.28GB (0.658192), which exceeds the memory usage threshold of 0.65.")
    assert is_oom(ray)
    r = report_from_exception(ray)
    assert (r.backend, r.origin, r.pid, r.process) == ("host", "ray", 548, 12_180_000_000)
    assert (r.capacity, r.free, r.allowed) == (33_280_000_000, 11_370_000_000, 21_632_000_000)
    assert is_oom(RuntimeError("The model's max seq len (4096) is larger than the maximum number of tokens that can "
                               "be stored in KV cache (3664)."))
    assert not is_oom(RuntimeError("Allocation on device 0 launch on device 1"))
