"""Choose by what a change costs the experiment: the config predicted to fit whose changes cost the least.

GRPO users choose a number of generations, a completion length, an effective batch and a full fine-tune on purpose:
these are the experiment. Every remedy declares a cost class (``Remedy.cost``, cheapest first: ``none``, ``speed``,
``precision``, ``capacity``, ``signal``; see ``oomguard.strategies.base``). A config's cost is compared class by
class from the costliest down: fewer changes in the costliest class win, then smaller ones (``class_distance``: how
far that class's graded values moved from the user's), then the ladder's order; only between equals does the next
class down count. So a micro-batch split (speed) and bf16 weights (precision) win over LoRA (capacity), and LoRA over
a single token cut from the completions (signal).

Two steps, like the ladder-order choice of ``oomguard.decide.choose``:

1. **Ceiling** (``Ladder.climb_by_cost``): climb the ladder's rungs of the cheapest class, then of the next class
   too, and so on, to the first config predicted to fit. Every rung of the classes below the last one is in force,
   at its strongest.
2. **Cheapest below it** (``cheapest``): class by class from the costliest down, keep the fewest rungs of that class
   (then the smallest change: graded rungs are relaxed to the value closest to the user's) that still fit with every
   cheaper rung at its strongest; then the next class down is decided with those kept. Exact for this order of
   costs as long as a cheaper rung never adds memory, and cheap: a class has at most a handful of rungs.

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> from oomguard.strategies import make_remedy
>>> climbed = [Rung(make_remedy(n)) for n in ("micro_batch", "bf16_load", "lora", "shorter_sequences")]
>>> fits = lambda k: k.dtype == "bfloat16" and k.per_device_train_batch_size <= 4   # a toy model
>>> user = TRL_DEFAULTS.replace(per_device_train_batch_size=8, learning_rate=1e-4)  # bf16 weights still learn
>>> c = cheapest(user, climbed, fits)
>>> [r.name for r in c.rungs], c.knobs.per_device_train_batch_size, c.knobs.gradient_accumulation_steps
(['micro_batch', 'bf16_load'], 4, 2)
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ..strategies import COST_CLASSES, REGISTRY, WEIGHED, Context, cost_rank
from ..vocab.knobcost import total
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.knobtable import TABLE
from .choose import Choice, Rung, relax_rungs, replay
from .ladder import Ladder


def class_distance(user: Knobs, k: Knobs, world_size: int = 1, image_pixels: int | None = None) -> dict[str, float]:
    """How far ``k`` moved from ``user`` within each cost class whose changes are weighed (0 for the others): the
    costs declared on the knobs (the knob table's ``speed_cost`` and ``signal_cost``: a flag set, a ZeRO stage, a
    share cut) and on the remedies whose rungs move a quantity read from several knobs (``Remedy.speed_cost``: the
    micro-steps per generation round, the generation rounds per step, the prompts per step), each measured from the
    user's value to ``k``'s and summed (``oomguard.vocab.knobcost``). For ``speed`` a rough share of a step's time
    the changes add, never compared with another class's; for ``signal`` the relative cuts of what GRPO learns from
    (completion length, generations, prompts per step; half a cut of a vision-language model's pixels, of those the
    largest image, ``image_pixels``, got).

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> user = TRL_DEFAULTS.replace(max_completion_length=256, num_generations=8, per_device_train_batch_size=8)
    >>> d = class_distance(user, user.replace(max_completion_length=192, per_device_train_batch_size=4,
    ...                                        gradient_accumulation_steps=2))
    >>> d["signal"], d["speed"]
    (0.25, 0.05)
    >>> class_distance(user, user.replace(zero_stage=3))["speed"] > class_distance(user, user.replace(
    ...     per_device_train_batch_size=2, gradient_accumulation_steps=4))["speed"]
    True
    """
    out = dict.fromkeys(COST_CLASSES, 0.0)
    for cls, attr in WEIGHED.items():
        costs = {name: (c, getattr(user, name), getattr(k, name))
                 for name, info in TABLE.items() if (c := getattr(info, attr)) is not None}
        costs |= {f"remedy {name}": (c, c.of(user, world_size), c.of(k, world_size))
                  for name, r in REGISTRY.items() if (c := getattr(r, attr)) is not None and c.of is not None}
        out[cls] = round(total(costs, image_pixels), 9)
    return out


@dataclass(frozen=True)
class CostPreference:
    """The user's preference between configs by what they cost the experiment, in one place (``cheapest`` and
    ``Climb.rechoose``). ``key(names, knobs)`` is smaller for the better config: class by class from the costliest,
    the number of rungs of that class, then how far its graded values moved (``class_distance``), then the ladder's
    order (the earliest-listed rungs preferred).

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> from oomguard.strategies import make_remedy
    >>> pref = CostPreference.of([Rung(make_remedy(n)) for n in ("micro_batch", "lora")], ["micro_batch", "lora"],
    ...                          TRL_DEFAULTS)
    >>> pref.key(["micro_batch"], TRL_DEFAULTS) < pref.key(["lora"], TRL_DEFAULTS)
    True
    """

    costs: dict[str, str]
    position: dict[str, int]
    user: Knobs
    world_size: int = 1
    image_pixels: int | None = None  # a vision-language model's largest image (RunFacts), for the pixel cut

    @classmethod
    def of(cls, rungs: Sequence[Rung], order: Sequence[str], user: Knobs, world_size: int = 1,
           facts: RunFacts | None = None) -> CostPreference:
        names = list(dict.fromkeys(r.name for r in rungs))
        costs = {r.name: r.remedy.cost for r in rungs}
        position = {n: (order.index(n) if n in order else len(order) + i) for i, n in enumerate(names)}
        pixels = facts.image_height * facts.image_width if facts and facts.image_height and facts.image_width else None
        return cls(costs, position, user, world_size, pixels)

    def class_key(self, cost: str, names: Collection[str], knobs: Knobs) -> tuple[Any, ...]:
        """One class's part of the key: how many rungs of it, how far its values moved, where they are listed."""
        mine = sorted((self.position[n] for n in dict.fromkeys(names) if self.costs.get(n) == cost), reverse=True)
        return (len(mine), class_distance(self.user, knobs, self.world_size, self.image_pixels)[cost], tuple(mine))

    def key(self, names: Collection[str], knobs: Knobs) -> tuple[Any, ...]:
        return tuple(self.class_key(c, names, knobs) for c in reversed(COST_CLASSES))


def cheapest(start: Knobs, climbed: Sequence[Rung], fits: Callable[[Knobs], bool], *, order: Sequence[str] = (),
             facts: RunFacts | None = None, avoid: Collection[Knobs] = (), user: Knobs | None = None,
             peak: Callable[[Knobs], int | None] | None = None) -> Choice | None:
    """The config below ``climbed`` that ``fits`` and costs the experiment least; None when none does.

    ``start`` is where the rungs replay from (the user's config with a lock's pins), ``user`` the config graded
    knobs relax towards and costs are measured from (default ``start``); ``order`` the ladder's rung names (ties);
    configs in ``avoid`` (they ran out of memory) never fit; ``peak`` (optional) records the predicted peak for the
    report's dropped rungs. Same arguments and result as ``oomguard.decide.choose.choose``.
    """
    facts = facts or RunFacts()
    user = user or start
    avoid_list = list(avoid)
    names = list(dict.fromkeys(r.name for r in climbed))
    pref = CostPreference.of(climbed, order, user, facts.world_size, facts)

    def ok(k: Knobs) -> bool:
        return k not in avoid_list and fits(k)

    def build(kept: dict[str, Rung | None], rest: Collection[str]) -> list[Rung]:
        """The climbed rungs in their order: those decided (a relaxed one by its values), then those still at
        their strongest (every pass of them)."""
        out = []
        for r in climbed:
            if r.name in kept:
                chosen = kept[r.name]
                if chosen is not None and chosen not in out:
                    out.append(chosen)
                elif chosen is None:
                    out.append(r)
            elif r.name in rest:
                out.append(r)
        return out

    kept: dict[str, Rung | None] = {}  # decided rungs: None keeps the climbed passes, a Rung a relaxed value
    relaxed_all: list[tuple[str, Any, Any]] = []
    for cost in reversed(COST_CLASSES):
        mine = [n for n in names if pref.costs[n] == cost]
        if not mine:
            continue
        below = [n for n in names if cost_rank(pref.costs[n]) < cost_rank(cost)]
        best: tuple[tuple[Any, ...], dict[str, Rung | None], list[tuple[str, Any, Any]]] | None = None
        for size in range(len(mine) + 1):
            for subset in itertools.combinations(mine, size):
                trial = {**kept, **dict.fromkeys(subset)}
                rungs = build(trial, below)
                if not ok(replay(start, rungs, facts)[0]):
                    continue
                graded = sorted((n for n in subset if _remedy(climbed, n).graded), key=lambda n: -pref.position[n])
                rungs, knobs, relaxed = relax_rungs(start, rungs, graded, user, ok, facts)
                decided = {**trial, **{r.name: (r if r.values is not None else None) for r in rungs
                                       if r.name in subset}}
                key = pref.class_key(cost, subset, knobs)
                if best is None or key < best[0]:
                    best = (key, decided, relaxed)
            if best is not None:
                break  # the fewest rungs of this class that fit
        if best is None:
            return None  # not even the whole ceiling fits
        kept = best[1]
        relaxed_all = [r for r in relaxed_all if r[0] not in {x[0] for x in best[2]}] + best[2]
    rungs = build(kept, ())
    knobs = replay(start, rungs, facts)[0]
    in_force = {r.name for r in rungs}
    dropped = tuple(n for n in names if n not in in_force)
    explain: dict[str, Any] = {}
    if peak is not None and dropped:
        p = peak(knobs)
        explain = {n: {"predicted_bytes_without": p} for n in dropped}
    still = tuple(r for r in relaxed_all if getattr(knobs, r[0]) == r[2])
    return Choice(rungs=tuple(rungs), knobs=knobs, dropped=dropped, relaxed=still, explain=explain)


def pick(ladder: Ladder, user: Knobs, facts: RunFacts, fits: Callable[[Knobs], bool], *,
         peak: Callable[[Knobs], int | None] | None = None) -> Choice | None:
    """From ``user``'s config, the cheapest config of ``ladder``'s rungs predicted to fit: the ceiling by cost
    (``Ladder.climb_by_cost``), then ``cheapest`` below it; None when nothing fits (or ``user`` needs no change).

    >>> from oomguard.decide.ladder import load_ladder
    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> bf16 = lambda k: k.dtype == "bfloat16"
    >>> [r.name for r in pick(load_ladder("default"), TRL_DEFAULTS.replace(learning_rate=1e-4), RunFacts(), bf16).rungs]
    ['bf16_load']
    >>> [r.name for r in pick(load_ladder("default"), TRL_DEFAULTS, RunFacts(), bf16).rungs]  # 1e-6: LoRA keeps it
    ['lora', 'bf16_load']
    """
    steps, ran_out = ladder.climb_by_cost(Context(knobs=user, facts=facts), fits)
    if ran_out is not None or not steps:
        return None
    return cheapest(user, [Rung(s.remedy) for s in steps], fits, order=[r.name for r in ladder.rungs], facts=facts,
                    peak=peak)


def _remedy(climbed: Sequence[Rung], name: str) -> Any:
    return next(r.remedy for r in climbed if r.name == name)


def costs_of(rungs: Sequence[Rung]) -> Counter[str]:
    """How many rungs of each cost class are in force.

    >>> from oomguard.strategies import make_remedy
    >>> dict(costs_of([Rung(make_remedy("micro_batch")), Rung(make_remedy("bf16_load"))]))
    {'speed': 1, 'precision': 1}
    """
    return Counter(r.remedy.cost for r in {r.name: r for r in rungs}.values())


__all__ = ["CostPreference", "cheapest", "class_distance", "cost_rank", "costs_of", "pick"]
