"""What a run's attempts proved, kept for the rest of the run: a prediction proven wrong (``decide/miss.py``: the
memory model is unsure from then on) and the OOMs climbed for (``decide/repeat.py``: one that fails as the last did
shows the rungs between them changed nothing). The conductor asks; the decisions stay its own.

>>> from oomguard.vocab.records import Attempt
>>> p = Proofs()
>>> p.repeat(Attempt(1, {}, [], "ok", 0, 1.0), None, {}) is None, p.unsure, p.said()
(True, False, [])
"""

from __future__ import annotations

from ..memory.estimate import Estimate, measured_error
from ..vocab.diagnosis import LEAK_KINDS, Diagnosis
from ..vocab.records import Attempt, AttemptKind, Outcome
from .miss import Miss, find_miss
from .repeat import Repeat, find_repeat


class Proofs:
    """The first prediction the run proved wrong (``miss``), the lines the last attempt's misses leave to say, and
    the OOMs climbed for."""

    def __init__(self) -> None:
        self.miss: Miss | None = None
        self._said: list[str] = []
        self.ooms: list[tuple[Attempt, Diagnosis]] = []

    @property
    def unsure(self) -> bool:
        """Whether the run proved the memory model wrong: from then on it is never sure, and its word alone never
        trades precision, capacity or signal before a speed or allocator change has run."""
        return self.miss is not None

    def learn(self, est: Estimate, attempt: Attempt, diag: Diagnosis | None, *, simulated: bool,
              head: str | None) -> Miss | None:
        """Whether ``attempt`` proved ``est`` (its config's prediction) wrong, beyond twice the model's measured error
        for the device and LM head: the miss is kept on the attempt (``Attempt.miss``) and said after it."""
        err = measured_error(simulated=simulated, head=head)
        miss = find_miss(est, attempt, diag, under=err.under, over=err.over)
        if miss is not None:
            attempt.miss = miss.to_dict()
            self._said.append(miss.line(stable=attempt.outcome == Outcome.OK and attempt.kind == AttemptKind.RUN))
            self.miss = self.miss or miss
        return miss

    def said(self) -> list[str]:
        """The lines left to say (each once)."""
        out, self._said = self._said, []
        return out

    def repeat(self, attempt: Attempt, diag: Diagnosis | None, who: dict[str, str],
               world_size: int = 1) -> Repeat | None:
        """Whether ``attempt``'s OOM failed as the last one climbed for did (``who``: which rung set each knob in
        force); each OOM is kept to compare the next with (not a leak's, nor an undo trial's)."""
        if attempt.outcome != Outcome.OOM or diag is None or diag.kind in LEAK_KINDS or \
                attempt.kind == AttemptKind.MINIMIZE:
            return None
        before = self.ooms[-1] if self.ooms else None
        self.ooms.append((attempt, diag))
        return find_repeat(before, (attempt, diag), who, world_size) if before is not None else None


__all__ = ["Proofs"]
