"""The state of a climb up the ladder, shared by `oomguard run` and `@oomguard.guard`.

It holds the three layers of knobs (TRL defaults, what the code itself set, the rungs climbed), replays the rungs
to get the effective knobs, climbs one rung per OOM, and builds the RunReport with the diff.

>>> from oomguard.ladder import load_ladder
>>> c = Climb(load_ladder("default"))
>>> c.observe({"max_completion_length": 1024})
>>> c.effective()[0].max_completion_length
1024
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .diagnose import Diagnosis
from .knobs import TRL_DEFAULTS, Knobs, RunFacts
from .ladder import Exhausted, Ladder, Step
from .records import Attempt, RunReport, now_iso
from .strategies import Context, Remedy


@dataclass
class Climb:
    ladder: Ladder
    base: Knobs = field(default_factory=Knobs)  # the user's own starting values (guard(knobs=...)): original
    pinned: Knobs = field(default_factory=Knobs)  # a lock file's overrides, replayed: oomguard's, not the user's
    env_knobs: dict[str, Any] = field(default_factory=dict)  # allocator settings found in the environment
    facts: RunFacts = field(default_factory=RunFacts)
    observed: dict[str, Any] = field(default_factory=dict)
    applied: list[tuple[Remedy, Diagnosis | None]] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    exhausted: Exhausted | None = None
    started: float = field(default_factory=time.time)
    started_iso: str = field(default_factory=now_iso)

    # -- knobs -------------------------------------------------------------------------------------------------
    def observe(self, values: dict[str, Any]) -> None:
        """Record what the code set; the first report of each knob wins."""
        for k, v in values.items():
            if k in TRL_DEFAULTS.to_dict() and v is not None:
                self.observed.setdefault(k, tuple(v) if isinstance(v, list) else v)

    def original(self) -> Knobs:
        """The user's own config: TRL defaults, the allocator settings in the environment, then the code's values."""
        return TRL_DEFAULTS.merged(self.env_knobs).merged(self.observed).merged(self.base)

    def effective(self, without: int | None = None) -> tuple[Knobs, dict[str, str]]:
        """The knobs for the next attempt, replayed from the original, and which remedy set each changed knob.

        Replaying (rather than storing the result) keeps the rungs right when a later attempt is the first to
        report what the code set. ``without`` leaves out one climbed rung (by its index), to test whether it is
        still needed.
        """
        original = self.original()
        knobs = original.merged(self.pinned)
        who: dict[str, str] = {r.knob: "lock" for r in original.diff(knobs)}
        used: Counter[str] = Counter()
        for i, (remedy, diag) in enumerate(self.applied):
            if i == without:
                continue
            ctx = Context(knobs=knobs, facts=self.facts, diagnosis=diag, used=dict(used))
            used[remedy.name] += 1
            if remedy.blocked(ctx):
                continue
            new = remedy.apply(ctx)
            for row in knobs.diff(new):
                who[row.knob] = remedy.name
            knobs = new
        return knobs, who

    def overrides(self, knobs: Knobs | None = None) -> dict[str, Any]:
        """What oomguard changes relative to the original: the values a plan carries to the training code."""
        knobs = knobs if knobs is not None else self.effective()[0]
        return {r.knob: r.after for r in self.original().diff(knobs)}

    def remedies_in_force(self) -> list[str]:
        names: list[str] = []
        for remedy, _ in self.applied:
            if remedy.name not in names:
                names.append(remedy.name)
        return names

    # -- climbing ----------------------------------------------------------------------------------------------
    def climb(self, attempt: Attempt, diag: Diagnosis | None, read_fields: frozenset[str] | None = None,
              subject: str = "the command", fits: Callable[[Knobs], bool] | None = None,
              ) -> tuple[list[Step] | Exhausted, dict[str, Any]]:
        """Take the next rung for this OOM and record it on the attempt; returns the steps and the knobs changed.

        With ``fits`` (the memory model's verdict), rungs predicted not to be enough are climbed together with the
        next ones, straight to the first prefix of the ladder predicted to fit; the ladder's order is kept. If no
        prefix is predicted to fit, a single rung is climbed and the next attempt decides.
        """
        knobs = self.effective()[0]
        used = Counter(r.name for r, _ in self.applied)
        ctx = Context(knobs=knobs, facts=self.facts, diagnosis=diag, used=dict(used), read_fields=read_fields,
                      subject=subject)
        steps: list[Step] = []
        if fits is not None:
            steps, ran_out = self.ladder.climb(ctx, fits)
            if ran_out is not None:
                steps = steps[:1]
        if not steps:
            step = self.ladder.next(ctx)
            if isinstance(step, Exhausted):
                attempt.skipped = [{"remedy": n, "reason": why} for n, why in step.skipped]
                self.exhausted = step
                return step, {}
            steps = [step]
        skipped: dict[str, str] = {}
        for s in steps:
            for n, why in s.skipped:
                skipped.setdefault(n, why)
        climbed = {s.remedy.name for s in steps}
        attempt.skipped = [{"remedy": n, "reason": why} for n, why in skipped.items() if n not in climbed]
        for s in steps:
            self.applied.append((s.remedy, diag))
        attempt.climbed = "+".join(s.remedy.name for s in steps)
        return steps, {r.knob: r.after for r in knobs.diff(steps[-1].knobs)}

    def drop(self, index: int) -> Remedy:
        """Remove a climbed rung for good (``--minimize`` found it unnecessary)."""
        return self.applied.pop(index)[0]

    # -- the end -----------------------------------------------------------------------------------------------
    def report(self, status: str, message: str, exit_code: int | None, **extra: Any) -> RunReport:
        original = self.original()
        final, who = self.effective()
        last = self.attempts[-1] if self.attempts else None
        if last is not None:
            final = Knobs.from_dict(last.knobs)
        rows = [{**r.to_dict(), "remedy": who.get(r.knob)} for r in original.diff(final)]
        return RunReport(
            status=status, attempts=self.attempts, original=original.to_dict(),
            stable=final.to_dict() if status == "stable" else None, diff=rows, ladder=self.ladder.name,
            message=message, exit_code=exit_code, started=self.started_iso, finished=now_iso(),
            facts=self.facts.to_dict(), **extra,
        )
