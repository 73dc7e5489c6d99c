"""What the conductor decides comes back as data: the next attempt's kind (``Next``) and what to tell the user first,
in order (``Said``), which a front-end says its own way (``say``).

>>> nxt = Next(None).line("done")
>>> say(nxt, print, print)
done
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..vocab.records import AttemptKind

if TYPE_CHECKING:
    from .climb import Decision


@dataclass(frozen=True)
class Said:
    """One thing to tell the user, in order: a ``line``, or the climb's ``decision`` (``exhausted`` when there was
    nothing left), shown as the front-end shows decisions."""

    line: str | None = None
    decision: Decision | None = None


@dataclass
class Next:
    """What comes next: an attempt of ``kind`` (None: the run is done), a probe ``deferred`` until the training
    process finds the model sure of its config (then it is the real run), an undo trial ``without`` one rung, and
    what to tell the user first."""

    kind: AttemptKind | None
    deferred: bool = False
    without: str | None = None
    said: list[Said] = field(default_factory=list)
    checkpoint_every: int | None = None  # save a checkpoint every this many steps (a leak's restarts)

    def line(self, text: str) -> Next:
        self.said.append(Said(line=text))
        return self


def say(nxt: Next, line: Callable[[str], None], decision: Callable[[Decision], None]) -> None:
    """Tell the user what ``nxt`` says, in order, through a front-end's two ways of saying things."""
    for s in nxt.said:
        if s.decision is not None:
            decision(s.decision)
        elif s.line is not None:
            line(s.line)


__all__ = ["Next", "Said", "say"]
