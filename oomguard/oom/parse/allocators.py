"""PyTorch's allocators, per backend: the caching allocator on CUDA, HIP (ROCm), XPU, NPU and MTIA (four eras of
wording), ``backend:cudaMallocAsync``, MPS and the CPU allocator.

Their messages carry the richest figures: the request, the device's capacity and what is free, what PyTorch has
allocated and reserved, this process's total and the other processes on the device.
"""

from __future__ import annotations

import re
from typing import Any

from ...vocab.oomreport import OtherProcess
from .patterns import CASELESS, GAP, ONE_EB, SIZE, Head, either, first_size, size_of, words

_P_REQUESTED = re.compile(words("Tried to allocate") + GAP + SIZE, CASELESS)
_P_REQ_EB = re.compile(words("Tried to allocate more than 1") + GAP + "EB", CASELESS)
_P_DEVICE = re.compile(r"\b(?:GPU|NPU|XPU|device)" + GAP + r"(\d+)", CASELESS)
_P_CAPACITY = re.compile(words("total") + GAP + r"capac(?:ity|ty)" + GAP + "of" + GAP + SIZE, CASELESS)  # 2.1: "capacty"
_P_CAPACITY_OLD = re.compile(SIZE + GAP + words("total capacity"), CASELESS)
_P_FREE = re.compile(words("of which") + GAP + SIZE + GAP + words("is free"), CASELESS)
_P_FREE_OLD = re.compile(SIZE + GAP + r"free\b", CASELESS)
_P_ALLOWED = re.compile(SIZE + GAP + r"allowed\b", CASELESS)
_P_ALLOC = re.compile(words("Of the allocated memory") + GAP + SIZE + GAP + words("is allocated by PyTorch"), CASELESS)
_P_ALLOC_OLD = re.compile(SIZE + GAP + words("already allocated"), CASELESS)
_P_PRIVATE = re.compile(r"with" + GAP + SIZE + GAP + words("allocated in private pools"), CASELESS)
_P_RESV_UNALLOC = re.compile(SIZE + GAP + words("is reserved by PyTorch but unallocated"), CASELESS)
_P_RESV_TOTAL = re.compile(SIZE + GAP + words("reserved in total by PyTorch"), CASELESS)
_P_CACHED = re.compile(SIZE + GAP + r"cached\b", CASELESS)
_P_THIS_PROC = re.compile(words("this process has") + GAP + SIZE + GAP + words("memory in use"), CASELESS)
_P_OTHER_PROC = re.compile(r"Process" + GAP + r"(\d+)" + GAP + r"has" + GAP + SIZE + GAP + words("memory in use"), CASELESS)
_P_MPS_ALLOC = re.compile(r"MPS" + GAP + r"allocated:" + GAP + SIZE, CASELESS)
_P_MPS_CURRENT = re.compile(words("currently allocated:") + GAP + SIZE, CASELESS)
_P_MPS_OTHER = re.compile(words("other allocations:") + GAP + SIZE, CASELESS)
_P_MPS_MAX = re.compile(words("max allowed:") + GAP + SIZE, CASELESS)
_P_CPU_REQ = re.compile(words("you tried to allocate") + GAP + r"(\d+)" + GAP + r"bytes", CASELESS)
# cudaMallocAsync: "Currently allocated     : 54.14 GiB", "Requested : ...", "Device limit : ...",
# "Free (according to CUDA): ...", "PyTorch limit (set by user-supplied memory fraction)\n : ..."
_P_ASYNC_DEVICE = re.compile(words("Allocation on device") + GAP + r"(\d+)", CASELESS)
_P_ASYNC_ALLOC = re.compile(words("Currently allocated") + GAP + r":" + GAP + SIZE, CASELESS)
_P_ASYNC_REQ = re.compile(r"Requested" + GAP + r":" + GAP + SIZE, CASELESS)
_P_ASYNC_TOTAL = re.compile(words("Device limit") + GAP + r":" + GAP + SIZE, CASELESS)
_P_ASYNC_FREE = re.compile(r"Free" + GAP + r"\(" + GAP + r"according" + GAP + r"to" + GAP + r"\w+" + GAP + r"\)" + GAP + r":"
                           + GAP + SIZE, CASELESS)
_P_ASYNC_LIMIT = re.compile(r"memory" + GAP + r"fraction" + GAP + r"\)" + GAP + r":?" + GAP + SIZE, CASELESS)


def _allocator_figures(core: str, text: str) -> dict[str, Any]:
    """The caching allocator's figures (1.x to 2.x wordings)."""
    kw: dict[str, Any] = {}
    kw["requested"] = first_size(_P_REQUESTED, core)
    if kw["requested"] is None and _P_REQ_EB.search(core):
        kw["requested"] = ONE_EB
    m = _P_DEVICE.search(core)
    kw["device"] = int(m.group(1)) if m else None
    kw["capacity"] = either(first_size(_P_CAPACITY, core), first_size(_P_CAPACITY_OLD, core))
    kw["free"] = either(first_size(_P_FREE, core), first_size(_P_FREE_OLD, core))
    kw["allowed"] = first_size(_P_ALLOWED, core)
    kw["allocated"] = either(first_size(_P_ALLOC, core), first_size(_P_ALLOC_OLD, core))
    kw["private_pools"] = first_size(_P_PRIVATE, core)
    ru = first_size(_P_RESV_UNALLOC, core)
    if ru is None:
        total = first_size(_P_RESV_TOTAL, core)
        if total is not None and kw["allocated"] is not None:
            ru = max(0, total - kw["allocated"])
    if ru is None:
        ru = first_size(_P_CACHED, core)
    kw["reserved_unallocated"] = ru
    kw["process"] = first_size(_P_THIS_PROC, core)
    kw["other_processes"] = tuple(
        OtherProcess(int(m.group(1)), size_of(m.group(2), m.group(3))) for m in _P_OTHER_PROC.finditer(core)
    )
    return kw


def _mps_figures(core: str, text: str) -> dict[str, Any]:
    """MPS: the limit, PyTorch's share and the process's Metal memory."""
    kw: dict[str, Any] = {}
    # Old MPS builds print binary values labelled KB/MB/GB; newer ones print KiB/MiB/GiB. Both read as binary.
    # "max allowed" is the high-watermark limit (it can exceed physical memory), so it is ``allowed``, not the
    # device's capacity. "MPS allocated" is PyTorch's share; "other allocations" the rest of the process's Metal
    # memory; the oldest builds print only "currently allocated", the process total.
    kw["requested"] = first_size(_P_REQUESTED, core, binary_si=True)
    allocated = first_size(_P_MPS_ALLOC, core, binary_si=True)
    other = first_size(_P_MPS_OTHER, core, binary_si=True)
    limit = first_size(_P_MPS_MAX, core, binary_si=True)
    kw["allowed"] = limit
    kw["allocated"] = allocated
    if allocated is not None:
        kw["process"] = allocated + (other or 0)
    else:
        kw["process"] = first_size(_P_MPS_CURRENT, core, binary_si=True)
    if limit is not None and kw["process"] is not None:
        kw["free"] = max(0, limit - kw["process"])
    return kw


def _cpu_figures(core: str, text: str) -> dict[str, Any]:
    """The CPU allocator: the request, in bytes."""
    kw: dict[str, Any] = {}
    m = _P_CPU_REQ.search(core)
    kw["requested"] = int(m.group(1)) if m else None
    return kw


def _async_figures(core: str, text: str) -> dict[str, Any]:
    """cudaMallocAsync: its figures come one per line."""
    kw: dict[str, Any] = {}
    m = _P_ASYNC_DEVICE.search(core)
    kw["device"] = int(m.group(1)) if m else None
    kw["allocated"] = first_size(_P_ASYNC_ALLOC, core)
    kw["requested"] = first_size(_P_ASYNC_REQ, core)
    kw["capacity"] = first_size(_P_ASYNC_TOTAL, core)
    kw["free"] = first_size(_P_ASYNC_FREE, core)
    limit = first_size(_P_ASYNC_LIMIT, core)  # 2^64 (NVML-garbage sized, so None) when no fraction is set
    kw["allowed"] = limit if limit is None or kw["capacity"] is None or limit < kw["capacity"] else None
    return kw


# The caching allocators, tried first.
CACHING: tuple[Head, ...] = (
    Head(
        "allocator",
        re.compile(r"\b(?P<dev>CUDA|HIP|XPU|NPU|MTIA)" + GAP + words("out of memory") + GAP + r"\."),
        # The figures end with "... but unallocated." (2.1+), "... reserved in total by PyTorch)" (1.4-2.0),
        # "... cached)" (<= 1.3) or the 1EB refusal. A line that merely ends in "memory in use." is not the end: the
        # message goes on with "Of the allocated memory ...".
        complete=re.compile(
            words("but unallocated") + r"|" + words("in total by PyTorch") + r"|cached\s*\)"
            r"|" + words("more than 1") + GAP + r"EB",
            re.IGNORECASE,
        ),
        requires=re.compile(words("Tried to allocate"), re.IGNORECASE),
        figures=_allocator_figures,
    ),
    Head(
        "mps",
        re.compile(words("MPS backend out of memory") + GAP + r"\("),
        backend="mps",
        complete=re.compile(words("Tried to allocate") + GAP + SIZE + r".*?pool", re.IGNORECASE),
        figures=_mps_figures,
    ),
    Head(
        "cpu-allocator",
        re.compile(r"DefaultCPUAllocator:" + GAP + r"(?:can'?t" + GAP + words("allocate memory") + r"|"
                   + words("not enough memory") + r")"),
        backend="cpu",
        complete=re.compile(words("you tried to allocate") + GAP + r"\d+", re.IGNORECASE),
        figures=_cpu_figures,
    ),
)

# cudaMallocAsync, tried after the CUDA runtime's messages (``runtimes.RUNTIME``).
ASYNC: tuple[Head, ...] = (
    # PyTorch's cudaMallocAsync backend. Builds that print the device index as a raw byte (a NUL for device 0) cut the
    # message short after "Allocation on device"; the full form lists its figures on the following lines. Error
    # reports (ComfyUI's) print the type and the message on separate lines.
    Head(
        "async-allocator",
        re.compile(r"OutOfMemoryError:" + GAP + words("Allocation on device") + r"|" + words("Allocation on device")
                   + GAP + r"\d+" + GAP + words("would exceed allowed memory")),
        backend="cuda",
        complete=re.compile(r"memory" + GAP + r"fraction" + GAP + r"\)" + GAP + r":?" + GAP + SIZE
                            + r"|" + words("Allocation on device") + r"[\s\x00]*$", re.IGNORECASE),
        figures=_async_figures,
    ),
    Head(
        "async-allocator",
        re.compile(words("Exception Type") + r"\W{0,8}(?:torch\.(?:cuda\.)?)?OutOfMemoryError\b"),
        backend="cuda",
        complete=re.compile(words("Allocation on device")),
        requires=re.compile(r"Exception" + GAP + r"Message\W{0,8}" + words("Allocation on device")),
        figures=_async_figures,
    ),
)
