"""The caching-allocator model (pure, no torch) and the replay of the simulated device's allocation traces."""

from __future__ import annotations

import doctest
import gc
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.child import simulate
from oomguard.memory import allocmodel
from oomguard.memory.allocmodel import LARGE_BUFFER, PAGE, SMALL_BUFFER, AllocatorModel, round_size, segment_size

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]


def _load_trace_module():
    spec = importlib.util.spec_from_file_location("bench_trace", ROOT / "bench" / "_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


trace = _load_trace_module()


def test_doctests():
    assert doctest.testmod(allocmodel).failed == 0
    assert doctest.testmod(trace).failed == 0


def test_the_model_is_pure():
    """The supervisor side may use it: importing it must not import torch."""
    code = "import sys, oomguard.memory.allocmodel; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_sizes_round_like_the_cuda_allocator():
    assert round_size(1) == 512 and round_size(1000) == 1024
    assert segment_size(1000) == SMALL_BUFFER
    assert segment_size(3 * MiB) == LARGE_BUFFER
    assert segment_size(11 * MiB) == 12 * MiB


def test_blocks_split_merge_and_cache():
    m = AllocatorModel(100 * MiB)
    a = m.malloc(3 * MiB)
    b = m.malloc(3 * MiB)
    assert m.reserved == 20 * MiB and m.allocated == 6 * MiB  # one 20 MiB segment, split
    m.free(a)
    m.free(b)
    assert m.allocated == 0 and m.reserved == 20 * MiB  # cached, not returned
    assert m.peak_allocated == 6 * MiB and m.peak_reserved == 20 * MiB
    m.release_cached()
    assert m.reserved == 0


def test_fragmentation_raises_with_reserved_but_unallocated_memory():
    m = AllocatorModel(60 * MiB)
    blocks = [m.malloc(3 * MiB) for _ in range(18)]  # three 20 MiB segments
    for b in blocks[::2]:
        m.free(b)
    with pytest.raises(MemoryError) as e:
        m.malloc(12 * MiB)  # no free run is that long and no segment is entirely free
    assert e.value.args[0] == 12 * MiB
    assert m.reserved - m.allocated >= 12 * MiB
    assert (m.num_alloc_retries, m.num_ooms) == (1, 1)


def test_cached_segments_are_released_before_an_oom():
    m = AllocatorModel(80 * MiB)
    m.free(m.malloc(60 * MiB))
    assert m.reserved == 60 * MiB
    m.malloc(70 * MiB)  # does not fit next to the cached 60 MiB: released and retried, no OOM
    assert (m.reserved, m.num_alloc_retries, m.num_ooms) == (70 * MiB, 1, 0)


def test_max_split_keeps_large_cached_blocks_whole():
    def reserved_after_small_request(max_split):
        m = AllocatorModel(1024 * MiB, max_split=max_split)
        m.free(m.malloc(100 * MiB))
        m.malloc(3 * MiB)
        return m.reserved

    assert reserved_after_small_request(None) == 100 * MiB  # the cached block is split
    assert reserved_after_small_request(64 * MiB) == 120 * MiB  # it is not: a new 20 MiB segment


def test_expandable_segments_reuse_freed_granules():
    m = AllocatorModel(64 * MiB, expandable=True)
    blocks = [m.malloc(3 * MiB) for _ in range(18)]  # 54 MiB over three 20 MiB granules
    for b in blocks[:7]:
        m.free(b)  # the first granule (and a bit) is free again
    m.malloc(12 * MiB)  # its granule is unmapped and mapped again where the new block goes
    assert m.reserved == 60 * MiB
    small = m.malloc(1000)
    assert small is not None and m.reserved % PAGE == 0


class _Storage:
    """Stands in for a torch storage: the simulated device only asks for ``nbytes()`` and a weak reference."""

    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n


def test_a_recorded_trace_replays_to_the_device_figures(tmp_path, monkeypatch):
    """bench/min_budget.py's premise: replaying a run's trace gives the peaks the device measured, and the smallest
    budget it finds is one the run fits in, and one MiB less is not."""
    path = tmp_path / "trace.txt"
    monkeypatch.setenv(simulate.TRACE_ENV, str(path))
    monkeypatch.delenv("RANK", raising=False)
    dev = simulate.SimulatedDevice(256 * MiB, expandable=False, max_split=None)
    keep = [_Storage(n) for n in (3 * MiB, 700, 25 * MiB, 5 * MiB)]
    for s in keep:
        dev.track(s)
    del keep[1:3]
    gc.collect()
    dev.release_cached()
    for n in (9 * MiB, 40 * MiB):
        s = _Storage(n)
        keep.append(s)
        dev.track(s)
    dev.dump_trace(str(path))

    events, expandable = trace.read_trace(str(path))
    assert not expandable and [e[0] for e in events].count("f") == 2 and ("e", 0, 0) in events
    fits, facts = trace.replay(events, 256 * MiB)
    assert fits and facts == {"peak_allocated": dev.model.peak_allocated, "peak_reserved": dev.model.peak_reserved}
    least = trace.min_capacity(events)
    assert trace.replay(events, least)[0] and not trace.replay(events, least - MiB)[0]
