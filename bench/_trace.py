"""Allocation traces of the simulated device, replayed through the caching-allocator model at other budgets.

A run under ``OOMGUARD_SIMULATE_TRACE=PATH`` writes every allocation and free of its simulated device to PATH
(:meth:`oomguard.child.simulate.SimulatedDevice.dump_trace`): a header line ``# ... expandable=0|1``, then one line
per event, ``a ID BYTES`` (allocate), ``f ID`` (free) or ``e`` (``empty_cache``). Replaying it through
:class:`oomguard.memory.allocmodel.AllocatorModel` takes milliseconds, so ``bench/min_budget.py`` can bisect for the
smallest budget a configuration fits in without running it again.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from oomguard.memory.allocmodel import AllocatorModel, Block  # noqa: E402

Event = tuple[str, int, int]


def replay(events: list[Event], capacity: int, expandable: bool = False,
           max_split: int | None = None) -> tuple[bool, dict[str, int]]:
    """Replay a trace through the allocator model at ``capacity``: (fits, facts at the end or at the OOM).

    >>> replay([("a", 0, 3 << 20), ("a", 1, 3 << 20), ("f", 0, 0)], 20 << 20)[0]
    True
    >>> replay([("a", 0, 3 << 20), ("a", 1, 30 << 20)], 40 << 20)
    (False, {'request': 31457280, 'allocated': 3145728, 'reserved': 20971520})
    """
    m = AllocatorModel(capacity, expandable, max_split)
    live: dict[int, Block] = {}
    for kind, i, n in events:
        if kind == "a":
            try:
                live[i] = m.malloc(n)
            except MemoryError as e:
                return False, {"request": int(e.args[0]), "allocated": m.allocated, "reserved": m.reserved}
        elif kind == "f" and i in live:
            m.free(live.pop(i))
        elif kind == "e":
            m.release_cached()
    return True, {"peak_allocated": m.peak_allocated, "peak_reserved": m.peak_reserved}


def read_trace(path: str) -> tuple[list[Event], bool]:
    """The events of a trace file, and whether the run had expandable segments on."""
    events: list[Event] = []
    expandable = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#"):
                expandable = "expandable=1" in line
                continue
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "a":
                events.append(("a", int(parts[1]), int(parts[2])))
            elif parts[0] == "f":
                events.append(("f", int(parts[1]), 0))
            else:
                events.append(("e", 0, 0))
    return events, expandable


def min_capacity(events: list[Event], expandable: bool = False, step: int = 1 << 20,
                 max_split: int | None = None) -> int:
    """The smallest capacity (to ``step``) at which the trace runs without an OOM.

    >>> min_capacity([("a", 0, 3 << 20), ("a", 1, 3 << 20)]) >> 20  # one 20 MiB segment holds both
    20
    >>> min_capacity([("a", 0, 3 << 20), ("a", 1, 3 << 20)], expandable=True) >> 20  # one 20 MiB granule
    20
    """
    lo, hi = 0, step
    while not replay(events, hi, expandable, max_split)[0]:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step or step
        if mid <= lo:
            break
        if replay(events, mid, expandable, max_split)[0]:
            hi = mid
        else:
            lo = mid
    return hi
