"""Knobs that remember which fields a guarded function reads.

A function that takes ``knobs`` (``@oomguard.guard`` style (b)) gets a :class:`TrackedKnobs`. The fields it reads are
the only ones a rung can act on: a rung that changes only fields the function never reads is skipped (a plain loop
that reads the batch size gains nothing from fewer generations), and the RunReport's diff shows only what reached it.

>>> from oomguard.vocab.knobs import Knobs
>>> reads: set[str] = set()
>>> knobs = track(Knobs(per_device_train_batch_size=8), reads)
>>> knobs.per_device_train_batch_size
8
>>> sorted(reads)
['per_device_train_batch_size']
"""

from __future__ import annotations

from typing import Any

from ..vocab.knobs import KNOB_NAMES, Knobs


class TrackedKnobs(Knobs):
    """Knobs that add the name of every field read to a shared set (``_reads``), so a rung that changes only unread
    fields can be skipped. Build one with :func:`track`."""

    def __getattribute__(self, name: str) -> Any:
        if name in KNOB_NAMES:
            reads = object.__getattribute__(self, "__dict__").get("_reads")
            if reads is not None:
                reads.add(name)
        return super().__getattribute__(name)


def track(knobs: Knobs, reads: set[str]) -> TrackedKnobs:
    """A copy of ``knobs`` that adds each field read to ``reads`` (the set outlives the call: the climb reads it).

    >>> from oomguard.vocab.knobs import Knobs
    >>> reads: set[str] = set()
    >>> track(Knobs(optim="adamw_torch"), reads).optim, reads
    ('adamw_torch', {'optim'})
    """
    tracked = TrackedKnobs(**{f: getattr(knobs, f) for f in KNOB_NAMES})
    object.__setattr__(tracked, "_reads", reads)
    return tracked
