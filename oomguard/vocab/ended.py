"""How one attempt ended, as the front-end that launched it observed it (``Ended``): what a front-end hands the
conductor (``oomguard.decide.conductor``), which alone builds the attempt's record (``Attempt``) from it, writes its
notes and counts it against the budget.

A front-end (``oomguard run``'s ``Launcher``, ``@oomguard.guard``'s wrapper) launches the attempt the conductor names
and returns this frozen result; it never writes a record. Its fields are the record's (``Attempt``'s, without the
index, which the conductor gives, and the decision's fields: ``climbed``, ``choice``, ``miss``), plus what only the
conductor reads: the OOM's ``diagnosis``, the knobs that reach the code (``read_fields``, where the front-end knows
them) and, for a guarded call, why only a fresh process could help (``fresh_process``) and the rungs that would not
take effect in this process (``not_here``).

>>> Ended(kind="run", outcome="ok", knobs={}, remedies=[], exit_code=0, seconds=1.0).fresh_process is None
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .diagnosis import Diagnosis


@dataclass(frozen=True)
class Ended:
    """One attempt's end (see the module)."""

    kind: str  # an AttemptKind: how it ran (a probe the training process found sure ran as the real run)
    outcome: str  # an Outcome
    knobs: dict[str, Any]  # as the training process (or the call) ran them
    remedies: list[str]
    exit_code: int | None
    seconds: float
    peak_bytes: int | None = None
    step: int | None = None
    peak_reserved_bytes: int | None = None
    oom: dict[str, Any] | None = None
    trend: dict[str, Any] | None = None
    predicted_bytes: int | None = None  # a pre-flight stop's prediction
    note: str | None = None
    unmet: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None
    generated: dict[str, Any] | None = None
    override_error: dict[str, Any] | None = None
    probe_decision: dict[str, Any] | None = None
    trace: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] | None = None
    # what only the conductor reads: not kept in the record
    diagnosis: Diagnosis | None = None
    read_fields: frozenset[str] | None = None
    fresh_process: str | None = None
    not_here: frozenset[str] = frozenset()


__all__ = ["Ended"]
