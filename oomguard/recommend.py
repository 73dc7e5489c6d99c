"""Rank the remedies that address a diagnosis, for `oomguard analyze`.

The ranking differs from a ladder's fixed order on purpose: a post-mortem can point at the most direct fix for this
OOM (8-bit optimizer for an optimizer-step OOM), where a ladder climbs the same order for every run. The remedy
names are the ladder's, so advice and `oomguard run` speak the same language.

>>> from oomguard.oom import parse_oom
>>> from oomguard.diagnose import diagnose
>>> d = diagnose(parse_oom("CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total capacity of 15.73 GiB "
...     "of which 1.28 GiB is free. Of the allocated memory 11.82 GiB is allocated by PyTorch, and 2.41 GiB is "
...     "reserved by PyTorch but unallocated."))
>>> [a.name for a in recommend(d)][:2]
['expandable_segments', 'empty_cache']
"""

from __future__ import annotations

from .diagnose import OVERFLOW_FACTOR, Diagnosis
from .sizes import format_size
from .strategies import REGISTRY, Advice

_SHAPES = ["shorter_sequences", "fewer_generations", "micro_batch"]
_STATE = ["optimizer_8bit", "lora", "bf16_load", "load_4bit"]
_BY_PHASE = {
    "generation": ["shorter_sequences", "fewer_generations", "vllm_memory", *_STATE],
    "scoring": ["micro_batch", "shorter_sequences", "fewer_generations", *_STATE],
    "forward": ["checkpointing", "micro_batch", "shorter_sequences", "fewer_generations", *_STATE],
    "backward": ["checkpointing", "micro_batch", "shorter_sequences", "fewer_generations", "lora", "optimizer_8bit",
                 "bf16_load", "load_4bit"],
    "optimizer": _STATE,
    "load": ["bf16_load", "load_4bit"],
    "unknown": ["checkpointing", *_SHAPES, *_STATE, "vllm_memory"],
}


def recommend(d: Diagnosis) -> list[Advice]:
    """Remedies that address this diagnosis, most direct first, each with its reason and bytes freed if known."""
    r = d.report
    out: list[Advice] = []
    if d.kind == "host-ram":
        return [REGISTRY[n]().advise(d) for n in ("fewer_workers", "smaller_prefetch", "no_cpu_offload")]
    if d.kind == "vllm-reservation":
        return [REGISTRY["vllm_memory"]().advise(d)]
    if d.kind == "impossible":
        limit = r.allowed or r.capacity or 0
        if r.requested and limit and r.requested > OVERFLOW_FACTOR * limit:
            return [Advice("fix_shapes", f"A {format_size(r.requested)} request on a {format_size(limit)} device is an "
                                         "overflowed or mistaken tensor shape; no memory setting can hold it.", None)]
    if d.kind == "neighbour":
        out.append(Advice("free_gpu", f"Other processes hold {format_size(r.others_total)}: stop them or choose an idle "
                                      "GPU (CUDA_VISIBLE_DEVICES).", r.others_total or None))
    if d.kind == "driver":
        out.append(Advice("fresh_process", "Restart the process: a CUDA context that failed this way can stay unusable "
                                           "(`oomguard run` relaunches each attempt in a fresh process).", None))
    if d.kind in ("fragmentation", "driver", "non-pytorch"):
        names = ["expandable_segments", "empty_cache"] if d.kind == "fragmentation" else ["empty_cache"]
        if d.kind == "non-pytorch":
            names.append("vllm_memory")
    else:
        names = []
    order = _BY_PHASE.get(d.phase, _BY_PHASE["unknown"])
    if d.kind == "small-allocations":
        order = [*_STATE, *[n for n in order if n not in _STATE]]
    if d.kind == "impossible":
        order = [n for n in order if n in _SHAPES]
    for n in [*names, *order]:
        remedy = REGISTRY[n]()
        if n in names or remedy.helps(d) is None:
            advice = remedy.advise(d)
            if advice.name not in {a.name for a in out}:
                out.append(advice)
    return out
