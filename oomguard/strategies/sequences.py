"""Shorter sequences: the padded completion width sets the KV cache, the activations and the logits tiles."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, halve_request, register
from .params import Param, shrink_factor


@register
class ShorterSequences(Remedy):
    name = "shorter_sequences"
    summary = "Cap completions shorter (max_completion_length) and drop the longest prompts (max_prompt_tokens)."
    cost = "signal"
    trade_note = "long reasoning is cut off; the longest prompts leave the dataset"
    resume = "continue"
    graded = True
    changes = ("max_completion_length", "max_prompt_tokens")
    shrinks_shapes = True
    params = {"factor": shrink_factor(0.5, "what each step multiplies max_completion_length by"),
              "min_completion_length": Param(64, int, low=1, text="the shortest completion length it goes down to"),
              "prompt_tail_ratio": Param(1.25, float, low=1, text="how far the longest prompt may exceed the 95th "
                                                                  "percentile before the long tail is dropped")}

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        parts = []
        if final.max_completion_length != user.max_completion_length:
            parts.append(f"{final.max_completion_length}-token completions (yours: {user.max_completion_length})")
        if final.max_prompt_tokens != user.max_prompt_tokens and final.max_prompt_tokens:
            parts.append(f"prompts over {final.max_prompt_tokens} tokens left out")
        return ", ".join(parts) or self.name

    def blocked(self, ctx: Context) -> str | None:
        c = ctx.value("max_completion_length")
        if c <= self.p["min_completion_length"] and not self._prompt_cap(ctx):
            return f"max_completion_length is at its floor ({self.p['min_completion_length']})"
        return None

    def _prompt_cap(self, ctx: Context) -> int | None:
        """Drop the prompt tail (above the 95th percentile) when it is much longer than the bulk."""
        f = ctx.facts
        if ctx.knobs.max_prompt_tokens is not None or not f.prompt_tokens_max or not f.prompt_tokens_p95:
            return None
        if f.prompt_tokens_max > self.p["prompt_tail_ratio"] * f.prompt_tokens_p95:
            return int(f.prompt_tokens_p95)
        return None

    def apply(self, ctx: Context) -> Knobs:
        c = ctx.value("max_completion_length")
        new_c = max(int(self.p["min_completion_length"]), int(c * float(self.p["factor"])))
        changes: dict[str, int] = {}
        if new_c < c:
            changes["max_completion_length"] = new_c
        cap = self._prompt_cap(ctx)
        if cap:
            changes["max_prompt_tokens"] = cap
        return ctx.knobs.replace(**changes)

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Completion lengths on a grid between the climbed and the user's (longest first), each with the user's
        prompt limit before the climbed one.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> cands = ShorterSequences().relax(TRL_DEFAULTS, TRL_DEFAULTS.replace(max_completion_length=256))
        >>> [k.max_completion_length for k in cands][:3], len(cands)
        ([480, 448, 416], 7)
        """
        c_user, c_now = user.max_completion_length or 512, current.max_completion_length or 512
        step = completion_grid(c_user)
        lengths = [c for c in range(c_user - c_user % step, c_now, -step) if c_now < c < c_user]
        caps = list(dict.fromkeys([user.max_prompt_tokens, current.max_prompt_tokens]))
        out = [current.replace(max_prompt_tokens=cap) for cap in caps[:-1]]  # the climbed length, every prompt kept
        out[:0] = [current.replace(max_completion_length=c, max_prompt_tokens=cap) for c in lengths for cap in caps]
        return out

    def trade_for(self, changes: Mapping[str, Any]) -> str:
        """Only the trades of the knobs that changed: a prompt limit left unset drops no prompt (and nothing is
        traded when neither changed).

        >>> ShorterSequences().trade_for({"max_completion_length": 64})
        'long reasoning is cut off'
        >>> ShorterSequences().trade_for({"max_prompt_tokens": 300})
        'the longest prompts leave the dataset'
        """
        notes = [note for knob, note in (("max_completion_length", "long reasoning is cut off"),
                                         ("max_prompt_tokens", "the longest prompts leave the dataset"))
                 if knob in changes]
        return "; ".join(notes)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Halving max_completion_length halves the padded completion width, and the KV cache, "
                                 "activations and log-prob tiles scale with it.",
                      halve_request(d) if d.phase in ("generation", "scoring", "forward", "backward") else None)


def completion_grid(length: int) -> int:
    """The step between relaxed completion lengths: a sixteenth of the user's length as a power of two, at least 8
    tokens (32 for 512, 64 for 1024), so a relaxed length is a round number and the search stays short.

    >>> completion_grid(512), completion_grid(1024), completion_grid(64)
    (32, 64, 8)
    """
    return max(8, 1 << max(0, length.bit_length() - 5))
