"""Every wording oomguard recognises, in the order it tries them, and the cheap filter that runs before any of them.

The heads come from one module per source of OOM text. The first head that matches a line (and whose ``requires``
holds) makes the finding, so the order matters where one line matches two: vLLM's cumem failure before the CUDA
runtime's message it resembles, the caching allocators before everything below them, Python's ``MemoryError`` last.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from . import allocators, cluster, host, runtimes, vllm
from .patterns import Head, words

HEADS: tuple[Head, ...] = (
    *allocators.CACHING, *vllm.CUMEM, *runtimes.RUNTIME, *allocators.ASYNC, *runtimes.CODES, *vllm.ENGINE,
    *host.KILLER, *cluster.SLURM, *host.SHELL, *cluster.RAY, *host.PYTHON,
)

# Configuration clashes that libraries report in out-of-memory words. Unsloth's standby loader used to re-raise the
# expandable-segments assertion as ``MemoryError("... ran out of memory ...")``; no memory ran out, and no remedy that
# saves memory would help. A message that carries one of these phrases is never an OOM.
VETO = re.compile(
    words("Standby mode is not supported with expandable segments") + r"|"
    + words("Expandable segments are not compatible with memory pool"),
    re.IGNORECASE,
)


def recognitions(stripped: str) -> Iterator[tuple[Head, re.Match[str]]]:
    for head in HEADS:
        m = head.pattern.search(stripped)
        if m:
            yield head, m


def recognise(stripped: str) -> tuple[Head, re.Match[str]] | None:
    return next(recognitions(stripped), None)


def backend_for(head: Head, m: re.Match[str]) -> str:
    if head.backend:
        return head.backend
    groups = m.groupdict()
    if groups.get("dev"):
        dev = groups["dev"].lower()
        return {"mtia": "cuda"}.get(dev, dev)
    lib = (groups.get("lib") or "").upper()
    if lib.startswith(("HIP", "MIOPEN", "ROC")):
        return "hip"
    return "cuda"


def pid_of(m: re.Match[str]) -> int | None:
    pid = m.groupdict().get("pid")
    return int(pid) if pid else None


# The cheap filter: a line is looked at only if its lower-cased bytes match one of these. Each regex starts with a
# literal, so the regex engine skips through a chunk at literal-search speed (GB/s) and only OOM-shaped hits come
# back to Python; the context around the literal is checked in C by lookbehinds. Every head above contains one of
# these phrases (with single spaces); str and bytes use the very same test, so streaming a file and scanning a string
# always find the same messages.
CHEAP_REGEXES = (
    re.compile(rb"memory(?:error|allocation| ?utilization|(?<=of memory)|(?<=ofmemory)|(?<=of-memory)|(?<=of_memory)"
               rb"|(?<=allocate memory)|(?<=enough memory)|(?<=device_memory)|(?<=low on memory))"),
    re.compile(rb"cache(?: ?blocks|(?<=kv cache)|(?<=kvcache))"),
    re.compile(rb"alloc_?failed"),
    re.compile(rb"kill(?:ed|(?<=oom-kill)|(?<=oom_kill))"),
)


def _cheap_match(folded: bytes) -> bool:
    return any(rx.search(folded) for rx in CHEAP_REGEXES)


def might_be_oom(s: str) -> bool:
    return _cheap_match(s.encode("utf-8", errors="replace").lower())
