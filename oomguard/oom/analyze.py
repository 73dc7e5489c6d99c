"""`oomguard analyze`: explain OOMs after the fact, from logs, crash records, run reports and memory snapshots.

Each input becomes zero or more findings (one per OOM, in file order) plus notes for inputs that could not be read.
Text logs are streamed, so a gigabyte of log is read in bounded memory.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp(), "train.log")
>>> _ = p.write_text("step 1\\nMemoryError\\n")
>>> result = analyze_paths([p])
>>> [(f["line"], f["backend"], f["kind"]) for f in result.findings]
[(2, 'host', 'host-ram')]
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from ..vocab.diagnosis import Diagnosis, Live
from ..vocab.distributed import deepspeed_buckets
from ..vocab.oomreport import Frame, OOMReport
from ..vocab.records import CRASH_SCHEMA, REPORT_SCHEMA, CrashRecord, RecordError
from ..vocab.sizes import GiB, format_size
from .diagnose import diagnose
from .parse import Hit, Readable, parse_oom, scan_stream
from .recommend import ranked
from .snapshot import SnapshotError, load_snapshot_bytes, looks_like_pickle, oom_reports, summarize
from .trace_log import Tee, Trace, TraceReader, traces_from_state, with_capacity
from .trend import assess

DEFAULT_MAX_BYTES = 64 * GiB
BIG_FILE = 1 * GiB
_SNAPSHOT_MAX = 4 * GiB  # snapshots are loaded whole; bigger ones are refused rather than filling RAM


@dataclass
class AnalyzeResult:
    findings: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line each: "path: reason"
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    files_read: int = 0
    trends: list[dict[str, Any]] = field(default_factory=list)  # memory traces read, with their verdicts

    def to_dict(self) -> dict[str, Any]:
        return {"findings": self.findings, "snapshots": self.snapshots, "trends": self.trends, "notes": self.notes,
                "files_read": self.files_read}


def finding(source: str, line: int | None, report: OOMReport, d: Diagnosis, *, rank: int | None = None,
            frames: Sequence[Frame] = (), extra: dict[str, Any] | None = None,
            knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON contract of one finding (see README, "analyze --json").

    The figures are ``d.report``, the report as diagnosed (``report`` is the one ``d`` was made from): a process
    that NVML listed as another one but that is this process (containers) is counted as this process, never as both. Remedies are all there, ranked; ``top`` marks those the
    terminal shows without ``--all``, and ``paste`` holds ready-to-paste lines, computed from ``knobs`` (the run's
    effective knobs, where a crash record or run report holds them) or TRL's defaults.
    """
    report = d.report
    out: dict[str, Any] = {
        "source": source,
        "line": line,
        "is_oom": True,
        "backend": report.backend,
        "requested_bytes": report.requested,
        "capacity_bytes": report.capacity,
        "free_bytes": report.free,
        "allocated_bytes": report.allocated,
        "reserved_unallocated_bytes": report.reserved_unallocated,
        "process_bytes": report.process,
        "other_processes": [{"pid": p.pid, "bytes": p.bytes} for p in report.other_processes],
        "kind": d.kind,
        "phase": d.phase,
        "evidence": list(d.evidence),
        "remedies": [r.to_dict() for r in ranked(d, knobs)],
        "origin": report.origin,
        "device": report.device,
        "allowed_bytes": report.allowed,
        "private_pools_bytes": report.private_pools,
        "rank": rank,
        "message": report.message,
        "frames": [f.to_dict() for f in frames[-8:]],
    }
    for key, value in (("allowed_min_bytes", report.allowed_min), ("max_seq_len", report.max_seq_len),
                       ("kv_cache_tokens", report.kv_cache_tokens)):
        if value is not None:
            out[key] = value
    if d.facts.live is not None:  # what was live at the OOM by what holds it, and what that makes it short of
        out["live_bytes"] = d.facts.live.to_dict()
        if d.facts.short_of:
            out["short_of"] = d.facts.short_of
    if extra:
        out.update(extra)
    return out


def finding_from_hit(source: str, hit: Hit) -> dict[str, Any]:
    # vLLM's own engine process (a server, ``trl vllm-serve`` / ``vllm serve``, or an engine a framework starts in
    # a process of its own): its memory is that engine's, which the trainer's knobs never reach
    d = diagnose(hit.report, hit.frames, engine=hit.server)
    extra = None if hit.server is None else {"vllm_process": hit.server}
    return finding(source, hit.line, hit.report, d, rank=hit.rank, frames=hit.frames, extra=extra)


def finding_from_crash(source: str, rec: CrashRecord, line: int | None = 1, d: Diagnosis | None = None) -> dict[str, Any]:
    """A crash record's OOM, its message parsed again (so an older record gains what the parser learned since),
    diagnosed with the phase the training process recorded (``d``: as the caller diagnosed it, with what it knew
    beside the record), remedies pasted against the knobs it ran with."""
    report = _reparsed(rec.message, rec.report)
    if d is None:
        d = diagnose(report, rec.frames, phase=rec.phase, buffers=deepspeed_buckets(rec.knobs, rec.model_config),
                     live=Live.of(rec.live))
    return finding(source, line, report, d, rank=rec.rank, frames=rec.frames, knobs=rec.knobs,
                   extra={"step": rec.step, "peak_bytes": rec.peak_bytes, "input": "crash-record"})


def _reparsed(message: str | None, stored: OOMReport) -> OOMReport:
    fresh = parse_oom(message) if message else None
    if fresh is None or fresh.origin != stored.origin:
        return stored
    return fresh


def finding_from_attempt(source: str, att: dict[str, Any]) -> dict[str, Any] | None:
    """A run report's attempt that ended in an OOM, diagnosed again from its message: the verdict stored at run
    time came from the oomguard of that day. The stored finding is kept as it is when its message cannot be read."""
    oom = att.get("oom")
    if not isinstance(oom, dict) or not oom.get("is_oom"):
        return None
    extra = {"attempt": att.get("index"), "input": "run-report"}
    report = parse_oom(str(oom.get("message") or ""))
    if report is None:
        return {**oom, "source": source, **extra}
    frames = [Frame.from_dict(f) for f in oom.get("frames") or [] if isinstance(f, dict)]
    knobs = att.get("knobs") if isinstance(att.get("knobs"), dict) else None
    d = diagnose(report, frames, phase=str(oom.get("phase") or "unknown"), buffers=deepspeed_buckets(knobs, None))
    return finding(source, oom.get("line"), report, d, rank=oom.get("rank"), frames=frames, knobs=knobs, extra=extra)


def for_terminal(f: dict[str, Any], *, show_all: bool = False) -> tuple[dict[str, Any], int]:
    """A copy of finding ``f`` for the terminal: only the top remedies unless ``show_all``, each reason followed by
    the bytes it frees and its paste lines on lines of their own. Returns the copy and how many remedies it leaves
    out.

    >>> f = {"remedies": [{"name": "a", "reason": "Why.", "frees_bytes": 2 << 30, "paste": ["X=1"], "top": True},
    ...                   {"name": "b", "reason": "Why not.", "frees_bytes": None, "paste": [], "top": False}]}
    >>> shown, hidden = for_terminal(f)
    >>> shown["remedies"][0]["reason"], hidden
    ('Why. (frees ~2.00 GiB)\\n      X=1', 1)
    """
    remedies = f.get("remedies") or []
    shown = remedies if show_all else [r for r in remedies if r.get("top", True)]
    out = []
    for r in shown:
        reason = str(r.get("reason") or "")
        if r.get("frees_bytes"):
            reason += f" (frees ~{format_size(r['frees_bytes'])})"
        for line in r.get("paste") or []:
            reason += f"\n      {line}"
        out.append({**r, "reason": reason, "frees_bytes": None})
    return {**f, "remedies": out}, len(remedies) - len(shown)


def iter_files(paths: Sequence[str], notes: list[str]) -> Iterator[Path]:
    """Files named or found (recursively, sorted) under directories; notes for what cannot be used."""
    for raw in paths:
        p = Path(raw)
        try:
            if p.is_dir():
                found = False
                for root, dirs, files in os.walk(p, onerror=lambda e: notes.append(f"{e.filename}: {e.strerror}")):
                    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                    for name in sorted(files):
                        if not name.startswith("."):
                            found = True
                            yield Path(root) / name
                if not found:
                    notes.append(f"{p}: directory holds no files to analyze")
            elif p.exists():
                yield p
            else:
                notes.append(f"{p}: no such file or directory")
        except OSError as e:
            notes.append(f"{p}: cannot read ({e.strerror or e})")


def analyze_paths(paths: Sequence[str], *, max_bytes: int | None = DEFAULT_MAX_BYTES,
                  progress: Any = None) -> AnalyzeResult:
    """Analyze every input; never raises for a user's bad input (those become notes)."""
    result = AnalyzeResult()
    for path in iter_files(paths, result.notes):
        _analyze_file(path, result, max_bytes, progress)
    return result


def _analyze_file(path: Path, result: AnalyzeResult, max_bytes: int | None, progress: Any) -> None:
    src = str(path)
    try:
        if not path.is_file():
            result.notes.append(f"{src}: not a regular file")
            return
        size = path.stat().st_size
        f: BinaryIO = open(path, "rb")  # noqa: SIM115 (closed below)
    except PermissionError:
        result.notes.append(f"{src}: cannot read it (permission denied)")
        return
    except OSError as e:
        result.notes.append(f"{src}: cannot read it ({e.strerror or e})")
        return
    with f:
        try:
            head = f.read(8192)
        except OSError as e:
            result.notes.append(f"{src}: cannot read it ({e.strerror or e})")
            return
        if not head:
            result.notes.append(f"{src}: empty file")
            return
        f.seek(0)
        if looks_like_pickle(head):
            _snapshot(src, f, size, result)
        elif head[:2] == b"\x1f\x8b":
            with gzip.open(f) as g:
                _text(src, g, size, result, max_bytes, progress, compressed=True)
        elif head.lstrip()[:1] == b"{" and b'"schema"' in head and b"oomguard." in head:
            _record(src, f, result)
        elif head.lstrip()[:1] == b"{" and b'"log_history"' in head:
            _trainer_state(src, f, result)
        elif b"\x00" in head:
            result.notes.append(f"{src}: binary file, not a log, crash record or memory snapshot; skipped")
        else:
            _text(src, f, size, result, max_bytes, progress)


def _text(src: str, f: Readable, size: int, result: AnalyzeResult, max_bytes: int | None, progress: Any,
          compressed: bool = False) -> None:
    if size >= BIG_FILE and progress:
        progress(f"{src}: {format_size(size)}{' compressed' if compressed else ''}, scanning…")
    reader = TraceReader(src)
    first = len(result.findings)
    try:
        for hit in scan_stream(Tee(f, reader), max_bytes=max_bytes):
            result.findings.append(finding_from_hit(src, hit))
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        result.notes.append(f"{src}: read failed part-way ({e}); findings before that point are kept")
    _trends(src, reader.done(), result, result.findings[first:])
    result.files_read += 1
    if max_bytes is not None and not compressed and size > max_bytes:
        result.notes.append(f"{src}: {format_size(size)} log, only the first {format_size(max_bytes)} scanned "
                            "(raise --max-bytes to read it all)")


def _snapshot(src: str, f: BinaryIO, size: int, result: AnalyzeResult) -> None:
    if size > _SNAPSHOT_MAX:
        result.notes.append(f"{src}: {format_size(size)} snapshot is too large to load (limit "
                            f"{format_size(_SNAPSHOT_MAX)}); record with max_entries to keep it small")
        return
    try:
        snap = load_snapshot_bytes(f.read())
    except SnapshotError as e:
        result.notes.append(f"{src}: {e}")
        return
    summary = summarize(snap)
    result.files_read += 1
    result.snapshots.append({"source": src, **summary.to_dict()})
    for i, (report, frames) in enumerate(oom_reports(summary)):
        d = diagnose(report, frames)
        result.findings.append(finding(src, None, report, d, frames=frames, extra={"input": "snapshot", "event": i}))


def _record(src: str, f: BinaryIO, result: AnalyzeResult) -> None:
    try:
        raw = f.read()
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        result.notes.append(f"{src}: looks like an oomguard record but is not valid JSON ({e})")
        return
    schema = str(data.get("schema", "")) if isinstance(data, dict) else ""
    try:
        if schema.startswith(CRASH_SCHEMA.split("/")[0] + "/"):
            rec = CrashRecord.from_dict(data, src)
            line = raw[: raw.find(b'"message"')].count(b"\n") + 1 if b'"message"' in raw else 1
            result.findings.append(finding_from_crash(src, rec, line))
        elif schema.startswith(REPORT_SCHEMA.split("/")[0] + "/"):
            for att in data.get("attempts") or []:
                found = finding_from_attempt(src, att) if isinstance(att, dict) else None
                if found is not None:
                    result.findings.append(found)
        else:
            result.notes.append(f"{src}: an oomguard file of kind {schema!r}, which holds no OOM")
            return
    except RecordError as e:
        result.notes.append(str(e))
        return
    result.files_read += 1


def _trainer_state(src: str, f: BinaryIO, result: AnalyzeResult) -> None:
    try:
        data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        result.notes.append(f"{src}: looks like a trainer_state.json but is not valid JSON ({e})")
        return
    result.files_read += 1
    _trends(src, traces_from_state(data if isinstance(data, dict) else {}, src), result, [])


MAX_TRACE_POINTS = 2000  # samples kept in a trend's JSON (for its chart), evenly thinned beyond


def _trends(src: str, traces: Sequence[Trace], result: AnalyzeResult, findings: Sequence[dict[str, Any]]) -> None:
    """Each memory trace of a file, with its verdicts (``oom/trend.py``); an OOM of the same file that follows a trace
    with verdicts gets them as evidence too (the same sentences)."""
    capacity = max((f["capacity_bytes"] for f in findings if f.get("capacity_bytes")), default=None)
    read: list[tuple[int, dict[str, Any]]] = []
    for trace in traces:
        t = assess(with_capacity(trace, capacity), host_basis=trace.host_basis)
        if trace.holders and t.leak is not None:
            t = replace(t, verdicts=tuple(replace(v, holders=trace.holders) if v is t.leak else v for v in t.verdicts))
        samples = trace.samples
        if len(samples) > MAX_TRACE_POINTS:
            samples = [samples[round(i * (len(samples) - 1) / (MAX_TRACE_POINTS - 1))] for i in range(MAX_TRACE_POINTS)]
        entry = {"source": src, "input": f"trace-{trace.form}", "pid": trace.pid, "first_line": trace.first_line,
                 "last_line": trace.last_line, "steps": len(trace.samples), "capacity_bytes": capacity or max(
                     (s.capacity for s in trace.samples if s.capacity), default=None),
                 **t.to_dict(), "evidence": list(t.evidence()), "samples": [s.to_event() for s in samples]}
        result.trends.append(entry)
        read.append((trace.first_line or 0, entry))
    for f in findings:  # the trace the OOM ended (the latest that began before it), where it says something
        line = f.get("line")
        before = [e for first, e in read if isinstance(line, int) and first <= line]
        if before and before[-1]["verdicts"]:
            f["trend"] = [v["kind"] for v in before[-1]["verdicts"]]
            f["evidence"] = [*f["evidence"], *before[-1]["evidence"]]
