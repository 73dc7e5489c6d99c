"""Choose the best config among the climbed rungs: change no more than memory demands.

The ladder walk finds *a* config that fits: the first prefix of the ladder the memory model predicts to fit. To reach
a later rung it keeps every earlier one, so a run that needed only LoRA also gets its completions and generations
halved. ``choose`` takes that prefix as the ceiling and picks, by prediction, the best config below it:

1. **Drop** every climbed rung that is not needed. Among the subsets of the climbed rungs predicted to fit, those
   with the fewest quality trades go on, then the fewest speed trades; between equals, those whose costly rungs come
   earliest in the ladder (the ladder's order is the user's preference for what to change first).
2. **Relax** each graded rung kept (completion length, generations, micro-batch, vLLM reservation), latest in the
   ladder first, to the value closest to the user's that is predicted to fit (``Remedy.relax``), e.g. 448 tokens
   rather than a blind halving to 256. Of the subsets still in the running (they differ only in free rungs such as
   allocator settings), the one whose graded knobs end closest to the user's wins, then the one with fewer changes:
   a free rung stays exactly when it lets a graded knob stay closer to the user's value.

Configurations that already ran out of memory (``avoid``) are never chosen again. The result is 1-minimal under the
model: undoing any single change of it is predicted not to fit.

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> from oomguard.strategies import make_remedy
>>> climbed = [Rung(make_remedy("shorter_sequences")), Rung(make_remedy("lora"))]
>>> fits = lambda k: bool(k.lora_r)                      # a toy model: LoRA alone is enough
>>> c = choose(TRL_DEFAULTS, climbed, fits, order=["shorter_sequences", "lora"])
>>> [r.remedy.name for r in c.rungs], c.dropped
(['lora'], ('shorter_sequences',))
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..strategies import Context, Remedy
from ..vocab.diagnosis import Diagnosis
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.sizes import format_size

# How much each kind of trade costs the user, cheapest last: quality changes what is learned.
TRADE_COST = ("quality", "speed", "host", "nothing")
# Exhaustive search over the subsets of at most this many distinct rungs (2^12 predictions); a greedy pass beyond.
EXHAUSTIVE_LIMIT = 12


@dataclass(frozen=True)
class Rung:
    """One rung in force: the remedy, the diagnosis it was climbed for, and, for a relaxed graded rung, the exact
    values it sets (replacing ``remedy.apply``)."""

    remedy: Remedy
    diagnosis: Diagnosis | None = None
    values: tuple[tuple[str, Any], ...] | None = None

    @property
    def name(self) -> str:
        return self.remedy.name


def replay(start: Knobs, rungs: Sequence[Rung], facts: RunFacts | None = None) -> tuple[Knobs, dict[str, str]]:
    """The knobs after ``rungs`` from ``start``, and which rung set each knob that changed.

    Replaying (rather than storing the result) keeps the rungs right when a later attempt is the first to report what
    the code set. A rung that is blocked at its turn (already in force) changes nothing. A knob is the last changer's,
    unless that rung only kept it in step (``Remedy.follows``) with what another rung set.
    """
    facts = facts or RunFacts()
    knobs, who = start, dict[str, str]()
    used: Counter[str] = Counter()
    for rung in rungs:
        ctx = Context(knobs=knobs, facts=facts, diagnosis=rung.diagnosis, used=dict(used))
        used[rung.name] += 1
        if rung.values is not None:
            new = rung.remedy.with_values(knobs, dict(rung.values), facts.world_size)
        elif rung.remedy.foreign(ctx) or rung.remedy.blocked(ctx):
            continue
        else:
            new = rung.remedy.apply(ctx)
        for row in knobs.diff(new):
            if row.knob in rung.remedy.follows and who.get(row.knob, rung.name) != rung.name:
                continue  # kept as another rung set it: that rung's change
            who[row.knob] = rung.name
        knobs = new
    return knobs, who


@dataclass(frozen=True)
class Choice:
    """What ``choose`` picked: the rungs in force, their knobs, and why (for the report)."""

    rungs: tuple[Rung, ...]
    knobs: Knobs
    dropped: tuple[str, ...] = ()
    relaxed: tuple[tuple[str, Any, Any], ...] = ()  # (knob, climbed value, chosen value)
    explain: dict[str, Any] = field(default_factory=dict, compare=False)

    def lines(self, capacity: int | None, load_only: bool = False) -> list[str]:
        """One line per rung dropped and per graded knob relaxed, with the prediction behind it (``load_only``: only
        the load could be judged, before GRPOTrainer was built)."""
        cap = format_size(capacity) if capacity else "the device"
        lines = []
        if self.dropped:
            peak = next((e.get("predicted_bytes_without") for e in self.explain.values()), None)
            them = "it" if len(self.dropped) == 1 else "them"
            why = f"predicted peak without {them} {format_size(peak)} of {cap}" if peak else "predicted to fit"
            if load_only:
                why = (f"loading the model without {them} is predicted to fit {cap}; the training step is judged "
                       "once GRPOTrainer is built")
            lines.append(f"  not needed: {', '.join(self.dropped)} ({why})")
        for knob, climbed, chosen in self.relaxed:
            lines.append(f"  relaxed {knob}: {climbed} → {chosen}, the value closest to yours predicted to fit")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the report: each dropped rung with the predicted peak without it, each relaxed knob."""
        return {
            "dropped": [{"remedy": n, **self.explain.get(n, {})} for n in self.dropped],
            "relaxed": [{"knob": k, "climbed": _plain(a), "chosen": _plain(b)} for k, a, b in self.relaxed],
            "rungs": [r.name for r in self.rungs],
        }


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


# The graded knobs a relaxation moves, for how far a config is from the user's (relative change, summed).
GRADED_KNOBS = ("max_completion_length", "num_generations", "per_device_train_batch_size",
                "vllm_gpu_memory_utilization")


def distance(user: Knobs, knobs: Knobs) -> float:
    """How far the graded knobs are from the user's: the sum of their relative changes.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> distance(TRL_DEFAULTS, TRL_DEFAULTS.replace(max_completion_length=384, per_device_train_batch_size=4))
    0.75
    """
    total = 0.0
    for k in GRADED_KNOBS:
        u, v = getattr(user, k), getattr(knobs, k)
        if isinstance(u, (int, float)) and isinstance(v, (int, float)) and u:
            total += abs(v - u) / abs(u)
    return round(total, 9)


@dataclass(frozen=True)
class Preference:
    """The user's preference between configs below one ceiling, in one place (``choose`` and ``Climb.rechoose``).

    ``key(names, knobs)`` is smaller for the better config: fewer quality trades, then speed, then host; then the
    earliest-listed costly rungs; then graded knobs closer to the user's (``distance``); then fewer free rungs (those
    that trade nothing, such as allocator settings), the earliest-listed first.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> from oomguard.strategies import make_remedy
    >>> pref = Preference.of([Rung(make_remedy("expandable_segments")), Rung(make_remedy("lora"))],
    ...                      ["expandable_segments", "lora"], TRL_DEFAULTS)
    >>> pref.key(["lora"], TRL_DEFAULTS) < pref.key(["expandable_segments", "lora"], TRL_DEFAULTS)
    True
    """

    trades: dict[str, str]
    position: dict[str, int]
    user: Knobs

    @classmethod
    def of(cls, climbed: Sequence[Rung], order: Sequence[str], user: Knobs) -> Preference:
        names = list(dict.fromkeys(r.name for r in climbed))
        by_name = {r.name: r.remedy for r in climbed}
        trades = {n: by_name[n].trades if by_name[n].trades in TRADE_COST else "speed" for n in names}
        position = {n: (order.index(n) if n in order else len(order) + i) for i, n in enumerate(names)}
        return cls(trades, position, user)

    def rank(self, names: Collection[str]) -> tuple[Any, ...]:
        """The first round: the costly trades. Rungs that trade nothing are left to the second round, where relaxing
        decides them."""
        counts = Counter(self.trades[n] for n in names)
        costly = [self.position[n] for n in names if self.trades[n] != "nothing"]
        return (*(counts.get(t, 0) for t in TRADE_COST[:-1]), tuple(sorted(costly, reverse=True)))

    def closeness(self, names: Collection[str], knobs: Knobs) -> tuple[Any, ...]:
        """The second round, between configs of equal rank: graded knobs closest to the user's, then fewer free
        changes."""
        free = [self.position[n] for n in names if self.trades[n] == "nothing"]
        return (distance(self.user, knobs), len(free), tuple(sorted(free, reverse=True)))

    def key(self, names: Collection[str], knobs: Knobs) -> tuple[Any, ...]:
        names = list(dict.fromkeys(names))
        return (*self.rank(names), *self.closeness(names, knobs))


def relax_rungs(start: Knobs, rungs: Sequence[Rung], names: Sequence[str], user: Knobs, ok: Callable[[Knobs], bool],
                facts: RunFacts) -> tuple[list[Rung], Knobs, list[tuple[str, Any, Any]]]:
    """Relax the graded rungs ``names`` of ``rungs``, in that order, each to the value closest to ``user``'s that is
    ``ok`` (``Remedy.relax`` lists them, closest first); the rest of ``rungs`` stays in force. Returns the rungs (a
    relaxed one carries its exact values), their knobs and each knob relaxed as ``(knob, climbed, chosen)``.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> from oomguard.strategies import make_remedy
    >>> user = TRL_DEFAULTS.replace(max_completion_length=256)
    >>> rungs = [Rung(make_remedy("shorter_sequences"))]                 # climbed: 256 -> 128
    >>> _, k, relaxed = relax_rungs(user, rungs, ["shorter_sequences"], user,
    ...                             lambda k: k.max_completion_length <= 200, RunFacts())
    >>> k.max_completion_length, relaxed
    (192, [('max_completion_length', 128, 192)])
    """
    rungs = list(rungs)
    knobs = replay(start, rungs, facts)[0]
    relaxed: list[tuple[str, Any, Any]] = []
    for name in names:
        first = next((i for i, r in enumerate(rungs) if r.name == name), None)
        if first is None:
            continue
        remedy = rungs[first].remedy
        for cand in remedy.relax(user, knobs, facts.world_size):
            values = remedy.values_of(cand, facts.world_size)
            trial = [r for r in rungs[:first] if r.name != name] + [
                Rung(remedy, rungs[first].diagnosis, values)] + [r for r in rungs[first + 1:] if r.name != name]
            new = replay(start, trial, facts)[0]
            if new != knobs and ok(new):
                relaxed += [(row.knob, row.before, row.after) for row in knobs.diff(new)]
                rungs, knobs = trial, new
                break
    return rungs, knobs, relaxed


def choose(start: Knobs, climbed: Sequence[Rung], fits: Callable[[Knobs], bool], *, order: Sequence[str] = (),
           facts: RunFacts | None = None, avoid: Collection[Knobs] = (), user: Knobs | None = None,
           peak: Callable[[Knobs], int | None] | None = None,
           relax_fits: Callable[[Knobs], bool] | None = None) -> Choice | None:
    """The best config below ``climbed`` that ``fits``; None when none does (not even all of them).

    ``start`` is where the rungs replay from (the user's config, with a lock's pins); ``user`` is the user's own config
    that graded knobs relax towards (default ``start``). ``order`` lists the ladder's rung names (its preference);
    ``peak`` (optional) gives a predicted peak, recorded for each dropped rung. ``relax_fits`` (default ``fits``)
    judges the configs a graded knob is relaxed to: relaxing pushes a config to the device's edge, so a caller whose
    predictions can be short there asks for more room.

    Two rounds: the subsets predicted to fit with the fewest costly trades (quality, then speed, then host; between
    equals, the earliest-listed) go on; each is relaxed, and the one whose graded knobs end closest to the user's
    wins, then the one with fewer free changes. So a free rung (expandable segments) is kept exactly when it lets a
    graded knob stay closer to the user's value.
    """
    facts = facts or RunFacts()
    user = user or start
    names = list(dict.fromkeys(r.name for r in climbed))
    by_name = {r.name: r.remedy for r in climbed}
    pref = Preference.of(climbed, order, user)
    trades, position = pref.trades, pref.position
    avoid_set = list(avoid)

    def knobs_of(keep: Collection[str]) -> Knobs:
        return replay(start, [r for r in climbed if r.name in keep], facts)[0]

    def ok(k: Knobs, judge: Callable[[Knobs], bool] = fits) -> bool:
        return k not in avoid_set and judge(k)

    def relax(keep: Collection[str]) -> tuple[list[Rung], Knobs, list[tuple[str, Any, Any]]]:
        """The graded rungs kept, the user's least preferred (latest-listed) first, each at the value closest to
        the user's that still fits."""
        rungs = [r for r in climbed if r.name in keep]
        graded = sorted((n for n in keep if by_name[n].graded), key=lambda n: -position[n])
        return relax_rungs(start, rungs, graded, user, lambda k: ok(k, relax_fits or fits), facts)

    finalists: list[list[str]] = []
    if len(names) <= EXHAUSTIVE_LIMIT:
        best: tuple[Any, ...] | None = None
        for n in range(len(names) + 1):
            for subset in itertools.combinations(names, n):
                key = pref.rank(subset)
                if best is not None and key > best:
                    continue
                if ok(knobs_of(subset)):
                    if best is None or key < best:
                        best, finalists = key, []
                    finalists.append(list(subset))
    elif ok(knobs_of(names)):
        # Greedy: drop the costliest rungs first (quality before speed, latest-listed first) while it still fits.
        keep = list(names)
        for name in sorted(names, key=lambda n: (TRADE_COST.index(trades[n]), -position[n])):
            trial = [m for m in keep if m != name]
            if ok(knobs_of(trial)):
                keep = trial
        finalists = [keep]
    if not finalists:
        return None

    relaxed_of = {tuple(k): relax(k) for k in finalists}
    keep = min(finalists, key=lambda k: pref.closeness(k, relaxed_of[tuple(k)][1]))
    rungs, knobs, relaxed = relaxed_of[tuple(keep)]
    dropped = tuple(n for n in names if n not in keep)
    explain: dict[str, Any] = {}
    if peak is not None and dropped:
        p = peak(knobs_of(keep))
        explain = {n: {"predicted_bytes_without": p} for n in dropped}
    return Choice(rungs=tuple(rungs), knobs=knobs, dropped=dropped, relaxed=tuple(relaxed), explain=explain)


__all__ = ["EXHAUSTIVE_LIMIT", "GRADED_KNOBS", "TRADE_COST", "Choice", "Preference", "Rung", "choose", "distance",
           "relax_rungs", "replay"]
