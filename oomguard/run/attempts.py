"""One attempt of ``oomguard run``, from its plan to how it ended: the plan file and environment of the launch, the
process watched while it runs (its events, the live view, a rank that died while others hang, a node of a group
that must stop), and how it ended (``classify``: an ``Ended``, with what the training process said of itself).

``Launcher`` launches what the conductor (``oomguard.decide.conductor``) decides and hands back how it ended; the
conductor alone writes the attempt's record. The Launcher's own state is what only a launch knows: the newest checkpoint the run wrote (a later run resumes from it), where the run
writes, why a group ended early, the warnings said once and kept for the report, the device's context measured."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from ..decide.conductor import Conductor, Next
from ..oom.trendwords import held
from ..vocab import allocconf
from ..vocab.ended import Ended
from ..vocab.events import (
    CheckpointSaved,
    ChildEvent,
    EventTail,
    MemHolders,
    MemTrend,
    PatchFailed,
    ProbeDecided,
    ProcessStarted,
    TrainBegin,
)
from ..vocab.files import write_json_atomic
from ..vocab.knobs import Knobs
from ..vocab.lock import shown
from ..vocab.protocol import PLAN_ENV, SIMULATE_ENV, STOPPED_MARK, Plan, ProbePlan, whereabouts
from ..vocab.records import AttemptKind
from ..vocab.serial import to_fields
from ..vocab.trace import Holder
from .aside import Aside
from .classify import classify
from .command import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, UsageError
from .group import Group, GroupError, GroupTail
from .hostmem import host_limit
from .learning import knobs_ran, ran_report, take_events
from .options import BOOT_DIR, Reporter, RunOptions
from .proc import Interrupts, ProcessResult, StartError, process_alive, run_attempt
from .resume import resume_plan
from .watch import PROBE_DIR_PREFIX, Watch

CENSUS_AFTER = 3  # steps into a run restarted after a leak before the training process finds where it is held


def script_cadence(save_strategy: str, save_steps: float | None) -> int | None:
    """The script's own checkpoint cadence in steps, as TrainBegin reports it; None where it has none in steps.

    A leak's restarts need checkpoints no further apart than oomguard's cadence; a script that already saves as often
    keeps its own. A ``save_steps`` below 1 is the transformers ratio of the run's total steps, unknown here, so it
    is no cadence to compare (oomguard adds its own beside it).

    >>> script_cadence("IntervalStrategy.STEPS", 50.0), script_cadence("steps", 0.1), script_cadence("epoch", 50)
    (50, None, None)
    """
    if "steps" not in save_strategy.lower().split(".")[-1:] or not save_steps or save_steps < 1:
        return None
    return int(save_steps)


class Launcher:
    """Launches one attempt at a time and watches it (see the module)."""

    def __init__(self, argv: list[str], options: RunOptions, ui: Reporter, conductor: Conductor, run_dir: Path,
                 group: Group | None, interrupts: Interrupts, *, sim_context: int | None, sized_by_nvml: bool) -> None:
        self.argv, self.o, self.ui, self.conductor = argv, options, ui, conductor
        self.run_dir, self.group, self.interrupts = run_dir, group, interrupts
        self.sim_context = sim_context  # the simulated device's memory outside its allocator
        self.sized_by_nvml = sized_by_nvml  # the device's size came from NVML: the training process's CUDA may differ
        self.here = whereabouts()  # a PID of the training processes names one of ours only where this matches
        user = allocconf.user_settings(os.environ)  # read from the variable torch reads
        self.user_expandable = bool(user.expandable_segments)
        self.user_max_split = user.max_split_size_mb
        self.checkpoint: str | None = None  # the newest checkpoint the run wrote
        self.checkpoint_knobs: Knobs | None = None  # the knobs of the run that wrote it
        self.output_dir: str | None = None
        self.warned_no_checkpoints = False
        self.group_failure: str | None = None  # why the group ended early (a node died), for the report
        self.warnings: list[str] = []  # one line each, said once and kept in the report
        self.broken: str | None = None  # the first patch of oomguard's that failed in the training process
        self.device: dict[str, Any] = {}  # what the training process measured about the device (event `device`)
        self.host_limit = host_limit()  # the host memory a training process may use, for its trace's host leaks
        self.trends_said: set[str] = set()  # the memory trace's live warnings said so far (each once)
        self.script_saves: int | None = None  # the script's own checkpoint cadence, in steps (TrainBegin)
        self.leak_held: str | None = None  # where a leak's memory is held, as the training process found it

    def warn(self, line: str | None) -> None:
        """Say ``line`` once, and keep it for the report."""
        if line and line not in self.warnings:
            self.warnings.append(line)
            self.ui.message(f"warning: {line}")

    def learn(self, events: list[ChildEvent]) -> None:
        """Hand what the training process reported to the conductor (``learning.take_events``)."""
        device = take_events(self.conductor, events, sized_by_nvml=self.sized_by_nvml, say=self.ui.message,
                             warn=self.warn)
        if device:
            self.device = device

    @property
    def max_attempts(self) -> int:
        return self.conductor.policy.max_attempts

    def launch(self, nxt: Next) -> Ended:
        """Run the attempt ``nxt`` names to its end and say how it ended (``classify``), for the conductor to record:
        this writes no record."""
        c, kind = self.conductor.climb, nxt.kind
        assert kind is not None
        index = len(c.attempts) + 1
        without = nxt.without if kind == AttemptKind.MINIMIZE else None
        knobs = c.effective(without)[0]
        adir = self.group.attempt_dir(index) if self.group else self.run_dir / f"attempt-{index}"
        adir.mkdir(parents=True, exist_ok=True)
        events_path = self.group.events_path(index) if self.group else adir / "events.jsonl"
        remedies = c.remedies_in_force(without)
        # A probe's output directory is oomguard's: made here, deleted when the attempt ends, whatever the ending (a
        # script that saves at its end writes a whole model there). The user's output_dir is never given to a probe.
        scratch = Path(tempfile.mkdtemp(prefix=PROBE_DIR_PREFIX)) if kind != AttemptKind.RUN else None
        # a probe unless the training process finds the memory model sure of the config: then it is the real run
        deferred = nxt.deferred
        probe = (ProbePlan(steps=self.conductor.probe_steps, output_dir=str(scratch), unless_sure=deferred)
                 if scratch is not None else None)
        resume = (resume_plan(self.checkpoint, self.checkpoint_knobs, knobs, c.climbed, self.output_dir, index)
                  if kind == AttemptKind.RUN else None)
        plan = Plan(attempt=index, overrides=c.overrides(knobs), pinned=c.pinned.to_dict(only_set=True),
                    simulate_gpu=self.o.simulate_gpu,
                    simulate_context=self.sim_context, gpu_memory=self.o.gpu_memory, crash_dir=str(adir),
                    events=str(events_path), remedies=remedies, probe=probe, resume=resume,
                    **self.conductor.judging(),
                    checkpoint_every=self._saves(nxt) if kind == AttemptKind.RUN or deferred else None,
                    trace=self.o.trace, host_limit=self.host_limit,
                    census_after=CENSUS_AFTER if self.conductor.leaks else None)
        self.ui.attempt_start(index, self.max_attempts, c.actions_in_force(without), plan.overrides,
                              AttemptKind.RUN if deferred else kind)
        if resume:
            self.ui.message(f"  {resume.mode}: {resume.why}")
        watch = Watch(kind, knobs, GroupTail(adir) if self.group else EventTail(events_path),
                      self.progress_state(index, kind, remedies), saves_set=plan.checkpoint_every)
        if self.group is not None:
            self.group.publish(index, {"kind": kind.value, "plan": plan.to_dict(), "actions":
                                       c.actions_in_force(without), "max_attempts": self.max_attempts,
                                       "alloc": self._alloc_options(knobs)})
        aside = Aside(lambda: (adir / STOPPED_MARK).exists(), adir / "after-stop.log")
        res = self.start(self._env(self.write_plan(adir, plan), knobs), watch, scratch, aside)
        if aside.lines:
            self.ui.message(f"  what the command printed after {aside.why} ({aside.lines} lines) is in {aside.path}")
        if self.group is not None:
            self._gather(index, res, watch)
        self.poll(watch, live=False)  # the last lines the process wrote
        events = watch.events
        self.learn(events)
        # The knobs as the child really ran them: the first attempt learns the user's config while it runs, and the
        # training process says what it runs (a value of oomguard's the script set again later, say)
        ran = knobs_ran(c.effective(without)[0], events)
        ended = classify(index, res, adir, events, ran, remedies, self.ui.message, self.host_limit, kind=watch.kind,
                         resume=to_fields(resume) if resume is not None else None, group_failure=self.group_failure)
        for e in (e for e in events if isinstance(e, PatchFailed)):
            self.warn(e.line())
            self.broken = self.broken or e.line()
        self._said_later(events, plan.overrides)
        return ended

    def _said_later(self, events: list[ChildEvent], overrides: dict[str, Any]) -> None:
        """A value oomguard set that the training process runs otherwise (the script sets it again later, a stack
        changes it): said once, since no rung can change it that way. (A replayed lock stops there instead:
        ``child/ran.py``.)"""
        ran = ran_report(events)
        if ran is None or ran.unmet:  # a replay that stopped for it said so itself
            return
        for knob, where in ran.later.items():
            self.warn(f"oomguard set {knob}={shown(overrides.get(knob))}, but the training process runs "
                      f"{shown(ran.knobs.get(knob))} ({where}): a rung that changes it cannot help this command")

    def start(self, env: dict[str, str], watch: Watch, scratch: Path | None,
               aside: Aside | None = None) -> ProcessResult:
        """Run the command once, watched; a command that cannot start is the user's to fix (one line, exit 127 or
        126); an error once it runs is oomguard's own (``run_attempt`` has ended the attempt's processes), raised on.
        A probe's scratch output directory goes whatever the ending: a script that saves its model at the end writes
        a whole copy of it there."""
        try:
            with self.ui.live():
                return run_attempt(self.argv, env, self.interrupts, grace=self.o.grace, echo=self.o.echo,
                                   on_tick=lambda: self._tick(watch), named=lambda: self._ours(watch),
                                   aside=aside)
        except StartError as start:
            e = start.error
            if isinstance(e, FileNotFoundError):
                raise UsageError(f"command not found: {self.argv[0]}", EXIT_NOT_FOUND) from None
            if isinstance(e, PermissionError):
                raise UsageError(f"permission denied: {self.argv[0]} is not executable", EXIT_NOT_EXECUTABLE) from None
            # ENOEXEC: a script without a #! line, a binary for another machine
            why = ("the kernel cannot run it (no #! line naming an interpreter, or a binary for another machine); "
                   f"add a #! line, or run it through its interpreter (`oomguard run -- bash {self.argv[0]}`)"
                   if e.errno == errno.ENOEXEC else e.strerror or str(e))
            raise UsageError(f"cannot execute {self.argv[0]}: {why}", EXIT_NOT_EXECUTABLE) from None
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    def _ours(self, w: Watch) -> list[int]:
        """The training processes of this attempt on this machine, as their events name them (ranks that a launcher
        started in sessions of their own among them): tracked so that none outlives the attempt."""
        # a node of a group reads every node's events; another node's PIDs are never this node's to end (nodes that
        # share a host, as in a test, name the same host), so it tracks its own process tree only
        if self.group is not None:
            return []
        return [e.pid for e in w.events if isinstance(e, ProcessStarted) and e.pid and e.where == self.here]

    def write_plan(self, adir: Path, plan: Plan | dict[str, Any]) -> Path:
        name = f"plan-node{self.group.m.node}.json" if self.group else "plan.json"
        return write_json_atomic(adir / name, plan if isinstance(plan, dict) else plan.to_dict())

    def _tick(self, w: Watch) -> int | None:
        """While an attempt runs: its events (``_watch``), and in a group, whether the group told this node to stop
        (SIGTERM, then SIGKILL after the grace)."""
        sig = self.poll(w)
        if self.group is None or sig is not None:
            return sig
        if w.trouble_at is None:
            why = self.group.trouble()
            if why is None:
                return None
            w.trouble_at = time.monotonic()
            self.group_failure = self.group.failure
            if self.group_failure is not None:
                self.group.fail(self.group_failure)  # every node ends with it (the first word stays)
            self.ui.message(f"stopping this node's command: {why}")
        return signal.SIGKILL if time.monotonic() - w.trouble_at > self.o.grace else signal.SIGTERM

    def _gather(self, index: int, res: Any, w: Watch) -> None:
        """Leader: wait for every node's command to end, and take their word (interrupts, host OOM kills) into
        ``res``; a node that falls silent ends the group."""
        assert self.group is not None
        try:
            for node, r in sorted(self.group.gather(index, tick=lambda: self.poll(w, live=False)).items()):
                res.interrupted = res.interrupted or r.get("interrupted")
                res.host_oom.extend(f"node {node}: {e}" for e in r.get("host_oom") or [])
                res.host_strong = res.host_strong or bool(r.get("host_strong"))
                res.survivors.extend(r.get("survivors") or [])
        except GroupError as e:
            self.group_failure = str(e)
            self.group.fail(str(e))

    def _env(self, plan_path: Path, knobs: Knobs) -> dict[str, str]:
        return self.env_with(plan_path, self._alloc_options(knobs))

    def _alloc_options(self, knobs: Knobs) -> dict[str, str]:
        """The allocator options oomguard adds to the user's own for ``knobs``."""
        return allocconf.added(knobs.expandable_segments, knobs.max_split_size_mb,
                               had_expandable=self.user_expandable, had_max_split=self.user_max_split)

    def env_with(self, plan_path: Path, alloc: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.o.extra_env)
        env[PLAN_ENV] = str(plan_path)
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + old if old else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.o.simulate_gpu:
            env[SIMULATE_ENV] = str(self.o.simulate_gpu)
        allocconf.merge(env, alloc)  # into the variable torch reads, keeping the user's other options
        return env

    def _probe_decided(self, w: Watch, ev: ProbeDecided) -> None:
        """The training process decided an attempt launched as a probe unless the memory model is sure: say which,
        and follow a real run as one (its checkpoints, the warning when it saves none)."""
        if ev.decided == "run":
            w.kind = AttemptKind.RUN
            w.progress.kind = AttemptKind.RUN.value
            self.ui.message(f"  {ev.why}: this launch is the real run, no probe first (--always-probe probes it)")
        else:
            w.progress.kind = AttemptKind.PROBE.value
            label = w.progress.label or ""
            if label.startswith("attempt "):  # named as the attempt it may have been: the end line names the probe
                w.progress.label = "probe " + label[len("attempt "):]
            self.ui.message(f"  {ev.why}: a {self.conductor.probe_steps}-step worst-case probe first")

    def progress_state(self, index: int, kind: AttemptKind, remedies: list[str]) -> Any:
        """The live view's state (the console reporter owns one; for others, --json-log, it is kept here)."""
        state = getattr(self.ui, "state", None)
        if state is not None:
            state.capacity = self.conductor.capacity
            return state
        from ..display.ui import Progress

        return Progress(index=index, max_attempts=self.max_attempts, kind=kind, remedies=remedies,
                        capacity=self.conductor.capacity)

    def _saves(self, nxt: Next) -> int | None:
        """The checkpoint cadence of a real run: a leak's restarts need one (unless the script already saves as
        often), else --checkpoint-every. The training process adds its checkpoints beside the script's own and
        deletes them again, all but the newest (child/saves.py)."""
        every = nxt.checkpoint_every
        if every is not None and self.script_saves is not None and self.script_saves <= every:
            every = None
        return every or self.o.checkpoint_every

    def _trend_said(self, ev: MemTrend) -> None:
        """What the memory trace says while the run goes on: a leak (with the step the device or the host is full at
        that rate) or fragmentation that grows, each sentence once; the first of each kind is kept for the report."""
        for v in ev.trend.get("verdicts") or []:
            text, kind = v.get("evidence"), v.get("kind")
            if not text or text in self.trends_said or kind == "long-sample":
                continue
            first = not any(said.split(":", 1)[0] == text.split(":", 1)[0] for said in self.trends_said)
            self.trends_said.add(text)
            if first:
                self.warn(f"while it runs: {text}")
            else:
                self.ui.message(f"  the memory trace now: {text}")

    def poll(self, w: Watch, live: bool = True) -> int | None:
        """While an attempt runs: follow its new events; end a group whose rank died of OOM but which hangs."""
        fresh = w.tail.poll()
        for ev in fresh:
            w.events.append(ev)
            w.progress.update(ev)
            w.ranks.add(ev)
            if isinstance(ev, ProbeDecided) and not w.decided:
                w.decided = True
                self._probe_decided(w, ev)
            if w.kind != AttemptKind.RUN:
                continue
            if isinstance(ev, TrainBegin):
                self.output_dir = ev.output_dir or self.output_dir
                if w.saves_set is None:  # the script's own cadence (oomguard set none): a leak's restarts keep it
                    self.script_saves = script_cadence(ev.save_strategy, ev.save_steps)
                if ("no" in ev.save_strategy.lower().split(".")[-1:] and not self.warned_no_checkpoints
                        and w.saves_set is None):  # oomguard's own cadence saves beside it
                    self.warned_no_checkpoints = True
                    self.ui.message("the script saves no checkpoints, so an OOM late in training restarts it from "
                                    "step 0; add --checkpoint-every N to lose at most N steps")
            elif isinstance(ev, MemTrend):
                self._trend_said(ev)
            elif isinstance(ev, MemHolders) and ev.holders:
                self.leak_held = held(tuple(Holder.from_dict(h) for h in ev.holders)).strip()
                self.ui.message(f"  where the leak is held: {self.leak_held}")
            elif isinstance(ev, CheckpointSaved) and ev.path:
                self.checkpoint, self.checkpoint_knobs = ev.path, w.knobs
        if fresh and live:
            self.ui.progress(w.progress)
        if w.decided_at is None and live and w.ranks.decided(alive=process_alive, here=self.here) is not None:
            w.decided_at = time.monotonic()
        if w.decided_at is not None:
            waited = time.monotonic() - w.decided_at
            if waited > self.o.oom_grace + self.o.grace:
                return signal.SIGKILL
            if waited > self.o.oom_grace:
                return signal.SIGTERM  # a rank's end decided the attempt; the others are stuck waiting for it
        return None
