"""The Supervisor: launch the user's command, watch it, and after an OOM let the climb choose the next config.

``Supervisor.run`` reads top to bottom like torchrun's elastic agent (``_invoke_run``): launch an attempt in a fresh
process group, classify how it ended, decide what comes next, stop. It is a plain loop rather than a tenacity
``Retrying``: what comes next is the climb's decision (probe, run, minimize trial, done), not a retry policy, and
there is nothing for tenacity to add (no waits, no exceptions to retry); the budget (``--max-attempts``,
``--max-time``) is one test at the top of the loop.

The supervisor never imports torch: everything it learns about the training process comes from the typed events of
the plan's events file, the CrashRecord, the exit status and the tail of the output. It owns no climbing state:
``Climb`` records attempts and chooses knobs; ``classify``, ``resume_plan``, ``Minimizer`` and ``conclude`` are the
other concerns, each in its own module.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..decide.choose import Choice
from ..decide.climb import Climb
from ..decide.experiment import Experiment, precision_warning
from ..decide.ladder import Exhausted, Ladder, Step, load_ladder
from ..memory.allocmodel import context_for
from ..memory.device import gpu_bf16, gpu_name, gpu_total_memory
from ..vocab import allocconf
from ..vocab.diagnosis import Diagnosis
from ..vocab.knobs import DS_SIZE_KNOBS, Knobs, RunFacts, reachable
from ..vocab.protocol import EXIT_OOM, PLAN_ENV, SIMULATE_ENV, Plan, whereabouts
from ..vocab.records import (
    Attempt,
    AttemptKind,
    CheckpointSaved,
    ChildEvent,
    CodeSeen,
    ConfigGenerated,
    DatasetSeen,
    EventTail,
    ModelSeen,
    OtherEvent,
    Outcome,
    OverrideFailed,
    PatchFailed,
    ProcessStarted,
    RunReport,
    TrainBegin,
    now_iso,
    publish,
    write_json_atomic,
)
from ..vocab.schema import LOCK_SCHEMA
from ..vocab.sizes import format_size
from ..vocab.trlrange import Support, head_of, support
from .classify import classify
from .command import (
    EXIT_BUG,
    EXIT_EXHAUSTED,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    UsageError,
    load_lock,
    resolve_command,
)
from .follower import follow
from .group import Group, GroupError, GroupTail, Membership
from .launch import MULTI_GPU, facts_reason
from .minimize import Minimizer
from .proc import Interrupts, ProcessResult, become_subreaper, process_alive, run_attempt
from .resume import resume_plan
from .verdict import conclude
from .watch import PROBE_DIR_PREFIX, Watch

BOOT_DIR = Path(__file__).resolve().parents[1] / "child" / "_boot"
# The real run can allocate a little more than its probe (the last step's logging, the final save, evaluation, which
# the probe leaves out): 0.7% was measured on a TRL-docs client. A probe's peak counts this much higher when the
# memory model learns from it, so choices after a probe keep that room.
PROBE_TAIL = 0.01
# The cost classes whose changes a default run probes without, when the model cannot rule out that they are not needed:
# what is trained and what GRPO learns from. A speed or precision change stays unless --minimize proves it.
UNDO_BY_DEFAULT = ("capacity", "signal")


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
    replay: dict[str, Any] | None = None  # a lock file's content: replay it without climbing
    grace: float = 20.0
    echo: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    predict: bool = True  # let the memory model choose (ceiling, drops, relaxed graded knobs)
    probe_steps: int = 2  # a short worst-case probe before the real run (0: none)
    minimize: bool = False  # once the choice's probe fits, prove each rung needed with probes
    refine: bool = True  # once a probe fits: choose again with what it measured, probe changes the model is unsure of
    checkpoint_every: int | None = None  # make the script save every N steps, so a late OOM loses at most N
    oom_grace: float = 10.0  # after a rank's end decides the attempt (an OOM, a pre-flight stop, a failure, a death),
    # how long the others may take to stop before oomguard stops them
    capacity: int | None = None  # the device size, for predictions (else --simulate-gpu, --gpu-memory or NVML)
    html_path: Path | None = None  # also write a self-contained HTML report
    preflight: bool = True  # stop a config predicted too far over the device before it loads or generates
    preflight_margin: float | None = None  # how far over; None: the memory model's measured error (Guide.stop_margin)
    membership: Membership | None = None  # this node's place in a job on several nodes (oomguard.group)
    trl: Support | None = None  # the command's TRL as read before launching (run.command.trl_support), if readable
    # --ladder was not given: a run the training process reports distributed takes the multi-gpu ladder
    ladder_auto: bool = False
    ladder_reason: str | None = None  # why the command itself picked the multi-gpu ladder (run.launch)


class Supervisor:
    def __init__(self, argv: list[str], options: RunOptions, reporter: Reporter) -> None:
        self.argv = argv
        self.o = options
        self.ui = reporter
        self.run_dir = options.workdir / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.interrupts = Interrupts()
        self.here = whereabouts()  # a PID of the training processes names one of ours only where this matches
        self.reached: set[str] = set()  # construction points the command passed through (config, trainer, model)
        user = allocconf.user_settings(os.environ)  # read from the variable torch reads
        self.user_expandable = bool(user.expandable_segments)
        self.user_max_split = user.max_split_size_mb
        self.climb = Climb(
            options.ladder,
            pinned=Knobs.from_dict((options.replay or {}).get("overrides") or {}),
            env_knobs={"expandable_segments": self.user_expandable, "max_split_size_mb": self.user_max_split},
            facts=RunFacts(alloc_conf_locked=user.locked_text(),
                           bf16_supported=None if options.simulate_gpu else gpu_bf16()),
        )
        self.capacity = options.capacity or options.simulate_gpu or options.gpu_memory or gpu_total_memory()
        self.sized_by_nvml = not (options.capacity or options.simulate_gpu or options.gpu_memory)
        simulated = bool(options.simulate_gpu)
        self.sim_context = (context_for(options.simulate_gpu, options.simulate_context) if simulated else None)
        self.device: dict[str, Any] = {}  # what the training process measured about the device (event `device`)
        self.guide: Any = None  # the memory model (decide.plan.Guide), loaded only where it can judge: a known size
        if options.predict and self.capacity:
            from ..decide.plan import Guide

            self.guide = Guide(self.capacity, simulated=simulated, context=self.sim_context,
                               device_name=None if simulated else gpu_name(), warn=reporter.message)
        self.trl_seen: tuple[str, str | None] | None = None  # the TRL (version, reported head) the guide models
        self._take_trl(options.trl.version if options.trl else None, None)
        self.minimizer = Minimizer()
        self.newly: list[str] = []  # rungs the last choice put in force (taken back if their overrides break)
        self.last_diag: Diagnosis | None = None  # the OOM the climb last answered
        self.checkpoint: str | None = None  # the newest checkpoint the run wrote
        self.checkpoint_knobs: Knobs | None = None  # the knobs of the run that wrote it
        self.output_dir: str | None = None
        self.warned_no_checkpoints = False
        self.group = Group(options.membership) if options.membership else None
        self.store_sync: Any = None  # the helper that mirrors the group's directory (oomguard.rendezvous)
        self.group_failure: str | None = None  # why the group ended early (a node died), for the report
        self.warnings: list[str] = []  # one line each, said once and kept in the report
        self.broken: str | None = None  # the first patch of oomguard's that failed in the training process

    def _open_group(self) -> None:
        """Form the group of a job's nodes before the first launch (oomguard.group): through torchrun's rendezvous
        host where the command has one and no directory was named (oomguard.rendezvous), else in the directory."""
        assert self.group is not None
        m = self.group.m
        self.group.notice = self.ui.message
        role = "leads: it decides every attempt" if m.leader else "follows node 0, which decides every attempt"
        where = f"in {self.group.base}"
        if m.store is not None:
            from .rendezvous import StoreSync, training_python

            sync = StoreSync(m, training_python(self.argv))
            try:
                sync.start()
            except GroupError as e:
                self.ui.message(f"cannot meet through torchrun's rendezvous host ({e}): the group meets in "
                                f"{self.group.base} instead, which every node must see (--group DIR)")
            else:
                self.store_sync = sync
                self.group.via = sync.endpoint
                self.group.tick = sync.poll
                where = (f"through a store at {sync.endpoint}, torchrun's rendezvous host (this node "
                         f"{'hosts it' if sync.role == 'host' else 'reaches it' if sync.role else 'waits for it'}), "
                         f"mirroring {self.group.base}")
        self.ui.message(f"node {m.node} of {m.nodes} ({m.source}); this node {role}; the group meets {where}")
        try:
            self.group.open()
            if m.leader:
                self.group.assemble()
        except GroupError as e:
            if self.store_sync is not None:
                self.store_sync.close(wait=5)
            raise UsageError(str(e), 1) from None

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Launch, classify, decide, until the climb says done or the budget is spent; then write the report."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        become_subreaper()  # orphaned ranks come back to this process, where the attempt's sweep finds them
        if self.o.ladder_reason:
            self._ladder_line(self.o.ladder_reason)
        if self.group is None:
            return self._lead()
        self._open_group()
        try:
            if not self.group.m.leader:
                return follow(self)
            return self._lead()
        except BaseException as e:  # the others must not wait for a node that has left
            self.group.fail(f"node {self.group.m.node} ended with an error: {e}")
            raise
        finally:
            self.group.done()
            if self.store_sync is not None:  # its last files reach the other nodes before this one leaves
                self.store_sync.close()

    def _lead(self) -> int:
        kind: AttemptKind | None = AttemptKind.PROBE if self.o.probe_steps > 0 else AttemptKind.RUN
        last: Attempt | None = None
        with self.interrupts:
            try:
                while kind is not None and (last is None or not self._budget_spent()):
                    last, diag = self._launch(kind)
                    self.climb.record(last)
                    self.ui.attempt_end(last, diag)
                    kind = self._decide(last, diag)
            except KeyboardInterrupt:
                self.interrupts.signum = self.interrupts.signum or 2
        return self._finish(last)

    def _budget_spent(self) -> bool:
        """--max-attempts (minimize trials are extra work the user asked for: they do not count) or --max-time."""
        counted = sum(1 for a in self.climb.attempts if a.kind != AttemptKind.MINIMIZE)
        late = self.o.max_time is not None and time.time() - self.climb.started >= self.o.max_time
        return counted >= self.o.max_attempts or late

    # -- one attempt -------------------------------------------------------------------------------------------
    def _launch(self, kind: AttemptKind) -> tuple[Attempt, Diagnosis | None]:
        """Run one attempt of ``kind`` to its end and return its record and, for an OOM, its diagnosis."""
        c = self.climb
        index = len(c.attempts) + 1
        without = self.minimizer.trial if kind == AttemptKind.MINIMIZE else None
        knobs = c.effective(without)[0]
        adir = self.group.attempt_dir(index) if self.group else self.run_dir / f"attempt-{index}"
        adir.mkdir(parents=True, exist_ok=True)
        events_path = self.group.events_path(index) if self.group else adir / "events.jsonl"
        remedies = c.remedies_in_force(without)
        # A probe's output directory is oomguard's: made here, deleted when the attempt ends, whatever the ending (a
        # script that saves at its end writes a whole model there). The user's output_dir is never given to a probe.
        scratch = Path(tempfile.mkdtemp(prefix=PROBE_DIR_PREFIX)) if kind != AttemptKind.RUN else None
        probe = ({"steps": self.o.probe_steps, "rows": 64, "output_dir": str(scratch)} if scratch is not None
                 else None)
        resume = (resume_plan(self.checkpoint, self.checkpoint_knobs, knobs, c.climbed, self.output_dir, index)
                  if kind == AttemptKind.RUN else None)
        plan = Plan(attempt=index, overrides=c.overrides(knobs), simulate_gpu=self.o.simulate_gpu,
                    simulate_context=self.sim_context, gpu_memory=self.o.gpu_memory, crash_dir=str(adir), events=str(events_path),
                    remedies=remedies, probe=probe, resume=resume, preflight=self._preflight(),
                    checkpoint_every=self.o.checkpoint_every if kind == AttemptKind.RUN else None)
        self.ui.attempt_start(index, self.o.max_attempts, c.actions_in_force(without), plan.overrides, kind)
        if resume:
            self.ui.message(f"  {resume['mode']}: {resume['why']}")
        watch = Watch(kind, knobs, GroupTail(adir) if self.group else EventTail(events_path),
                       self._progress_state(index, kind, remedies))
        if self.group is not None:
            self.group.publish(index, {"kind": kind.value, "plan": plan.to_dict(), "actions":
                                       c.actions_in_force(without), "max_attempts": self.o.max_attempts,
                                       "alloc": self._alloc_options(knobs)})
        res = self._start(self._env(self._write_plan(adir, plan), knobs), watch, scratch)
        if self.group is not None:
            self._gather(index, res, watch)
        self._watch(watch, live=False)  # the last lines the process wrote
        events = watch.events
        self._learn(events)
        attempt, diag = classify(index, res, adir, events, knobs, remedies, self.ui.message)
        attempt.kind, attempt.resume = kind, resume
        if self.group_failure is not None:
            attempt.outcome, attempt.note = Outcome.FAILED, self.group_failure
            attempt.exit_code = attempt.exit_code or 1
        for g in (e for e in events if isinstance(e, ConfigGenerated)):
            attempt.generated = {**(attempt.generated or {}),
                                 g.kind: {"path": g.path, "config": g.config, "replaces": g.replaces}}
        broken = [e for e in events if isinstance(e, PatchFailed)]
        for e in broken:
            self._warn(e.line())
            self.broken = self.broken or e.line()
        if kind != AttemptKind.RUN and not any(isinstance(e, CodeSeen) and e.point == "config" for e in events):
            attempt.kind = AttemptKind.RUN  # no GRPOConfig to shorten: the "probe" was the whole command
            if broken:
                attempt.note = broken[0].line()
            elif attempt.outcome != Outcome.FAILED:
                attempt.note = "the command builds no GRPOConfig, so it ran in full instead of as a short probe"
            elif not attempt.note:  # what a training process said of its failure stays the reason
                attempt.note = "it failed before it built a GRPOConfig (its own output above says why)"
        # The knobs as the child really ran them: the first attempt learns the user's config while it runs.
        attempt.knobs = c.effective(without)[0].to_dict()
        broke = next((e for e in events if isinstance(e, OverrideFailed)), None)
        if attempt.outcome == Outcome.FAILED and broke is not None:
            attempt.override_error = {"where": broke.where, "error": broke.error}
        self._teach_guide(attempt, diag)
        return attempt, diag

    def _start(self, env: dict[str, str], watch: Watch, scratch: Path | None) -> ProcessResult:
        """Run the command once, watched; a command that cannot start is the user's to fix (one line, exit 127 or
        126). A probe's scratch output directory goes whatever the ending: a script that saves its model at the end
        writes a whole copy of it there."""
        try:
            with self.ui.live():
                return run_attempt(self.argv, env, self.interrupts, grace=self.o.grace, echo=self.o.echo,
                                   on_tick=lambda: self._tick(watch), named=lambda: self._ours(watch))
        except FileNotFoundError:
            raise UsageError(f"command not found: {self.argv[0]}", EXIT_NOT_FOUND) from None
        except PermissionError:
            raise UsageError(f"permission denied: {self.argv[0]} is not executable", EXIT_NOT_EXECUTABLE) from None
        except OSError as e:  # ENOEXEC: a script without a #! line, a binary for another machine
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
        return [e.pid for e in w.events if isinstance(e, ProcessStarted) and e.pid and e.where == self.here]

    def _write_plan(self, adir: Path, plan: Plan | dict[str, Any]) -> Path:
        name = f"plan-node{self.group.m.node}.json" if self.group else "plan.json"
        return write_json_atomic(adir / name, plan if isinstance(plan, dict) else plan.to_dict())

    def _tick(self, w: Watch) -> int | None:
        """While an attempt runs: its events (``_watch``), and in a group, whether the group told this node to stop
        (SIGTERM, then SIGKILL after the grace)."""
        sig = self._watch(w)
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
            for node, r in sorted(self.group.gather(index, tick=lambda: self._watch(w, live=False)).items()):
                res.interrupted = res.interrupted or r.get("interrupted")
                res.host_oom.extend(f"node {node}: {e}" for e in r.get("host_oom") or [])
                res.host_strong = res.host_strong or bool(r.get("host_strong"))
                res.survivors.extend(r.get("survivors") or [])
        except GroupError as e:
            self.group_failure = str(e)
            self.group.fail(str(e))

    def _env(self, plan_path: Path, knobs: Knobs) -> dict[str, str]:
        return self._env_with(plan_path, self._alloc_options(knobs))

    def _alloc_options(self, knobs: Knobs) -> dict[str, str]:
        """The allocator options oomguard adds to the user's own for ``knobs``."""
        return allocconf.added(knobs.expandable_segments, knobs.max_split_size_mb,
                               had_expandable=self.user_expandable, had_max_split=self.user_max_split)

    def _env_with(self, plan_path: Path, alloc: dict[str, str]) -> dict[str, str]:
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

    def _preflight(self) -> dict[str, Any] | None:
        """What the training process needs to stop a config the model is sure cannot fit (child/preflight.py)."""
        if self.guide is None or not self.o.preflight or self.o.replay:
            return None
        margin, source = self._stop_margin()
        # one margin per LM head and for a TRL newer than tested: the training process takes the one of the TRL it
        # finds (the supervisor may not see the command's environment); --preflight-margin sets the one margin
        margins = self.guide.stop_margins() if self.o.preflight_margin is None else None
        return {"capacity": self.capacity, "margin": margin, "margin_source": source,
                **({"margins": margins} if margins else {}),
                "simulated": self.guide.simulated, "context": self.guide.context,
                "coefficients": dataclasses.asdict(self.guide.coefficients)}

    def _stop_margin(self) -> tuple[float, str]:
        """The pre-flight's margin: --preflight-margin, else the memory model's measured error."""
        if self.o.preflight_margin is not None:
            return self.o.preflight_margin, "--preflight-margin"
        assert self.guide is not None
        return self.guide.stop_margin()

    def _progress_state(self, index: int, kind: AttemptKind, remedies: list[str]) -> Any:
        """The live view's state (the console reporter owns one; for others, --json-log, it is kept here)."""
        state = getattr(self.ui, "state", None)
        if state is not None:
            state.capacity = self.capacity
            return state
        from ..display.ui import Progress

        return Progress(index=index, max_attempts=self.o.max_attempts, kind=kind, remedies=remedies,
                        capacity=self.capacity)

    def _watch(self, w: Watch, live: bool = True) -> int | None:
        """While an attempt runs: follow its new events; end a group whose rank died of OOM but which hangs."""
        fresh = w.tail.poll()
        for ev in fresh:
            w.events.append(ev)
            w.progress.update(ev)
            w.ranks.add(ev)
            if w.kind != AttemptKind.RUN:
                continue
            if isinstance(ev, TrainBegin):
                self.output_dir = ev.output_dir or self.output_dir
                if "no" in ev.save_strategy.lower().split(".")[-1:] and not self.warned_no_checkpoints:
                    self.warned_no_checkpoints = True
                    self.ui.message("the script saves no checkpoints, so an OOM late in training restarts it from "
                                    "step 0; add --checkpoint-every N to lose at most N steps")
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

    def _learn(self, events: list[ChildEvent]) -> None:
        """Take what the training process reported: the script's own values (first report wins), and facts."""
        c = self.climb
        facts = c.facts
        for ev in events:
            if isinstance(ev, CodeSeen):
                self.reached.add(ev.point)
                c.observe(ev.observed)
                facts = facts.replace(**{k: v for k, v in ev.facts.items() if k in RunFacts.__dataclass_fields__})
                if ev.world_size:
                    facts = facts.replace(world_size=ev.world_size)
            elif isinstance(ev, DatasetSeen):
                facts = facts.replace(prompt_tokens_max=ev.prompt_tokens_max or facts.prompt_tokens_max,
                                      prompt_tokens_p95=ev.prompt_tokens_p95 or facts.prompt_tokens_p95,
                                      dataset_rows=ev.rows or facts.dataset_rows)
            elif isinstance(ev, ModelSeen):
                self.reached.update(("model", *ev.reaches))  # before a load: points the script passes after it
                facts = facts.replace(model_config=ev.config or facts.model_config)
            elif isinstance(ev, OtherEvent) and ev.name == "device" and ev.data.get("context_bytes"):
                self.device = {k: ev.data.get(k) for k in ("context_bytes", "measured_bytes", "how",
                                                           "allocator_bytes", "final")}
                if self.guide is not None and ev.data.get("final"):  # --gpu-memory: the context really held
                    self.guide.set_context(int(ev.data["context_bytes"]))
        c.learn(facts)
        self._take_device(facts.device_total)
        if facts.bf16_moving is not None:  # measured on the loaded weights: the user's own config may not learn
            self._warn(precision_warning(c.original(), facts))
        self._take_trl(facts.trl_version, facts.trl_head)
        if self.o.ladder_auto and c.ladder.name != MULTI_GPU and not c.climbed and (why := facts_reason(facts)):
            c.ladder = load_ladder(MULTI_GPU)  # before the first decision: nothing was climbed on the other ladder
            self._ladder_line(why)

    def _take_device(self, total: int | None) -> None:
        """The size of the device the training process computes on, as CUDA reports it there: where the size came
        from NVML and differs (a device order or a MIG layout NVML could not resolve), it is the one judged."""
        if not total or not self.sized_by_nvml or total == self.capacity:
            return
        old, self.capacity = self.capacity, total
        if self.guide is not None:
            self.guide.capacity = total
        self.ui.message(f"the training process sees a device of {format_size(total)}"
                        + (f", not the {format_size(old)} NVML reported" if old else "")
                        + ": predictions use its size from now on")

    def _warn(self, line: str | None) -> None:
        """Say ``line`` once, and keep it for the report."""
        if line and line not in self.warnings:
            self.warnings.append(line)
            self.ui.message(f"warning: {line}")

    def _take_trl(self, version: str | None, head: str | None) -> None:
        """The command's TRL, read before launching or reported by the training process: a release newer than the
        tested ones gets one line, and a probe verifies its first choice even under --no-probe; the guide models its
        LM head (the reported one, else the one its release is known to have) and its measured error."""
        if version is None or (version, head) == self.trl_seen:
            return
        s = support(version)
        if s.untested and (self.trl_seen is None or self.trl_seen[0] != version):
            self.ui.message(str(s.message))
            if self.o.probe_steps <= 0 and not self.o.replay:
                self.o.probe_steps = 2
        self.trl_seen = (version, head)
        if self.guide is not None:
            self.guide.set_trl(head or head_of(version), s.untested)

    def _ladder_line(self, why: str) -> None:
        """One line: the ladder oomguard picked by itself, and why."""
        self.ui.message(f"ladder {MULTI_GPU}: {why}, so the rungs that only apply to distributed runs (DeepSpeed's "
                        "buffers, ZeRO stages, offload) come before any trade of quality; --ladder NAME picks another")

    def _teach_guide(self, attempt: Attempt, diag: Diagnosis | None) -> None:
        """The memory model's prediction for the attempt, and what it learns from it (online, and across runs)."""
        if self.guide is None:
            return
        c = self.climb
        knobs = Knobs.from_dict(attempt.knobs)
        est = self.guide.predict(c.facts, knobs)
        if attempt.outcome != Outcome.PREDICTED:  # a stop keeps the figure it was stopped on (a load, perhaps)
            attempt.predicted_bytes = est.peak_bytes if est else None
        # a success teaches the steady state only once an optimizer step has run with its state in place
        if attempt.outcome == Outcome.OK and (attempt.step or 0) < 2:
            return
        peak = attempt.peak_bytes
        if peak and attempt.kind != AttemptKind.RUN:
            peak = int(peak * (1 + PROBE_TAIL))
        self.guide.learn(c.facts, knobs, attempt.outcome, peak, diag.report if diag else None)
        if attempt.outcome == Outcome.OK and attempt.kind == AttemptKind.RUN:  # what this machine teaches later runs
            self.guide.record(c.facts, knobs, attempt.peak_bytes, attempt.peak_reserved_bytes)

    # -- what comes next ---------------------------------------------------------------------------------------
    def _decide(self, attempt: Attempt, diag: Diagnosis | None) -> AttemptKind | None:
        """The kind of the next attempt, or None when the run is done."""
        c = self.climb
        if self.interrupts.signum or attempt.outcome == Outcome.INTERRUPTED:
            return None
        if attempt.outcome != Outcome.FAILED:
            self.newly = []  # the rungs in force launched: a later failure is not theirs
        if c.settle_rechoice(attempt.outcome == Outcome.OK) and attempt.outcome != Outcome.OK:
            # the config chosen again after a probe fit did not hold: back to that one, which needs no new probe
            attempt.note = "the config chosen again did not hold: back to the config the probe before showed to fit"
            self.ui.message(f"  {attempt.note}")
            return self._after_fit(attempt)
        if attempt.outcome == Outcome.FAILED:
            if attempt.override_error is not None and self.newly and not self.o.replay:
                return self._take_back(attempt, attempt.override_error)
            return None
        if attempt.kind == AttemptKind.MINIMIZE:
            attempt.note = self.minimizer.settle(c, attempt.outcome == Outcome.OK)
            return self._after_fit(attempt)
        if attempt.outcome == Outcome.OK:
            if attempt.kind == AttemptKind.RUN:
                return None
            return self._after_fit(attempt)
        # out of memory, or stopped by the pre-flight check
        if self.o.replay:
            self.ui.decision([], c.give_up("lock", "a locked config is replayed without climbing"), {})
            return None
        self.last_diag = diag
        return self._choose(attempt, diag)

    def _after_fit(self, attempt: Attempt) -> AttemptKind:
        """After a probe fits (or an undo trial settles): a config the user prefers that the model, calibrated by
        what the probe measured, now predicts to fit (probed next); else the next undo trial (every rung with
        ``--minimize``; by default those whose removal the model is unsure of); else the real run."""
        c = self.climb
        guide = self.guide if self.o.refine else None
        if guide is not None and self._room_for(2) and (fits := guide.fits(c.facts)) is not None:
            choice = c.rechoose(fits, guide.peak(c.facts), guide.fits(c.facts, guide.relax_margin))
            if choice is not None:
                attempt.choice = {**choice.to_dict(), "after": "probe"}
                self.ui.message("  re-chose with what the probe measured: a config closer to yours is predicted "
                                "to fit")
                for line in self._explain(choice):
                    self.ui.message(line)
                return AttemptKind.PROBE
        # a change the model is unsure of, but not so unsure that the pre-flight check would stop the trial
        doubt = None if guide is None else min(guide.doubt, self._stop_margin()[0]) if self.o.preflight else guide.doubt
        worth = guide.plausible(c.facts, doubt) if guide is not None else None
        if not self.minimizer.started and c.applied and (self.o.minimize or worth is not None):
            # by default only what changes the experiment is worth a launch to undo; --minimize tries every change
            self.minimizer.start(c, None if self.o.minimize else UNDO_BY_DEFAULT)
        if (self.minimizer.started and self._room_for(2, counted=False)
                and (name := self.minimizer.next_trial(c, None if self.o.minimize else worth))):
            why = ("--minimize" if self.o.minimize
                   else "predicted just over the device without it, within the model's error")
            self.ui.message(f"  is {name} needed? one probe without it ({why})")
            return AttemptKind.MINIMIZE
        return AttemptKind.RUN

    def _room_for(self, attempts: int, counted: bool = True) -> bool:
        """Whether the budget leaves room for this many more attempts, so that an optional probe never takes the
        real run's place: --max-attempts (for attempts it counts), and --max-time by the longest attempt so far."""
        c = self.climb
        if counted and sum(1 for a in c.attempts if a.kind != AttemptKind.MINIMIZE) + attempts > self.o.max_attempts:
            return False
        if self.o.max_time is not None:
            longest = max((a.seconds for a in c.attempts), default=0.0)
            return time.time() - c.started + (attempts - 1) * longest < self.o.max_time
        return True

    def _take_back(self, attempt: Attempt, err: dict[str, Any]) -> AttemptKind | None:
        """oomguard's own overrides broke the launch (a rung GRPO or PEFT rejects): take the rung back, go on."""
        why = f"applying it failed in {err.get('where')}: {err.get('error')}"
        names, self.newly = self.newly, []
        self.climb.take_back(names, why)
        attempt.note = f"oomguard's overrides broke the launch, not the script: took back {', '.join(names)}"
        self.ui.message(f"  took back {', '.join(names)}: {why}")
        return self._choose(attempt, self.last_diag)

    def _choose(self, attempt: Attempt, diag: Diagnosis | None) -> AttemptKind | None:
        """Let the climb choose the next config, and say what it chose and why."""
        c = self.climb
        before = set(c.remedies_in_force())
        fits = self.guide.fits(c.facts) if self.guide is not None else None
        peak = self.guide.peak(c.facts) if self.guide is not None else None
        relax = self.guide.fits(c.facts, self.guide.relax_margin) if self.guide is not None else None
        decision = c.choose_next(diag, reachable(self.reached), fits=fits, peak=peak, relax_fits=relax)
        attempt.climbed, attempt.skipped = decision.label(), decision.skipped_rows()
        if decision.exhausted is not None:
            self.ui.decision([], decision.exhausted, {})
            return None
        attempt.choice = decision.choice.to_dict() if decision.choice is not None else None
        self.newly = [n for n in c.remedies_in_force() if n not in before]
        self.ui.decision(decision.steps, None, decision.changes, attempt.skipped)
        if decision.choice is not None:
            for line in self._explain(decision.choice):
                self.ui.message(line)
        if self.o.probe_steps <= 0:
            return AttemptKind.RUN
        if c.effective()[0] in c.verified:  # a probe already ran this config: no second probe
            self.ui.message("  back to a config a probe already showed to fit")
            return self._after_fit(attempt)
        return AttemptKind.PROBE

    def _explain(self, ch: Choice) -> list[str]:
        """One line per rung dropped and per graded knob relaxed by the choice, with the prediction behind it."""
        cap = format_size(self.capacity) if self.capacity else "the device"
        lines = []
        if ch.dropped:
            peak = next(iter(ch.explain.values()), {}).get("predicted_bytes_without")
            them = "it" if len(ch.dropped) == 1 else "them"
            why = f"predicted peak without {them} {format_size(peak)} of {cap}" if peak else "predicted to fit"
            from ..decide.plan import Guide  # loaded already where a guide judges

            if self.guide is not None and Guide.load_only(self.climb.facts):
                why = (f"loading the model without {them} is predicted to fit {cap}; the training step is judged "
                       "once GRPOTrainer is built")
            lines.append(f"  not needed: {', '.join(ch.dropped)} ({why})")
        for knob, climbed, chosen in ch.relaxed:
            lines.append(f"  relaxed {knob}: {climbed} → {chosen}, the value closest to yours predicted to fit")
        return lines

    # -- the end -----------------------------------------------------------------------------------------------
    def _finish(self, last: Attempt | None) -> int:
        c = self.climb
        status, code, message = conclude(last, c, signum=self.interrupts.signum, replay=self.o.replay,
                                         reached=bool(self.reached), max_attempts=self.o.max_attempts,
                                         max_time=self.o.max_time, broken=self.broken)
        if self.group_failure is not None and status == "failed":
            message = self.group_failure
        report = c.report(status, message, code, command=self.argv,
                          device={"simulate_gpu": self.o.simulate_gpu, "simulate_context": self.sim_context,
                                  "gpu_memory": self.o.gpu_memory, "capacity": self.capacity,
                                  **({"context": self.device} if self.device else {}),
                                  **({"preflight_margin": self._stop_margin()[0],
                                      "preflight_margin_source": self._stop_margin()[1]}
                                     if self.guide is not None and self.o.preflight else {}),
                                  **({"calibration": self.guide.describe()} if self.guide is not None else {})})
        if last is not None and last.generated:
            who = {r["knob"]: r["remedy"] for r in report.diff}
            for kind, g in last.generated.items():
                report.diff.append({"knob": f"{kind} config", "from": g.get("replaces"), "to": g.get("path"),
                                    "remedy": next((who[k] for k in ("zero_stage", "offload_optimizer",
                                                                     "offload_params", *DS_SIZE_KNOBS) if who.get(k)),
                                                   None)})
        if status == "stable":
            final = Knobs.from_dict(report.attempts[-1].knobs)
            try:  # a help to the user: it must never cost the stable run its report and lock
                report.experiment = self._experiment(final).to_dict()
                report.alternatives = [a.to_dict() for a in self._alternatives(final)]
            except Exception as e:
                self.ui.message(f"could not work out alternatives to the stable config ({type(e).__name__}: {e})")
        if self.group is not None:
            report.group = self._group_info()
        report.warnings = list(self.warnings)
        lock_path = self._write_outputs(report, status)
        if self.group is not None:
            lock = (self._lock_data(Knobs.from_dict(report.attempts[-1].knobs), report.original, report.stable,
                                    report.diff) if lock_path is not None else None)
            self.group.finish({"status": status, "exit_code": code, "report": report.to_dict(), "lock": lock})
        self.ui.finish(report, self.o.report_path, lock_path)
        return code

    def _group_info(self) -> dict[str, Any]:
        assert self.group is not None
        m = self.group.m
        return {"node": m.node, "nodes": m.nodes, "leader": 0, "session": str(self.group.session),
                "source": m.source}

    def _experiment(self, final: Knobs) -> Experiment:
        """What the stable config kept of the user's experiment and what it changed, in cost classes, with the
        predicted time of each speed change (oomguard.decide.experiment)."""
        c = self.climb
        return c.experiment(final, self.guide.slowdown(c.facts) if self.guide is not None else None)

    def _alternatives(self, final: Knobs) -> list[Any]:
        """Configs predicted to fit, with the model's error as headroom, that trade differently from ``final``
        (oomguard.decide.alternatives), each written as a lock in the run's directory so that one flag runs it."""
        c = self.climb
        guide = self.guide
        if guide is None or self.o.replay or (fits := guide.fits(c.facts, guide.relax_margin)) is None:
            return []
        from ..decide.alternatives import alternatives

        alts = alternatives(c.original(), final, c.applied, c.facts, fits, guide.peak(c.facts), ladder=self.o.ladder,
                            skip=tuple(c.refused), slowdown=guide.slowdown(c.facts))
        for n, a in enumerate(alts, 1):
            path = self.run_dir / f"alternative-{n}.lock.json"
            write_json_atomic(path, self._lock_data(a.knobs, c.original().to_dict(), a.knobs.to_dict(),
                                                    [{**r.to_dict(), "remedy": None} for r in c.original().diff(
                                                        a.knobs)]))
            alts[n - 1] = dataclasses.replace(a, lock=str(path))
        return alts

    def _lock_data(self, knobs: Knobs, original: dict[str, Any], stable: dict[str, Any] | None,
                   diff: list[dict[str, Any]]) -> dict[str, Any]:
        return {"schema": LOCK_SCHEMA, "created": now_iso(), "command": self.argv, "ladder": self.o.ladder.name,
                "overrides": self.climb.overrides(knobs), "original": original, "stable": stable,
                "world_size": self.climb.facts.world_size, "diff": diff}

    def _write_outputs(self, report: RunReport, status: str) -> Path | None:
        """The report (and HTML), and the lock when stable. Each run keeps its own copies; the top-level files are
        copies of the latest, and an older one that no run keeps is kept aside first."""
        c = self.climb
        kept = self.o.workdir / "kept"
        aside = publish(report.to_dict(), self.run_dir / "report.json", self.o.report_path, kept)
        if self.o.html_path:
            from ..display.html import write_run_html

            breakdown = None
            if self.guide is not None and report.attempts:
                est = self.guide.predict(c.facts, Knobs.from_dict(report.attempts[-1].knobs))
                breakdown = dict(est.breakdown) if est else None
            write_run_html(self.o.html_path, report.to_dict(), breakdown)
        lock_path: Path | None = None
        if status == "stable":
            lock_path = self.o.lock_path
            final = Knobs.from_dict(report.attempts[-1].knobs)
            lock_aside = publish(self._lock_data(final, report.original, report.stable, report.diff),
                                 self.run_dir / "lock.json", lock_path, kept)
            aside = aside or lock_aside
        if aside is not None:
            self.ui.message(f"an older report or lock (not kept by any run) was kept aside in {kept}/ before the new "
                            "one replaced it")
        return lock_path


__all__ = ["EXIT_BUG", "EXIT_EXHAUSTED", "EXIT_NOT_EXECUTABLE", "EXIT_NOT_FOUND", "EXIT_OOM", "RunOptions",
           "Supervisor", "UsageError", "load_lock", "resolve_command"]
