"""Evaluation remedies: an evaluation pass that runs out of memory is fixed by evaluating in smaller batches, which
costs training nothing.

GRPO evaluates with ``per_device_eval_batch_size`` rows per device, generated and scored at once, with
``num_generations_eval`` completions per prompt (TRL's ``None``: ``num_generations``); the global eval batch must hold
whole groups (``per_device_eval_batch_size x ranks`` divisible by ``num_generations_eval``, GRPOConfig's check).
Halving the rows halves the pass's KV cache, logits and activations; below one group per device the group shrinks
too, and evaluation then scores fewer completions per prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, halve_request, register
from .params import Param

_SAME_TRAINING = "evaluation only (training is unchanged): evaluation runs in more, smaller batches"


def _eval_knobs(knobs: Knobs, rows: int, generations: int, world_size: int, floor: int,
                like: Knobs | None = None) -> Knobs | None:
    """``knobs`` evaluating ``rows`` rows per device with the most completions per prompt, at most ``generations`` and
    at least ``floor``, that whole groups allow; None when none does. Where that is as many completions as ``like``
    evaluates with (``knobs`` by default; the user's knobs when relaxing), ``num_generations_eval`` is written as
    ``like`` writes it (unset stays unset), so the diff shows only what changed."""
    like = like if like is not None else knobs
    for g in range(generations, floor - 1, -1):
        if (rows * world_size) % g == 0:
            spelled = like.num_generations_eval if g == like.eval_geometry()[1] else g
            out = knobs.replace(per_device_eval_batch_size=rows, num_generations_eval=spelled)
            return None if out.validate(world_size) else out
    return None


@register
class EvalBatch(Remedy):
    name = "eval_batch"
    summary = ("Evaluate in smaller batches: halve per_device_eval_batch_size (and num_generations_eval with it once "
               "a batch holds one group). Training is unchanged.")
    cost = "none"
    trade_note = _SAME_TRAINING
    resume = "continue"
    graded = True
    changes = ("per_device_eval_batch_size", "num_generations_eval")
    shrinks_shapes = True
    params = {"min_generations": Param(1, int, low=1,
                                       text="the fewest completions per prompt evaluation goes down to")}

    def foreign(self, ctx: Context) -> str | None:
        return None if ctx.knobs.evaluates() else "the run does not evaluate"

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.kind != "host-ram" and d.phase not in ("evaluation", "unknown"):
            return f"the OOM came in {d.phase}, not in an evaluation pass: the evaluation batch is not in it"
        return super().helps(d)

    def _candidate(self, ctx: Context) -> Knobs | None:
        k, world = ctx.knobs, ctx.facts.world_size
        rows, g = k.eval_geometry()
        for b in range(rows // 2, 0, -1):
            out = _eval_knobs(k, b, g, world, int(self.p["min_generations"]))
            if out is not None:
                return out
        return None

    def blocked(self, ctx: Context) -> str | None:
        if self._candidate(ctx) is None:
            rows, g = ctx.knobs.eval_geometry()
            return f"at its floor: {rows} evaluation rows per device with {g} completions per prompt"
        return None

    def apply(self, ctx: Context) -> Knobs:
        out = self._candidate(ctx)
        assert out is not None
        return out

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Evaluation batches between the climbed one and the user's: the most completions per prompt first (the
        user's keeps evaluation's metrics as they were), then the most rows.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> user = TRL_DEFAULTS.replace(eval_strategy="steps", per_device_eval_batch_size=16, num_generations=4)
        >>> now = user.replace(per_device_eval_batch_size=2, num_generations_eval=2)
        >>> [k.eval_geometry() for k in EvalBatch().relax(user, now)][:6]
        [(12, 4), (8, 4), (4, 4), (15, 3), (12, 3), (9, 3)]
        """
        rows_user, g_user = user.eval_geometry()
        rows_now, g_now = current.eval_geometry()
        out = []
        for g in range(g_user, max(g_now, int(self.p["min_generations"])) - 1, -1):
            for b in range(rows_user, rows_now - 1, -1):
                if (b * world_size) % g or (b, g) in ((rows_user, g_user), (rows_now, g_now)):
                    continue
                k = _eval_knobs(current, b, g, world_size, g, like=user)
                if k is not None:
                    out.append(k)
        return out

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> user = TRL_DEFAULTS.replace(eval_strategy="steps", per_device_eval_batch_size=8)
        >>> EvalBatch().describe_change(user, user.replace(per_device_eval_batch_size=4, num_generations_eval=4))
        'evaluation in batches of 4 rows (yours: 8), 4 completions per prompt at evaluation (yours: 8); training unchanged'
        """
        (rows_u, g_u), (rows, g) = user.eval_geometry(), final.eval_geometry()
        parts = []
        if rows != rows_u:
            parts.append(f"evaluation in batches of {rows} row{'' if rows == 1 else 's'} (yours: {rows_u})")
        if g != g_u:
            parts.append(f"{g} completion{'' if g == 1 else 's'} per prompt at evaluation (yours: {g_u})")
        return (", ".join(parts) + "; training unchanged") if parts else self.name

    def trade_for(self, changes: Mapping[str, Any]) -> str:
        """Evaluation only; fewer completions per prompt at evaluation make its metrics noisier.

        >>> EvalBatch().trade_for({"per_device_eval_batch_size": 4, "num_generations_eval": 4})[-38:]
        'per prompt, so its metrics are noisier'
        """
        if not set(self.changes) & set(changes):
            return ""
        if "num_generations_eval" in changes:
            return _SAME_TRAINING + " and scores fewer completions per prompt, so its metrics are noisier"
        return _SAME_TRAINING

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "An evaluation pass generates and scores per_device_eval_batch_size rows at once: "
                                 "halving them halves its KV cache, logits and activations, and training is "
                                 "unchanged.",
                      halve_request(d) if d.phase == "evaluation" else None)
