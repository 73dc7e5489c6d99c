"""PyTorch's allocators, per backend: the caching allocator on CUDA, HIP (ROCm), XPU, NPU and MTIA (four eras of
wording), ``backend:cudaMallocAsync``, MPS and the CPU allocator.

Their messages carry the richest figures: the request, the device's capacity and what is free, what PyTorch has
allocated and reserved, this process's total and the other processes on the device.
"""

from __future__ import annotations

import re
from typing import Any

from ...vocab.oomreport import OtherProcess
from .patterns import _F, _ONE_EB, _W, SIZE, _either, _first, _Head, _size, _words

_P_REQUESTED = re.compile(_words("Tried to allocate") + _W + SIZE, _F)
_P_REQ_EB = re.compile(_words("Tried to allocate more than 1") + _W + "EB", _F)
_P_DEVICE = re.compile(r"\b(?:GPU|NPU|XPU|device)" + _W + r"(\d+)", _F)
_P_CAPACITY = re.compile(_words("total") + _W + r"capac(?:ity|ty)" + _W + "of" + _W + SIZE, _F)  # 2.1: "capacty"
_P_CAPACITY_OLD = re.compile(SIZE + _W + _words("total capacity"), _F)
_P_FREE = re.compile(_words("of which") + _W + SIZE + _W + _words("is free"), _F)
_P_FREE_OLD = re.compile(SIZE + _W + r"free\b", _F)
_P_ALLOWED = re.compile(SIZE + _W + r"allowed\b", _F)
_P_ALLOC = re.compile(_words("Of the allocated memory") + _W + SIZE + _W + _words("is allocated by PyTorch"), _F)
_P_ALLOC_OLD = re.compile(SIZE + _W + _words("already allocated"), _F)
_P_PRIVATE = re.compile(r"with" + _W + SIZE + _W + _words("allocated in private pools"), _F)
_P_RESV_UNALLOC = re.compile(SIZE + _W + _words("is reserved by PyTorch but unallocated"), _F)
_P_RESV_TOTAL = re.compile(SIZE + _W + _words("reserved in total by PyTorch"), _F)
_P_CACHED = re.compile(SIZE + _W + r"cached\b", _F)
_P_THIS_PROC = re.compile(_words("this process has") + _W + SIZE + _W + _words("memory in use"), _F)
_P_OTHER_PROC = re.compile(r"Process" + _W + r"(\d+)" + _W + r"has" + _W + SIZE + _W + _words("memory in use"), _F)
_P_MPS_ALLOC = re.compile(r"MPS" + _W + r"allocated:" + _W + SIZE, _F)
_P_MPS_CURRENT = re.compile(_words("currently allocated:") + _W + SIZE, _F)
_P_MPS_OTHER = re.compile(_words("other allocations:") + _W + SIZE, _F)
_P_MPS_MAX = re.compile(_words("max allowed:") + _W + SIZE, _F)
_P_CPU_REQ = re.compile(_words("you tried to allocate") + _W + r"(\d+)" + _W + r"bytes", _F)
# cudaMallocAsync: "Currently allocated     : 54.14 GiB", "Requested : ...", "Device limit : ...",
# "Free (according to CUDA): ...", "PyTorch limit (set by user-supplied memory fraction)\n : ..."
_P_ASYNC_DEVICE = re.compile(_words("Allocation on device") + _W + r"(\d+)", _F)
_P_ASYNC_ALLOC = re.compile(_words("Currently allocated") + _W + r":" + _W + SIZE, _F)
_P_ASYNC_REQ = re.compile(r"Requested" + _W + r":" + _W + SIZE, _F)
_P_ASYNC_TOTAL = re.compile(_words("Device limit") + _W + r":" + _W + SIZE, _F)
_P_ASYNC_FREE = re.compile(r"Free" + _W + r"\(" + _W + r"according" + _W + r"to" + _W + r"\w+" + _W + r"\)" + _W + r":"
                           + _W + SIZE, _F)
_P_ASYNC_LIMIT = re.compile(r"memory" + _W + r"fraction" + _W + r"\)" + _W + r":?" + _W + SIZE, _F)


def _allocator_figures(core: str, text: str) -> dict[str, Any]:
    """The caching allocator's figures (1.x to 2.x wordings)."""
    kw: dict[str, Any] = {}
    kw["requested"] = _first(_P_REQUESTED, core)
    if kw["requested"] is None and _P_REQ_EB.search(core):
        kw["requested"] = _ONE_EB
    m = _P_DEVICE.search(core)
    kw["device"] = int(m.group(1)) if m else None
    kw["capacity"] = _either(_first(_P_CAPACITY, core), _first(_P_CAPACITY_OLD, core))
    kw["free"] = _either(_first(_P_FREE, core), _first(_P_FREE_OLD, core))
    kw["allowed"] = _first(_P_ALLOWED, core)
    kw["allocated"] = _either(_first(_P_ALLOC, core), _first(_P_ALLOC_OLD, core))
    kw["private_pools"] = _first(_P_PRIVATE, core)
    ru = _first(_P_RESV_UNALLOC, core)
    if ru is None:
        total = _first(_P_RESV_TOTAL, core)
        if total is not None and kw["allocated"] is not None:
            ru = max(0, total - kw["allocated"])
    if ru is None:
        ru = _first(_P_CACHED, core)
    kw["reserved_unallocated"] = ru
    kw["process"] = _first(_P_THIS_PROC, core)
    kw["other_processes"] = tuple(
        OtherProcess(int(m.group(1)), _size(m.group(2), m.group(3))) for m in _P_OTHER_PROC.finditer(core)
    )
    return kw


def _mps_figures(core: str, text: str) -> dict[str, Any]:
    """MPS: the limit, PyTorch's share and the process's Metal memory."""
    kw: dict[str, Any] = {}
    # Old MPS builds print binary values labelled KB/MB/GB; newer ones print KiB/MiB/GiB. Both read as binary.
    # "max allowed" is the high-watermark limit (it can exceed physical memory), so it is ``allowed``, not the
    # device's capacity. "MPS allocated" is PyTorch's share; "other allocations" the rest of the process's Metal
    # memory; the oldest builds print only "currently allocated", the process total.
    kw["requested"] = _first(_P_REQUESTED, core, binary_si=True)
    allocated = _first(_P_MPS_ALLOC, core, binary_si=True)
    other = _first(_P_MPS_OTHER, core, binary_si=True)
    limit = _first(_P_MPS_MAX, core, binary_si=True)
    kw["allowed"] = limit
    kw["allocated"] = allocated
    if allocated is not None:
        kw["process"] = allocated + (other or 0)
    else:
        kw["process"] = _first(_P_MPS_CURRENT, core, binary_si=True)
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
    kw["allocated"] = _first(_P_ASYNC_ALLOC, core)
    kw["requested"] = _first(_P_ASYNC_REQ, core)
    kw["capacity"] = _first(_P_ASYNC_TOTAL, core)
    kw["free"] = _first(_P_ASYNC_FREE, core)
    limit = _first(_P_ASYNC_LIMIT, core)  # 2^64 (NVML-garbage sized, so None) when no fraction is set
    kw["allowed"] = limit if limit is None or kw["capacity"] is None or limit < kw["capacity"] else None
    return kw


# The caching allocators, tried first.
CACHING: tuple[_Head, ...] = (
    _Head(
        "allocator",
        re.compile(r"\b(?P<dev>CUDA|HIP|XPU|NPU|MTIA)" + _W + _words("out of memory") + _W + r"\."),
        # The figures end with "... but unallocated." (2.1+), "... reserved in total by PyTorch)" (1.4-2.0),
        # "... cached)" (<= 1.3) or the 1EB refusal. A line that merely ends in "memory in use." is not the end: the
        # message goes on with "Of the allocated memory ...".
        complete=re.compile(
            _words("but unallocated") + r"|" + _words("in total by PyTorch") + r"|cached\s*\)"
            r"|" + _words("more than 1") + _W + r"EB",
            re.IGNORECASE,
        ),
        requires=re.compile(_words("Tried to allocate"), re.IGNORECASE),
        figures=_allocator_figures,
    ),
    _Head(
        "mps",
        re.compile(_words("MPS backend out of memory") + _W + r"\("),
        backend="mps",
        complete=re.compile(_words("Tried to allocate") + _W + SIZE + r".*?pool", re.IGNORECASE),
        figures=_mps_figures,
    ),
    _Head(
        "cpu-allocator",
        re.compile(r"DefaultCPUAllocator:" + _W + r"(?:can'?t" + _W + _words("allocate memory") + r"|"
                   + _words("not enough memory") + r")"),
        backend="cpu",
        complete=re.compile(_words("you tried to allocate") + _W + r"\d+", re.IGNORECASE),
        figures=_cpu_figures,
    ),
)

# cudaMallocAsync, tried after the CUDA runtime's messages (``runtimes.RUNTIME``).
ASYNC: tuple[_Head, ...] = (
    # PyTorch's cudaMallocAsync backend. Builds that print the device index as a raw byte (a NUL for device 0) cut the
    # message short after "Allocation on device"; the full form lists its figures on the following lines. Error
    # reports (ComfyUI's) print the type and the message on separate lines.
    _Head(
        "async-allocator",
        re.compile(r"OutOfMemoryError:" + _W + _words("Allocation on device") + r"|" + _words("Allocation on device")
                   + _W + r"\d+" + _W + _words("would exceed allowed memory")),
        backend="cuda",
        complete=re.compile(r"memory" + _W + r"fraction" + _W + r"\)" + _W + r":?" + _W + SIZE
                            + r"|" + _words("Allocation on device") + r"[\s\x00]*$", re.IGNORECASE),
        figures=_async_figures,
    ),
    _Head(
        "async-allocator",
        re.compile(_words("Exception Type") + r"\W{0,8}(?:torch\.(?:cuda\.)?)?OutOfMemoryError\b"),
        backend="cuda",
        complete=re.compile(_words("Allocation on device")),
        requires=re.compile(r"Exception" + _W + r"Message\W{0,8}" + _words("Allocation on device")),
        figures=_async_figures,
    ),
)
