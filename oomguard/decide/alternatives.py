"""Configs that fit and keep more of the user's GRPO semantics than the one chosen: the trade-off, shown.

The climb follows the ladder's order (the mission's: shorter sequences and fewer generations early), which is right
as a default but can cut half of every reasoning trace where a micro-batch split and an 8-bit optimizer would have
kept it. When the chosen config trades quality (shorter completions, fewer generations or prompts per step, LoRA,
4-bit), :func:`alternatives` finds up to three configs the memory model predicts to fit that keep more of what GRPO
learns from, paying in speed or precision instead. The default choice does not change: they are shown (final
message, report, ``oomguard plan``) with what each trades and the lock or knobs that run it.

How: from the user's own config, a ladder of the rungs that keep GRPO's semantics (allocator settings, bf16 load,
micro-batch split, checkpointing, 8-bit optimizer) is climbed to the first prefix predicted to fit, then only what is
needed is kept (``oomguard.decide.choose``); then the same with one quality trade allowed at a time (LoRA, 4-bit, fewer
generations, shorter sequences), so a config that needs some quality trade still keeps the rest. Those that keep
more than the chosen config, and no less on any count, are ranked by how much they keep.

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> user = TRL_DEFAULTS.replace(max_completion_length=1024, num_generations=16, per_device_train_batch_size=16)
>>> chosen = user.replace(max_completion_length=512)
>>> fits = lambda k: k.max_completion_length <= 512 or k.optim == "adamw_bnb_8bit"
>>> alts = alternatives(user, chosen, RunFacts(), fits)
>>> alts[0].keeps, alts[0].trades
(['max_completion_length 1024 (the choice: 512)'], ['precision: 8-bit moments: about 2 bytes per parameter instead of 8, with a small effect on updates'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..strategies import Context, make_remedy
from ..vocab.knobs import Knobs, RunFacts
from .choose import Rung, choose, replay
from .ladder import Ladder

# Rungs that keep what GRPO learns from (they trade nothing, speed or precision), in the order they are tried.
KEEPERS = ("expandable_segments", "empty_cache", "bf16_load", "micro_batch", "checkpointing", "optimizer_8bit")
# Quality trades, one of which an alternative may still need.
TRADERS = ("lora", "load_4bit", "fewer_generations", "shorter_sequences")


@dataclass(frozen=True)
class Alternative:
    """A config that fits and keeps more of the user's GRPO semantics than the chosen one."""

    knobs: Knobs
    keeps: list[str]  # what it keeps that the choice gave up, each "knob value (the choice: value)"
    trades: list[str]  # "speed: ...", "precision: ...", "quality: ..." against the user's own config
    predicted_bytes: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # what changes from the user's config
    lock: str | None = None  # the lock file that runs it (written by `oomguard run`)

    def to_dict(self) -> dict[str, Any]:
        return {"keeps": self.keeps, "trades": self.trades, "predicted_bytes": self.predicted_bytes,
                "overrides": self.overrides, "lock": self.lock}


def semantics(user: Knobs, k: Knobs, world_size: int = 1) -> dict[str, float]:
    """How much of the user's GRPO semantics ``k`` keeps, per count (1.0: all of it), higher is better.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> semantics(TRL_DEFAULTS, TRL_DEFAULTS.replace(max_completion_length=256, lora_r=16))["max_completion_length"]
    0.5
    """
    def ratio(a: Any, b: Any) -> float:
        return min(1.0, float(b) / float(a)) if a and b else 1.0

    rows_user = user.rows_per_device(world_size) // max(1, user.num_generations or 1)
    rows_k = k.rows_per_device(world_size) // max(1, k.num_generations or 1)
    return {
        "max_completion_length": ratio(user.max_completion_length, k.max_completion_length),
        "num_generations": ratio(user.num_generations, k.num_generations),
        "prompts_per_step": ratio(rows_user or 1, rows_k or 1),
        "full_weights": 0.0 if (k.lora_r and not user.lora_r) else 1.0,
        "unquantised": 0.0 if (k.load_in_4bit and not user.load_in_4bit) else 1.0,
    }


def trades_quality(user: Knobs, k: Knobs, world_size: int = 1) -> bool:
    """Whether ``k`` gives up any of the user's GRPO semantics."""
    return any(v < 1.0 for v in semantics(user, k, world_size).values())


def _keeps_more(user: Knobs, alt: Knobs, chosen: Knobs, world: int) -> list[str] | None:
    """What ``alt`` keeps that ``chosen`` gave up, or None when it gives up more anywhere (or keeps nothing more)."""
    a, c = semantics(user, alt, world), semantics(user, chosen, world)
    if any(a[key] < c[key] - 1e-9 for key in a):
        return None
    out = []
    for key in a:
        if a[key] > c[key] + 1e-9:
            if key in ("max_completion_length", "num_generations"):
                out.append(f"{key} {getattr(alt, key)} (the choice: {getattr(chosen, key)})")
            elif key == "prompts_per_step":
                out.append(f"per_device_train_batch_size x gradient_accumulation_steps "
                           f"{alt.rows_per_device(world)} rows (the choice: {chosen.rows_per_device(world)})")
            else:
                out.append({"full_weights": "a full fine-tune (the choice: LoRA)",
                            "unquantised": "unquantised weights (the choice: 4-bit)"}[key])
    return out or None


def _trades(user: Knobs, rungs: Sequence[Rung], facts: RunFacts) -> list[str]:
    """What the config of ``rungs`` trades against the user's, per rung that changed something, with its kind."""
    k, who = replay(user, rungs, facts)
    changes = {r.knob: r.after for r in user.diff(k)}
    out = []
    for rung in rungs:
        remedy = rung.remedy
        mine = {knob: v for knob, v in changes.items() if who.get(knob) == rung.name}
        if not mine or remedy.trades == "nothing":
            continue
        note = remedy.trade_for(mine)
        kind = "precision" if remedy.name in ("bf16_load", "optimizer_8bit") else remedy.trades
        if note:
            out.append(f"{kind}: {note}")
    return list(dict.fromkeys(out))


def alternatives(user: Knobs, chosen: Knobs, facts: RunFacts, fits: Callable[[Knobs], bool],
                 peak: Callable[[Knobs], int | None] | None = None, *, limit: int = 3,
                 skip: Sequence[str] = ()) -> list[Alternative]:
    """Up to ``limit`` configs predicted to fit (``fits``) that keep more of ``user``'s GRPO semantics than
    ``chosen``, most kept first; none when ``chosen`` trades no quality. ``skip``: rungs that cannot apply here (a
    missing package, say)."""
    world = facts.world_size
    if not trades_quality(user, chosen, world):
        return []
    found: dict[Knobs, Alternative] = {}
    for extra in ((), *((q,) for q in TRADERS)):
        names = [n for n in (*KEEPERS, *extra) if n not in skip]
        ladder = Ladder(name="alternatives", description="", rungs=tuple(make_remedy(n) for n in names))
        steps, exhausted = ladder.climb_to_fit(Context(knobs=user, facts=facts), fits)
        if exhausted is not None or not steps:
            continue
        choice = choose(user, [Rung(s.remedy) for s in steps], fits, order=names, facts=facts)
        if choice is None or choice.knobs in found:
            continue
        keeps = _keeps_more(user, choice.knobs, chosen, world)
        if keeps is None:
            continue
        k = choice.knobs
        found[k] = Alternative(knobs=k, keeps=keeps, trades=_trades(user, choice.rungs, facts),
                               predicted_bytes=peak(k) if peak is not None else None,
                               overrides={r.knob: r.after for r in user.diff(k)})

    def rank(a: Alternative) -> tuple:
        s = semantics(user, a.knobs, world)
        return (-sum(s.values()), len(a.trades), a.predicted_bytes or 0)

    return sorted(found.values(), key=rank)[:limit]


__all__ = ["KEEPERS", "TRADERS", "Alternative", "alternatives", "semantics", "trades_quality"]
