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

from oomguard.oom import BACKENDS, OOMReport, is_oom, parse_oom, scan_stream, scan_text
from oomguard.sizes import GiB, KiB, MiB, format_size, parse_size

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
                                            r"Killed process|less than desired", f, re.IGNORECASE)]
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
