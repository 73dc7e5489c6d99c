"""A run's memory trace: one :class:`MemSample` per optimizer step, and :class:`Holder`, where grown memory is held.

The training process measures a sample at each step's end (:mod:`oomguard.child.trace`) and sends it as a ``mem``
event (``vocab.events.MemSampled``, the fields of :meth:`MemSample.to_event`); ``oomguard analyze`` reads the same samples back
from an events file or a log (:mod:`oomguard.oom.trace_log`); :mod:`oomguard.oom.trend` tells a leak, a long sample
and fragmentation apart from them; :mod:`oomguard.display.trace_chart` draws them. Every field but ``step`` may be
unknown (``None``): a log that prints only a peak gives only a peak.

>>> s = MemSample(step=3, kept=70 << 20, peak=96 << 20, reserved=100 << 20, host_rss=2 << 30, completion_tokens=32)
>>> s.to_event()
{'step': 3, 'kept': 73400320, 'peak': 100663296, 'reserved': 104857600, 'host_rss': 2147483648, 'completion_tokens': 32}
>>> MemSample.from_event({"event": "mem", **s.to_event()}) == s
True
>>> s.transient
27262976
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


def _int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return None


@dataclass(frozen=True)
class MemSample:
    """The memory of one optimizer step, in bytes (tokens for the lengths).

    - ``kept``: allocated at the step's end, after the optimizer step and ``zero_grad``: what the step keeps (weights,
      optimizer state, whatever the run holds on to).
    - ``peak``: the step's own peak of allocated memory (the peak counter is reset at each step's end).
    - ``reserved``: what the caching allocator holds at the step's end (allocated plus its cache).
    - ``host_rss``: the training process's resident anonymous host memory at the step's end (file-backed pages left
      out: a memory-mapped dataset is not a leak; on the simulated device, its tensors left out too, as they are
      the device's memory).
    - ``prompt_tokens``, ``completion_tokens``: the longest prompt and completion the step trained on (the padded
      widths of its batch), where the trainer shows them.
    - ``capacity``: the device's size, where the sample's source says it (the first sample of a run is enough).
    """

    step: int
    kept: int | None = None
    peak: int | None = None
    reserved: int | None = None
    host_rss: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    capacity: int | None = None

    @property
    def transient(self) -> int | None:
        """What the step used beyond what it kept (``peak - kept``): activations, logits, generation's cache."""
        if self.peak is None or self.kept is None:
            return None
        return max(0, self.peak - self.kept)

    @property
    def tokens(self) -> int | None:
        """The step's longest prompt plus its longest completion, where both or either is known."""
        if self.prompt_tokens is None and self.completion_tokens is None:
            return None
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)

    def to_event(self) -> dict[str, Any]:
        """The ``mem`` event's fields (those known)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_event(cls, d: dict[str, Any]) -> MemSample | None:
        """A sample from a ``mem`` event's fields (extra keys are ignored); None without a step."""
        step = _int(d.get("step"))
        if step is None:
            return None
        return cls(step=step, **{f.name: _int(d.get(f.name)) for f in fields(cls) if f.name != "step"})


@dataclass(frozen=True)
class Holder:
    """Where memory that grew between two steps is held.

    ``kind`` is ``site`` (the code line that allocated it: ``name`` is ``file:line in function``) or ``object`` (the
    Python object that holds the tensors: ``name`` says which, e.g. ``list `CACHE` of module `my_rewards```).
    ``grown`` is the bytes it gained between ``since`` and ``until`` (steps), ``count`` the tensors or blocks that
    stayed.

    >>> Holder("site", "rewards.py:12 in leaky_reward", 48 << 20, 8, 9, 17).to_dict()["grown"]
    50331648
    """

    kind: str
    name: str
    grown: int
    count: int
    since: int | None = None
    until: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "grown": self.grown, "count": self.count, "since": self.since,
                "until": self.until}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Holder:
        return cls(str(d.get("kind", "")), str(d.get("name", "")), _int(d.get("grown")) or 0,
                   _int(d.get("count")) or 0, _int(d.get("since")), _int(d.get("until")))
