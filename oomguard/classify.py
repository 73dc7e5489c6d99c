"""How an attempt ended, from what is left of it: the exit status, the events, the CrashRecord and the output's tail.

In order: an interrupt; a clean exit; a pre-flight stop (its own exit code and event); an OOM the training process
recorded (a CrashRecord); a SIGKILL with evidence of the kernel's OOM killer (``hostmem``); an OOM seen only in the
output (a process that died before it could write a record); else a failure that is passed through untouched. A
SIGKILL without such evidence (``kill -9``, ``timeout -s KILL``, a preemption) is never retried as an OOM.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from .analyze import finding, finding_from_crash, finding_from_hit
from .child.runtime import EXIT_PREDICTED
from .diagnose import Diagnosis, diagnose
from .knobs import Knobs
from .oom import OOMReport, scan_text
from .proc import ProcessResult
from .records import Attempt, ChildEvent, CrashRecord, Outcome, PreflightStop, RecordError, StepDone
from .sizes import format_size


def crash_record(adir: Path, warn: Callable[[str], None]) -> CrashRecord | None:
    """The first readable CrashRecord an attempt's ranks wrote (an unreadable one is named, then skipped)."""
    for p in sorted(adir.glob("crash-*.json"), key=lambda p: p.stat().st_mtime):
        try:
            return CrashRecord.read(p)
        except RecordError as e:
            warn(str(e))
    return None


def classify(index: int, res: ProcessResult, adir: Path, events: Sequence[ChildEvent], knobs: Knobs,
             remedies: list[str], warn: Callable[[str], None]) -> tuple[Attempt, Diagnosis | None]:
    """The Attempt record of launch ``index`` and, for an OOM, its Diagnosis."""
    steps = [e.step for e in events if isinstance(e, StepDone) and e.step is not None]
    peaks = [e.peak for e in events if isinstance(e, StepDone) and e.peak is not None]
    reserved = [e.reserved for e in events if isinstance(e, StepDone) and e.reserved is not None]
    attempt = Attempt(index=index, knobs=knobs.to_dict(), remedies=remedies, outcome=Outcome.FAILED,
                      exit_code=res.exit_code, seconds=res.seconds, peak_bytes=max(peaks) if peaks else None,
                      step=max(steps) if steps else None, peak_reserved_bytes=max(reserved) if reserved else None)
    if res.survivors:
        warn(f"{len(res.survivors)} process(es) of attempt {index} still alive after SIGKILL (pids "
             f"{', '.join(map(str, res.survivors[:8]))}): the next attempt may find their memory in use")
    if res.interrupted:
        attempt.outcome = Outcome.INTERRUPTED
        return attempt, None
    if res.returncode == 0:
        attempt.outcome = Outcome.OK
        return attempt, None
    stop = next((e for e in events if isinstance(e, PreflightStop)), None)
    if stop is not None and res.returncode == EXIT_PREDICTED:
        attempt.outcome = Outcome.PREDICTED
        attempt.predicted_bytes = stop.predicted_bytes
        attempt.note = (f"stopped before generating: predicted {format_size(stop.predicted_bytes or 0)}, "
                        f"more than {100 * stop.margin:.0f}% over the capacity")
        return attempt, None
    crash = crash_record(adir, warn)
    if crash is not None:
        d = diagnose(crash.report, crash.frames, phase=crash.phase)
        attempt.outcome = Outcome.OOM
        attempt.oom = finding_from_crash(str(adir / "crash"), crash)
        attempt.peak_bytes = attempt.peak_bytes or crash.peak_bytes
        if crash.step is not None:
            attempt.step = crash.step
        return attempt, d
    sigkill = res.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
    if sigkill and res.host_oom:  # a host-RAM OOM only with evidence (proc.py, hostmem.py)
        report = OOMReport(backend="host", origin="oom-killer",
                           message=f"the training process was killed by SIGKILL (exit {res.exit_code}): "
                                   + "; ".join(res.host_oom))
        d = diagnose(report)
        d = dataclasses.replace(d, evidence=(*d.evidence, *(e[0].upper() + e[1:] + "." for e in res.host_oom)))
        attempt.outcome = Outcome.OOM
        attempt.oom = finding("exit status", None, report, d)
        return attempt, d
    hits = scan_text(res.stderr_tail) or scan_text(res.stdout_tail)
    if hits:
        hit = hits[-1]
        attempt.outcome = Outcome.OOM
        attempt.oom = finding_from_hit("stderr", hit)
        return attempt, diagnose(hit.report, hit.frames)
    if sigkill:  # a kill -9, `timeout -s KILL`, a preemption: not ours to retry
        attempt.note = (f"killed by SIGKILL (exit {res.exit_code}) with no sign of the kernel's OOM killer "
                        f"({res.host_checked}): passed through as a failure, not retried")
        warn(f"attempt {index} was {attempt.note}")
    return attempt, None


__all__ = ["classify", "crash_record"]
