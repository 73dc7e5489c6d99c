"""Versioned records that oomguard writes: CrashRecord (the training process's last words), RunReport and the lock.

Every record is JSON with a ``schema`` field, ``"<kind>/<major>"``. Readers accept any record of the same major
version and ignore fields they do not know, so a newer oomguard can add fields without breaking older readers.
Writes are atomic (a temporary file in the same directory, fsync, rename): a crash mid-write never leaves half a
record, and an existing file is replaced only by a complete one.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> p = write_json_atomic(os.path.join(d, "r.json"), {"schema": CRASH_SCHEMA, "message": "x"})
>>> read_json(p)["message"]
'x'
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from .files import read_json, write_json_atomic
from .oomreport import Frame, OOMReport
from .schema import CRASH_SCHEMA as CRASH_SCHEMA  # re-exported: a record's readers take them from here
from .schema import REPORT_SCHEMA as REPORT_SCHEMA
from .schema import RecordError as RecordError
from .schema import check_schema
from .serial import to_fields


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass
class CrashRecord:
    """What the training process writes when it dies of OOM (schema ``oomguard.crash/1``).

    Fields: ``message`` (the exception text), ``exception_type``, ``report`` (the parsed OOMReport), ``frames``
    (outermost first), ``phase``, ``step`` (the trainer's global step, if training had started), ``memory_stats``
    (``torch.cuda.memory_stats()`` on a GPU, the simulated device's counters on CPU), ``knobs`` (the effective
    knobs), ``observed`` (what the script itself set), ``peak_bytes``, ``rank``/``world_size``, ``pid``, ``host``,
    ``device``, ``attempt``, ``model_config`` (the model's config.json as a dict, for the memory model), ``created``,
    ``traceback`` (the full formatted traceback, chained exceptions included: the terminal shows only its last frames),
    ``prompt_tokens``/``completion_tokens`` (the widths of the batch the step that ran out trained on, where known),
    ``live`` (the bytes live on the device at the OOM by what holds them: ``parameters``, ``gradients``,
    ``optimizer``, ``other``).
    """

    message: str
    exception_type: str
    report: OOMReport
    frames: list[Frame] = field(default_factory=list)
    phase: str = "unknown"
    step: int | None = None
    memory_stats: dict[str, Any] | None = None
    knobs: dict[str, Any] | None = None
    observed: dict[str, Any] | None = None
    peak_bytes: int | None = None
    rank: int | None = None
    world_size: int | None = None
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    device: str | None = None
    attempt: int | None = None
    model_config: dict[str, Any] | None = None
    created: str = field(default_factory=now_iso)
    traceback: str | None = None
    # the longest prompt and completion of the batch the step that ran out trained on, where the trainer held it
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # the bytes live on the device at the OOM by what holds them: parameters, gradients, optimizer (its state), other
    # (the step's activations, generation's buffers, the rest: child/live.py)
    live: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        # "created" second, as records have always been written: a reader's line numbers point past it
        return {"schema": CRASH_SCHEMA, "created": self.created, **to_fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "crash record") -> CrashRecord:
        check_schema(d, CRASH_SCHEMA, source)
        try:
            report = OOMReport.from_dict(d.get("report") or {"backend": "cuda", "origin": "allocator",
                                                              "message": d.get("message", "")})
            return cls(
                message=str(d.get("message", "")),
                exception_type=str(d.get("exception_type", "")),
                report=report,
                frames=[Frame.from_dict(f) for f in d.get("frames") or []],
                phase=str(d.get("phase") or "unknown"),
                step=d.get("step"),
                memory_stats=d.get("memory_stats"),
                knobs=d.get("knobs"),
                observed=d.get("observed"),
                peak_bytes=d.get("peak_bytes"),
                rank=d.get("rank"),
                world_size=d.get("world_size"),
                pid=int(d.get("pid") or 0),
                host=str(d.get("host", "")),
                device=d.get("device"),
                attempt=d.get("attempt"),
                model_config=d.get("model_config"),
                created=str(d.get("created", "")),
                traceback=d.get("traceback") if isinstance(d.get("traceback"), str) else None,
                prompt_tokens=d.get("prompt_tokens") if isinstance(d.get("prompt_tokens"), int) else None,
                completion_tokens=d.get("completion_tokens") if isinstance(d.get("completion_tokens"), int) else None,
                live=d.get("live") if isinstance(d.get("live"), dict) else None,
            )
        except (TypeError, ValueError, KeyError) as e:
            raise RecordError(f"{source}: malformed crash record ({e})") from None

    def write(self, path: str | os.PathLike[str]) -> Path:
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> CrashRecord:
        try:
            data = read_json(path)
        except (OSError, ValueError) as e:
            raise RecordError(f"{path}: cannot read crash record ({e})") from None
        return cls.from_dict(data, str(path))


class AttemptKind(str, Enum):
    """What an attempt is for: a short worst-case ``probe``, the real ``run``, or a ``minimize`` trial (a probe
    without one rung). A str, so reports and comparisons read the plain value."""

    PROBE = "probe"
    RUN = "run"
    MINIMIZE = "minimize"

    def __str__(self) -> str:
        return self.value


class Outcome(str, Enum):
    """How an attempt ended: ``ok``; ``oom``; ``predicted`` (the pre-flight check stopped it); ``failed`` (not an
    OOM: passed through); ``interrupted`` (a signal to oomguard)."""

    OK = "ok"
    OOM = "oom"
    PREDICTED = "predicted"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value


@dataclass
class Attempt:
    """One launch (or one in-process call, for the decorator) and how it ended."""

    index: int
    knobs: dict[str, Any]
    remedies: list[str]
    outcome: str  # an Outcome
    exit_code: int | None
    seconds: float = field(metadata={"round": 3})
    peak_bytes: int | None = None
    oom: dict[str, Any] | None = None
    step: int | None = None
    peak_reserved_bytes: int | None = None
    kind: str = AttemptKind.RUN  # an AttemptKind
    skipped: list[dict[str, str]] = field(default_factory=list)  # rungs passed over after this attempt, with why
    climbed: str | None = None  # the rung climbed after this attempt
    resume: dict[str, Any] | None = None  # how this attempt continued from a checkpoint, if it did
    predicted_bytes: int | None = None
    note: str | None = None
    memory: dict[str, Any] | None = None  # guard(): live bytes before the call and after releasing a failed one
    generated: dict[str, Any] | None = None  # configs oomguard generated for this attempt (e.g. DeepSpeed)
    choice: dict[str, Any] | None = None  # after this attempt: rungs dropped and graded knobs relaxed, by prediction
    override_error: dict[str, Any] | None = None  # applying oomguard's overrides failed: where, error
    # launched as a probe unless the memory model is sure of the config: what the training process decided, and why
    probe_decision: dict[str, Any] | None = None
    # a replayed lock's value the training process did not run (knob, locked, ran, where): it stopped before training
    unmet: dict[str, Any] | None = field(default=None, metadata={"omit": True})
    # the memory trace of its main process, one sample per step (thinned): step, kept, peak, reserved, host_rss
    trace: list[dict[str, Any]] = field(default_factory=list, metadata={"omit": True})
    trend: dict[str, Any] | None = field(default=None, metadata={"omit": True})  # what the trace said of its OOM
    # its measured peak far from the memory model's prediction (decide/miss.py): by how much, and which term missed
    miss: dict[str, Any] | None = field(default=None, metadata={"omit": True})

    def to_dict(self) -> dict[str, Any]:
        return to_fields(self)

    def files(self) -> dict[str, str]:
        """Where the configs oomguard generated for this attempt were written, by kind (``{"deepspeed": PATH}``)."""
        return {kind: g["path"] for kind, g in (self.generated or {}).items() if isinstance(g, dict) and g.get("path")}


def ran_to_end(status: str, exit_code: int | None) -> bool:
    """Whether a run's last config ran to the end: stable, or a leaking run that finished every step through its
    restarts (its config and the cadence the restarts needed are then what a lock replays and the diff shows).

    >>> ran_to_end("stable", 0), ran_to_end("leaked", 0), ran_to_end("leaked", 76), ran_to_end("exhausted", 75)
    (True, True, False, False)
    """
    return status == "stable" or (status == "leaked" and exit_code == 0)


@dataclass
class RunReport:
    """All attempts, the original and stable knobs, and the diff (schema ``oomguard.report/1``)."""

    status: str  # stable | leaked | exhausted | failed | interrupted
    attempts: list[Attempt]
    original: dict[str, Any]  # the command's own values; null where it never said one (``unseen``)
    stable: dict[str, Any] | None
    diff: list[dict[str, Any]]
    command: list[str] = field(default_factory=list)
    ladder: str | None = None
    message: str = ""
    exit_code: int | None = None
    started: str = field(default_factory=now_iso)
    finished: str | None = None
    device: dict[str, Any] | None = None
    facts: dict[str, Any] | None = None
    # configs predicted to fit that trade differently (oomguard.decide.alternatives)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    # what the stable config kept of the user's experiment and what it changed (oomguard.decide.experiment)
    experiment: dict[str, Any] | None = field(default=None, metadata={"omit": True})
    # a job on several nodes: this node's place in it (oomguard.run.group)
    group: dict[str, Any] | None = field(default=None, metadata={"omit": True})
    # one line each: what the user should know that is not an OOM (a config whose weights cannot move, a patch of
    # oomguard's that failed)
    warnings: list[str] = field(default_factory=list, metadata={"omit": True})
    # the knobs whose value the command never said (it stopped before the construction point that sets them: a load
    # stopped before GRPOConfig exists): null in ``original``, not TRL's defaults
    unseen: list[str] = field(default_factory=list, metadata={"omit": True})

    def to_dict(self) -> dict[str, Any]:
        return {"schema": REPORT_SCHEMA, **to_fields(self)}

    def write(self, path: str | os.PathLike[str]) -> Path:
        return write_json_atomic(path, self.to_dict())


def rung_label(rungs: Sequence[tuple[str, int]]) -> str:
    """The one way rungs climbed together are written, in the terminal and the HTML report alike.

    ``rungs`` holds ``(remedy, pass)`` pairs; a graded rung on its second or later pass is marked "(again)".

    >>> rung_label([("shorter_sequences", 1), ("fewer_generations", 1), ("shorter_sequences", 2)])
    'shorter_sequences + fewer_generations + shorter_sequences (again)'
    """
    return " + ".join(name + (" (again)" if pass_no > 1 else "") for name, pass_no in rungs)


def climbed_labels(climbed: Sequence[str | None]) -> list[str | None]:
    """``rung_label`` for each attempt's ``climbed`` field (``"a+b+a"``, as a RunReport stores it), counting the
    passes over the whole run, so a rung climbed again after an earlier attempt is marked as the terminal marks it.

    >>> climbed_labels(["shorter_sequences", None, "fewer_generations+shorter_sequences"])
    ['shorter_sequences', None, 'fewer_generations + shorter_sequences (again)']
    """
    seen: Counter[str] = Counter()
    out: list[str | None] = []
    for text in climbed:
        if not text:
            out.append(text)
            continue
        rungs = []
        for name in text.split("+"):
            seen[name] += 1
            rungs.append((name, seen[name]))
        out.append(rung_label(rungs))
    return out
