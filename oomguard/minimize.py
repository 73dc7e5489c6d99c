"""``--minimize``: prove the chosen config minimal with probes, one rung at a time.

The climb's choice is minimal by prediction. On request, once its probe passes, each rung still in force is tried
without (quality trades first, the latest-listed first, then speed trades, then free changes), one probe each; a
removal that still fits is kept. A trial whose knobs equal one already probed is skipped, so no probe is repeated
(a rung climbed twice is one trial; a rung that changes nothing here is none).

>>> from oomguard.climb import Climb
>>> from oomguard.ladder import load_ladder
>>> m = Minimizer()
>>> m.start(Climb(load_ladder("default")))
>>> m.next_trial(Climb(load_ladder("default"))) is None
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .climb import Climb
from .knobs import Knobs

TRADE_ORDER = {"quality": 0, "speed": 1, "host": 2, "nothing": 3}


@dataclass
class Minimizer:
    queue: list[str] | None = None  # rungs still to try without; None until started
    trial: str | None = None  # the rung the running trial leaves out
    tried: list[Knobs] = field(default_factory=list)  # the knobs each trial ran

    @property
    def started(self) -> bool:
        return self.queue is not None

    def start(self, climb: Climb) -> None:
        """Queue the rungs in force, costliest first; the chosen config itself counts as tried."""
        trades = {r.name: r.remedy.trades for r in climb.applied}
        self.queue = sorted(reversed(climb.remedies_in_force()), key=lambda n: TRADE_ORDER.get(trades[n], 9))
        self.tried = [climb.effective()[0]]

    def next_trial(self, climb: Climb) -> str | None:
        """The next rung to try without (its knobs never probed before), or None when all are settled."""
        while self.queue:
            candidate = self.queue.pop(0)
            if candidate not in climb.remedies_in_force():
                continue
            knobs = climb.effective(candidate)[0]
            if knobs in self.tried:
                continue  # the same overrides were probed already
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
