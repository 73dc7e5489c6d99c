"""Allocator remedies: they change how PyTorch's caching allocator hands out memory, not how much is needed."""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs
from oomguard.vocab.sizes import MiB, format_size

from .base import Advice, Context, Remedy, register
from .params import Param


@register
class ExpandableSegments(Remedy):
    name = "expandable_segments"
    summary = "Let the allocator grow segments in place (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."
    cost = "none"
    trade_note = "no cost to speed or results; such memory cannot be shared over CUDA IPC"
    resume = "continue"
    changes = ("expandable_segments",)
    addresses = "fragmentation"

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return "expandable segments in the allocator"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.facts.alloc_conf_locked:
            return f"you set {ctx.facts.alloc_conf_locked} yourself, and oomguard keeps it"
        if ctx.value("expandable_segments"):
            return "already in force"
        if ctx.value("use_vllm") and ctx.value("vllm_enable_sleep_mode"):
            return "vLLM sleep mode is on, and its memory pool fails with expandable segments (pytorch #147851)"
        return None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(expandable_segments=True)

    def advise(self, d: Diagnosis) -> Advice:
        r = d.report
        ru = r.reserved_unallocated
        if ru and r.requested:
            return Advice(self.name, f"{format_size(ru)} is reserved but unallocated; with expandable segments the "
                                     f"allocator can use it for the {format_size(r.requested)} request.", ru)
        return Advice(self.name, "Expandable segments stop the allocator from leaving unusable holes.", ru)


@register
class EmptyCache(Remedy):
    """Cache hygiene for allocators without expandable segments (locked off by the user, vLLM sleep mode, ...).

    Emptying the cache alone cannot give back a segment that still holds one live block, and that is how caches
    fragment: a long-lived small tensor (a gradient, an optimizer moment) is carved out of a large cached block and
    pins it. So this rung does both: it releases the cache between phases (after each generation, before the
    optimizer step, and transformers' ``torch_empty_cache_steps=1`` between forward and backward), and it sets
    ``max_split_size_mb`` so that large cached blocks are never split for small requests and stay releasable.
    """

    name = "empty_cache"
    summary = ("Release cached blocks between phases (torch_empty_cache_steps=1) and keep large cached blocks whole "
               "(max_split_size_mb), so small long-lived tensors cannot pin them.")
    cost = "none"
    trade_note = "about 10% slower (transformers #31372), plus more device allocations"
    resume = "continue"
    changes = ("torch_empty_cache_steps", "max_split_size_mb")
    addresses = "fragmentation"
    # "auto": 1/32 of the device (at least PyTorch's minimum of 21): blocks that large are worth keeping whole.
    params = {"max_split_size_mb": Param("auto", int, low=21, also=("auto",),
                                         text="MiB above which cached blocks are never split; PyTorch's minimum is 21")}

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return "the cache emptied between phases, large blocks kept whole"

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.kind in ("driver", "non-pytorch"):
            return None  # cuBLAS, NCCL and a colocated vLLM allocate outside PyTorch and need the cache released
        return super().helps(d)

    def blocked(self, ctx: Context) -> str | None:
        if ctx.knobs.torch_empty_cache_steps == 1 and ctx.knobs.max_split_size_mb is not None:
            return "already in force"
        return None

    def _max_split(self, ctx: Context) -> int:
        v = self.p["max_split_size_mb"]
        if v != "auto":
            return max(21, int(v))
        r = ctx.diagnosis.report if ctx.diagnosis is not None else None
        cap = (r.allowed or r.capacity) if r is not None else None
        return max(21, cap // 32 // MiB) if cap else 512

    def apply(self, ctx: Context) -> Knobs:
        changes: dict[str, int] = {"torch_empty_cache_steps": 1}
        if ctx.knobs.max_split_size_mb is None:
            changes["max_split_size_mb"] = self._max_split(ctx)
        return ctx.knobs.replace(**changes)

    def advise(self, d: Diagnosis) -> Advice:
        if d.kind == "fragmentation":
            return Advice(self.name, "Keeping large cached blocks whole (max_split_size_mb) stops small long-lived "
                                     "tensors from pinning them, and emptying the cache between phases gives them back.",
                          None)
        return Advice(self.name, "Memory outside PyTorch's allocator (cuBLAS, NCCL, vLLM) can only use what the "
                                 "cache gives back.", None)
