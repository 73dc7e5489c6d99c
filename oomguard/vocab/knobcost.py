"""What moving one value away from the user's costs the experiment, within one cost class: the figures the choice
weighs when two configs change as many things of a class (``oomguard.decide.cheapest.class_distance``).

A cost is declared once, where the value it reads lives: on the knob's entry in the knob table (``speed_cost=`` and
``signal_cost=`` of ``knobtable.knob``) when the knob's own value measures it (a flag turned on, a ZeRO stage, a
share of the device), or on the remedy (``Remedy.speed_cost``) when the quantity its rung moves is read from several
knobs (``of=``: the micro-steps per generation round, the generation rounds per optimizer step, the prompts per
step), which no single knob holds and which other rungs move too. A speed cost is a rough share of a step's time, a
signal cost a share of what GRPO learns from; a cost of 0 says, on purpose, that the change costs nothing in its
class.

>>> on(0.1).measure(None, True), halving(0.05).measure(0.5, 0.125), cut(1.0).measure(256, 192)
(0.1, 0.1, 0.25)
>>> stages({2: 0.05, 3: 0.3}, unset=0).measure(2, 3), FREE.measure(4, 2)
(0.25, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

HOWS = ("on", "off", "stages", "halving", "doubling", "cut", "free")


@dataclass(frozen=True)
class Cost:
    """How far a value moved, weighed: ``how`` it is read (see :data:`HOWS` and the constructors below), its
    ``weight``, the ``steps`` of a value that costs by stage, ``unset`` (what a value left unset, None, reads as;
    None: an unset value moved nothing), ``group`` (costs of one group count once, the largest: DeepSpeed's three
    buffer sizes are one change), ``capped`` (a cut of the pixels the largest image really got, not of a budget it
    never used), ``of`` (a remedy's: the quantity read from the knobs, ``of(knobs, world_size)``) and ``what`` (that
    quantity in words, and why the figure, for the reference pages)."""

    how: str
    weight: float = 0.0
    steps: tuple[tuple[Any, float], ...] = ()
    unset: Any = None
    group: str = ""
    capped: bool = False
    of: Callable[[Any, int], float] | None = None
    what: str = ""

    def __post_init__(self) -> None:
        if self.how not in HOWS:
            raise ValueError(f"a cost is read one of {', '.join(HOWS)} ways, not {self.how!r}")

    def measure(self, before: Any, after: Any, cap: float | None = None) -> float:
        """What moving from ``before`` (the user's) to ``after`` costs; never below 0 (a change back towards the user,
        or a cheaper one, costs nothing).

        >>> off(0.3).measure(None, False), off(0.3).measure(False, False), doubling(0.05).measure(2, 8)
        (0.3, 0.0, 0.1)
        >>> cut(0.5, capped=True).measure(12845056, 1036800, cap=1080 * 1920)
        0.25
        """
        if self.how == "free":
            return 0.0
        if self.how == "on":
            return self.weight if after and not before else 0.0
        if self.how == "off":
            return self.weight if after is False and before is not False else 0.0
        before = self.unset if before is None else before
        after = self.unset if after is None else after
        if self.how == "stages":
            table = dict(self.steps)
            moved: float = table.get(after, 0.0) - table.get(before, 0.0)
            return max(0.0, moved)
        if not before or not after:
            return 0.0
        if self.how == "cut":
            had = min(before, cap) if self.capped and cap else before
            return self.weight * max(0.0, 1.0 - float(after) / float(had))
        ratio = float(before) / float(after) if self.how == "halving" else float(after) / float(before)
        return self.weight * max(0.0, math.log2(ratio))

    def text(self) -> str:
        """The figure in words, for the reference pages: ``0.1 when set``, ``0.5 × the share cut (...)``.

        >>> halving(0.05, what="fewer sequences at once").text()
        '0.05 per halving (fewer sequences at once)'
        >>> cut(1.0).text(), FREE.text()
        ('the share cut', '0')
        """
        if self.how == "free":
            body = "0"
        elif self.how == "stages":
            body = ", ".join(f"{w:g} at {v}" for v, w in self.steps)
        elif self.how == "cut":
            body = "the share cut" if self.weight == 1 else f"{self.weight:g} × the share cut"
        else:
            body = f"{self.weight:g} " + {"on": "when set", "off": "when turned off", "halving": "per halving",
                                          "doubling": "per doubling"}[self.how]
        return body + (f" ({self.what})" if self.what else "")


def on(weight: float, **kw: Any) -> Cost:
    """A flag the user left off, turned on (an offload, checkpointing)."""
    return Cost("on", weight, **kw)


def off(weight: float, **kw: Any) -> Cost:
    """A flag turned off (False) where the user had it on or unset (ZeRO-3's generation gathered whole)."""
    return Cost("off", weight, **kw)


def stages(table: Mapping[Any, float], **kw: Any) -> Cost:
    """A value that costs by what it is (a ZeRO stage): the cost of the new value less the user's."""
    return Cost("stages", steps=tuple(table.items()), **kw)


def halving(weight: float, **kw: Any) -> Cost:
    """``weight`` for each halving of the value (a share of the device given to a cache)."""
    return Cost("halving", weight, **kw)


def doubling(weight: float, **kw: Any) -> Cost:
    """``weight`` for each doubling of the value (micro-steps per round, rounds per step)."""
    return Cost("doubling", weight, **kw)


def cut(weight: float, **kw: Any) -> Cost:
    """``weight`` times the share of the value cut (a completion length, a vLLM reservation)."""
    return Cost("cut", weight, **kw)


FREE = Cost("free")  # declared on purpose: the change costs nothing in its class


def total(costs: Mapping[str, tuple[Cost, Any, Any]], cap: float | None = None) -> float:
    """The sum of every cost's measure (``{name: (cost, before, after)}``), a group's counted once (its largest);
    summed exactly (``math.fsum``), so the order the costs are listed in never moves a figure.

    >>> b = on(0.01, group="buffers")
    >>> total({"a": (b, None, "auto"), "b": (b, None, "auto"), "c": (on(0.1), False, True)})
    0.11
    """
    grouped: dict[str, float] = {}
    alone = []
    for cost, before, after in costs.values():
        m = cost.measure(before, after, cap)
        if cost.group:
            grouped[cost.group] = max(grouped.get(cost.group, 0.0), m)
        else:
            alone.append(m)
    return math.fsum([*alone, *grouped.values()])


__all__ = ["FREE", "HOWS", "Cost", "cut", "doubling", "halving", "off", "on", "stages", "total"]
