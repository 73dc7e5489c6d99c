"""Configs that fit and trade differently from the one chosen: the trade-off, shown.

The default choice costs the experiment least (``oomguard.decide.cheapest``): a micro-batch split before bf16
weights, bf16 weights before LoRA, LoRA before a single token cut from the completions. A user may weigh it
otherwise: a faster run that shortens completions, LoRA rather than bf16 master weights. So the end of a run shows,
for each cost class the choice pays in (speed, precision, capacity, signal), the cheapest config predicted to fit
that pays nothing in that class, and when the choice pays in several, one that pays in none of them; each with
what it changes, how much faster or slower a step is predicted, its predicted peak, and the lock that runs it. The
default choice does not change.

The rungs searched are those of the run's ladder and of the default ladder (so that a run on the `fastest` ladder is
shown the micro-batch split it did not list), less those that cannot apply here (``skip``).

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> from oomguard.strategies import make_remedy
>>> user = TRL_DEFAULTS.replace(max_completion_length=1024, num_generations=16, per_device_train_batch_size=16)
>>> fits = lambda k: k.per_device_train_batch_size <= 8 or k.max_completion_length <= 768
>>> chosen = user.replace(per_device_train_batch_size=8, gradient_accumulation_steps=2)   # a micro-batch split
>>> split = Rung(make_remedy("micro_batch"), values=(("per_device_train_batch_size", 8),
...                                                   ("gradient_accumulation_steps", 2), ("steps_per_generation", 2)))
>>> alts = alternatives(user, chosen, [split], RunFacts(), fits)
>>> alts[0].avoids, alts[0].trades
(['speed'], ['768-token completions (yours: 1024) (signal)'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..strategies import cost_rank
from ..vocab.knobs import Knobs, RunFacts
from .cheapest import CostPreference, pick
from .choose import Rung, replay
from .experiment import Experiment, summarise
from .ladder import Ladder, load_ladder


@dataclass(frozen=True)
class Alternative:
    """A config predicted to fit that pays nothing in the cost classes ``avoids``, which the chosen config pays in."""

    knobs: Knobs
    keeps: list[str]  # what it keeps that the choice changed: "no speed change (the choice: ...)"
    trades: list[str]  # its own changes against the user's config, each "what (cost class)"
    predicted_bytes: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # what changes from the user's config
    lock: str | None = None  # the lock file that runs it (written by `oomguard run`)
    avoids: list[str] = field(default_factory=list)  # the cost classes it leaves as the user had them
    versus_choice: float | None = None  # predicted step time against the chosen config's (-0.2: 20% faster)
    experiment: Experiment | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"avoids": self.avoids, "keeps": self.keeps, "trades": self.trades,
                "predicted_bytes": self.predicted_bytes, "versus_choice": self.versus_choice,
                "overrides": self.overrides, "lock": self.lock,
                **({"experiment": self.experiment.to_dict()} if self.experiment is not None else {})}


def searched(ladder: Ladder, skip: Sequence[str] = ()) -> Ladder:
    """The rungs an alternative may use: the run's ladder's, then the default ladder's it lacks, in cost order
    (stable, so each ladder's own order breaks ties), less ``skip``.

    >>> [r.name for r in searched(load_ladder("fastest")).rungs][2:7]
    ['eval_batch', 'deepspeed_buffers', 'paged_cache', 'checkpointing', 'liger_kernel']
    """
    seen = {r.name for r in ladder.rungs}
    rungs = [*ladder.rungs, *(r for r in load_ladder("default").rungs if r.name not in seen)]
    rungs = sorted((r for r in rungs if r.name not in skip), key=lambda r: cost_rank(r.cost))
    return Ladder(name="alternatives", description="", rungs=tuple(rungs), max_passes=ladder.max_passes)


def alternatives(user: Knobs, chosen: Knobs, chosen_rungs: Sequence[Rung], facts: RunFacts,
                 fits: Callable[[Knobs], bool], peak: Callable[[Knobs], int | None] | None = None, *,
                 ladder: Ladder | None = None, limit: int = 3, skip: Sequence[str] = (),
                 slowdown: Callable[[Knobs, Knobs], float | None] | None = None) -> list[Alternative]:
    """Up to ``limit`` configs predicted to fit (``fits``) that pay nothing in one of the cost classes ``chosen``
    pays in (then in all of them), cheapest first; none when ``chosen`` changes nothing that costs.

    ``chosen_rungs`` are the rungs in force in ``chosen`` (what each changed, and its cost class), ``ladder`` (the run's ladder, default ``default``), ``skip`` (rungs that cannot apply here: a missing package,
    say), ``slowdown(before, after)`` (optional: predicted extra time of a step of ``after``).
    """
    world = facts.world_size
    pool = searched(ladder or load_ladder("default"), skip)
    mine = _summary(user, chosen, chosen_rungs, facts, slowdown)
    paid = sorted({c.cost for c in mine.changed} - {"none"}, key=cost_rank, reverse=True)
    if not paid:
        return []
    tries = [[c] for c in paid] + ([paid] if len(paid) > 1 else [])
    found: dict[Knobs, Alternative] = {}
    keys: dict[Knobs, tuple[Any, ...]] = {}
    for avoid in tries:
        choice = pick(pool.only([r.name for r in pool.rungs if r.cost not in avoid]), user, facts, fits)
        if choice is None or choice.knobs == chosen or choice.knobs in found:
            continue
        k = choice.knobs
        exp = _summary(user, k, list(choice.rungs), facts, slowdown)
        keeps = [f"no {c} change, unlike the choice ({', '.join(x.what for x in mine.changed if x.cost == c)})"
                 for c in avoid]
        found[k] = Alternative(knobs=k, keeps=keeps, trades=[c.text() for c in exp.changed if c.cost != "none"],
                               predicted_bytes=peak(k) if peak is not None else None,
                               overrides={r.knob: r.after for r in user.diff(k)}, avoids=list(avoid),
                               versus_choice=slowdown(chosen, k) if slowdown is not None else None, experiment=exp)
        keys[k] = CostPreference.of(list(choice.rungs), [r.name for r in pool.rungs], user, world, facts).key(
            [r.name for r in choice.rungs], k)
    return sorted(found.values(), key=lambda a: keys[a.knobs])[:limit]


def _summary(user: Knobs, k: Knobs, rungs: Sequence[Rung], facts: RunFacts,
             slowdown: Callable[[Knobs, Knobs], float | None] | None) -> Experiment:
    """What ``k`` changes, by the rungs that made it."""
    who = replay(user, rungs, facts)[1]
    remedies = list({r.name: r.remedy for r in rungs}.values())
    return summarise(user, k, remedies, who, world_size=facts.world_size, slowdown=slowdown, facts=facts)


__all__ = ["Alternative", "alternatives", "searched"]
