"""What a run of ``oomguard run`` is given: its options (``RunOptions``), the reporter it talks through, and the
constants its parts share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from ..decide.conductor import Policy
from ..decide.ladder import Exhausted, Ladder, Step
from ..vocab.diagnosis import Diagnosis
from ..vocab.lock import Lock
from ..vocab.records import Attempt, RunReport
from ..vocab.trlrange import Support
from .group import Membership

__all__ = ["BOOT_DIR", "RANK_GRACE_ENV", "Reporter", "RunOptions", "rank_grace"]

BOOT_DIR = Path(__file__).resolve().parents[1] / "child" / "_boot"
# How long the other ranks may take to stop after one rank's end decided the attempt, before oomguard stops them:
# they are usually stuck at a collective waiting for the rank that is gone. The default suits a real job (a rank
# that writes its own record of a pre-flight stop or an OOM a little later than the first); tests shorten it.
RANK_GRACE_ENV = "OOMGUARD_RANK_GRACE"
RANK_GRACE_S = 10.0


def rank_grace(env: Mapping[str, str]) -> float:
    """The rank-hang grace in seconds: ``$OOMGUARD_RANK_GRACE``, else 10.

    >>> rank_grace({}), rank_grace({"OOMGUARD_RANK_GRACE": "2.5"})
    (10.0, 2.5)
    >>> rank_grace({"OOMGUARD_RANK_GRACE": "soon"})
    Traceback (most recent call last):
    ...
    ValueError: OOMGUARD_RANK_GRACE='soon' is not a number of seconds: set it to e.g. 10, or unset it for the default
    """
    raw = env.get(RANK_GRACE_ENV)
    if raw is None or not raw.strip():
        return RANK_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{RANK_GRACE_ENV}={raw!r} is not a number of seconds: set it to e.g. 10, or unset it for "
                         "the default")
    return value


class Reporter(Protocol):
    def attempt_start(self, index: int, max_attempts: int, remedies: list[str], changes: dict[str, Any],
                      kind: str) -> None: ...
    def attempt_end(self, attempt: Attempt, diagnosis: Diagnosis | None) -> None: ...
    def decision(self, steps: list[Step], exhausted: Exhausted | None, changes: dict[str, Any],
                 skipped: list[dict[str, str]] | None = None) -> None: ...
    def live(self) -> Any: ...
    def progress(self, state: Any) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, report: RunReport, report_path: Path, lock_path: Path | None) -> None: ...


@dataclass
class RunOptions:
    """What `oomguard run` is given: the climb's ``policy`` (the conductor's, ``Policy``: the budget, probes, undo
    trials, the pre-flight, the ladder's choice, leak restarts; its ``replay`` and ``device`` are set from ``replay``
    and the machine when the run starts), and what only the launches and the report need."""

    ladder: Ladder
    policy: Policy = field(default_factory=Policy)
    simulate_gpu: int | None = None
    simulate_context: int | None = None  # the simulated device's memory outside its allocator (None: the default)
    gpu_memory: int | None = None
    report_path: Path = Path("oomguard-report.json")
    lock_path: Path = Path("oomguard.lock.json")
    workdir: Path = Path(".oomguard")
    replay: Lock | None = None  # a lock file's content: replay it without climbing
    grace: float = 20.0
    echo: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    predict: bool = True  # let the memory model choose (ceiling, drops, relaxed graded knobs)
    checkpoint_every: int | None = None  # add a checkpoint every N steps, so a late OOM loses at most N
    oom_grace: float = RANK_GRACE_S  # after a rank's end decides the attempt (an OOM, a pre-flight stop, a failure, a death),
    # how long the others may take to stop before oomguard stops them
    capacity: int | None = None  # the device size, for predictions (else --simulate-gpu, --gpu-memory or NVML)
    html_path: Path | None = None  # also write a self-contained HTML report
    membership: Membership | None = None  # this node's place in a job on several nodes (oomguard.group)
    trl: Support | None = None  # the command's TRL as read before launching (run.command.trl_support), if readable
    ladder_reason: str | None = None  # why the command itself picked the multi-gpu ladder (run.launch)
    trace: bool = True  # the training process samples its memory at each step (leaks, long samples, fragmentation)

    def policy_for(self, device: bool) -> Policy:
        """The climb's policy for this run; ``device``: whether a device could run out of memory (an accelerator, a
        simulated or named size)."""
        return replace(self.policy, replay=bool(self.replay), device=device)
