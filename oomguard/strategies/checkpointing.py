"""Activation checkpointing: keep only each layer's input and recompute the rest in backward."""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register


@register
class Checkpointing(Remedy):
    name = "checkpointing"
    summary = "Turn on activation checkpointing (activation_checkpointing=True)."
    cost = "speed"
    trade_note = "about 20-30% slower: each layer's forward runs twice"
    resume = "continue"
    changes = ("gradient_checkpointing",)
    shrinks_shapes = True

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.phase in ("generation", "scoring"):
            return f"the OOM came during {d.phase}, which runs without gradients, so there is nothing to checkpoint"
        if d is not None and d.kind == "impossible":
            return "checkpointing does not shrink the single oversized request"
        return super().helps(d)

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return "gradient checkpointing"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("gradient_checkpointing"):
            trl = f"TRL {ctx.facts.trl_version}" if ctx.facts.trl_version else "TRL"
            return f"already in force ({trl} checkpoints by default)"
        return None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(gradient_checkpointing=True)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Checkpointing stores one tensor per layer instead of every activation; it is on by "
                                 "default in TRL's GRPOConfig (0.29 to 1.16) unless the script turned it off.", None)
