"""vLLM: its start-up check of free memory, its KV-cache checks and its cumem allocator's failures.

vLLM reserves its share of the device up front (``gpu_memory_utilization``), so its OOMs are refusals at start-up
rather than failed allocations; a few wordings print their figures before the phrase that is recognised, so these
readers look at the whole joined text.
"""

from __future__ import annotations

import re
from typing import Any

from .patterns import CASELESS, GAP, NUM, SIZE, UNIT, Head, size_of, words

_P_VLLM_FREE = re.compile(
    words("Free memory on device") + GAP + r"(?:\(?[\w:]*\)?\s*)?\(" + GAP + NUM + GAP + r"/" + GAP + NUM + GAP + UNIT
    + GAP + r"\)" + r".*?" + words("utilization") + GAP + r"\(" + GAP + r"([\d.]+)" + GAP + r"," + GAP + SIZE,
    CASELESS,
)
# vLLM's CPU build words the same check by the NUMA node's memory ("Available memory on node 0 (11.53/13.84 GiB) on
# startup is less than desired CPU memory utilization (0.9, 12.45 GiB)", vllm/v1/worker/cpu_worker.py), and again
# when an explicit KV cache size does not fit ("... on kv cache allocation is less than requested memory for kv").
_P_VLLM_NODE = re.compile(
    words("Available memory on node") + GAP + r"\d+" + GAP + r"\(" + GAP + NUM + GAP + r"/" + GAP + NUM + GAP + UNIT
    + GAP + r"\)" + r".*?" + words("utilization") + GAP + r"\(" + GAP + r"([\d.]+)" + GAP + r"," + GAP + SIZE,
    CASELESS,
)
_P_VLLM_KV = re.compile(
    r"\(" + GAP + SIZE + GAP + words("KV cache is needed") + r".*?" + words("KV cache memory") + GAP + r"\(" + GAP + SIZE, CASELESS
)
_P_VLLM_SEQ = re.compile(words("max seq len") + GAP + r"\(" + GAP + r"(\d+)" + GAP + r"\)", CASELESS)
_P_VLLM_KV_TOKENS = re.compile(words("stored in KV cache") + GAP + r"\(" + GAP + r"(\d+)" + GAP + r"\)" + r"|"
                               + words("estimated maximum model length is") + GAP + r"(\d+)", CASELESS)


def _startup_figures(core: str, text: str) -> dict[str, Any]:
    """Free and total memory, and what the utilization asked for."""
    kw: dict[str, Any] = {}
    m = _P_VLLM_FREE.search(text) or _P_VLLM_NODE.search(text)
    if m:
        unit = m.group(3)
        kw["free"] = size_of(m.group(1), unit)
        kw["capacity"] = size_of(m.group(2), unit)
        kw["requested"] = size_of(m.group(5), m.group(6))
    return kw


def _kv_figures(core: str, text: str) -> dict[str, Any]:
    """The KV cache needed and available, in bytes or in tokens."""
    kw: dict[str, Any] = {}
    m = _P_VLLM_KV.search(text)
    if m:  # a small model's sizes print as "0.0 GiB": too small to read, not zero
        kw["requested"] = size_of(m.group(1), m.group(2)) or None
        kw["free"] = size_of(m.group(3), m.group(4)) or None
    m = _P_VLLM_SEQ.search(text)
    kw["max_seq_len"] = int(m.group(1)) if m else None
    m = _P_VLLM_KV_TOKENS.search(text)
    kw["kv_cache_tokens"] = int(m.group(1) or m.group(2)) if m else None
    return kw


# The cumem allocator's failure, tried before the CUDA runtime's messages it resembles.
CUMEM: tuple[Head, ...] = (
    Head("vllm-cumem", re.compile(words("CUDA Error: out of memory at") + r".*cumem", re.IGNORECASE), backend="vllm"),
)

# The engine's start-up and KV-cache checks.
ENGINE: tuple[Head, ...] = (
    Head(
        "vllm-startup",
        re.compile(words("Free memory on device") + r".*?" + words("less than desired GPU memory utilization"),
                   re.IGNORECASE),
        backend="vllm",
        figures=_startup_figures,
    ),
    Head(
        "vllm-startup",
        re.compile(words("Available memory on node") + r".*?" + words("is less than desired CPU memory utilization"),
                   re.IGNORECASE),
        backend="vllm",
        figures=_startup_figures,
    ),
    Head(
        "vllm-startup",
        re.compile(words("Available memory on node") + r".*?" + words("on kv cache allocation is less than requested"),
                   re.IGNORECASE),
        backend="vllm",
    ),
    Head(
        "vllm-startup",
        re.compile(words("out of memory occurred when warming up"), re.IGNORECASE),
        backend="vllm",
        figures=_startup_figures,
    ),
    Head("vllm-kv", re.compile(words("No available memory for the cache blocks"), re.IGNORECASE), backend="vllm",
          figures=_kv_figures),
    Head("vllm-kv", re.compile(words("larger than the available KV cache memory"), re.IGNORECASE), backend="vllm",
          figures=_kv_figures),
    # vLLM before 0.6: "The model's max seq len (29000) is larger than the maximum number of tokens that can be stored
    # in KV cache (23648)."
    Head("vllm-kv", re.compile(words("max seq len") + GAP + r"\(" + GAP + r"\d+" + GAP + r"\)" + GAP
                                + words("is larger than the maximum number of tokens that can be stored in KV cache"),
                                re.IGNORECASE), backend="vllm", figures=_kv_figures),
)
