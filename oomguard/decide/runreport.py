"""The report a climb ends with: the user's config, what ran stable, and the diff between them, each change named by
the rung that made it (what it really did, where that is narrower than its name) and by the front-end's own flag
where it has one. What the command never said is not claimed as TRL's default: its ``from`` is null, and it is named
(``unseen``).

>>> from oomguard.decide.climb import Climb
>>> from oomguard.decide.ladder import load_ladder
>>> climb_report(Climb(load_ladder("default")), "stable", "ran", 0).diff
[]
"""

from __future__ import annotations

from typing import Any, Protocol

from ..vocab.facts import RunFacts
from ..vocab.knobs import Knobs
from ..vocab.records import Attempt, RunReport, now_iso
from ..vocab.stacks import said_by_knob
from .ladder import Ladder


class Ended(Protocol):
    """What the report reads of a climb (``decide.climb.Climb``)."""

    attempts: list[Attempt]
    facts: RunFacts
    started_iso: str
    ladder: Ladder

    def original(self) -> Knobs: ...
    def effective(self, without: str | None = None) -> tuple[Knobs, dict[str, str]]: ...
    def unseen(self) -> list[str]: ...
    def action(self, name: str, changes: dict[str, Any], who: dict[str, str]) -> str: ...


def climb_report(climb: Ended, status: str, message: str, exit_code: int | None, **extra: Any) -> RunReport:
    """``climb``'s report, ending with ``status`` (``stable``, ``exhausted``...), ``message`` and ``exit_code``."""
    original = climb.original()
    final, who = climb.effective()
    last = climb.attempts[-1] if climb.attempts else None
    if last is not None:
        final = Knobs.from_dict(last.knobs)
    # what the command never said is not claimed as TRL's default: null, and named
    unseen = climb.unseen()
    rows = [{**r.to_dict(), "remedy": who.get(r.knob), **({"from": None, "unseen": True}
                                                           if r.knob in unseen else {})}
            for r in original.diff(final)]
    changes = {r["knob"]: r["to"] for r in rows}
    # a front-end's own flag for the change (``swift rlhf --lora_rank 16``), where it has one; a spelling of
    # several knobs (swift's ``--deepspeed zero3_offload``) once, read from all the knobs in force; a config the
    # last attempt generated where the front-end has no word (``--deepspeed PATH``) by its path
    said = said_by_knob(climb.facts.stack, changes, among=final, files=last.files() if last is not None else None)
    for r in rows:
        if r["knob"] in said:
            r["flag"] = said[r["knob"]]
    for r in rows:  # what the rung did, where that is narrower than its name
        action = climb.action(r["remedy"], changes, who) if r["remedy"] else None
        if action and action != r["remedy"]:
            r["action"] = action
    return RunReport(
        status=status, attempts=climb.attempts, original={**original.to_dict(), **dict.fromkeys(unseen)},
        unseen=unseen,
        stable=final.to_dict() if status == "stable" else None, diff=rows, ladder=climb.ladder.name,
        message=message, exit_code=exit_code, started=climb.started_iso, finished=now_iso(),
        facts=climb.facts.to_dict(), **extra,
    )


__all__ = ["climb_report"]
