"""``@oomguard.guard``: the ladder for custom training functions, retried in-process.

This module is the decorator and its retry loop; each other concern has its own module: one call and its OOM as
plain data (:mod:`oomguard.inprocess.attempt`), the knobs a function reads (:mod:`oomguard.inprocess.tracked`),
memory given back after a failed attempt (:mod:`oomguard.inprocess.release`), the allocator settings of an attempt
(:mod:`oomguard.inprocess.allocapply`) and ``isolate=True``, one spawned process per attempt
(:mod:`oomguard.inprocess.isolate`). No module is named ``guard``: the package attribute ``oomguard.guard`` is the
function, and importing any of these modules leaves it so.

The loop is ``oomguard run``'s, driven by the same ``Conductor`` (``oomguard.decide.conductor``, ``drive``) with a
policy of no probes: this wrapper only calls the function once per attempt and says how it ended (an ``Ended``); the
conductor writes each attempt's record (the memory model learns by the same rule), chooses the next config ``after``
an OOM, and says when the budget (attempts, time) is ``spent``. The wrapper observes what only this process can: that
only a fresh process could help (a call here cannot recover from what a CUDA runtime OOM leaves:
``Ended.fresh_process``) and which rungs would not take effect here (``Ended.not_here``).

Only OOMs are retried (``oomguard.is_oom``); anything else propagates unchanged.

>>> import oomguard
>>> @oomguard.guard
... def train(knobs):
...     if knobs.per_device_train_batch_size > 2:  # stands in for a real torch.OutOfMemoryError
...         raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
...                            "8.00 GiB of which 1.00 GiB is free.")
...     return "trained"
>>> train()
'trained'
>>> [(a.knobs["per_device_train_batch_size"], a.outcome) for a in train.report.attempts]
[(8, 'oom'), (4, 'oom'), (2, 'ok')]
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..decide.climb import Climb, Decision
from ..decide.conductor import Conductor, Ended, Next, Policy
from ..decide.experiment import Experiment, cost_note, experiment_lines
from ..decide.ladder import Ladder, load_ladder
from ..oom.diagnose import diagnose
from ..oom.trend import assess, at_oom, describe
from ..vocab import allocconf
from ..vocab.diagnosis import Diagnosis
from ..vocab.knobs import Knobs, RunFacts, reachable
from ..vocab.records import AttemptKind, Outcome, RunReport, rung_label
from ..vocab.sizes import format_size, parse_size
from ..vocab.trace import MemSample
from . import allocapply
from .attempt import call_once, start_simulation, stop_simulation
from .isolate import check_picklable, lookup, run_isolated
from .release import live_bytes, loaded_torch, release, reset_peak
from .tracked import TrackedKnobs

# One line per OOM and per climb, the way transformers users see library messages. No handler is added: with logging
# unconfigured, Python's last-resort handler prints WARNING lines to stderr; configured logging takes them as usual.
log = logging.getLogger("oomguard")

# The allocator knobs are set by oomguard itself (not read by the function), so they always count as reached.
ALLOCATOR_KNOBS = frozenset({"expandable_segments", "max_split_size_mb"})


class OOMGuardExhausted(RuntimeError):
    """Every rung was tried (or the budget ran out) and the function still ran out of memory.

    ``.report`` holds the RunReport. The last OOM is described in the message, not chained, so its traceback does
    not keep the failed attempt's tensors alive.

    >>> import oomguard
    >>> def hopeless(knobs):
    ...     knobs.per_device_train_batch_size
    ...     raise MemoryError("out of memory")
    >>> try:
    ...     oomguard.guard(hopeless, max_attempts=1, verbose=False)()
    ... except oomguard.OOMGuardExhausted as e:
    ...     print(e.report.status)
    exhausted
    """

    def __init__(self, message: str, report: RunReport) -> None:
        super().__init__(message)
        self.report = report


class _Call:
    """What a guarded call's attempts leave for its end, never the exception itself: the value of the attempt that
    fit, the last OOM's diagnosis and message, and the knobs the last attempt reached (for the climb's lines)."""

    def __init__(self) -> None:
        self.value: Any = None
        self.diagnosis: Diagnosis | None = None
        self.message = ""
        self.fields: frozenset[str] = frozenset()


class Guarded:
    """A function wrapped by :func:`guard`. Call it as the function; ``.report`` is the last call's RunReport."""

    def __init__(self, fn: Callable[..., Any], ladder: str | Ladder, knobs: Knobs | dict[str, Any] | None,
                 max_attempts: int, simulate_gpu: int | str | None, report: str | os.PathLike[str] | None,
                 isolate: bool, predict: bool = True, verbose: bool = True, max_time: float | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.ladder = ladder if isinstance(ladder, Ladder) else load_ladder(ladder)
        self.initial = knobs if isinstance(knobs, Knobs) else Knobs.from_dict(knobs or {})
        self.max_attempts = max_attempts
        self.max_time = max_time
        if simulate_gpu in (None, ""):
            simulate_gpu = os.environ.get("OOMGUARD_SIMULATE_GPU") or None  # the rehearsal device, as for `run`
        self.simulate_gpu = parse_size(simulate_gpu) if simulate_gpu not in (None, "") else None
        self.report_path = Path(report) if report else None
        self.isolate = isolate
        self.predict = predict
        self.verbose = verbose
        self._judge_obj: Any = None
        self.report: RunReport | None = None
        # memory at the end of each call that fit, over the guarded function's life: a leak across calls shows here
        self.calls: list[MemSample] = []
        self._leak_said = False
        self.takes_knobs = "knobs" in inspect.signature(fn).parameters

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by reference (isolate=True sends it to a spawned process): module attribute lookup.
        return (lookup, (self.fn.__module__, self.fn.__qualname__))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self.__call__, obj)

    # -- the retry loop ----------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_distributed()
        if self.isolate:
            check_picklable(self, args, kwargs)
        started = bool(self.simulate_gpu and not self.isolate and start_simulation(self.simulate_gpu))
        try:
            return self._climb(args, kwargs)
        finally:
            if started:
                stop_simulation()

    def _climb(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        user = allocconf.user_settings(os.environ)  # the allocator settings in force are the user's own
        climb = Climb(self.ladder, base=self.initial, facts=RunFacts(alloc_conf_locked=user.locked_text()),
                      env_knobs={"expandable_segments": bool(user.expandable_segments),
                                 "max_split_size_mb": user.max_split_size_mb})
        # a function that takes knobs may read them for memory the GRPO model does not describe: climbed unjudged
        conductor = Conductor(climb, None if self.takes_knobs else self._judge(), self.policy(), subject="the function")
        reads: set[str] = set()
        call = _Call()
        last = conductor.drive(lambda _nxt: self._attempt(conductor, reads, call, args, kwargs),
                               lambda nxt: self._tell(nxt, call))
        assert last is not None  # the first attempt always runs
        if last.outcome == "ok":
            n = len(climb.attempts)
            self.report = self._report(climb, reads, "stable", f"stable after {n} attempt(s)" if n > 1 else
                                       "the call fit on the first attempt; nothing changed", 0)
            if n > 1:
                self._log(logging.INFO, f"{self.fn.__name__}() is stable after {n} attempts")
                for line in experiment_lines(self.report.experiment):
                    self._log(logging.INFO, line)
            self._write()
            return call.value
        late = self.max_time is not None and time.time() - climb.started >= self.max_time
        leaked = climb.exhausted is not None and climb.exhausted.skipped[:1] and climb.exhausted.skipped[0][0] == "leak"
        why = (f"it leaks memory, which no config change cures ({call.diagnosis.evidence[0]})"
               if leaked and call.diagnosis is not None and call.diagnosis.evidence
               else "no rung left that can help" if climb.exhausted is not None
               else f"stopped after {len(climb.attempts)} attempt(s) and {self.max_time:g} s (max_time)" if late
               else f"stopped after {self.max_attempts} attempts (max_attempts)")
        self.report = self._report(climb, reads, "leaked" if leaked else "exhausted", f"{why}; last OOM: {call.message}",
                                   None)
        self._write()
        skipped = "; ".join(f"{s['remedy']}: {s['reason']}" for s in last.skipped[-4:])
        raise OOMGuardExhausted(
            f"{self.fn.__name__} still ran out of memory after {len(climb.attempts)} attempt(s): {why}. "
            f"Last OOM: {call.message[:300]}" + (f" (skipped {skipped})" if skipped else ""), self.report)

    def policy(self) -> Policy:
        """The climb's policy for a guarded call: ``oomguard run``'s with no probes (the call is the attempt), no
        pre-flight, and the guard's budget."""
        return Policy(max_attempts=self.max_attempts, max_time=self.max_time, probe_steps=0, preflight=False,
                      leak_restart=False)

    def _attempt(self, conductor: Conductor, reads: set[str], call: _Call, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Ended:
        """One attempt: run the call with the climb's knobs and say how it ended, for the conductor to record."""
        climb = conductor.climb
        index = len(climb.attempts) + 1
        knobs, remedies = climb.effective()[0], climb.remedies_in_force()
        note = allocapply.apply(knobs, climb, self.isolate)
        before = live_bytes()
        reset_peak()
        start = time.monotonic()
        if self.isolate:
            result = run_isolated(self, knobs, climb, args, kwargs)
        else:
            result = call_once(self.fn, self.takes_knobs, knobs, climb.overrides(knobs), reads, args, kwargs)
        seconds = time.monotonic() - start
        reads |= result.reads  # an isolated attempt reads knobs in its own process
        climb.observe(result.observed)
        if result.facts:
            climb.learn(climb.facts.replace(**result.facts))
        # the knobs as the call really ran them: a GRPOConfig built inside it reports the function's own values
        ended = Ended(kind=AttemptKind.RUN.value, outcome=Outcome.OK.value, knobs=climb.effective()[0].to_dict(),
                      remedies=remedies, exit_code=None, seconds=seconds, peak_bytes=result.peak, note=note or None)
        if result.ok:
            call.value = result.value
            self._watch_calls(live_bytes(), result.peak)
            return ended
        # An OOM: everything below works from plain data; the exception and its frames are gone.
        release()
        memory = {"live_before": before, "live_after_release": live_bytes()}
        r = result.report
        assert r is not None  # a failed call carries its OOMReport
        samples = result.samples or self.calls  # the trainer's steps in this call, else the calls before it
        last = max((s.step for s in samples), default=0)
        d = diagnose(r, result.frames, phase=result.phase, trend=at_oom(samples, step=last + 1) if samples else None)
        call.diagnosis, call.message = d, r.message
        self._log(logging.WARNING, f"{self.fn.__name__}() attempt {index}/{self.max_attempts} ran out of "
                  f"memory: {d.kind}{' during ' + d.phase if d.phase != 'unknown' else ''}"
                  f"{f' ({format_size(r.requested)} requested)' if r.requested else ''}")
        fresh = None
        if d.kind == "driver" and not self.isolate:
            fresh = "a CUDA runtime OOM can leave the context unusable; use guard(isolate=True) or `oomguard run`"
            self._log(logging.WARNING, f"not retrying {self.fn.__name__}(): {fresh}")
        reached = ALLOCATOR_KNOBS if self.takes_knobs else reachable(result.reached)
        call.fields = frozenset(set(reads) | set(reached))
        ladder = climb.ladder
        not_here = frozenset(rung.name for rung in (*ladder.rungs, *ladder.host_rungs)
                             if not allocapply.can_apply_here(rung.name, self.isolate))
        from ..oom.analyze import finding

        return replace(ended, outcome=Outcome.OOM.value, oom=finding(f"{self.fn.__name__}()", None, r, d,
                                                               frames=result.frames),
                       memory=memory, diagnosis=d, read_fields=call.fields, fresh_process=fresh, not_here=not_here)

    def _tell(self, nxt: Next, call: _Call) -> None:
        """What the conductor decided after an attempt, as log lines: the climb in one line (for a function that takes
        ``knobs``, only the changes it reads), and its other lines."""
        for said in nxt.said:
            if said.decision is not None:
                self._log_climb(said.decision, call.fields if self.takes_knobs else None)
            elif said.line is not None:
                self._log(logging.INFO, said.line.strip())

    def _watch_calls(self, kept: int | None, peak: int | None) -> None:
        """Memory at the end of a call that fit: a leak across calls (the function keeps memory from one call to
        the next) is said once, with the call at which it runs out at that rate."""
        if kept is None:
            return
        self.calls.append(MemSample(step=len(self.calls) + 1, kept=kept, peak=peak))
        leak = assess(self.calls).leak
        if leak is not None and not self._leak_said:
            self._leak_said = True
            self._log(logging.WARNING, f"{self.fn.__name__}() keeps memory from call to call (each call is a step "
                      f"here): {describe(leak)}")

    # -- the report and the log lines --------------------------------------------------------------------------
    def _report(self, climb: Climb, reads: set[str], status: str, message: str, code: int | None) -> RunReport:
        report = climb.report(status, message, code)
        if self.takes_knobs:
            # A rung may change knobs the function never reads (num_generations beside the batch size of a plain
            # loop); the diff shows what reached the function.
            report.diff = [r for r in report.diff if r["knob"] in reads or r["knob"] in ALLOCATOR_KNOBS]
        if status == "stable" and climb.applied:
            judge = self._judge()
            exp = climb.experiment(slowdown=judge.slowdown(climb.facts) if judge is not None else None)
            # what an experiment keeps is GRPO's: a function that built no GRPOConfig is told only what changed
            report.experiment = (exp if climb.observed else Experiment([], exp.changed)).to_dict()
        return report

    def _write(self) -> None:
        if self.report_path and self.report is not None:
            self.report.write(self.report_path)

    def _log(self, level: int, message: str) -> None:
        """One line to the ``oomguard`` logger: at ``level`` when verbose, else at DEBUG (hidden by default). With
        logging unconfigured, Python's last-resort handler prints the bare message, so it then names oomguard."""
        log.log(level if self.verbose else logging.DEBUG, message if log.hasHandlers() else f"oomguard: {message}")

    def _log_climb(self, decision: Decision, read: frozenset[str] | None) -> None:
        """The climb in one line; for a function that takes ``knobs``, only the changes it reads (as in the diff)."""
        changes = ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
                            for k, v in decision.changes.items() if read is None or k in read)
        if decision.exhausted is not None:
            self._log(logging.WARNING, f"no rung left that can help {self.fn.__name__}()")
        elif not decision.steps:
            self._log(logging.WARNING, f"choosing again with what was learned: {changes}")
        else:
            steps = decision.steps
            note = cost_note([s.remedy for s in steps], decision.changes)
            self._log(logging.WARNING, f"climbing {rung_label([(s.remedy.name, s.pass_no) for s in steps])}: "
                      f"{changes or 'no knob changed'} ({note})")

    # -- the memory model --------------------------------------------------------------------------------------
    def _judge(self) -> Any:
        """The memory model for this call's device, when guided climbing is possible (a GRPO model was seen)."""
        if not self.predict:
            return None
        if getattr(self, "_judge_obj", None) is None:
            from ..decide.judge import Judge

            cap = self.simulate_gpu
            context = None  # the device's own: a card's m_ctx, or the simulated device's (child/simulate.py)
            if cap is not None:
                from ..memory.allocmodel import context_for

                context = context_for(cap)
            torch = loaded_torch()
            if cap is None and torch is not None and torch.cuda.is_available():
                dev = torch.cuda.current_device()
                cap = int(torch.cuda.get_device_properties(dev).total_memory)
                # a per-process cap the caller set (torch.cuda.set_per_process_memory_fraction) is the capacity
                getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
                fraction = float(getter(dev)) if getter is not None else 1.0
                if 0 < fraction < 1:  # the caller's cap bounds the allocator only: the context lies outside it
                    cap, context = int(cap * fraction), 0
            self._judge_obj = Judge(cap, simulated=bool(self.simulate_gpu), context=context) if cap else None
        return self._judge_obj


def _refuse_distributed() -> None:
    """guard retries one process; with several ranks the others would wait in a collective, so refuse in one line."""
    torch = loaded_torch()
    if torch is None:
        return
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("oomguard.guard does not coordinate OOM recovery across ranks: one rank would retry while "
                           "the others wait in a collective. Run the job under `oomguard run -- torchrun ...`, which "
                           "restarts every rank with the next rung.")


def guard(fn: Callable[..., Any] | None = None, *, ladder: str | Ladder = "default",
          knobs: Knobs | dict[str, Any] | None = None, max_attempts: int = 8, simulate_gpu: int | str | None = None,
          report: str | os.PathLike[str] | None = None, isolate: bool = False, predict: bool = True,
          verbose: bool = True, max_time: float | None = None) -> Any:
    """Retry ``fn`` on OOM, climbing the ladder between attempts. Usable bare, with options, or as a call.

    ``@oomguard.guard``, ``@oomguard.guard(max_attempts=4)`` and ``oomguard.guard(fn, simulate_gpu="300MiB")`` all
    work. Returns the function's own value; raises :class:`OOMGuardExhausted` when nothing fits. With ``predict``
    (the default), once the function has built a GRPO model the memory model skips rungs predicted not to be enough.
    With ``verbose`` (the default), each OOM and each climb is one WARNING line on the ``oomguard`` logger, shown
    even when logging is not configured (``verbose=False`` logs them at DEBUG instead). ``max_time``: no new attempt
    after this many seconds from the first (the budget besides ``max_attempts``).

    >>> @guard(max_attempts=4)
    ... def steps(knobs):
    ...     return knobs.max_completion_length
    >>> steps(), steps.report.status
    (512, 'stable')
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    if max_time is not None and not max_time > 0:
        raise ValueError("max_time must be a number of seconds above 0")
    if fn is None:
        return lambda f: Guarded(f, ladder, knobs, max_attempts, simulate_gpu, report, isolate, predict, verbose,
                                 max_time)
    return Guarded(fn, ladder, knobs, max_attempts, simulate_gpu, report, isolate, predict, verbose, max_time)


__all__ = ["Guarded", "OOMGuardExhausted", "TrackedKnobs", "guard"]
