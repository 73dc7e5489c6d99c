"""What a node follows while one attempt runs: its events, as they arrive, and when an ending decided the attempt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..vocab.events import ChildEvent, EventTail
from ..vocab.knobs import Knobs
from ..vocab.records import AttemptKind
from .classify import Ranks
from .group import GroupTail

PROBE_DIR_PREFIX = "oomguard-probe-"  # in the temporary directory: a probe's output_dir, deleted when it ends


@dataclass
class Watch:
    """What the supervisor follows while one attempt runs."""

    kind: AttemptKind
    knobs: Knobs
    tail: EventTail | GroupTail
    progress: Any
    events: list[ChildEvent] = field(default_factory=list)
    ranks: Ranks = field(default_factory=Ranks)
    decided_at: float | None = None  # when a rank's end decided the attempt while others may still run
    trouble_at: float | None = None  # when the group told this node to stop (a node died, the leader ended the job)
    decided: bool = False  # an attempt launched as a probe unless the model is sure: the training process decided
    saves_set: int | None = None  # the checkpoint cadence oomguard set for this attempt (None: the script's own)


__all__ = ["PROBE_DIR_PREFIX", "Watch"]
