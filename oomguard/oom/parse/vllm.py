"""vLLM: its start-up check of free memory, its KV-cache checks and its cumem allocator's failures.

vLLM reserves its share of the device up front (``gpu_memory_utilization``), so its OOMs are refusals at start-up
rather than failed allocations; a few wordings print their figures before the phrase that is recognised, so these
readers look at the whole joined text.
"""

from __future__ import annotations

import re
from typing import Any

from .patterns import _F, _NUM, _UNIT, _W, SIZE, _Head, _size, _words

_P_VLLM_FREE = re.compile(
    _words("Free memory on device") + _W + r"(?:\(?[\w:]*\)?\s*)?\(" + _W + _NUM + _W + r"/" + _W + _NUM + _W + _UNIT
    + _W + r"\)" + r".*?" + _words("utilization") + _W + r"\(" + _W + r"([\d.]+)" + _W + r"," + _W + SIZE,
    _F,
)
# vLLM's CPU build words the same check by the NUMA node's memory ("Available memory on node 0 (11.53/13.84 GiB) on
# startup is less than desired CPU memory utilization (0.9, 12.45 GiB)", vllm/v1/worker/cpu_worker.py), and again
# when an explicit KV cache size does not fit ("... on kv cache allocation is less than requested memory for kv").
_P_VLLM_NODE = re.compile(
    _words("Available memory on node") + _W + r"\d+" + _W + r"\(" + _W + _NUM + _W + r"/" + _W + _NUM + _W + _UNIT
    + _W + r"\)" + r".*?" + _words("utilization") + _W + r"\(" + _W + r"([\d.]+)" + _W + r"," + _W + SIZE,
    _F,
)
_P_VLLM_KV = re.compile(
    r"\(" + _W + SIZE + _W + _words("KV cache is needed") + r".*?" + _words("KV cache memory") + _W + r"\(" + _W + SIZE, _F
)
_P_VLLM_SEQ = re.compile(_words("max seq len") + _W + r"\(" + _W + r"(\d+)" + _W + r"\)", _F)
_P_VLLM_KV_TOKENS = re.compile(_words("stored in KV cache") + _W + r"\(" + _W + r"(\d+)" + _W + r"\)" + r"|"
                               + _words("estimated maximum model length is") + _W + r"(\d+)", _F)


def _startup_figures(core: str, text: str) -> dict[str, Any]:
    """Free and total memory, and what the utilization asked for."""
    kw: dict[str, Any] = {}
    m = _P_VLLM_FREE.search(text) or _P_VLLM_NODE.search(text)
    if m:
        unit = m.group(3)
        kw["free"] = _size(m.group(1), unit)
        kw["capacity"] = _size(m.group(2), unit)
        kw["requested"] = _size(m.group(5), m.group(6))
    return kw


def _kv_figures(core: str, text: str) -> dict[str, Any]:
    """The KV cache needed and available, in bytes or in tokens."""
    kw: dict[str, Any] = {}
    m = _P_VLLM_KV.search(text)
    if m:  # a small model's sizes print as "0.0 GiB": too small to read, not zero
        kw["requested"] = _size(m.group(1), m.group(2)) or None
        kw["free"] = _size(m.group(3), m.group(4)) or None
    m = _P_VLLM_SEQ.search(text)
    kw["max_seq_len"] = int(m.group(1)) if m else None
    m = _P_VLLM_KV_TOKENS.search(text)
    kw["kv_cache_tokens"] = int(m.group(1) or m.group(2)) if m else None
    return kw


# The cumem allocator's failure, tried before the CUDA runtime's messages it resembles.
CUMEM: tuple[_Head, ...] = (
    _Head("vllm-cumem", re.compile(_words("CUDA Error: out of memory at") + r".*cumem", re.IGNORECASE), backend="vllm"),
)

# The engine's start-up and KV-cache checks.
ENGINE: tuple[_Head, ...] = (
    _Head(
        "vllm-startup",
        re.compile(_words("Free memory on device") + r".*?" + _words("less than desired GPU memory utilization"),
                   re.IGNORECASE),
        backend="vllm",
        figures=_startup_figures,
    ),
    _Head(
        "vllm-startup",
        re.compile(_words("Available memory on node") + r".*?" + _words("is less than desired CPU memory utilization"),
                   re.IGNORECASE),
        backend="vllm",
        figures=_startup_figures,
    ),
    _Head(
        "vllm-startup",
        re.compile(_words("Available memory on node") + r".*?" + _words("on kv cache allocation is less than requested"),
                   re.IGNORECASE),
        backend="vllm",
    ),
    _Head(
        "vllm-startup",
        re.compile(_words("out of memory occurred when warming up"), re.IGNORECASE),
        backend="vllm",
        figures=_startup_figures,
    ),
    _Head("vllm-kv", re.compile(_words("No available memory for the cache blocks"), re.IGNORECASE), backend="vllm",
          figures=_kv_figures),
    _Head("vllm-kv", re.compile(_words("larger than the available KV cache memory"), re.IGNORECASE), backend="vllm",
          figures=_kv_figures),
    # vLLM before 0.6: "The model's max seq len (29000) is larger than the maximum number of tokens that can be stored
    # in KV cache (23648)."
    _Head("vllm-kv", re.compile(_words("max seq len") + _W + r"\(" + _W + r"\d+" + _W + r"\)" + _W
                                + _words("is larger than the maximum number of tokens that can be stored in KV cache"),
                                re.IGNORECASE), backend="vllm", figures=_kv_figures),
)
