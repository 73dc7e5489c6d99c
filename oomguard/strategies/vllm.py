"""vLLM colocate: its reservation (engine, profile activations and KV cache) sits beside training unless it sleeps.

One rung, ``vllm_memory``, that climbs the way the diagnosis points (``VllmMemory.apply``):

- training needs the room (a training-side OOM beside the reservation, vLLM's own start-up beside what training
  holds, a pre-flight stop): a smaller ``vllm_gpu_memory_utilization``, with ``vllm_max_model_length`` no longer than
  the run's longest prompt plus its completions (vLLM must hold only one such sequence, so a smaller reservation
  still starts); at the utilization's floor, sleep mode where the platform has it (CUDA, ROCm; not vLLM's CPU build),
  then the trainer's weights and optimizer state in host RAM while vLLM generates where the stack takes it (ms-swift's
  ``--offload_model --offload_optimizer``; TRL has no such option);
- one full-length sequence does not fit the KV cache ("... KV cache is needed, which is larger than the available
  KV cache memory", "No available memory for the cache blocks"): a shorter ``vllm_max_model_length`` (the model's
  default is its whole context window, 32k tokens and more for released models), else a larger reservation;
- the start-up check ("Free memory on device ... is less than desired GPU memory utilization", its CPU twin): a
  reservation that fits what is free.

Its cost is speed: a smaller KV cache batches fewer sequences at once, sleep mode reloads vLLM's weights for each
generation, and the offload moves the trainer's state through host memory each step; what is generated and trained
stays the same.
"""

from __future__ import annotations

import math

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register
from .params import Param, shrink_factor

LENGTH_STEP = 64  # vllm_max_model_length is set to the longest sequence rounded up to this


def length_needed(ctx: Context) -> int | None:
    """The longest sequence vLLM must hold in this run: the longest prompt plus ``max_completion_length``, rounded up
    to ``LENGTH_STEP``; None while the prompts' lengths are not known.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
    >>> length_needed(Context(knobs=TRL_DEFAULTS, facts=RunFacts(prompt_tokens_max=100)))  # 100 + 512
    640
    """
    prompt = ctx.facts.prompt_tokens_max or ctx.value("max_prompt_tokens")
    if not prompt:
        return None
    return LENGTH_STEP * math.ceil((int(prompt) + int(ctx.value("max_completion_length"))) / LENGTH_STEP)


@register
class VllmMemory(Remedy):
    name = "vllm_memory"
    summary = ("Rebalance vLLM colocate: a smaller vllm_gpu_memory_utilization (with vllm_max_model_length no longer "
               "than the run's sequences), sleep between generations where the platform has it, the trainer's state in "
               "host RAM while vLLM generates where the stack takes it, or room for one full-length sequence in its "
               "KV cache.")
    cost = "speed"
    trade_note = ("a smaller KV cache batches fewer sequences at once; sleep mode reloads vLLM's weights each step; "
                  "the offload moves the trainer's weights and optimizer state through host RAM each step")
    resume = "continue"
    graded = True
    changes = ("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_max_model_length",
               "offload_during_generation")
    addresses = "vllm"
    params = {"factor": shrink_factor(0.75, "what each step multiplies vllm_gpu_memory_utilization by"),
              "min_utilization": Param(0.1, float, low=0, high=1, low_open=True,
                                       text="the smallest vllm_gpu_memory_utilization it goes down to")}

    def foreign(self, ctx: Context) -> str | None:
        return None if ctx.value("use_vllm") else "the run does not use vLLM"

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> user = TRL_DEFAULTS.replace(use_vllm=True, vllm_gpu_memory_utilization=0.9)
        >>> VllmMemory().describe_change(user, user.replace(vllm_gpu_memory_utilization=0.55, vllm_max_model_length=256))
        "vLLM reserves 0.55 of the device (yours: 0.9), sequences up to 256 tokens (yours: the model's)"
        """
        parts = []
        u_user, u = user.vllm_gpu_memory_utilization or 0.3, final.vllm_gpu_memory_utilization or 0.3
        if u != u_user:
            parts.append(f"vLLM reserves {u:g} of the device (yours: {u_user:g})")
        if final.vllm_max_model_length != user.vllm_max_model_length:
            parts.append(f"sequences up to {final.vllm_max_model_length} tokens (yours: "
                         f"{user.vllm_max_model_length or 'the model' + chr(39) + 's'})")
        if final.vllm_enable_sleep_mode and not user.vllm_enable_sleep_mode:
            parts.append("vLLM sleeps while training")
        if final.offload_during_generation and not user.offload_during_generation:
            parts.append("the trainer's weights and optimizer wait in host RAM while vLLM generates")
        return ", ".join(parts) or self.name

    def _sleep_possible(self, ctx: Context) -> bool:
        return bool(ctx.facts.vllm_sleep) and not ctx.value("vllm_enable_sleep_mode")

    def _offload_possible(self, ctx: Context) -> bool:
        """The stack takes ``offload_during_generation`` (the training process reported what it lacks, and this is
        not among it) and it is not on yet."""
        lacks = ctx.facts.trl_lacks
        return bool(lacks) and "offload_during_generation" not in lacks and not ctx.value("offload_during_generation")

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("vllm_mode") != "colocate":
            return ("vLLM runs as a server, on its own device: its memory is the server's (trl vllm-serve "
                    "--gpu_memory_utilization, --max_model_len)")
        if self.apply(ctx) == ctx.knobs:
            return "at its floor" + ("" if ctx.facts.vllm_sleep or ctx.facts.vllm_sleep is None
                                     else " (the platform has no sleep mode)")
        return None

    def apply(self, ctx: Context) -> Knobs:
        k = ctx.knobs
        d = ctx.diagnosis
        u = float(ctx.value("vllm_gpu_memory_utilization"))
        # never below what vLLM needs to start on this device, where the memory model knows it
        floor = max(float(self.p["min_utilization"]), ctx.facts.vllm_min_utilization or 0.0)
        need = length_needed(ctx)
        longer = need is not None and (k.vllm_max_model_length is None or k.vllm_max_model_length > need)
        r = d.report if d is not None else None
        if r is not None and r.origin == "vllm-kv":  # one full-length sequence does not fit the KV cache
            if longer:
                return k.replace(vllm_max_model_length=need)
            held = ctx.facts.vllm_min_utilization  # the least share that holds one of the run's sequences, if known
            if held is not None and u >= held:
                return k  # it holds the run's sequences already: a larger share would only take training's room
            if u < 0.9:  # to what holds them where the memory model knows it, else one step
                return k.replace(vllm_gpu_memory_utilization=round(min(0.9, held or u / self.p["factor"]), 3))
            return k
        out = k.replace(vllm_max_model_length=need) if longer else k
        if r is not None and r.origin == "vllm-startup" and r.free and r.capacity and u > floor:
            fits_free = round(max(floor, 0.9 * r.free / r.capacity), 3)
            if fits_free < u:
                return out.replace(vllm_gpu_memory_utilization=fits_free)
        if u > floor:  # training needs the room
            return out.replace(vllm_gpu_memory_utilization=round(max(floor, u * self.p["factor"]), 3))
        if self._sleep_possible(ctx):
            return out.replace(vllm_enable_sleep_mode=True)
        if self._offload_possible(ctx):
            return out.replace(offload_during_generation=True)
        return out

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """vLLM reservations between the climbed and the user's, in steps of 0.05 (largest first), the rest as
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
            return Advice(self.name, "Set vllm_max_model_length to the run's longest prompt plus "
                                     "max_completion_length, or raise vllm_gpu_memory_utilization, so one full-length "
                                     "sequence fits in the KV cache.", None)
        return Advice(self.name, "A colocated vLLM keeps its weights and KV cache resident unless it sleeps "
                                 "(vllm_enable_sleep_mode) or reserves less (vllm_gpu_memory_utilization).", None)
