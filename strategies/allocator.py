"""Allocator remedies: they change how PyTorch's caching allocator hands out memory, not how much is needed."""

from __future__ import annotations

from oomguard.diagnose import Diagnosis
from oomguard.knobs import Knobs
from oomguard.sizes import format_size

from .base import Advice, Context, Remedy, register


@register
class ExpandableSegments(Remedy):
    name = "expandable_segments"
    summary = "Let the allocator grow segments in place (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."
    trades = "nothing"
    trade_note = "no cost to speed or results; such memory cannot be shared over CUDA IPC"
    resume = "continue"
    changes = ("expandable_segments",)
    addresses = "fragmentation"

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
    name = "empty_cache"
    summary = "Release cached blocks between phases (torch_empty_cache_steps=1, and after each generation)."
    trades = "speed"
    trade_note = "about 10% slower (transformers #31372)"
    resume = "continue"
    changes = ("torch_empty_cache_steps",)
    addresses = "fragmentation"

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.kind in ("driver", "non-pytorch"):
            return None  # cuBLAS, NCCL and a colocated vLLM allocate outside PyTorch and need the cache released
        return super().helps(d)

    def blocked(self, ctx: Context) -> str | None:
        return "already in force" if ctx.knobs.torch_empty_cache_steps == 1 else None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(torch_empty_cache_steps=1)

    def advise(self, d: Diagnosis) -> Advice:
        if d.kind == "fragmentation":
            return Advice(self.name, "Emptying the cache after generation lets training lay out fresh segments "
                                     "instead of splitting the generation-sized ones.", None)
        return Advice(self.name, "Memory outside PyTorch's allocator (cuBLAS, NCCL, vLLM) can only use what the "
                                 "cache gives back.", None)
