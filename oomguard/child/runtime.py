"""State of oomguard inside the training process: the plan, the knobs, events to the supervisor, crash records.

Everything here is cheap to import (no torch): the bootstrap loads it in every Python process of a run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from ..vocab.events import Adapted, CodeSeen, DatasetSeen, Event, ModelSeen, OOMRaised, ProbeDecided, ProcessEnded
from ..vocab.knobs import TRL_DEFAULTS, Knobs
from ..vocab.protocol import END_ERROR, END_EXIT, END_OOM, STOPPED_MARK, Plan, oom_line
from ..vocab.sizes import format_size


class Runtime:
    """One per process. Holds the plan, what the script set, and talks to the supervisor through files."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.overrides = Knobs.from_dict(plan.overrides)
        self.observed: dict[str, Any] = {}
        self.resolved: dict[str, Any] = {}  # observed values a stack changed after the script set them
        # knobs oomguard set that the process runs otherwise (the script set them again later, a stack changed them):
        # knob -> (the value it runs, who changed it); child/ran.py
        self.later: dict[str, tuple[Any, str]] = {}
        self.ran_said: dict[str, Any] | None = None  # the knobs the last ``ran`` event reported
        self.model_config: dict[str, Any] | None = None
        self.trainer: Any = None
        self.memwatch: Any = None  # the per-step memory trace (child/memwatch.py), from the first train_begin
        self.added: Any = None  # the checkpoints oomguard's saving adds to the user's (child/saves.py), or None
        self.crashed = False
        self.crash_path: Path | None = None  # the CrashRecord this process wrote (once)
        self.started = time.time()
        self.reached: set[str] = set()  # construction points passed: config, trainer, model
        self._facts: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._events_warned = False
        self._observed_said: dict[str, Any] = {}  # the observed values some event has reported
        self.ended: str | None = None  # how this process ended, once its `end` event is written
        self.after_first_step: list[Any] = []  # called once, when the first optimizer step has ended
        self.exit_code: int | None = None  # what the script passed to sys.exit, if it did
        self.stack_facts: list[Any] = []  # a stack adapter's facts(trainer), asked once the trainer is built
        # a front-end's loader running now (Unsloth's from_pretrained): it passes oomguard's dtype on to transformers,
        # so the dtype from_pretrained is given is the front-end adapter's to observe, not the load patch's
        self.loader: str | None = None
        self._adapted: dict[str, Any] = {}  # knobs oomguard changed to let the command run here (``adapt``)
        self.unobserved: list[str] = []  # what oomguard could not observe of this run (``cannot_observe``)
        # the longest prompts measured before GRPOTrainer was built, checked against the trainer's own construction
        # once it exists (child/prompts.py)
        self.prompts: Any = None
        # the process's peaks before the per-step trace last reset the device's peak counters (child/trace.py), so
        # that peak_bytes() stays the peak of the whole process
        self.peak_floor = 0
        self.reserved_floor = 0
        # "probe" (a short worst-case rehearsal), "run" (the real run), None: launched as a probe unless the memory
        # model is sure of the config, not decided yet (``decide_probe``)
        self.probe_as: str | None = ("run" if plan.probe is None else None if plan.probe.unless_sure and plan.judge
                                     else "probe")

    def stopping_on_purpose(self) -> None:
        """Mark, before this process stops itself on purpose (its own one-line reason printed already), that what a
        launcher prints next about its exit is not a crash (``vocab.protocol.STOPPED_MARK``)."""
        if not self.plan.crash_dir:
            return
        try:
            Path(self.plan.crash_dir, STOPPED_MARK).write_text(f"{os.getpid()}\n")
        except OSError:
            pass

    # -- probe or run ------------------------------------------------------------------------------------------
    def probing(self) -> bool:
        """Whether this attempt is a probe (decided; an undecided one is not yet)."""
        return self.probe_as == "probe"

    def probe_undecided(self) -> bool:
        """Launched as a probe unless the memory model is sure of the config, and not decided yet."""
        return self.probe_as is None

    def decide_probe(self, decided: str, why: str, **numbers: Any) -> None:
        """Settle an undecided attempt as ``probe`` or ``run`` (once), and tell the supervisor."""
        if self.probe_as is not None:
            return
        self.probe_as = decided
        self.emit(ProbeDecided(decided=decided, why=why, **numbers))

    # -- knobs -------------------------------------------------------------------------------------------------
    def observe(self, values: dict[str, Any]) -> None:
        """Record what the script set, first value wins (copies of the config must not overwrite it)."""
        for k, v in values.items():
            self.observed.setdefault(k, v)

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """Values the user's stack resolved after the script set them (what the command really trains with): they
        replace the observed ones, except where oomguard set the knob. Returns those taken."""
        taken = {k: v for k, v in values.items() if getattr(self.overrides, k, None) is None}
        self.observed.update(taken)
        self.resolved.update(taken)
        return taken

    def adapt(self, knob: str, value: Any, why: str) -> None:
        """oomguard set ``knob`` to ``value`` so that the command runs here (not for memory): the supervisor puts it
        in the diff and the lock, so that what ran is what a replay runs (once per knob)."""
        if knob in self._adapted:
            return
        self._adapted[knob] = value
        self.emit(Adapted(knob=knob, value=value, why=why))

    def cannot_observe(self, line: str) -> None:
        """Something of this run oomguard could not observe (one line, what and why): the supervisor says it once, and
        the memory model is never sure of the run (``RunFacts.unobserved``)."""
        if line in self.unobserved:
            return
        self.unobserved.append(line)
        self.emit(CodeSeen(point="facts", facts={"unobserved": list(self.unobserved)}))

    def knobs(self) -> Knobs:
        """The effective knobs: TRL defaults, the script's values, then oomguard's overrides."""
        base = TRL_DEFAULTS.merged({k: v for k, v in self.observed.items() if v is not None})
        return base.merged(self.overrides)

    def runs_instead(self, values: dict[str, Any], where: str) -> None:
        """The process runs these values of knobs oomguard set, not oomguard's (``where`` says who changed them)."""
        for k, v in values.items():
            if v is not None and getattr(self.overrides, k, None) is not None:
                self.later[k] = (v, where)

    def ran(self) -> Knobs:
        """The knobs the process runs: the effective knobs, what oomguard adapted, then what changed oomguard's values
        since (``runs_instead``)."""
        return self.knobs().merged(self._adapted).merged({k: v for k, (v, _where) in self.later.items()})

    def override(self, name: str) -> Any:
        return getattr(self.overrides, name)

    def facts(self) -> dict[str, Any]:
        """What the trainer patch learned about the run (model_source, user_peft, world_size)."""
        return dict(self._facts)

    # -- events ------------------------------------------------------------------------------------------------
    def emit(self, ev: Event) -> None:
        """Append the event as one JSON line to the events file, with who and when (O_APPEND keeps lines from several
        processes whole)."""
        if isinstance(ev, CodeSeen):
            if ev.point in ("config", "trainer"):
                self.reached.add(ev.point)
            self._facts.update(ev.facts)
            self._observed_said.update(ev.observed)
        elif isinstance(ev, ModelSeen):
            self.reached.add("model")
        elif isinstance(ev, DatasetSeen):
            for k in ("prompt_tokens_max", "prompt_tokens_p95"):
                if getattr(ev, k) is not None:
                    self._facts[k] = getattr(ev, k)
        path = self.plan.events
        if not path:
            return
        rec = {**ev.to_json(), "t": round(time.time(), 3), "pid": os.getpid(), "rank": rank()}
        line = json.dumps(rec, default=str) + "\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:  # training goes on, but the supervisor learns nothing more from this process
            if not self._events_warned:
                self._events_warned = True
                sys.stderr.write(f"oomguard: warning: cannot write events to {path} ({e.strerror or e}): oomguard "
                                 "will not see your config, progress or checkpoints from this process (the diff "
                                 "starts from TRL's defaults); check the space and permissions of --workdir\n")

    def end(self, how: str, **data: Any) -> None:
        """Write this process's ``end`` event, once: the supervisor decides how the attempt ended from these records
        (and the crash records), never from the exit code of a launcher that may sit between it and this process.

        ``how``: ``exit`` (the interpreter shuts down; ``code`` is what the script passed to ``sys.exit``, else 0),
        ``error`` (an uncaught exception that is not an OOM), ``oom`` (a CrashRecord was written and the process is
        about to exit) or ``predicted`` (the pre-flight check stopped it). A process killed by a signal writes none.
        """
        with self._lock:
            if self.ended is not None:
                return
            self.ended = how
        unsaid = {k: v for k, v in self.observed.items() if k not in self._observed_said}
        if unsaid:  # what the script set as far as it got (a load stopped or out of memory before its config exists)
            self.emit(CodeSeen(point="facts", observed=unsaid))
        self.emit(ProcessEnded(how=how, reached=tuple(sorted(self.reached)), **data))

    def at_exit(self) -> None:
        """The ``atexit`` handler: a process that reaches interpreter shutdown ends with ``exit`` and its code, unless
        an uncaught exception ended it that the excepthooks did not see (a traceback handler of the script's own,
        such as rich's, replaced them): Python keeps it in ``sys.last_value``, and it ends as an OOM (with its
        CrashRecord) or an error."""
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if self.ended is None and isinstance(exc, BaseException) and not isinstance(exc, SystemExit):
            from ..oom.parse import is_oom

            try:
                if is_oom(exc):
                    path = self.record_crash(exc)
                    self.end(END_OOM, path=str(path) if path else None)
                    sys.stderr.write(oom_line(path))  # after the traceback the script's own handler printed
                    sys.stderr.flush()
                    return
            except Exception:  # never fail the user's interpreter shutdown
                pass
            self.end(END_ERROR, error=f"{type(exc).__name__}: {exc}"[:500])
            return
        self.end(END_EXIT, code=exit_status(self.exit_code))

    # -- memory ------------------------------------------------------------------------------------------------
    def keep_peaks(self, allocated: int | None, reserved: int | None) -> None:
        """Remember the process's peaks before the device's peak counters are reset (the per-step trace resets them
        at each step), so that :meth:`peak_bytes` and :meth:`peak_reserved_bytes` stay the whole process's."""
        self.peak_floor = max(self.peak_floor, allocated or 0)
        self.reserved_floor = max(self.reserved_floor, reserved or 0)

    def peak_bytes(self) -> int | None:
        """The peak of allocated memory of the whole process so far (across the trace's per-step resets)."""
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            return max(dev.peak, self.peak_floor)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return max(int(torch.cuda.max_memory_allocated()), self.peak_floor)
        return None

    def peak_reserved_bytes(self) -> int | None:
        """The peak of reserved memory of the whole process so far (across the trace's per-step resets)."""
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            return max(dev.model.peak_reserved, self.reserved_floor)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return max(int(torch.cuda.max_memory_reserved()), self.reserved_floor)
        return None

    def memory_stats(self) -> dict[str, Any] | None:
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            return dev.stats()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            try:
                return {k: v for k, v in torch.cuda.memory_stats().items() if isinstance(v, (int, float))}
            except RuntimeError:
                return None
        return None

    def device_name(self) -> str:
        from . import simulate

        simulated = simulate.device()
        if simulated is not None:
            return f"simulated ({format_size(simulated.capacity)})"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
        return "cpu"

    def empty_cache(self) -> None:
        """Release cached blocks on whatever device this process uses (the simulated one included)."""
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            dev.release_cached()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    # -- crash -------------------------------------------------------------------------------------------------
    def record_crash(self, exc: BaseException) -> Path | None:
        """Write the CrashRecord for an OOM (once per process: a second call returns the first one's path)."""
        from ..oom.diagnose import phase_from_frames
        from ..oom.parse import oom_in_chain, report_from_exception
        from ..vocab.oomreport import Frame
        from ..vocab.records import CrashRecord
        from . import live

        with self._lock:
            if self.crashed or not self.plan.crash_dir:
                return self.crash_path
            self.crashed = True
        oom = oom_in_chain(exc) or exc
        frames = [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(oom.__traceback__)]
        if not frames and exc is not oom:
            frames = [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
        phase, _ = phase_from_frames(frames)
        step = prompt_tokens = completion_tokens = None
        if self.trainer is not None:
            step = getattr(getattr(self.trainer, "state", None), "global_step", None)
            try:  # the batch the step that ran out trains on: a long sample shows in its widths
                from .trace import batch_lengths

                prompt_tokens, completion_tokens = batch_lengths(self.trainer)
            except Exception:
                pass
        cls = type(oom)
        rec = CrashRecord(
            message=str(oom),
            exception_type=f"{cls.__module__}.{cls.__qualname__}",
            report=report_from_exception(oom),
            frames=frames,
            phase=phase,
            step=step,
            memory_stats=self.memory_stats(),
            knobs=self.knobs().to_dict(),
            observed=dict(self.observed),
            peak_bytes=self.peak_bytes(),
            rank=rank(),
            world_size=world_size(),
            device=self.device_name(),
            attempt=self.plan.attempt,
            model_config=self.model_config,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            live=live.of_trainer(self.trainer),
        )
        name = f"crash-rank{rank()}.json" if rank() is not None else f"crash-{os.getpid()}.json"
        path = Path(self.plan.crash_dir) / name
        try:
            rec.write(path)
        except OSError as e:
            sys.stderr.write(f"oomguard: could not write the crash record {path}: {e}\n")
            return None
        self.crash_path = path
        self.emit(OOMRaised(step=step, phase=phase, path=str(path)))
        return path


def is_helper(orig_argv: list[str]) -> bool:
    """A process that multiprocessing (or torch.multiprocessing) started to serve another: a spawned dataloader or
    ``datasets.map`` worker. It may re-import a script that builds a GRPOConfig, but it is not a training process.

    >>> is_helper(["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
    ...            "--multiprocessing-fork"]), is_helper(["python", "train.py"])
    (True, False)
    """
    return "--multiprocessing-fork" in orig_argv or any("multiprocessing" in a and ("spawn_main" in a or
                                                                                     "forkserver" in a)
                                                        for a in orig_argv)


def exit_status(code: Any) -> int:
    """The status the interpreter exits with after ``sys.exit(code)``.

    >>> [exit_status(c) for c in (None, 0, 3, True, "bad config")]
    [0, 0, 3, 1, 1]
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code) & 0xFF
    return 1


def rank() -> int | None:
    r = os.environ.get("RANK")
    try:
        return int(r) if r is not None else None
    except ValueError:
        return None


def world_size() -> int | None:
    w = os.environ.get("WORLD_SIZE")
    try:
        return int(w) if w is not None else None
    except ValueError:
        return None


_RUNTIME: Runtime | None = None


def runtime() -> Runtime | None:
    return _RUNTIME


def set_runtime(rt: Runtime | None) -> None:
    global _RUNTIME
    _RUNTIME = rt
