"""What an OOM means: the Diagnosis (kind, phase, evidence) and the words its fields take.

:func:`oomguard.oom.diagnose.diagnose` makes one from an OOMReport and its traceback; the remedies, the climb, the
supervisor and the guard read it. A request many times the device (:data:`OVERFLOW_FACTOR`) is an overflowed shape,
which no memory saving makes fit.

>>> d = Diagnosis("fragmentation", "backward", ("2.41 GiB reserved but unallocated",),
...               OOMReport(backend="cuda", origin="allocator", message="", requested=2**30, free=2**29))
>>> d.shortfall == 2**29, d.to_dict()["kind"]
(True, 'fragmentation')
"""

from __future__ import annotations

from dataclasses import dataclass
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
    "unknown",
)
PHASES = ("load", "generation", "scoring", "forward", "backward", "optimizer", "evaluation", "save", "unknown")

# A request this many times the device is an overflowed shape, not a budget problem.
OVERFLOW_FACTOR = 64


@dataclass(frozen=True)
class Diagnosis:
    """Why an OOM happened: ``kind``, ``phase`` and evidence sentences with the numbers.

    ``report`` is the report as diagnosed: where NVML listed this very process as another one (inside containers it
    cannot match process IDs), that process's memory has moved to ``process``, so no process is both.
    """

    kind: str
    phase: str
    evidence: tuple[str, ...]
    report: OOMReport
    frame: Frame | None = None  # the frame that decided the phase
    # The framework buffer the failing request is, when recognised: "DeepSpeed's gradient reduce bucket
    # (reduce_bucket_size)". Its size comes from a config, not from the step's shapes.
    buffer: str | None = None

    @property
    def shortfall(self) -> int | None:
        """Bytes the request lacked beyond what was free (``None`` without figures)."""
        r = self.report
        if r.requested is None or r.free is None:
            return None
        return max(0, r.requested - r.free)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "phase": self.phase, "evidence": list(self.evidence),
                **({"buffer": self.buffer} if self.buffer else {})}
