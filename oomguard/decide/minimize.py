"""Undo trials: prove with probes that each change in force is needed, one rung at a time.

The climb's choice is minimal by prediction. Once its probe passes, each rung still in force is tried without
(the costliest class first: signal, capacity, precision, speed, then free changes; the latest-listed first within a
class), one probe each; a removal that
still fits is kept. Two callers: ``--minimize`` tries every rung (proof, for users who want it); by default only
the rungs the memory model is unsure of are tried: those that change what is trained or learned from (capacity and
signal: LoRA, 4-bit, fewer generations, shorter completions) whose removal it predicts just over the device, within
its error (``Judge.plausible``). A speed or precision change the model is unsure of stays without a probe: worth a
launch only with ``--minimize``. A trial whose knobs equal those of an attempt already made is skipped, so no config is
probed twice (a rung climbed twice is one trial; a rung that changes nothing here is none).

>>> from oomguard.decide.climb import Climb
>>> from oomguard.decide.ladder import load_ladder
>>> m = Minimizer()
>>> m.start(Climb(load_ladder("default")))
>>> m.next_trial(Climb(load_ladder("default"))) is None
True
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ..vocab.knobs import Knobs
from .cheapest import cost_rank
from .climb import Climb


@dataclass
class Minimizer:
    queue: list[str] | None = None  # rungs still to try without; None until started
    trial: str | None = None  # the rung the running trial leaves out
    tried: list[Knobs] = field(default_factory=list)  # the knobs each attempt and trial ran

    @property
    def started(self) -> bool:
        return self.queue is not None

    def start(self, climb: Climb, costs: Collection[str] | None = None) -> None:
        """Queue the rungs in force (only those of the cost classes ``costs``, when given), costliest first; every
        config already run counts as tried."""
        rank = {r.name: cost_rank(r.remedy.cost) for r in climb.applied}
        cost = {r.name: r.remedy.cost for r in climb.applied}
        names = [n for n in reversed(climb.remedies_in_force()) if costs is None or cost[n] in costs]
        self.queue = sorted(names, key=lambda n: -rank[n])
        self.tried = [climb.effective()[0], *(Knobs.from_dict(a.knobs) for a in climb.attempts)]

    def next_trial(self, climb: Climb, worth: Callable[[Knobs], bool] | None = None) -> str | None:
        """The next rung to try without (its knobs never run before, and ``worth`` a probe), or None when all are
        settled. ``worth`` is asked when the rung's turn comes, so it sees what earlier probes taught the model."""
        while self.queue:
            candidate = self.queue.pop(0)
            if candidate not in climb.remedies_in_force():
                continue
            knobs = climb.effective(candidate)[0]
            if knobs in self.tried or (worth is not None and not worth(knobs)):
                continue  # the same overrides ran already, or the model is sure they cannot fit
            self.tried.append(knobs)
            self.trial = candidate
            return candidate
        self.trial = None
        return None

    def settle(self, climb: Climb, fits: bool) -> str:
        """Take the running trial's result: drop the rung if the probe fit without it. Returns the attempt's note."""
        removed = self.trial
        if removed is None:
            return ""
        if fits:
            climb.drop(removed)
            return f"{removed} is not needed: the probe fits without it"
        return f"{removed} is needed: without it the probe runs out of memory"


__all__ = ["Minimizer"]
