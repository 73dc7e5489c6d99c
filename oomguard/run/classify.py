"""How an attempt ended, decided once for the whole job from what its training processes recorded about themselves.

A launcher between oomguard and the training processes (torchrun, ``accelerate launch``, ``trl grpo``, a shell
script, Slurm's ``srun``) replaces their exit codes with its own, so the exit code of the command is the last thing
to trust. Every training process (one that passed a construction point: GRPOConfig, GRPOTrainer, from_pretrained)
writes an ``end`` event when it ends (``exit`` with its code, ``error``, ``oom`` with a CrashRecord, ``predicted``)
or writes none when a signal kills it. :class:`Ranks` gathers those records; :func:`classify` decides, in order:

1. an interrupt (a signal to oomguard);
2. an OOM that a training process recorded (a CrashRecord), unless that process caught it and ended cleanly or of
   another error; recorded with the training process's own exit code (EXIT_OOM), whatever a launcher exited with;
3. a replayed lock's value a training process does not run (a ``ran`` event with ``unmet``): it stopped before
   training, a failure with its own line and the usage code, never retried;
4. a pre-flight stop (a ``predicted`` event);
5. a host-RAM OOM: a training process (or the command itself) killed by SIGKILL, with evidence of the kernel's OOM
   killer (``hostmem``); a SIGKILL without such evidence (``kill -9``, a preemption) is never retried as an OOM;
6. an OOM seen only in the output, when the job did not end cleanly and no training process recorded how it ended
   (processes the bootstrap did not reach, or killed before they could write a record): where one did, its record
   decides, and an OOM a script caught and printed earlier cannot turn another failure into an OOM;
7. a clean end: every training process ended with ``exit`` 0 (or, with none to ask, the command exited 0), whatever
   code a launcher returned;
8. else a failure, passed through with the command's own exit code and the first training process's reason.

Where ranks record different endings (one OOM while the others wait, one stopped by the pre-flight), this order makes
the decision once, for the whole job.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..vocab.diagnosis import Live
from ..vocab.ended import Ended
from ..vocab.events import (
    CheckpointSaved,
    ChildEvent,
    CodeSeen,
    ConfigGenerated,
    DatasetSeen,
    MemSampled,
    OOMRaised,
    OverrideFailed,
    PatchFailed,
    PreflightStop,
    ProbeDecided,
    ProcessEnded,
    ProcessStarted,
    Ran,
    Saving,
    StepDone,
)
from ..vocab.knobs import Knobs
from ..vocab.lock import Unmet
from ..vocab.oomreport import OOMReport
from ..vocab.protocol import (
    END_ERROR,
    END_EXIT,
    END_OOM,
    END_PREDICTED,
    END_UNMET,
    EXIT_LOCK_UNMET,
    EXIT_OOM,
    EXIT_PREDICTED,
)
from ..vocab.records import AttemptKind, CrashRecord, Outcome, RecordError
from ..vocab.sizes import format_size
from .proc import ProcessResult

TRACE_POINTS = 256  # a report keeps at most this many samples of an attempt's memory trace (evenly thinned)


@dataclass
class Ranks:
    """The training processes of one attempt and how each said it ended (by pid).

    >>> r = Ranks.of([CodeSeen("config", pid=1, rank=0), CodeSeen("config", pid=2, rank=1),
    ...               ProcessEnded("exit", pid=1, rank=0, code=0)])
    >>> r.clean(), r.silent(), r.failure()
    (False, [2], None)
    >>> Ranks.of([CodeSeen("config", pid=7), ProcessEnded("error", pid=7, error="KeyError: 'answer'")]).failure()
    "the training process (pid 7) raised KeyError: 'answer'"
    """

    training: dict[int, int | None] = field(default_factory=dict)  # pid -> rank, in the order first seen
    ended: dict[int, ProcessEnded] = field(default_factory=dict)  # pid -> its own record of its end
    # crash records of OOMs their process caught and outlived: it ended cleanly, or of another error (uncaught, not
    # an OOM), which is then what ended it
    recovered: set[str] = field(default_factory=set)
    stop: PreflightStop | None = None
    unmet: Ran | None = None  # a replayed lock's value a training process does not run: it stopped before training
    finished: set[int] = field(default_factory=set)  # processes whose trainer.train() returned
    where: dict[int, str] = field(default_factory=dict)  # pid -> host and PID namespace it ran in
    helpers: set[int] = field(default_factory=set)  # processes multiprocessing started to serve another

    _ooms: dict[int, list[str]] = field(default_factory=dict)  # pid -> crash records its OOMs wrote

    @classmethod
    def of(cls, events: Iterable[ChildEvent]) -> Ranks:
        r = cls()
        for ev in events:
            r.add(ev)
        return r

    def add(self, ev: ChildEvent) -> None:
        """Take one event, in the order the processes wrote them."""
        if isinstance(ev, ProcessStarted) and ev.pid is not None:
            if ev.where:
                self.where[ev.pid] = ev.where
            if ev.helper:
                self.helpers.add(ev.pid)
                self.training.pop(ev.pid, None)
        elif isinstance(ev, CodeSeen) and ev.pid is not None and ev.pid not in self.helpers:
            self.training.setdefault(ev.pid, ev.rank)
        elif isinstance(ev, ProcessEnded) and ev.pid is not None:
            self.ended.setdefault(ev.pid, ev)
            if ev.reached and ev.pid not in self.helpers:
                self.training.setdefault(ev.pid, ev.rank)
            if (ev.how == END_EXIT and ev.code == 0) or ev.how == END_ERROR:
                self.recovered.update(self._ooms.get(ev.pid, []))
        elif isinstance(ev, OOMRaised) and ev.pid is not None and ev.path:
            self._ooms.setdefault(ev.pid, []).append(ev.path)
        elif isinstance(ev, PreflightStop) and self.stop is None:
            self.stop = ev
        elif isinstance(ev, Ran) and ev.unmet and self.unmet is None:
            self.unmet = ev
        elif isinstance(ev, StepDone) and ev.final and ev.pid is not None:
            self.finished.add(ev.pid)

    def decided(self, alive: Callable[[int], bool], here: str | None = None) -> str | None:
        """What settles the job's ending while other processes may still run (waiting at a collective for a rank
        that is gone): a process that ended by OOM or the pre-flight check, or a training process that failed, once
        it is gone (its own atexit work, an upload, is left to finish); or a training process gone without a word.
        ``alive(pid)`` is asked only of processes that ran ``here`` (this host and PID namespace; any, when None):
        elsewhere a PID names another process. None while nothing does.

        >>> r = Ranks.of([CodeSeen("trainer", pid=5, rank=1), ProcessEnded("oom", pid=5, rank=1, path="c.json")])
        >>> r.decided(alive=lambda pid: True) is None, r.decided(alive=lambda pid: False)
        (True, 'rank 1 (pid 5) ended: oom')
        >>> Ranks.of([CodeSeen("trainer", pid=5, rank=1)]).decided(alive=lambda pid: False)
        'rank 1 (pid 5) is gone without a word'
        """
        def gone(pid: int) -> bool:
            local = here is None or self.where.get(pid) in (None, here)
            return local and not alive(pid)

        for pid, e in self.ended.items():
            decisive = e.how in (END_OOM, END_PREDICTED, END_UNMET) or (pid in self.training and (e.how != END_EXIT or bool(e.code)))
            if decisive and (gone(pid) or (here is not None and self.where.get(pid) not in (None, here))):
                return f"{self.who(pid)} ended: {e.how}" + (f" {e.code}" if e.how == END_EXIT else "")
        lost = [pid for pid in self.silent() if gone(pid)]
        return f"{self.who(lost[0])} is gone without a word" if lost else None

    def spoke(self) -> bool:
        """Whether any training process recorded how it ended (an ``end`` event): then the job's ending rests on those
        records, never on text in the output, where an OOM a script caught and printed long before may still be."""
        return any(pid in self.ended for pid in self.training)

    def silent(self) -> list[int]:
        """Training processes that wrote no end and had not finished training: killed by a signal, or still running.
        (One that finished ``trainer.train()`` and then left by ``os._exit``, as some scripts do to skip a hanging
        teardown, is not silent.)"""
        return [pid for pid in self.training if pid not in self.ended and pid not in self.finished]

    def clean(self, direct: int | None = None, returncode: int = 0) -> bool:
        """Every training process ended well: with ``exit`` 0 (or left without a word after its training finished),
        and, where the command's exit status says otherwise, after its training finished (a ``raise SystemExit(1)``
        of the script's own leaves no mark in the process). ``direct`` is the PID of the command itself: when it is a
        training process, its exit status is its own. False when there is none to ask."""
        if not self.training or (direct in self.training and returncode != 0):
            return False

        def well(pid: int) -> bool:
            e = self.ended.get(pid)
            if e is None:
                return pid in self.finished
            return e.how == END_EXIT and e.code == 0 and (returncode == 0 or pid in self.finished)

        return all(well(pid) for pid in self.training)

    def failure(self, training_only: bool = False) -> str | None:
        """The first process that said it failed (an uncaught error, a non-zero ``sys.exit``), in words: a training
        process first, else (unless ``training_only``) any (a rank that failed before it built its config)."""
        said = [(pid, e) for pid, e in self.ended.items() if pid not in self.helpers
                and (pid in self.training or not training_only)
                and (e.how == END_ERROR or (e.how == END_EXIT and e.code))]
        said.sort(key=lambda pe: pe[0] not in self.training)
        for pid, e in said:
            what = f"raised {e.error or 'an exception'}" if e.how == END_ERROR else f"exited with code {e.code}"
            return f"{self.who(pid)} {what}"
        return None

    def who(self, pid: int) -> str:
        rank = self.training.get(pid, self.ended[pid].rank if pid in self.ended else None)
        return f"rank {rank} (pid {pid})" if rank is not None else f"the training process (pid {pid})"


def crash_record(adir: Path, warn: Callable[[str], None], skip: Iterable[str] = ()) -> CrashRecord | None:
    """The first readable CrashRecord an attempt's ranks wrote (an unreadable one is named, then skipped), leaving out
    those in ``skip`` (OOMs their process caught and outlived)."""
    skipped = {str(Path(s)) for s in skip}
    for p in sorted(adir.glob("crash-*.json"), key=lambda p: p.stat().st_mtime):
        if str(p) in skipped:
            continue
        try:
            return CrashRecord.read(p)
        except RecordError as e:
            warn(str(e))
    return None


def _sigkill(returncode: int) -> bool:
    return returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def classify(index: int, res: ProcessResult, adir: Path, events: Sequence[ChildEvent], knobs: Knobs,
             remedies: list[str], warn: Callable[[str], None], host_limit: int | None = None, *,
             kind: str = AttemptKind.RUN, resume: dict[str, Any] | None = None,
             group_failure: str | None = None) -> Ended:
    """How launch ``index`` ended (``Ended``, for the conductor to record): the ending (``ending``), then what the
    training process said of itself (``said_of_itself``). ``knobs``: as the training process ran them; ``kind``: how
    it ran (a probe it found sure ran as the real run); ``resume``: how it continued from a checkpoint;
    ``group_failure``: why the group of nodes ended early, if it did."""
    base = ending(index, res, adir, events, knobs, remedies, warn, host_limit)
    return said_of_itself(replace(base, kind=kind, resume=resume, trace=trace_of(events)), events, group_failure)


def ending(index: int, res: ProcessResult, adir: Path, events: Sequence[ChildEvent], knobs: Knobs,
           remedies: list[str], warn: Callable[[str], None], host_limit: int | None = None) -> Ended:
    """How launch ``index`` ended and, for an OOM, its Diagnosis (with what the training process's memory trace says
    of it: ``late_trend``; ``host_limit``, the host memory it could use), in the order of the module."""
    steps = [e.step for e in events if isinstance(e, StepDone) and e.step is not None]
    peaks = [e.peak for e in events if isinstance(e, StepDone) and e.peak is not None]
    reserved = [e.reserved for e in events if isinstance(e, StepDone) and e.reserved is not None]
    base = Ended(kind=AttemptKind.RUN, knobs=knobs.to_dict(), remedies=remedies, outcome=Outcome.FAILED,
                 exit_code=res.exit_code, seconds=res.seconds, peak_bytes=max(peaks) if peaks else None,
                 step=max(steps) if steps else None, peak_reserved_bytes=max(reserved) if reserved else None)
    if res.survivors:
        warn(f"{len(res.survivors)} process(es) of attempt {index} still alive after SIGKILL (pids "
             f"{', '.join(map(str, res.survivors[:8]))}): the next attempt may find their memory in use")
    if res.interrupted:
        return replace(base, outcome=Outcome.INTERRUPTED)
    ranks = Ranks.of(events)
    crash = crash_record(adir, warn, skip=ranks.recovered)
    # What reads an OOM (compiled patterns, the analysis) loads only where one may be: a clean end pays nothing for it.
    if crash is not None:
        from ..oom.analyze import finding_from_crash
        from ..oom.diagnose import diagnose
        from ..vocab.distributed import deepspeed_buckets

        trend = late_trend(events, crash.pid, host_limit, crash.step, crash.prompt_tokens, crash.completion_tokens)
        d = diagnose(crash.report, crash.frames, phase=crash.phase,
                     buffers=deepspeed_buckets(crash.knobs, crash.model_config), trend=trend,
                     live=live_at_oom(crash, events))
        # the training process's own exit code, whatever a launcher made of it
        return replace(base, outcome=Outcome.OOM, exit_code=EXIT_OOM, diagnosis=d,
                       oom=finding_from_crash(str(adir / "crash"), crash, d=d),
                       trend=trend.to_dict() if trend is not None and trend.verdicts else None,
                       peak_bytes=base.peak_bytes or crash.peak_bytes,
                       step=crash.step if crash.step is not None else base.step)
    if ranks.unmet is not None:
        unmet = Unmet.from_dict(ranks.unmet.unmet)
        # whatever a launcher made of it
        return replace(base, outcome=Outcome.FAILED, exit_code=EXIT_LOCK_UNMET, unmet=unmet.to_dict(),
                       note=unmet.line())
    if ranks.stop is not None:
        stop = ranks.stop
        # the training process's own code, whatever a launcher made of it
        stopped = replace(base, outcome=Outcome.PREDICTED, exit_code=EXIT_PREDICTED,
                          predicted_bytes=stop.predicted_bytes)
        saved = {"loads": "loading", "starts vLLM": "starting vLLM"}.get(stop.before, "generating")
        if stop.reason is not None:  # vLLM would refuse to start: its reservation, not the device, is too small
            from ..oom.diagnose import diagnose

            return replace(stopped, note=f"stopped before {saved}: {stop.reason}", diagnosis=diagnose(
                OOMReport(backend="vllm", origin="vllm-kv", message=stop.reason), reason=stop.reason))
        return replace(stopped, note=f"stopped before {saved}: predicted {format_size(stop.predicted_bytes or 0)}, "
                                     f"more than {100 * stop.margin:.1f}% over the capacity")
    silent = ranks.silent()
    killed = _sigkill(res.returncode) or bool(silent)
    said = ranks.failure(training_only=True)
    # a host-RAM OOM only with evidence (proc.py, hostmem.py); a rank's own error outweighs the weak evidence (resident
    # memory near the limit), not the kernel's word (its OOM-kill counter, its log naming one of ours)
    if killed and res.host_oom and (res.host_strong or said is None):
        victim = (f"killed by SIGKILL (exit {res.exit_code})" if _sigkill(res.returncode) or not silent
                  else f"{ranks.who(silent[0])} was killed without a word (the command exited {res.exit_code})")
        report = OOMReport(backend="host", origin="oom-killer",
                           message=f"the training process was {victim}: " + "; ".join(res.host_oom))
        from ..oom.analyze import finding
        from ..oom.diagnose import diagnose

        trend = late_trend(events, None, host_limit, base.step)
        d = diagnose(report, phase="save" if saving(events) else None, host_signs=res.host_oom, trend=trend)
        return replace(base, outcome=Outcome.OOM, oom=finding("exit status", None, report, d), diagnosis=d,
                       trend=trend.to_dict() if trend is not None and trend.verdicts else None)
    clean = ranks.clean(res.pid, res.returncode) if ranks.training else res.returncode == 0
    if not clean and not ranks.spoke():  # no training process could say how it ended (not reached, or killed): read
        # the output
        from ..oom.parse import scan_text

        hits = scan_text(res.stderr_tail) or scan_text(res.stdout_tail)
        if hits:
            hit = hits[-1]
            from ..oom.analyze import finding_from_hit
            from ..oom.diagnose import diagnose

            return replace(base, outcome=Outcome.OOM, oom=finding_from_hit("stderr", hit),
                           diagnosis=diagnose(hit.report, hit.frames))
    if clean:
        note = None
        if res.returncode != 0:
            note = (f"every training process finished, but the command exited with code {res.exit_code} "
                    "(its launcher's own): the training counts as done; the code is passed through")
            warn(f"attempt {index}: {note}")
        return replace(base, outcome=Outcome.OK, note=note)
    why = said or ranks.failure()
    if why is None and killed:
        how = (f"{ranks.who(silent[0])} ended without a word (killed by a signal)" if silent
               else f"killed by SIGKILL (exit {res.exit_code})")
        why = (f"{how}, with no sign of the kernel's OOM killer ({res.host_checked or 'not checked'}): passed "
               "through as a failure, not retried")
        warn(f"attempt {index}: {why}")
    return replace(base, note=why)


def said_of_itself(ended: Ended, events: Sequence[ChildEvent], group_failure: str | None) -> Ended:
    """What the training process said of its attempt beside how it ended, taken into ``ended``: the probe it decided
    to run as the real run (or not), a group that ended early (a failure, whatever the process said), the configs
    oomguard generated for it, a patch of oomguard's that failed, a command that builds no GRPOConfig (its "probe"
    was the whole command), and oomguard's overrides that broke it.

    >>> e = Ended(kind="probe", outcome="ok", knobs={}, remedies=[], exit_code=0, seconds=1.0)
    >>> print(said_of_itself(e, [], None).kind, said_of_itself(e, [], None).note[:32])
    run the command builds no GRPOConfig
    """
    changes: dict[str, Any] = {}
    decided = next((e for e in events if isinstance(e, ProbeDecided)), None)
    if decided is not None:
        changes["probe_decision"] = {"decided": decided.decided, "why": decided.why,
                                     "predicted_bytes": decided.predicted_bytes, "limit": decided.limit}
    outcome, note = ended.outcome, ended.note
    if group_failure is not None:
        outcome, note = Outcome.FAILED, group_failure
        changes.update(outcome=outcome, exit_code=ended.exit_code or 1)
    generated = ended.generated
    for g in (e for e in events if isinstance(e, ConfigGenerated)):
        generated = {**(generated or {}), g.kind: {"path": g.path, "config": g.config, "replaces": g.replaces}}
    broken = [e for e in events if isinstance(e, PatchFailed)]
    configured = any(isinstance(e, CodeSeen) and e.point == "config" for e in events)
    if ended.kind != AttemptKind.RUN and not configured:
        changes["kind"] = AttemptKind.RUN  # no GRPOConfig to shorten: the "probe" was the whole command
        if not broken and outcome != Outcome.FAILED:
            note = "the command builds no GRPOConfig, so it ran in full instead of as a short probe"
    if broken:
        note = broken[0].line()
    elif outcome == Outcome.FAILED and not configured and not note:
        # what a training process said of its failure stays the reason
        note = "it failed before it built a GRPOConfig (its own output above says why)"
    broke = next((e for e in events if isinstance(e, OverrideFailed)), None)
    if outcome == Outcome.FAILED and broke is not None:
        changes["override_error"] = {"where": broke.where, "error": broke.error, "overrides": list(broke.overrides)}
    return replace(ended, **changes, note=note, generated=generated)


def trace_of(events: Sequence[ChildEvent]) -> list[dict[str, Any]]:
    """The memory trace of an attempt's main process (the one with the most samples), thinned for the report.

    >>> trace_of([MemSampled(step=s, kept=10, peak=20, pid=1) for s in range(1, 4)])[-1]
    {'step': 3, 'kept': 10, 'peak': 20}
    """
    mine = main_trace(events)
    if len(mine) > TRACE_POINTS:
        stride = len(mine) / TRACE_POINTS
        mine = [mine[int(i * stride)] for i in range(TRACE_POINTS - 1)] + [mine[-1]]
    keys = ("step", "kept", "peak", "reserved", "host_rss", "prompt_tokens", "completion_tokens")
    return [{k: getattr(e, k) for k in keys if getattr(e, k) is not None} for e in mine]


def live_at_oom(crash: CrashRecord, events: Sequence[ChildEvent]) -> Live | None:
    """What was live at the OOM by what holds it: the training process's tally (``CrashRecord.live``), else what the
    step before kept as the long-lived state (its memory trace) against what PyTorch had allocated.

    >>> from oomguard.vocab.oomreport import OOMReport
    >>> crash = CrashRecord("x", "OutOfMemoryError", OOMReport("cuda", "allocator", "x", allocated=300), pid=7)
    >>> live_at_oom(crash, [MemSampled(step=1, kept=100, pid=7)])
    Live(parameters=100, gradients=0, optimizer=0, other=200, source='trace')
    """
    live = Live.of(crash.live)
    if live is not None or crash.report is None or not crash.report.allocated:
        return live
    kept = [e.kept for e in main_trace(events, crash.pid) if e.kept]
    if not kept:
        return None
    return Live(parameters=kept[-1], other=max(0, crash.report.allocated - kept[-1]), source="trace")


def main_trace(events: Sequence[ChildEvent], pid: int | None = None) -> list[MemSampled]:
    """The ``mem`` events of process ``pid`` (None: the process with the most samples, an attempt's main one).

    >>> [e.step for e in main_trace([MemSampled(step=1, pid=7), MemSampled(step=1, pid=8), MemSampled(step=2, pid=8)])]
    [1, 2]
    """
    samples = [e for e in events if isinstance(e, MemSampled) and e.step is not None]
    if pid is None and samples:
        pid = Counter(e.pid for e in samples).most_common(1)[0][0]
    return [e for e in samples if e.pid == pid]


def late_trend(events: Sequence[ChildEvent], pid: int | None, host_limit: int | None, step: int | None,
               prompt_tokens: int | None = None, completion_tokens: int | None = None) -> Any:
    """What the memory trace of process ``pid`` (None: the process with the most samples) says of its OOM at the
    step after ``step`` (``oom.trend.at_oom``), or None without a trace.

    >>> late_trend([], None, None, 3) is None
    True
    """
    mine = [e.sample() for e in main_trace(events, pid)]
    if not mine:
        return None
    from ..oom.trend import at_oom

    dataset = max((e.prompt_tokens_max for e in events if isinstance(e, DatasetSeen) and e.prompt_tokens_max),
                  default=None)
    return at_oom(mine, step=(step or max(s.step for s in mine)) + 1, host_limit=host_limit,
                  prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, dataset_prompt_max=dataset)


__all__ = ["TRACE_POINTS", "Ranks", "classify", "crash_record", "ending", "late_trend", "live_at_oom", "main_trace",
           "said_of_itself", "trace_of"]


def saving(events: Iterable[ChildEvent]) -> bool:
    """Whether a process of the attempt was in a checkpoint save when it ended: a ``saving`` event (Trainer's
    ``_save_checkpoint`` began) with no saved checkpoint nor training step after it.

    >>> saving([StepDone(step=4), Saving(step=4)]), saving([Saving(), CheckpointSaved(4)])
    (True, False)
    """
    state = False
    for ev in events:
        if isinstance(ev, Saving):
            state = True
        elif isinstance(ev, (CheckpointSaved, StepDone)):
            state = False
    return state
