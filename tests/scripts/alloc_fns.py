"""A guard(isolate=True) function for the allocator-settings tests: it must live in an importable module."""

import os

import oomguard
from oomguard.vocab import allocconf

FRAGMENTATION = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which "
                 "100.00 MiB is free. Of the allocated memory 6.00 GiB is allocated by PyTorch, and 1.50 GiB is "
                 "reserved by PyTorch but unallocated.")


@oomguard.guard(isolate=True, max_attempts=3)
def isolated_env(knobs):
    """Runs out of memory (fragmentation) until expandable segments are on; returns the allocator variables it saw."""
    if not knobs.expandable_segments:
        raise RuntimeError(FRAGMENTATION)
    return {v: os.environ.get(v) for v in allocconf.VARS}
