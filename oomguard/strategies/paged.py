"""transformers' continuous batching: its paged cache takes a share of the free device memory each generation round.

One rung, ``paged_cache``: a smaller ``cb_max_memory_percent`` (``transformers_continuous_batching_config``'s
``max_memory_percent``, TRL's default 0.5). transformers sizes the cache, its attention masks and the round's batch
within that share of what is free when the round starts, and frees them when it ends; a smaller share leaves the rest
of the round (its logits, sampling, what transformers does not count) and anything beside the trainer room to run.
Its cost is speed: a smaller cache holds fewer sequences at once, so a round takes more forward passes; what is
generated and learned stays the same.
"""

from __future__ import annotations

import math

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register
from .params import Param, shrink_factor

DEFAULT_SHARE = 0.5  # TRL's max_memory_percent when the script sets none (grpo_trainer.py, TRL 1.10 on)
STEP = 0.05  # relaxed values are multiples of this


def share(k: Knobs) -> float:
    """The paged cache's share of the free memory in force (TRL's 0.5 when unset)."""
    return float(k.cb_max_memory_percent or DEFAULT_SHARE)


@register
class PagedCache(Remedy):
    name = "paged_cache"
    summary = ("Give transformers' continuous batching a smaller share of the free memory for its paged cache "
               "(cb_max_memory_percent: transformers_continuous_batching_config's max_memory_percent): fewer "
               "sequences generated at once, the same completions.")
    cost = "speed"
    trade_note = "a smaller paged cache generates fewer sequences at once: more forward passes per generation round"
    resume = "continue"
    graded = True
    changes = ("cb_max_memory_percent",)
    params = {"factor": shrink_factor(0.5, "what each step multiplies cb_max_memory_percent by"),
              "min_share": Param(0.05, float, low=0, high=1, low_open=True,
                                 text="the smallest cb_max_memory_percent it goes down to")}

    def foreign(self, ctx: Context) -> str | None:
        if not ctx.value("use_transformers_continuous_batching") or ctx.value("use_vllm"):
            return "the run does not generate with transformers' continuous batching"
        return None

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.phase not in ("generation", "unknown"):
            return f"the OOM came in {d.phase}; the paged cache exists only while generating"
        if d is not None and d.kind == "impossible":
            # one request larger than the device while generating is the cache itself where transformers measured
            # more free memory than the process may use (a limit below the card's, a neighbour): its share sizes it
            return None
        return super().helps(d)

    def blocked(self, ctx: Context) -> str | None:
        if share(ctx.knobs) <= float(self.p["min_share"]) + 1e-9:
            return f"at its floor (cb_max_memory_percent {share(ctx.knobs):g})"
        return None

    def apply(self, ctx: Context) -> Knobs:
        s = share(ctx.knobs)
        return ctx.knobs.replace(cb_max_memory_percent=round(max(float(self.p["min_share"]),
                                                                 s * float(self.p["factor"])), 3))

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> PagedCache().describe_change(TRL_DEFAULTS, TRL_DEFAULTS.replace(cb_max_memory_percent=0.25))
        'the paged cache takes 0.25 of the free memory (yours: 0.5)'
        """
        return f"the paged cache takes {share(final):g} of the free memory (yours: {share(user):g})"

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Shares between the climbed and the user's, in steps of 0.05, largest first.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> [k.cb_max_memory_percent for k in PagedCache().relax(TRL_DEFAULTS, TRL_DEFAULTS.replace(
        ...     cb_max_memory_percent=0.35))]
        [0.45, 0.4]
        """
        hi, lo = share(user), share(current)
        steps = math.floor(round((hi - lo) / STEP, 6))
        return [current.replace(cb_max_memory_percent=round(hi - STEP * i, 3)) for i in range(1, steps)
                if lo < hi - STEP * i < hi]

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Continuous batching sizes its paged cache to a share of the free memory: lower "
                                 "transformers_continuous_batching_config's max_memory_percent (TRL's default 0.5).",
                      None)
