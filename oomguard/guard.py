"""``@oomguard.guard``: the ladder for custom training functions, retried in-process.

Two styles:

(a) The function builds a TRL ``GRPOTrainer`` itself and takes no ``knobs``: the same patches as ``oomguard run``
    apply within each call (GRPOConfig, GRPOTrainer, from_pretrained) and are removed afterwards.
(b) The function declares a parameter ``knobs`` and receives a :class:`~oomguard.knobs.Knobs`. The Knobs object
    records which fields the function reads; a rung that only changes fields it never read is skipped.

Only OOMs are retried (``oomguard.is_oom``); anything else propagates unchanged. Between attempts memory is really
released, in this order: leave the ``except`` block, drop the traceback (its frames pin tensors, pytorch #18853
and #27600), ``gc.collect()`` (with a scalar backward to flush what a failed backward leaves in the autograd
engine, pytorch #82218), ``torch.cuda.empty_cache()``, reset the peak statistics.

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
import gc
import importlib
import inspect
import logging
import os
import pickle
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_none

from . import allocconf
from .climb import Climb
from .diagnose import Diagnosis, diagnose, phase_from_frames
from .knobs import KNOB_NAMES, Knobs, RunFacts, reachable
from .ladder import Ladder, load_ladder
from .oom import Frame, is_oom, oom_in_chain, report_from_exception
from .records import Attempt, RunReport, rung_label
from .sizes import format_size, parse_size

# One line per OOM and per climb, the way transformers users see library messages. No handler is added: with logging
# unconfigured, Python's last-resort handler prints WARNING lines to stderr; configured logging takes them as usual.
log = logging.getLogger("oomguard")


class OOMGuardExhausted(RuntimeError):
    """Every rung was tried (or the budget ran out) and the function still ran out of memory.

    ``.report`` holds the RunReport. The last OOM is described in the message, not chained, so its traceback does
    not keep the failed attempt's tensors alive.
    """

    def __init__(self, message: str, report: RunReport) -> None:
        super().__init__(message)
        self.report = report


class TrackedKnobs(Knobs):
    """Knobs that remember which fields were read, so a rung that changes only unread fields can be skipped."""

    def __getattribute__(self, name: str) -> Any:
        if name in KNOB_NAMES:
            reads = object.__getattribute__(self, "__dict__").get("_reads")
            if reads is not None:
                reads.add(name)
        return super().__getattribute__(name)


def _track(knobs: Knobs, reads: set[str]) -> TrackedKnobs:
    t = TrackedKnobs(**{f: getattr(knobs, f) for f in KNOB_NAMES})
    object.__setattr__(t, "_reads", reads)
    return t


class _Attempt:
    """What one call produced: the result, or the facts of its OOM (never the exception itself)."""

    def __init__(self, record: Attempt, value: Any = None, diagnosis: Diagnosis | None = None,
                 message: str = "") -> None:
        self.record = record
        self.value = value
        self.diagnosis = diagnosis
        self.message = message

    @property
    def outcome(self) -> str:
        return self.record.outcome


class Guarded:
    """A function wrapped by :func:`guard`. Call it as the function; ``.report`` is the last call's RunReport."""

    def __init__(self, fn: Callable[..., Any], ladder: str | Ladder, knobs: Knobs | dict[str, Any] | None,
                 max_attempts: int, simulate_gpu: int | str | None, report: str | os.PathLike[str] | None,
                 isolate: bool, predict: bool = True, verbose: bool = True) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.ladder = ladder if isinstance(ladder, Ladder) else load_ladder(ladder)
        self.initial = knobs if isinstance(knobs, Knobs) else Knobs.from_dict(knobs or {})
        self.max_attempts = max_attempts
        if simulate_gpu in (None, ""):
            simulate_gpu = os.environ.get("OOMGUARD_SIMULATE_GPU") or None  # the rehearsal device, as for `run`
        self.simulate_gpu = parse_size(simulate_gpu) if simulate_gpu not in (None, "") else None
        self.report_path = Path(report) if report else None
        self.isolate = isolate
        self.predict = predict
        self.verbose = verbose
        self._guide_obj: Any = None
        self.report: RunReport | None = None
        self.takes_knobs = "knobs" in inspect.signature(fn).parameters

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by reference (isolate=True sends it to a spawned process): module attribute lookup.
        return (_lookup, (self.fn.__module__, self.fn.__qualname__))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self.__call__, obj)

    # ---------------------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_distributed()
        if self.isolate:
            _check_picklable(self, args, kwargs)
        started = bool(self.simulate_gpu) and not self.isolate and _start_simulation(self.simulate_gpu)
        try:
            return self._climb(args, kwargs)
        finally:
            if started:
                from .child import simulate

                simulate.stop()

    def _climb(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        user = allocconf.user_settings(os.environ)  # the allocator settings in force are the user's own
        climb = Climb(self.ladder, base=self.initial, facts=RunFacts(alloc_conf_locked=user.locked_text()),
                      env_knobs={"expandable_segments": bool(user.expandable_segments),
                                 "max_split_size_mb": user.max_split_size_mb})
        reads: set[str] = set()
        retryer = Retrying(
            stop=stop_after_attempt(self.max_attempts),
            wait=wait_none(),
            retry=retry_if_result(lambda a: a.outcome == "oom" and a.record.climbed is not None),
            retry_error_callback=lambda state: state.outcome.result(),
            reraise=True,
        )
        last: _Attempt = retryer(self._attempt, climb, reads, args, kwargs)
        if last.outcome == "ok":
            n = len(climb.attempts)
            if n > 1:
                self._log(logging.INFO, f"{self.fn.__name__}() is stable after {n} attempts")
            self.report = self._report(climb, reads, "stable", f"stable after {n} attempt(s)" if n > 1 else
                                       "the call fit on the first attempt; nothing changed", 0)
            self._write()
            return last.value
        why = ("no rung left that can help" if climb.exhausted is not None
               else f"stopped after {self.max_attempts} attempts (max_attempts)")
        self.report = self._report(climb, reads, "exhausted", f"{why}; last OOM: {last.message}", None)
        self._write()
        skipped = "; ".join(f"{s['remedy']}: {s['reason']}" for s in last.record.skipped[-4:])
        raise OOMGuardExhausted(
            f"{self.fn.__name__} still ran out of memory after {len(climb.attempts)} attempt(s): {why}. "
            f"Last OOM: {last.message[:300]}" + (f" (skipped {skipped})" if skipped else ""), self.report)

    def _report(self, climb: Climb, reads: set[str], status: str, message: str, code: int | None) -> RunReport:
        report = climb.report(status, message, code)
        if self.takes_knobs:
            # A rung may change knobs the function never reads (num_generations beside the batch size of a plain
            # loop); the diff shows what reached the function.
            allocator = {"expandable_segments", "max_split_size_mb"}
            report.diff = [r for r in report.diff if r["knob"] in reads or r["knob"] in allocator]
        return report

    def _write(self) -> None:
        if self.report_path and self.report is not None:
            self.report.write(self.report_path)

    def _attempt(self, climb: Climb, reads: set[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Attempt:
        index = len(climb.attempts) + 1
        knobs = climb.effective()[0]
        remedies = climb.remedies_in_force()
        record = Attempt(index=index, knobs=knobs.to_dict(), remedies=remedies, outcome="ok", exit_code=None,
                         seconds=0.0)
        note = _apply_allocator(knobs, climb, self.isolate)
        if note:
            record.note = note
        before = _live_bytes()
        _reset_peak()
        start = time.monotonic()
        if self.isolate:
            result = _run_isolated(self, knobs, climb, args, kwargs)
        else:
            result = self._call_here(knobs, climb, reads, args, kwargs)
        record.seconds = time.monotonic() - start
        record.peak_bytes = result.get("peak")
        reads |= result.get("reads", set())  # an isolated attempt reads knobs in its own process
        climb.observe(result.get("observed") or {})
        if result.get("facts"):
            climb.learn(climb.facts.replace(**result["facts"]))
        # the knobs as the call really ran them: a GRPOConfig built inside it reports the function's own values
        record.knobs = climb.effective()[0].to_dict()
        guide = self._guide()
        if guide is not None:
            report = result.get("report")
            guide.learn(climb.facts, knobs, "ok" if "value" in result else "oom", result.get("peak"), report)
            est = guide.predict(climb.facts, knobs)
            record.predicted_bytes = est.peak_bytes if est else None
        attempt = _Attempt(record)
        if "value" in result:
            attempt.value = result["value"]
            climb.record(record)
            return attempt
        # An OOM: everything below works from plain data; the exception and its frames are gone.
        _release()
        record.memory = {"live_before": before, "live_after_release": _live_bytes()}
        d = diagnose(result["report"], result["frames"], phase=result["phase"])
        from .analyze import finding

        record.outcome = "oom"
        record.oom = finding(f"{self.fn.__name__}()", None, result["report"], d, frames=result["frames"])
        attempt.diagnosis = d
        attempt.message = result["report"].message
        climb.record(record)
        r = result["report"]
        self._log(logging.WARNING, f"{self.fn.__name__}() attempt {index}/{self.max_attempts} ran out of memory: "
                  f"{d.kind}{' during ' + d.phase if d.phase != 'unknown' else ''}"
                  f"{f' ({format_size(r.requested)} requested)' if r.requested else ''}")
        if d.kind == "driver" and not self.isolate:
            why = "a CUDA runtime OOM can leave the context unusable; use guard(isolate=True) or `oomguard run`"
            climb.give_up("fresh_process", why)
            record.skipped = [{"remedy": "fresh_process", "reason": why}]
            self._log(logging.WARNING, f"not retrying {self.fn.__name__}(): {why}")
            return attempt
        fields = set(reads) | set(reachable(result.get("reached", set()))) if not self.takes_knobs else set(reads)
        if self.takes_knobs:
            fields |= {"expandable_segments", "max_split_size_mb"}
        guide = self._guide() if not self.takes_knobs else None
        decision = climb.choose_next(d, frozenset(fields), subject="the function", fits=self._fits(climb, result),
                                     peak=guide.peak(climb.facts) if guide is not None else None)
        record.climbed, record.skipped = decision.label(), decision.skipped_rows()
        record.choice = decision.choice.to_dict() if decision.choice is not None else None
        self._log_climb(decision, fields if self.takes_knobs else None)
        if decision.exhausted is not None:
            return attempt
        for step in decision.steps:
            if not _can_apply_here(step.remedy.name, self.isolate):
                record.skipped.append({"remedy": step.remedy.name, "reason": "needs a fresh process"})
        return attempt

    def _log(self, level: int, message: str) -> None:
        """One line to the ``oomguard`` logger: at ``level`` when verbose, else at DEBUG (hidden by default). With
        logging unconfigured, Python's last-resort handler prints the bare message, so it then names oomguard."""
        log.log(level if self.verbose else logging.DEBUG, message if log.hasHandlers() else f"oomguard: {message}")

    def _log_climb(self, decision: Any, read: set[str] | None) -> None:
        """The climb in one line; for a function that takes ``knobs``, only the changes it reads (as in the diff)."""
        changes = ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
                            for k, v in decision.changes.items() if read is None or k in read)
        if decision.exhausted is not None:
            self._log(logging.WARNING, f"no rung left that can help {self.fn.__name__}()")
        elif not decision.steps:
            self._log(logging.WARNING, f"choosing again with what was learned: {changes}")
        else:
            steps = decision.steps
            acting = [s for s in steps if not s.remedy.changes or set(s.remedy.changes) & set(decision.changes)]
            acting = acting or steps  # what is traded: the rungs whose knobs changed
            notes = "; ".join(dict.fromkeys(n for n in (s.remedy.trade_for(decision.changes) for s in acting) if n))
            trades = ", ".join(sorted({s.remedy.trades for s in acting}))
            self._log(logging.WARNING, f"climbing {rung_label([(s.remedy.name, s.pass_no) for s in steps])}: "
                      f"{changes or 'no knob changed'} (trades {trades}{': ' + notes if notes else ''})")

    def _guide(self) -> Any:
        """The memory model for this call's device, when guided climbing is possible (a GRPO model was seen)."""
        if not self.predict:
            return None
        if getattr(self, "_guide_obj", None) is None:
            from .plan import Guide

            cap = self.simulate_gpu
            torch = _torch()
            if cap is None and torch is not None and torch.cuda.is_available():
                cap = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
            self._guide_obj = Guide(cap, simulated=bool(self.simulate_gpu)) if cap else None
        return self._guide_obj

    def _fits(self, climb: Climb, result: dict[str, Any]) -> Any:
        guide = self._guide()
        return guide.fits(climb.facts) if guide is not None and not self.takes_knobs else None

    def _call_here(self, knobs: Knobs, climb: Climb, reads: set[str], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> dict[str, Any]:
        return _call_with_knobs(self.fn, self.takes_knobs, knobs, climb.overrides(knobs), reads, args, kwargs)


def _call_with_knobs(fn: Callable[..., Any], takes_knobs: bool, knobs: Knobs, overrides: dict[str, Any],
                     reads: set[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Call ``fn`` once. Returns plain data: ``value`` on success, or the OOM's report, frames and phase."""
    rt = None
    if takes_knobs:
        kwargs = {**kwargs, "knobs": _track(knobs, reads)}
    else:
        rt = _install_patches(overrides)
    try:
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:
            if not is_oom(e):
                raise
            oom = oom_in_chain(e) or e
            frames = tuple(Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(oom.__traceback__))
            out = {"report": report_from_exception(oom), "frames": frames, "phase": phase_from_frames(frames)[0]}
            del oom
            _drop_traceback(e)
        else:
            out = {"value": value}
        out["peak"] = _peak()
        out["reads"] = set(reads)
        if rt is not None:
            out["observed"] = dict(rt.observed)
            out["reached"] = set(rt.reached)
            facts = rt.facts()
            if rt.model_config:
                facts["model_config"] = rt.model_config
            if facts:
                out["facts"] = facts
        return out
    finally:
        if rt is not None:
            from .child import patches
            from .child.hooks import forget_hooks
            from .child.runtime import set_runtime

            rt.trainer = None  # the trainer holds the model; nothing of a finished call may outlive it
            patches.remove()
            forget_hooks()
            set_runtime(None)


def _drop_traceback(exc: BaseException, detach: bool = True) -> None:
    """Clear the frames of every traceback in the chain, so their locals (tensors) can be freed.

    Every link is followed, as :func:`oomguard.oom.oom_in_chain` follows them to decide that this was an OOM: both
    ``__cause__`` and ``__context__`` (``raise X from Y`` inside ``except OOM`` leaves the OOM only in the context)
    and the members of an ``ExceptionGroup``. Clearing the frames (not only dropping our reference) matters because
    the code may keep the exception elsewhere: a log record of ``logger.exception``, an error list. ``detach=False``
    clears the frames but leaves each ``__traceback__`` in place (for an exception the user may still inspect).
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            if detach:
                e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
        members = getattr(e, "exceptions", None)
        if isinstance(members, (list, tuple)):
            stack += [m for m in members if isinstance(m, BaseException)]


# ----------------------------------------------------------------------------------------------------------------
# Memory and the in-process rungs.


def _torch() -> Any:
    return sys.modules.get("torch")


def _cuda_in_use() -> bool:
    torch = _torch()
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def _live_bytes() -> int | None:
    from .child import simulate

    dev = simulate.device()
    if dev is not None:
        return dev.model.allocated
    if _cuda_in_use():
        return int(_torch().cuda.memory_allocated())
    return None


def _peak() -> int | None:
    from .child import simulate

    dev = simulate.device()
    if dev is not None:
        return dev.peak
    if _cuda_in_use():
        return int(_torch().cuda.max_memory_allocated())
    return None


def _reset_peak() -> None:
    from .child import simulate

    dev = simulate.device()
    if dev is not None:
        dev.reset_peak()
    if _cuda_in_use():
        _torch().cuda.reset_peak_memory_stats()


def _release() -> None:
    """After leaving the except block and dropping the traceback: collect, give the cache back, reset the peak.

    What else can keep a failed attempt's memory, and what is done about it:

    - an OOM that an earlier failure left in ``sys.last_exc`` / ``sys.last_value`` (a notebook keeps the last
      unhandled exception for ``%debug``): its frames are cleared;
    - an OOM inside ``backward()`` leaves the autograd engine holding the failed step's gradients until the next
      backward runs (pytorch #82218). CPU work runs on the calling thread, CUDA work on the device's own engine
      thread, so a scalar backward is run on each (on the current CUDA device too), then a second collection;
    - cuBLAS and cuBLASLt keep a workspace per (handle, stream), allocated through the caching allocator and never
      freed: 32 MiB each on Hopper and Blackwell, one handle for the forward's thread and one for the backward's
      engine thread (65 MiB live after a failed attempt in a real 4 GiB-capped run). They are cleared
      (``torch._C._cuda_clearCublasWorkspaces``) and come back on the next matmul.
    """
    _clear_last_oom()
    gc.collect()
    torch = _torch()
    if torch is not None:
        torch.zeros((), requires_grad=True).sum().backward()
        if _cuda_in_use():
            torch.zeros((), device="cuda", requires_grad=True).sum().backward()
        gc.collect()
    from .child import simulate

    dev = simulate.device()
    if dev is not None:
        dev.release_cached()
    if _cuda_in_use():
        clear = getattr(_torch()._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            _torch().cuda.synchronize()
            clear()
        _torch().cuda.empty_cache()
    _reset_peak()


def _clear_last_oom() -> None:
    """Clear the frames of an OOM that the interpreter keeps as the last unhandled exception (notebooks do, for
    ``%debug``): their locals are the failed run's tensors. The exception and its traceback stay for the user."""
    for name in ("last_exc", "last_value"):
        e = getattr(sys, name, None)
        if isinstance(e, BaseException) and is_oom(e):
            _drop_traceback(e, detach=False)
            tb = getattr(sys, "last_traceback", None)
            if tb is not None:
                traceback.clear_frames(tb)


def _can_apply_here(remedy: str, isolate: bool) -> bool:
    if remedy != "expandable_segments" or isolate:
        return True
    torch = _torch()
    return torch is None or not _cuda_in_use() or _allocator_setter(torch) is not None


def _alloc_options(knobs: Knobs, climb: Climb) -> dict[str, str]:
    """The allocator options the climbed rungs add to the user's own settings."""
    original = climb.original()
    opts: dict[str, str] = {}
    if knobs.expandable_segments and not original.expandable_segments:
        opts["expandable_segments"] = "True"
    if knobs.max_split_size_mb is not None and knobs.max_split_size_mb != original.max_split_size_mb:
        opts["max_split_size_mb"] = str(knobs.max_split_size_mb)
    return opts


def _apply_allocator(knobs: Knobs, climb: Climb, isolate: bool) -> str | None:
    """Allocator settings: merged into the variable torch reads (see :mod:`oomguard.allocconf`), never replacing
    the user's options; set in-process where torch allows it, on the simulated device, or for an isolated attempt's
    fresh process (:func:`_run_isolated` puts them in its environment)."""
    opts = _alloc_options(knobs, climb)
    if not opts:
        return None
    text = allocconf.format_options(opts)
    if isolate:
        return f"allocator settings {text} merged into {_written(opts)} of the attempt's fresh process"
    from .child import simulate

    dev = simulate.device()
    if dev is not None:
        if "max_split_size_mb" in opts:
            dev.set_max_split(int(opts["max_split_size_mb"]) << 20)
        if "expandable_segments" in opts:
            dev.set_expandable(True)
        return f"allocator settings {text} applied in-process (simulated device)"
    torch = _torch()
    if torch is not None and _cuda_in_use():
        setter = _allocator_setter(torch)
        if setter is None:
            return f"allocator settings {text} need a fresh process on this torch: use isolate=True"
        # parseArgs resets the options it is not given (max_split_size_mb among them): pass the whole settings
        setter(allocconf.format_options({**allocconf.in_force(os.environ), **opts}))
        return f"allocator settings {text} applied in-process"
    written = allocconf.merge(os.environ, opts)
    return f"allocator settings {text} merged into {', '.join(written)} for CUDA's first use"


def _written(opts: dict[str, str]) -> str:
    """The variables :func:`allocconf.merge` writes ``opts`` into, given this process's environment."""
    return ", ".join(allocconf.merge(dict(os.environ), opts))


def _allocator_setter(torch: Any) -> Any:
    """torch's in-process setter of the allocator settings (2.9+ names it in torch._C; older, in torch.cuda.memory)."""
    return (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            or getattr(torch.cuda.memory, "_set_allocator_settings", None))


def _start_simulation(size: int) -> bool:
    """Start the simulated device for this call; False if one already runs (it is then left as it is)."""
    from .child import simulate

    if simulate.device() is not None:
        return False
    simulate.start(size)
    return True


def _refuse_distributed() -> None:
    torch = _torch()
    if torch is None:
        return
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("oomguard.guard does not coordinate OOM recovery across ranks: one rank would retry while "
                           "the others wait in a collective. Run the job under `oomguard run -- torchrun ...`, which "
                           "restarts every rank with the next rung.")


def _install_patches(overrides: dict[str, Any]) -> Any:
    from .child import bootstrap
    from .child.runtime import Plan, Runtime, set_runtime

    rt = Runtime(Plan(attempt=1, overrides=overrides, log_to_trainer=False))
    set_runtime(rt)
    bootstrap.install_hooks(rt)
    return rt


# ----------------------------------------------------------------------------------------------------------------
# isolate=True: one spawned process per attempt.


def _lookup(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _check_picklable(g: Guarded, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if "<locals>" in g.fn.__qualname__ or (g.fn.__module__ == "__main__" and not _main_is_importable()):
        raise TypeError(f"guard(isolate=True) runs {g.fn.__name__} in a new process, so it must be defined at the top "
                        "of an importable module (not inside a function, a lambda or a notebook cell)")
    try:
        pickle.dumps((g, args, kwargs))
    except Exception as e:
        raise TypeError(f"guard(isolate=True) sends the function and its arguments to a new process, and they cannot "
                        f"be pickled: {e}") from None


def _main_is_importable() -> bool:
    main = sys.modules.get("__main__")
    return bool(getattr(main, "__file__", None))


def _isolated_child(conn: Any, payload: bytes, env: dict[str, str]) -> None:  # pragma: no cover - runs in a child
    os.environ.update(env)
    g, knobs, overrides, args, kwargs, simulate = pickle.loads(payload)
    if simulate:
        _start_simulation(simulate)
    try:
        out = _call_with_knobs(g.fn, g.takes_knobs, knobs, overrides, set(), args, kwargs)
        if "value" in out:
            try:
                pickle.dumps(out["value"])
            except Exception as e:
                out = {"error": f"the function's return value cannot be sent back: {e}"}
        conn.send(out)
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    finally:
        conn.close()


def _run_isolated(g: Guarded, knobs: Knobs, climb: Climb, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing as mp

    merged = dict(os.environ)  # the user's allocator settings, with the rungs' options merged in
    env = {var: merged[var] for var in allocconf.merge(merged, _alloc_options(knobs, climb))}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    payload = pickle.dumps((g, knobs, climb.overrides(knobs), args, kwargs, g.simulate_gpu))
    proc = ctx.Process(target=_isolated_child, args=(child, payload, env))
    proc.start()
    child.close()
    try:
        out = parent.recv()
    except EOFError:
        out = {"error": f"the isolated attempt died with exit code {proc.exitcode} before reporting"}
    proc.join()
    if "error" in out:
        raise RuntimeError(f"{g.fn.__name__} failed in its isolated process: {out['error']}"
                           + (f"\n{out['traceback']}" if out.get("traceback") else ""))
    return out


def guard(fn: Callable[..., Any] | None = None, *, ladder: str | Ladder = "default",
          knobs: Knobs | dict[str, Any] | None = None, max_attempts: int = 8, simulate_gpu: int | str | None = None,
          report: str | os.PathLike[str] | None = None, isolate: bool = False, predict: bool = True,
          verbose: bool = True) -> Any:
    """Retry ``fn`` on OOM, climbing the ladder between attempts. Usable bare, with options, or as a call.

    ``@oomguard.guard``, ``@oomguard.guard(max_attempts=4)`` and ``oomguard.guard(fn, simulate_gpu="300MiB")`` all
    work. Returns the function's own value; raises :class:`OOMGuardExhausted` when nothing fits. With ``predict``
    (the default), once the function has built a GRPO model the memory model skips rungs predicted not to be enough.
    With ``verbose`` (the default), each OOM and each climb is one WARNING line on the ``oomguard`` logger, shown
    even when logging is not configured (``verbose=False`` logs them at DEBUG instead).
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    if fn is None:
        return lambda f: Guarded(f, ladder, knobs, max_attempts, simulate_gpu, report, isolate, predict, verbose)
    return Guarded(fn, ladder, knobs, max_attempts, simulate_gpu, report, isolate, predict, verbose)


__all__ = ["Guarded", "OOMGuardExhausted", "TrackedKnobs", "guard"]


class _CallableModule(types.ModuleType):
    """Importing this submodule rebinds ``oomguard.guard`` to it; calling it still means ``guard(...)``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return guard(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
