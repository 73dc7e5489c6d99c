"""What a run of ``oomguard run`` is given: its options (``RunOptions``), the reporter it talks through, and the
constants its parts share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
    ladder: Ladder
    max_attempts: int = 8
    max_time: float | None = None
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
    probe_steps: int = 2  # a short worst-case probe before the real run (0: none)
    always_probe: bool = False  # probe even a config the memory model is sure of (else that one's launch is the run)
    minimize: bool = False  # once the choice's probe fits, prove each rung needed with probes
    refine: bool = True  # once a probe fits: choose again with what it measured, probe changes the model is unsure of
    checkpoint_every: int | None = None  # add a checkpoint every N steps, so a late OOM loses at most N
    oom_grace: float = RANK_GRACE_S  # after a rank's end decides the attempt (an OOM, a pre-flight stop, a failure, a death),
    # how long the others may take to stop before oomguard stops them
    capacity: int | None = None  # the device size, for predictions (else --simulate-gpu, --gpu-memory or NVML)
    html_path: Path | None = None  # also write a self-contained HTML report
    preflight: bool = True  # stop a config predicted too far over the device before it loads or generates
    preflight_margin: float | None = None  # how far over; None: the memory model's measured error (Judge.stop_margin)
    membership: Membership | None = None  # this node's place in a job on several nodes (oomguard.group)
    trl: Support | None = None  # the command's TRL as read before launching (run.command.trl_support), if readable
    # --ladder was not given: a run the training process reports distributed takes the multi-gpu ladder
    ladder_auto: bool = False
    ladder_reason: str | None = None  # why the command itself picked the multi-gpu ladder (run.launch)
    trace: bool = True  # the training process samples its memory at each step (leaks, long samples, fragmentation)
    leak_restart: bool = True  # after an OOM the trace shows is a leak: resume with the same config (else: stop)

    def policy(self, device: bool) -> Policy:
        """The options that shape the climb's decisions, for its conductor; ``device``: whether a device could run
        out of memory (an accelerator, a simulated or named size)."""
        return Policy(max_attempts=self.max_attempts, max_time=self.max_time, probe_steps=self.probe_steps,
                      always_probe=self.always_probe, refine=self.refine, minimize=self.minimize,
                      replay=bool(self.replay), preflight=self.preflight, preflight_margin=self.preflight_margin,
                      ladder_auto=self.ladder_auto, device=device, leak_restart=self.leak_restart)
