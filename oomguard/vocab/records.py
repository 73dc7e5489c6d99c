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

import json
import os
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from .files import write_atomic
from .oomreport import Frame, OOMReport
from .schema import CRASH_SCHEMA, REPORT_SCHEMA, RecordError, check_schema


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (``oomguard.vocab.files.write_atomic``) and return the path."""
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def publish(data: dict[str, Any], kept: str | os.PathLike[str], top: str | os.PathLike[str],
            aside_dir: str | os.PathLike[str]) -> Path | None:
    """Write a run's record (report or lock) to its own file ``kept`` and a copy of it to ``top``; lose nothing.

    ``kept`` (under the run's workdir) is never replaced; ``top`` (``oomguard-report.json``, ``oomguard.lock.json``)
    always holds the latest run's record, with ``kept_at`` naming the kept copy. A ``top`` file that is not such a copy
    (written by an older oomguard, or by hand, or whose kept copy is gone) is first copied into ``aside_dir``.
    Returns the path it was kept at, or None.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> _ = write_json_atomic(os.path.join(d, "top.json"), {"status": "stable", "by": "an older run"})
    >>> aside = publish({"status": "failed"}, os.path.join(d, "runs", "2", "report.json"), os.path.join(d, "top.json"),
    ...                 os.path.join(d, "kept"))
    >>> read_json(aside)["by"], read_json(os.path.join(d, "top.json"))["status"]
    ('an older run', 'failed')
    >>> publish({"status": "stable"}, os.path.join(d, "runs", "3", "report.json"), os.path.join(d, "top.json"),
    ...         os.path.join(d, "kept")) is None  # the top file was a copy of run 2's, which is kept
    True
    """
    kept, top = Path(kept), Path(top)
    data = {**data, "kept_at": str(kept.resolve())}
    write_json_atomic(kept, data)
    aside = None
    if top.exists() and not _is_kept_copy(top):
        aside = _keep_aside(top, Path(aside_dir))
    write_json_atomic(top, data)
    return aside


def _is_kept_copy(path: Path) -> bool:
    """True when ``path`` is a byte-for-byte copy of the record its ``kept_at`` names."""
    try:
        text = path.read_bytes()
        where = json.loads(text).get("kept_at")
        return bool(where) and Path(where).resolve() != path.resolve() and Path(where).read_bytes() == text
    except (OSError, ValueError, AttributeError):
        return False


def _keep_aside(path: Path, aside_dir: Path) -> Path:
    """Copy ``path`` into ``aside_dir`` under a name stamped with its modification time; never overwrite."""
    import shutil

    aside_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    dest = aside_dir / f"{path.stem}-{stamp}{path.suffix}"
    n = 1
    while dest.exists():
        n += 1
        dest = aside_dir / f"{path.stem}-{stamp}-{n}{path.suffix}"
    shutil.copy2(path, dest)
    return dest


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    to_dict = getattr(o, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return repr(o)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when it is missing, unreadable or not an object (a run cut short may
    leave no report, or half of one).

    >>> read_json_object("/nonexistent/report.json") is None
    True
    """
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class CrashRecord:
    """What the training process writes when it dies of OOM (schema ``oomguard.crash/1``).

    Fields: ``message`` (the exception text), ``exception_type``, ``report`` (the parsed OOMReport), ``frames``
    (outermost first), ``phase``, ``step`` (the trainer's global step, if training had started), ``memory_stats``
    (``torch.cuda.memory_stats()`` on a GPU, the simulated device's counters on CPU), ``knobs`` (the effective
    knobs), ``observed`` (what the script itself set), ``peak_bytes``, ``rank``/``world_size``, ``pid``, ``host``,
    ``device``, ``attempt``, ``model_config`` (the model's config.json as a dict, for the memory model), ``created``,
    ``traceback`` (the full formatted traceback, chained exceptions included: the terminal shows only its last frames).
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": CRASH_SCHEMA,
            "created": self.created,
            "message": self.message,
            "exception_type": self.exception_type,
            "report": self.report.to_dict(),
            "frames": [f.to_dict() for f in self.frames],
            "phase": self.phase,
            "step": self.step,
            "memory_stats": self.memory_stats,
            "knobs": self.knobs,
            "observed": self.observed,
            "peak_bytes": self.peak_bytes,
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "host": self.host,
            "device": self.device,
            "attempt": self.attempt,
            "model_config": self.model_config,
            "traceback": self.traceback,
        }

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
    seconds: float
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "knobs": self.knobs,
            "remedies": self.remedies,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "peak_bytes": self.peak_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "predicted_bytes": self.predicted_bytes,
            "oom": self.oom,
            "step": self.step,
            "climbed": self.climbed,
            "skipped": self.skipped,
            "resume": self.resume,
            "note": self.note,
            "memory": self.memory,
            "generated": self.generated,
            "choice": self.choice,
            "override_error": self.override_error,
            "probe_decision": self.probe_decision,
        }


@dataclass
class RunReport:
    """All attempts, the original and stable knobs, and the diff (schema ``oomguard.report/1``)."""

    status: str  # stable | exhausted | failed | interrupted
    attempts: list[Attempt]
    original: dict[str, Any]
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
    experiment: dict[str, Any] | None = None
    group: dict[str, Any] | None = None  # a job on several nodes: this node's place in it (oomguard.run.group)
    # one line each: what the user should know that is not an OOM (a config whose weights cannot move, a patch of
    # oomguard's that failed)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "status": self.status,
            "message": self.message,
            "exit_code": self.exit_code,
            "command": self.command,
            "ladder": self.ladder,
            "started": self.started,
            "finished": self.finished,
            "device": self.device,
            "attempts": [a.to_dict() for a in self.attempts],
            "original": self.original,
            "stable": self.stable,
            "diff": self.diff,
            "facts": self.facts,
            "alternatives": self.alternatives,
            **({"experiment": self.experiment} if self.experiment is not None else {}),
            **({"group": self.group} if self.group is not None else {}),
            **({"warnings": self.warnings} if self.warnings else {}),
        }

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
