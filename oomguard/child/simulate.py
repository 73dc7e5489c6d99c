"""The simulated device: a memory budget on CPU that raises real ``torch.OutOfMemoryError``s.

It is a rehearsal and test device, never passed off as a GPU. A ``TorchDispatchMode`` sees every tensor an operator
creates; each new storage is placed by a model of PyTorch's CUDA caching allocator, and a weak reference frees its
block when the storage dies. So "allocated" is the real live tensor memory of this process, rounded as the CUDA
allocator rounds it, and "reserved" follows the caching allocator's segment rules:

- sizes round up to 512 bytes; requests up to 1 MiB come from 2 MiB small-pool segments, requests up to 10 MiB from
  20 MiB segments, larger ones from segments rounded up to 2 MiB (``CUDACachingAllocator.cpp``);
- a free block is found best-fit and split when the remainder is worth keeping; freed blocks merge with free
  neighbours and stay cached;
- when a new segment does not fit, all fully free segments are released and the request is tried again, and only
  then is an OOM raised, with the allocator's exact message format;
- with ``expandable_segments:True`` (read from the allocator variable torch reads) each pool is one
  virtual segment mapped in granules (2 MiB for the small pool, 20 MiB for the large one, as in
  ``get_expandable_segment``), so freed granules can always be reused and fragmentation is limited to partly used
  granules.

Storages that exist before the mode starts (or that a loader maps straight from a file) are adopted with
:meth:`SimulatedDevice.adopt`.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import allocconf
from ..sizes import format_size

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this use the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer
LARGE_BUFFER = 20 << 20  # kLargeBuffer
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
PAGE = 2 << 20  # expandable segments map the small pool in 2 MiB granules ...
PAGE_LARGE = LARGE_BUFFER  # ... and the large pool in 20 MiB ones (segment_size in get_expandable_segment)

TRACE_ENV = "OOMGUARD_SIMULATE_TRACE"
SIMULATED_TAG = "  [oomguard simulated device: a memory budget on CPU, not a real GPU]"


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(n: int) -> int:
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((n + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    seg: _Segment
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.seg.id, self.offset)


@dataclass(eq=False)
class _Segment:
    id: int
    size: int
    small: bool


class AllocatorModel:
    """The segment and block bookkeeping of the caching allocator (no tensors here; sizes only)."""

    def __init__(self, capacity: int, expandable: bool = False, max_split: int | None = None) -> None:
        self.capacity = capacity
        self.expandable = expandable
        # max_split_size_mb: cached blocks at least this large are not split for smaller requests, so long-lived
        # small tensors cannot pin them (CUDACachingAllocator get_free_block / should_split).
        self.max_split = max_split
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._free_blocks: dict[tuple[int, int, int], _Block] = {}
        self._segments: dict[int, _Segment] = {}
        self._first: dict[int, _Block] = {}
        self._next_seg = 0
        # expandable segments: one virtual segment per pool, mapped in pages
        self._vseg: dict[bool, _Segment] = {}
        self._page_refs: dict[tuple[bool, int], int] = {}
        self._mapped: set[tuple[bool, int]] = set()

    # -- free list ---------------------------------------------------------------------------------------------
    def _add_free(self, b: _Block) -> None:
        b.free = True
        k = b.key()
        bisect.insort(self._free[b.seg.small], k)
        self._free_blocks[k] = b

    def _remove_free(self, b: _Block) -> None:
        k = b.key()
        lst = self._free[b.seg.small]
        i = bisect.bisect_left(lst, k)
        if i < len(lst) and lst[i] == k:
            lst.pop(i)
        self._free_blocks.pop(k, None)

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1, -1))
        if i >= len(lst):
            return None
        b = self._free_blocks[lst[i]]
        ms = self.max_split
        if ms is not None and not small and not self.expandable:
            if size < ms <= b.size:
                return None  # do not return an oversized block for a smaller request
            if size >= ms and b.size >= size + LARGE_BUFFER:
                return None  # an oversized block may be rounded up, but within a limit
        return b

    # -- public ------------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block:
        """Place a block, or raise MemoryError(request) when it cannot fit after releasing cached segments."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        if self.expandable:
            return self._malloc_expandable(size, small)
        b = self._best_fit(small, size)
        if b is None:
            seg_size = segment_size(size)
            if self.reserved + seg_size > self.capacity:
                self.num_alloc_retries += 1
                self.release_cached()
                if self.reserved + seg_size > self.capacity:
                    self.num_ooms += 1
                    raise MemoryError(seg_size)
            b = self._new_segment(seg_size, small)
        else:
            self._remove_free(b)
        self._split(b, size, small)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def free(self, b: _Block) -> None:
        if b.free:
            return
        self.allocated -= b.size
        if self.expandable:
            self._unref_pages(b)
        # merge with free neighbours
        if b.prev is not None and b.prev.free:
            self._remove_free(b.prev)
            b = self._absorb(b.prev, b)
        if b.next is not None and b.next.free:
            self._remove_free(b.next)
            self._absorb(b, b.next)
        self._add_free(b)

    @staticmethod
    def _absorb(left: _Block, right: _Block) -> _Block:
        """Merge ``right`` (the block after ``left`` in its segment) into ``left``."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        return left

    def release_cached(self) -> None:
        """Give fully free segments (or, expandable, unused pages) back to the device, like ``empty_cache()``."""
        if self.expandable:
            for page in [p for p in self._mapped if self._page_refs.get(p, 0) == 0]:
                self._mapped.discard(page)
                self.reserved -= self._granule(page[0])
            return
        for sid, seg in list(self._segments.items()):
            b = self._first[sid]
            if b.free and b.next is None and b.size == seg.size:
                self._remove_free(b)
                del self._segments[sid]
                del self._first[sid]
                self.reserved -= seg.size

    # -- internals ---------------------------------------------------------------------------------------------
    def _new_segment(self, seg_size: int, small: bool) -> _Block:
        seg = _Segment(self._next_seg, seg_size, small)
        self._next_seg += 1
        self._segments[seg.id] = seg
        b = _Block(seg, 0, seg_size)
        self._first[seg.id] = b
        self.reserved += seg_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return b

    def _split(self, b: _Block, size: int, small: bool) -> None:
        rest = b.size - size
        large_ok = rest > SMALL_SIZE and (self.max_split is None or size < self.max_split)
        if (small and rest >= MIN_BLOCK) or (not small and large_ok) or (self.expandable and rest >= MIN_BLOCK):
            r = _Block(b.seg, b.offset + size, rest, True, b, b.next)
            if b.next is not None:
                b.next.prev = r
            b.next = r
            b.size = size
            self._add_free(r)

    @staticmethod
    def _granule(small: bool) -> int:
        return PAGE if small else PAGE_LARGE

    def _pages(self, b: _Block) -> range:
        g = self._granule(b.seg.small)
        return range(b.offset // g, (b.offset + b.size - 1) // g + 1)

    def _malloc_expandable(self, size: int, small: bool) -> _Block:
        b = self._best_fit(small, size)
        if b is None:
            # grow the virtual segment at its end
            seg = self._vseg.get(small)
            if seg is None:
                seg = self._vseg[small] = _Segment(self._next_seg, 0, small)
                self._next_seg += 1
            tail = self._tail(seg)
            if tail is not None and tail.free:
                self._remove_free(tail)
                tail.size += size
                b = tail
            else:
                b = _Block(seg, seg.size, size, True, tail, None)
                if tail is not None:
                    tail.next = b
                else:
                    self._first[seg.id] = b
            seg.size += size
        else:
            self._remove_free(b)
        g = self._granule(small)
        span = range(b.offset // g, (b.offset + size - 1) // g + 1)
        need = [p for p in span if (small, p) not in self._mapped]
        if self.reserved + len(need) * g > self.capacity:
            self.num_alloc_retries += 1
            self.release_cached()
            need = [p for p in span if (small, p) not in self._mapped]
            if self.reserved + len(need) * g > self.capacity:
                self.num_ooms += 1
                self._add_free(b)
                raise MemoryError(size)
        for p in need:
            self._mapped.add((small, p))
            self.reserved += g
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._split(b, size, small)
        b.free = False
        for p in self._pages(b):
            self._page_refs[(small, p)] = self._page_refs.get((small, p), 0) + 1
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def _tail(self, seg: _Segment) -> _Block | None:
        b = self._first.get(seg.id)
        while b is not None and b.next is not None:
            b = b.next
        return b

    def _unref_pages(self, b: _Block) -> None:
        small = b.seg.small
        for p in self._pages(b):
            k = (small, p)
            n = self._page_refs.get(k, 0) - 1
            if n <= 0:
                self._page_refs.pop(k, None)
            else:
                self._page_refs[k] = n


def expandable_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether the allocator settings torch reads turn expandable segments on (see :mod:`oomguard.allocconf`)."""
    return allocconf.expandable(os.environ if env is None else env)


def max_split_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """``max_split_size_mb`` in bytes, if the allocator settings torch reads set it."""
    return allocconf.max_split_bytes(os.environ if env is None else env)


class SimulatedDevice:
    """A memory budget for this process's tensors, with the caching allocator's behaviour and message."""

    def __init__(self, capacity: int, expandable: bool | None = None, max_split: int | None = None) -> None:
        self.capacity = int(capacity)
        self.model = AllocatorModel(self.capacity, expandable_from_env() if expandable is None else expandable,
                                    max_split if max_split is not None else max_split_from_env())
        self._live: dict[int, tuple[Any, _Block, int]] = {}
        self._lock = threading.RLock()
        self._mode: Any = None
        self.last_oom: str | None = None
        # A weakref callback can fire while this thread is inside the model (GC runs during any allocation);
        # such frees wait until the model is consistent again.
        self._busy = 0
        self._pending: list[int] = []
        # OOMGUARD_SIMULATE_TRACE=path records every allocation and free, so a run can be replayed through the
        # allocator model at other budgets (bench/min_budget.py) without running it again.
        self._trace: list[tuple[str, int, int]] | None = [] if os.environ.get(TRACE_ENV) else None
        self._ids: dict[int, int] = {}
        self._next_id = 0
        if self._trace is not None:
            import atexit

            rank = os.environ.get("RANK")
            atexit.register(self.dump_trace, os.environ[TRACE_ENV] + (f".rank{rank}" if rank else ""))

    # -- storage tracking --------------------------------------------------------------------------------------
    def track(self, storage: Any) -> None:
        """Account for a storage; raise torch.OutOfMemoryError if it does not fit."""
        key = id(storage)
        with self._lock:
            entry = self._live.get(key)
            nbytes = storage.nbytes()
            if entry is not None:
                if entry[2] == nbytes:
                    return
                self._release(key)  # resized in place
            if nbytes == 0:
                return
            self._busy += 1
            try:
                block = self.model.malloc(nbytes)
            except MemoryError as e:
                request = int(e.args[0])
            else:
                request = 0
            finally:
                self._busy -= 1
                self._drain()
            if request:
                self._raise_oom(request)
            try:
                ref = weakref.ref(storage, lambda _r, k=key: self._release(k))
            except TypeError:
                self.model.free(block)
                return
            self._live[key] = (ref, block, nbytes)
            if self._trace is not None:
                self._ids[key] = self._next_id
                self._trace.append(("a", self._next_id, nbytes))
                self._next_id += 1

    def _release(self, key: int) -> None:
        with self._lock:
            if self._busy:
                self._pending.append(key)
                return
            entry = self._live.pop(key, None)
            if entry is not None and self._trace is not None and key in self._ids:
                self._trace.append(("f", self._ids.pop(key), 0))
            if entry is not None:
                self._busy += 1
                try:
                    self.model.free(entry[1])
                finally:
                    self._busy -= 1
                    self._drain()

    def _drain(self) -> None:
        while self._pending and not self._busy:
            self._release(self._pending.pop())

    def adopt(self, tensors: Any) -> int:
        """Account for tensors that already exist (model weights loaded before the mode saw them). Returns bytes."""
        before = self.model.allocated
        for t in tensors:
            try:
                if getattr(t, "device", None) is not None and t.device.type == "cpu":
                    self.track(t.untyped_storage())
            except (RuntimeError, NotImplementedError, TypeError):
                continue
        return self.model.allocated - before

    def release_cached(self) -> None:
        with self._lock:
            self.model.release_cached()
            if self._trace is not None:
                self._trace.append(("e", 0, 0))

    def set_max_split(self, nbytes: int | None) -> None:
        """``max_split_size_mb`` in-process; it governs the blocks placed from now on."""
        with self._lock:
            self.model.max_split = nbytes

    def dump_trace(self, path: str) -> None:
        """Write the allocation trace: one line per event, ``a ID BYTES``, ``f ID`` or ``e`` (empty_cache)."""
        if not self._trace:
            return
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# oomguard simulated-device trace; expandable={int(self.model.expandable)}\n")
            for kind, i, n in self._trace:
                f.write(f"{kind} {i} {n}\n" if kind == "a" else (f"f {i}\n" if kind == "f" else "e\n"))

    def set_expandable(self, on: bool = True) -> None:
        """Switch allocator mode in-process, like ``torch.cuda.memory._set_allocator_settings``: the live blocks
        are placed again under the new mode."""
        with self._lock:
            if self.model.expandable == on:
                return
            model = AllocatorModel(self.capacity, on, self.model.max_split)
            for key, (ref, _block, nbytes) in list(self._live.items()):
                self._live[key] = (ref, model.malloc(nbytes), nbytes)
            self.model = model

    # -- facts -------------------------------------------------------------------------------------------------
    @property
    def peak(self) -> int:
        return self.model.peak_allocated

    def stats(self) -> dict[str, Any]:
        m = self.model
        return {
            "simulated": True,
            "capacity": self.capacity,
            "expandable_segments": m.expandable,
            "allocated_bytes.all.current": m.allocated,
            "allocated_bytes.all.peak": m.peak_allocated,
            "reserved_bytes.all.current": m.reserved,
            "reserved_bytes.all.peak": m.peak_reserved,
            "num_alloc_retries": m.num_alloc_retries,
            "num_ooms": m.num_ooms,
        }

    def reset_peak(self) -> None:
        self.model.peak_allocated = self.model.allocated
        self.model.peak_reserved = self.model.reserved

    def oom_message(self, request: int) -> str:
        m = self.model
        free = max(0, self.capacity - m.reserved)
        return (
            f"CUDA out of memory. Tried to allocate {format_size(request)}. GPU 0 has a total capacity of "
            f"{format_size(self.capacity)} of which {format_size(free)} is free. Including non-PyTorch memory, this "
            f"process has {format_size(m.reserved)} memory in use. Of the allocated memory {format_size(m.allocated)} "
            f"is allocated by PyTorch, and {format_size(m.reserved - m.allocated)} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)" + SIMULATED_TAG
        )

    def _raise_oom(self, request: int) -> None:
        import torch

        self.last_oom = self.oom_message(request)
        raise torch.OutOfMemoryError(self.last_oom)

    # -- the dispatch mode -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Enter the dispatch mode on this thread for the rest of the process."""
        if self._mode is not None:
            return
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        device = self
        tensor_type = torch.Tensor

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                leaves = (out,) if isinstance(out, tensor_type) else tree_flatten(out)[0]
                for t in leaves:
                    if isinstance(t, tensor_type) and t.device.type == "cpu":
                        try:
                            storage = t.untyped_storage()
                        except (RuntimeError, NotImplementedError, TypeError):
                            continue
                        try:
                            device.track(storage)
                        except torch.OutOfMemoryError as e:
                            raise e.with_traceback(None) from None  # the user's frames, not the simulator's
                return out

        self._mode = _Count()
        self._mode.__enter__()

    def stop(self) -> None:
        """Leave the dispatch mode (on the thread that started it): tensors are no longer counted."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


_DEVICE: SimulatedDevice | None = None


def device() -> SimulatedDevice | None:
    """The simulated device of this process, if one was started."""
    return _DEVICE


def start(capacity: int, expandable: bool | None = None) -> SimulatedDevice:
    """Start this process's simulated device (once; later calls return the running one)."""
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = SimulatedDevice(capacity, expandable)
        _DEVICE.start()
    return _DEVICE


def stop() -> None:
    """Stop this process's simulated device, if one runs."""
    global _DEVICE
    if _DEVICE is not None:
        _DEVICE.stop()
        _DEVICE = None


def replay(events: list[tuple[str, int, int]], capacity: int, expandable: bool = False,
           max_split: int | None = None) -> tuple[bool, dict[str, int]]:
    """Replay a trace through the allocator model at ``capacity``: (fits, facts at the end or at the OOM).

    >>> replay([("a", 0, 3 << 20), ("a", 1, 3 << 20), ("f", 0, 0)], 20 << 20)[0]
    True
    """
    m = AllocatorModel(capacity, expandable, max_split)
    live: dict[int, _Block] = {}
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


def read_trace(path: str) -> tuple[list[tuple[str, int, int]], bool]:
    events: list[tuple[str, int, int]] = []
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


def min_capacity(events: list[tuple[str, int, int]], expandable: bool = False, step: int = 1 << 20,
                 max_split: int | None = None) -> int:
    """The smallest capacity (to ``step``) at which the trace runs without an OOM."""
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
