"""A model of PyTorch's CUDA caching allocator: where each block goes, what is reserved, and when it runs out.

Pure and torch-free: sizes only, no tensors. The simulated device (:mod:`oomguard.child.simulate`) places every
live storage with it, and ``bench/min_budget.py`` replays recorded allocation traces through it at other budgets
(``bench/_trace.py``). The rules are those of ``c10/cuda/CUDACachingAllocator.cpp``:

- sizes round up to 512 bytes (:func:`round_size`); requests up to 1 MiB come from 2 MiB small-pool segments,
  requests up to 10 MiB from 20 MiB segments, larger ones from segments rounded up to 2 MiB (:func:`segment_size`);
- a free block is found best-fit and split when the remainder is worth keeping; freed blocks merge with free
  neighbours and stay cached ("reserved but unallocated");
- when a new segment does not fit, all fully free segments are released (``num_alloc_retries``) and the request is
  tried again; only then does it fail (``num_ooms``), and :meth:`AllocatorModel.malloc` raises
  ``MemoryError(bytes it could not get)``;
- ``max_split_size_mb``: cached blocks at least that large are not split for smaller requests;
- with ``expandable_segments:True`` each pool is one virtual segment mapped in granules (2 MiB for the small pool,
  20 MiB for the large one, as in ``get_expandable_segment``), so freed granules can always be reused and
  fragmentation is limited to partly used granules.

(:mod:`oomguard.vocab.allocconf` reads these settings from the environment; :mod:`oomguard.inprocess.allocapply`
brings them to a live allocator between guarded attempts.) A simulated device the size of a card also holds what a
CUDA process holds outside the allocator (:func:`context_for`).

>>> m = AllocatorModel(64 * MiB)
>>> a = m.malloc(3 * MiB)  # a 20 MiB segment, split
>>> m.allocated // MiB, m.reserved // MiB
(3, 20)
>>> m.free(a); m.release_cached(); m.reserved
0
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..vocab.sizes import MiB

__all__ = [
    "CARD_CONTEXT",
    "CARD_SIZED",
    "LARGE_BUFFER",
    "MIN_BLOCK",
    "MIN_LARGE_ALLOC",
    "PAGE",
    "PAGE_LARGE",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "AllocatorModel",
    "Block",
    "Segment",
    "context_for",
    "round_size",
    "segment_size",
]

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = MiB  # kSmallSize: requests up to this use the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer
LARGE_BUFFER = 20 * MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
PAGE = 2 * MiB  # expandable segments map the small pool in 2 MiB granules ...
PAGE_LARGE = LARGE_BUFFER  # ... and the large pool in 20 MiB ones (segment_size in get_expandable_segment)

# A budget this large rehearses a card, so it holds what a CUDA process holds outside the allocator (the memory
# model's m_ctx, measured at real OOMs on an H100); a smaller budget is a test rig and holds nothing else.
CARD_SIZED = 4 * 2**30
CARD_CONTEXT = 800 * 2**20


def context_for(capacity: int, given: int | None = None) -> int:
    """The memory a simulated device of ``capacity`` bytes holds outside its allocator: ``given`` (the
    ``--simulate-context`` option), else :data:`CARD_CONTEXT` for a card-sized budget and 0 for a test rig.

    >>> context_for(300 * 2**20), context_for(24 * 2**30) // 2**20, context_for(24 * 2**30, given=0)
    (0, 800, 0)
    """
    if given is not None:
        return int(given)
    return CARD_CONTEXT if capacity >= CARD_SIZED else 0


def round_size(n: int) -> int:
    """The block size the allocator hands out for ``n`` bytes: a multiple of 512, at least 512.

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(n: int) -> int:
    """The size of the segment the allocator reserves from the device for a (rounded) block of ``n`` bytes.

    >>> [s // MiB for s in (segment_size(1000), segment_size(3 * MiB), segment_size(11 * MiB))]
    [2, 20, 12]
    """
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((n + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass(eq=False)
class Block:
    """A span of a segment, allocated or free: what :meth:`AllocatorModel.malloc` returns and ``free`` takes back."""

    seg: Segment
    offset: int
    size: int
    free: bool = True
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int, int]:
        """Its place in a free list ordered best-fit first: (size, segment, offset)."""
        return (self.size, self.seg.id, self.offset)


@dataclass(eq=False)
class Segment:
    """Memory reserved from the device in one piece (or, expandable, one pool's virtual segment)."""

    id: int
    size: int
    small: bool


class AllocatorModel:
    """The segment and block bookkeeping of the caching allocator over a device of ``capacity`` bytes.

    ``allocated`` and ``reserved`` (and their peaks) are what ``torch.cuda.memory_stats()`` calls
    ``allocated_bytes.all`` and ``reserved_bytes.all``; ``reserved - allocated`` is the cached, unallocated memory
    that fragmentation leaves.

    >>> m = AllocatorModel(60 * MiB)
    >>> blocks = [m.malloc(3 * MiB) for _ in range(18)]  # three 20 MiB segments
    >>> for b in blocks[::2]:
    ...     m.free(b)
    >>> try:
    ...     m.malloc(12 * MiB)  # 27 MiB are free, but no run of 12 MiB is
    ... except MemoryError as e:
    ...     print(e.args[0] // MiB, (m.reserved - m.allocated) // MiB, m.num_ooms)
    12 33 1
    """

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
        # a second pair of peaks, since ``mark()``: oomguard's own (a step's, a call's), so that the peaks above, which
        # the user's code reads, are never reset by oomguard
        self.mark_allocated = 0
        self.mark_reserved = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._free_blocks: dict[tuple[int, int, int], Block] = {}
        self._segments: dict[int, Segment] = {}
        self._first: dict[int, Block] = {}
        self._next_seg = 0
        # expandable segments: one virtual segment per pool, mapped in pages
        self._vseg: dict[bool, Segment] = {}
        self._page_refs: dict[tuple[bool, int], int] = {}
        self._mapped: set[tuple[bool, int]] = set()

    # -- free list ---------------------------------------------------------------------------------------------
    def _add_free(self, b: Block) -> None:
        b.free = True
        k = b.key()
        bisect.insort(self._free[b.seg.small], k)
        self._free_blocks[k] = b

    def _remove_free(self, b: Block) -> None:
        k = b.key()
        lst = self._free[b.seg.small]
        i = bisect.bisect_left(lst, k)
        if i < len(lst) and lst[i] == k:
            lst.pop(i)
        self._free_blocks.pop(k, None)

    def _best_fit(self, small: bool, size: int) -> Block | None:
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
    def malloc(self, nbytes: int) -> Block:
        """Place a block, or raise ``MemoryError(request)`` when it cannot fit after releasing cached segments.

        >>> m = AllocatorModel(2 * MiB)
        >>> m.malloc(100).size, m.reserved // MiB
        (512, 2)
        >>> m.malloc(3 * MiB)
        Traceback (most recent call last):
        MemoryError: 20971520
        """
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
        self.mark_allocated = max(self.mark_allocated, self.allocated)
        return b

    def mark(self) -> None:
        """Start the second pair of peaks (``mark_allocated``, ``mark_reserved``) again from now."""
        self.mark_allocated, self.mark_reserved = self.allocated, self.reserved

    def free(self, b: Block) -> None:
        """Give a block back: it merges with free neighbours and stays cached (reserved) until released."""
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
    def _absorb(left: Block, right: Block) -> Block:
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
    def _new_segment(self, seg_size: int, small: bool) -> Block:
        seg = Segment(self._next_seg, seg_size, small)
        self._next_seg += 1
        self._segments[seg.id] = seg
        b = Block(seg, 0, seg_size)
        self._first[seg.id] = b
        self.reserved += seg_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.mark_reserved = max(self.mark_reserved, self.reserved)
        return b

    def _split(self, b: Block, size: int, small: bool) -> None:
        rest = b.size - size
        large_ok = rest > SMALL_SIZE and (self.max_split is None or size < self.max_split)
        if (small and rest >= MIN_BLOCK) or (not small and large_ok) or (self.expandable and rest >= MIN_BLOCK):
            r = Block(b.seg, b.offset + size, rest, True, b, b.next)
            if b.next is not None:
                b.next.prev = r
            b.next = r
            b.size = size
            self._add_free(r)

    @staticmethod
    def _granule(small: bool) -> int:
        return PAGE if small else PAGE_LARGE

    def _pages(self, b: Block) -> range:
        g = self._granule(b.seg.small)
        return range(b.offset // g, (b.offset + b.size - 1) // g + 1)

    def _malloc_expandable(self, size: int, small: bool) -> Block:
        b = self._best_fit(small, size)
        if b is None:
            # grow the virtual segment at its end
            seg = self._vseg.get(small)
            if seg is None:
                seg = self._vseg[small] = Segment(self._next_seg, 0, small)
                self._next_seg += 1
            tail = self._tail(seg)
            if tail is not None and tail.free:
                self._remove_free(tail)
                tail.size += size
                b = tail
            else:
                b = Block(seg, seg.size, size, True, tail, None)
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
        self.mark_reserved = max(self.mark_reserved, self.reserved)
        self._split(b, size, small)
        b.free = False
        for p in self._pages(b):
            self._page_refs[(small, p)] = self._page_refs.get((small, p), 0) + 1
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.mark_allocated = max(self.mark_allocated, self.allocated)
        return b

    def _tail(self, seg: Segment) -> Block | None:
        b = self._first.get(seg.id)
        while b is not None and b.next is not None:
            b = b.next
        return b

    def _unref_pages(self, b: Block) -> None:
        small = b.seg.small
        for p in self._pages(b):
            k = (small, p)
            n = self._page_refs.get(k, 0) - 1
            if n <= 0:
                self._page_refs.pop(k, None)
            else:
                self._page_refs[k] = n
