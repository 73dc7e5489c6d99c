"""vLLM colocate: its reservation (weights plus KV cache) sits beside training unless it sleeps."""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register
from .params import Param, shrink_factor


@register
class VllmMemory(Remedy):
    name = "vllm_memory"
    summary = "Rebalance vLLM colocate: sleep between generations, or a smaller vllm_gpu_memory_utilization."
    cost = "speed"
    trade_note = "sleep mode reloads vLLM's weights each step; a smaller KV cache batches fewer sequences"
    resume = "continue"
    graded = True
    changes = ("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_max_model_length")
    addresses = "vllm"
    params = {"factor": shrink_factor(0.75, "what each step multiplies vllm_gpu_memory_utilization by"),
              "min_utilization": Param(0.1, float, low=0, high=1, low_open=True,
                                       text="the smallest vllm_gpu_memory_utilization it goes down to")}

    def foreign(self, ctx: Context) -> str | None:
        return None if ctx.value("use_vllm") else "the run does not use vLLM"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("vllm_gpu_memory_utilization") <= self.p["min_utilization"] and ctx.value("vllm_enable_sleep_mode"):
            return "at its floor"
        return None

    def apply(self, ctx: Context) -> Knobs:
        k = ctx.knobs
        d = ctx.diagnosis
        u = float(ctx.value("vllm_gpu_memory_utilization"))
        r = d.report if d else None
        if r is not None and r.origin == "vllm-kv" and u < 0.9:
            return k.replace(vllm_gpu_memory_utilization=round(min(0.9, u / self.p["factor"]), 3))
        if r is not None and r.origin == "vllm-startup" and r.free and r.capacity:
            return k.replace(vllm_gpu_memory_utilization=round(max(self.p["min_utilization"], 0.9 * r.free / r.capacity), 3))
        if not ctx.value("vllm_enable_sleep_mode") and ctx.value("vllm_mode") == "colocate":
            return k.replace(vllm_enable_sleep_mode=True)
        return k.replace(vllm_gpu_memory_utilization=round(max(self.p["min_utilization"], u * self.p["factor"]), 3))

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """vLLM reservations between the climbed and the user's, in steps of 0.05 (largest first), sleep mode as
        climbed. Only a lowered reservation relaxes; one raised for a full-length sequence stays as it is.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> now = TRL_DEFAULTS.replace(vllm_gpu_memory_utilization=0.15)
        >>> [k.vllm_gpu_memory_utilization for k in VllmMemory().relax(TRL_DEFAULTS, now)]
        [0.25, 0.2]
        """
        u_user = float(user.vllm_gpu_memory_utilization or 0.3)
        u_now = float(current.vllm_gpu_memory_utilization or 0.3)
        steps = round((u_user - u_now) / 0.05)
        return [current.replace(vllm_gpu_memory_utilization=round(u_user - 0.05 * i, 3)) for i in range(1, steps)
                if u_now < u_user - 0.05 * i < u_user]

    def advise(self, d: Diagnosis) -> Advice:
        r = d.report
        if r.origin == "vllm-startup" and r.free and r.capacity:
            return Advice(self.name, f"Set vllm_gpu_memory_utilization below {r.free / r.capacity:.2f} (free / total) "
                                     "or let vLLM sleep between generations.", (r.requested or 0) - r.free or None)
        if r.origin == "vllm-kv":
            return Advice(self.name, "Raise vllm_gpu_memory_utilization or lower vllm_max_model_length so one "
                                     "full-length sequence fits in the KV cache.", None)
        return Advice(self.name, "A colocated vLLM keeps its weights and KV cache resident unless it sleeps "
                                 "(vllm_enable_sleep_mode) or reserves less.", None)
