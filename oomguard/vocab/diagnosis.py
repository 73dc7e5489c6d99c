"""What an OOM means: the Diagnosis (kind, phase, evidence), the Verdict and Facts it is written from, and the words
its fields take.

:func:`oomguard.oom.diagnose.diagnose` makes one from an OOMReport and its traceback; the remedies, the climb, the
supervisor and the guard read it. ``oom/diagnose.py`` decides (a :class:`Verdict`: the kind, the phase and the
:class:`Facts` they rest on) and ``oom/evidence.py`` writes the evidence sentences from the verdict, in that one place;
nothing reads a sentence back, and nothing edits a Diagnosis after it is made. A request many times the device
(:data:`OVERFLOW_FACTOR`) is an overflowed shape, which no memory saving makes fit.

>>> d = Diagnosis("fragmentation", "backward", ("2.41 GiB reserved but unallocated",),
...               OOMReport(backend="cuda", origin="allocator", message="", requested=2**30, free=2**29))
>>> d.shortfall == 2**29, d.to_dict()["kind"], d.facts.overflowed
(True, 'fragmentation', False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .oomreport import Frame, OOMReport

KINDS = (
    "fragmentation",
    "neighbour",
    "non-pytorch",
    "impossible",
    "shortfall",
    "small-allocations",
    "host-ram",
    "vllm-reservation",
    "driver",
    "leak",
    "host-leak",
    "unknown",
)
# A run whose memory trace shows memory kept step after step until it ran out: no config change cures it (the climb
# climbs nothing for it; `oomguard run` resumes from a checkpoint with the same config).
LEAK_KINDS = ("leak", "host-leak")
PHASES = ("load", "generation", "scoring", "forward", "backward", "optimizer", "evaluation", "save", "unknown")

# A request this many times the device is an overflowed shape, not a budget problem.
OVERFLOW_FACTOR = 64
# Fragmentation is the verdict only when live tensors plus the request leave at least this share of the memory the
# process may use (its allowance, or the device less other processes) free. Closer to the limit, a defragmented cache
# would get this one request through and the next allocation of the step would fail: the process is short of memory.
FRAGMENTATION_HEADROOM = 0.10


@dataclass(frozen=True)
class Room:
    """The figures of the fragmentation test: live tensors plus the request, against the memory the process could
    use (its allowance, or the device less other processes and its non-PyTorch memory).

    >>> Room(live=6 * 2**30, need=7 * 2**30, usable=8 * 2**30).left == 2**30
    True
    """

    live: int
    need: int
    usable: int

    @property
    def left(self) -> int:
        """What the process could still use once the request is granted (negative: more than it holds)."""
        return self.usable - self.need

    @property
    def share(self) -> float:
        """``left`` as a share of ``usable`` (-1.0 where nothing is usable)."""
        return self.left / self.usable if self.usable else -1.0


@dataclass(frozen=True)
class Live:
    """What was live on the device at the OOM, by what holds it: the long-lived state (the model's ``parameters``,
    their ``gradients``, the ``optimizer``'s state) and the rest (``other``: the step's activations, generation's
    buffers). ``source``: ``tally`` (the training process counted each, ``CrashRecord.live``) or ``trace`` (what the
    step before kept, from the memory trace: the state as one figure, ``parameters``, the parts unknown).

    >>> live = Live.of({"parameters": 3 << 20, "gradients": 1 << 20, "optimizer": 1 << 20, "other": 300 << 20})
    >>> live.state >> 20, live.total >> 20, Live.of({"other": 5}) is None
    (5, 305, True)
    """

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    other: int = 0
    source: str = "tally"

    @classmethod
    def of(cls, d: Any, source: str = "tally") -> Live | None:
        """From a crash record's ``live`` (``{parameters, gradients, optimizer, other}``); None without its figures."""
        if not isinstance(d, dict) or not all(isinstance(d.get(k), int) for k in ("parameters", "other")):
            return None
        return cls(int(d["parameters"]), int(d.get("gradients") or 0), int(d.get("optimizer") or 0), int(d["other"]),
                   source)

    @property
    def state(self) -> int:
        """The long-lived state: parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.other

    def to_dict(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "other": self.other, "source": self.source}


# What a shortfall is short of, from what was live (``Facts.short_of``): the long-lived state held at least this share.
STATE_SHARE = 0.5
SHORT_OF = ("long-lived state", "activations", "generation buffers")


@dataclass(frozen=True)
class Facts:
    """What a diagnosis rests on beside the report's figures: each decision of the diagnosis, as a value.

    The figures' verdict (``by_figures``) and what it found: ``nvml_self`` (the pid NVML listed as another process
    that is this one, inside a container), ``overflowed`` (a request many times any device: an overflowed shape),
    ``own_cap`` (the process's own allowance refused a request the device had room for), ``cache_fits`` (memory
    reserved but unallocated held more than the request), ``room`` (the fragmentation test's figures, where known) and
    ``not_fragmentation`` (the cache held the request but too little room was left for the step), ``outside_torch``
    (this process's memory outside PyTorch's allocator), ``pool_hidden`` (cudaMallocAsync: device memory neither live
    tensors nor free). What the traceback showed: ``vllm_startup`` (what vLLM's own start-up was doing, "its KV
    cache": the kind is then ``vllm-reservation`` whatever the figures said). What the caller saw: ``reason`` (the
    training process's reason for stopping before vLLM started), ``host_signs`` (the supervisor's signs of the
    kernel's OOM killer, one clause each) and ``engine`` (vLLM's own engine process, where the OOM happened there).
    What the training process counted: ``live`` (:class:`Live`), and from it ``short_of``: what a shortfall (or
    small allocations) is short of, the long-lived state, the step's activations or generation's buffers.
    """

    by_figures: str | None = None
    nvml_self: int | None = None
    overflowed: bool = False
    own_cap: bool = False
    cache_fits: bool = False
    room: Room | None = None
    not_fragmentation: bool = False
    outside_torch: int | None = None
    pool_hidden: int | None = None
    vllm_startup: str | None = None
    reason: str | None = None
    host_signs: tuple[str, ...] = ()
    engine: str | None = None
    late: tuple[str, ...] = ()  # what the run's memory trace said of the OOM (``oom.trend.at_oom``), one sentence each
    # the kind is a leak that too few steps foretold (``Leak.young``): a restart must confirm it, else ``by_figures``
    young_leak: bool = False
    live: Live | None = None  # what was live at the OOM, by what holds it (the training process's tally, or the trace)
    short_of: str | None = None  # what a shortfall is short of (one of SHORT_OF), decided from ``live``


@dataclass(frozen=True)
class Verdict:
    """A diagnosis before its sentences: the kind, the report as diagnosed (this process told apart from its
    neighbours), the facts the kind rests on, the phase and the frame that shows it, and the framework buffer the
    failing request is (``None`` where it is none)."""

    kind: str
    report: OOMReport
    facts: Facts = field(default_factory=Facts)
    phase: str = "unknown"
    frame: Frame | None = None
    buffer: str | None = None


@dataclass(frozen=True)
class Diagnosis:
    """Why an OOM happened: ``kind``, ``phase`` and evidence sentences with the numbers.

    ``report`` is the report as diagnosed: where NVML listed this very process as another one (inside containers it
    cannot match process IDs), that process's memory has moved to ``process``, so no process is both. ``facts`` are
    what the kind rests on (:class:`Facts`); the evidence is written from them.
    """

    kind: str
    phase: str
    evidence: tuple[str, ...]
    report: OOMReport
    frame: Frame | None = None  # the frame that decided the phase
    # The framework buffer the failing request is, when recognised: "DeepSpeed's gradient reduce bucket
    # (reduce_bucket_size)". Its size comes from a config, not from the step's shapes.
    buffer: str | None = None
    facts: Facts = field(default_factory=Facts)

    @property
    def shortfall(self) -> int | None:
        """Bytes the request lacked beyond what was free (``None`` without figures)."""
        r = self.report
        if r.requested is None or r.free is None:
            return None
        return max(0, r.requested - r.free)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "phase": self.phase, "evidence": list(self.evidence),
                **({"buffer": self.buffer} if self.buffer else {}),
                **({"short_of": self.facts.short_of} if self.facts.short_of else {})}
