"""The Supervisor: launch the user's command, watch it, and on OOM climb the ladder and relaunch.

It reads top to bottom like torchrun's elastic agent: prepare a plan, launch the attempt in a fresh process group,
classify how it ended, and on an OOM diagnose it and take the next rung. tenacity decides when to stop (attempts,
time). The supervisor never imports torch: everything it learns about the training process comes from the plan's
events file, the CrashRecord, the exit status and the tail of the output.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_none
from tenacity.stop import stop_base

from . import allocconf
from .analyze import finding, finding_from_crash, finding_from_hit
from .child.runtime import EXIT_OOM, EXIT_PREDICTED, PLAN_ENV, SIMULATE_ENV, Plan
from .climb import Climb, Decision
from .device import gpu_name, gpu_total_memory
from .diagnose import Diagnosis, diagnose
from .knobs import TRL_DEFAULTS, Knobs, RunFacts, check_values, reachable
from .ladder import Exhausted, Ladder, Step
from .oom import OOMReport, scan_text
from .plan import Guide
from .proc import Interrupts, ProcessResult, run_attempt
from .records import (
    LOCK_SCHEMA,
    Attempt,
    CrashRecord,
    EventTail,
    RecordError,
    RunReport,
    check_schema,
    now_iso,
    publish,
    read_json,
    write_json_atomic,
)
from .sizes import format_size

EXIT_EXHAUSTED = 75  # EX_TEMPFAIL: the ladder or the budget is used up
EXIT_BUG = 70  # EX_SOFTWARE: an oomguard bug (a rung produced invalid knobs)
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126

BOOT_DIR = Path(__file__).resolve().parent / "child" / "_boot"


class stop_after_attempt_of(stop_base):
    """Stop once ``count()`` reaches ``limit``: tenacity's stop_after_attempt, counting only the attempts that count."""

    def __init__(self, count: Any, limit: int) -> None:
        self.count = count
        self.limit = limit

    def __call__(self, retry_state: Any) -> bool:
        return self.count() >= self.limit


class UsageError(Exception):
    """A mistake in how oomguard was called; the message is one line and names the way out."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Reporter(Protocol):
    def attempt_start(self, index: int, max_attempts: int, remedies: list[str], changes: dict[str, Any],
                      kind: str) -> None: ...
    def attempt_end(self, attempt: Attempt, diagnosis: Diagnosis | None) -> None: ...
    def climb(self, steps: list[Step], exhausted: Exhausted | None, changes: dict[str, Any],
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
    gpu_memory: int | None = None
    report_path: Path = Path("oomguard-report.json")
    lock_path: Path = Path("oomguard.lock.json")
    workdir: Path = Path(".oomguard")
    replay: dict[str, Any] | None = None  # a lock file's content: replay it without climbing
    grace: float = 20.0
    echo: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    predict: bool = True  # climb straight to the first ladder prefix the memory model predicts to fit
    probe_steps: int = 2  # a short worst-case probe before the real run (0: none)
    minimize: bool = False  # once stable, drop the rungs a probe shows are not needed
    checkpoint_every: int | None = None  # make the script save every N steps, so a late OOM loses at most N
    oom_grace: float = 10.0  # after a rank reports an OOM, how long the others may take to stop before we stop them
    capacity: int | None = None  # the device size, for predictions (else --simulate-gpu, --gpu-memory or NVML)
    html_path: Path | None = None  # also write a self-contained HTML report
    preflight_margin: float | None = 0.15  # stop a config predicted this far over capacity before it runs (None: off)


# ----------------------------------------------------------------------------------------------------------------
# Command forms


def resolve_command(args: list[str]) -> list[str]:
    """``train.py ARGS`` -> the current interpreter; ``-m module``; ``python ...``; any console script on PATH."""
    if not args:
        raise UsageError("no command given: use `oomguard run train.py ARGS...` or `oomguard run -- COMMAND...`")
    first = args[0]
    if first == "-m":
        if len(args) < 2:
            raise UsageError("`-m` needs a module name: `oomguard run -m package.module ARGS...`")
        return [sys.executable, "-m", *args[1:]]
    if first.endswith(".py"):
        if not Path(first).is_file():
            raise UsageError(f"no such script: {first}", EXIT_NOT_FOUND)
        return [sys.executable, *args]
    if os.sep in first or (os.altsep and os.altsep in first):
        if not Path(first).exists():
            raise UsageError(f"no such command: {first}", EXIT_NOT_FOUND)
        return list(args)
    if shutil.which(first) is None:
        raise UsageError(f"command not found: {first} (is it installed in this environment?)", EXIT_NOT_FOUND)
    return list(args)


# ----------------------------------------------------------------------------------------------------------------


class Supervisor:
    def __init__(self, argv: list[str], options: RunOptions, reporter: Reporter) -> None:
        self.argv = argv
        self.o = options
        self.ui = reporter
        self.run_dir = options.workdir / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.interrupts = Interrupts()
        self.reached: set[str] = set()  # construction points the command passed through (config, trainer, model)
        user = allocconf.user_settings(os.environ)  # read from the variable torch reads
        self.user_expandable = bool(user.expandable_segments)
        self.user_max_split = user.max_split_size_mb
        self.climb = Climb(
            options.ladder,
            pinned=Knobs.from_dict((options.replay or {}).get("overrides") or {}),
            env_knobs={"expandable_segments": self.user_expandable, "max_split_size_mb": self.user_max_split},
            facts=RunFacts(alloc_conf_locked=user.locked_text()),
        )
        self.capacity = options.capacity or options.simulate_gpu or options.gpu_memory or gpu_total_memory()
        simulated = bool(options.simulate_gpu)
        self.guide = (Guide(self.capacity, simulated=simulated, capped=bool(options.gpu_memory) and not simulated,
                            device_name=None if simulated else gpu_name(), warn=reporter.message)
                      if options.predict and self.capacity else None)
        self.next_kind = "probe" if options.probe_steps > 0 else "run"
        self.min_queue: list[str] | None = None  # rungs still to try without (--minimize)
        self.min_trial: str | None = None
        self.min_tried: list[Knobs] = []  # the knobs each minimize trial ran (a trial is never repeated)
        self.newly: list[str] = []  # rungs the last choice put in force (taken back if their overrides break)
        self.last_diag: Diagnosis | None = None
        self.override_error: dict[str, Any] | None = None
        self.checkpoint: str | None = None  # the newest checkpoint the run wrote
        self.checkpoint_knobs: Knobs | None = None  # the knobs of the run that wrote it
        self.output_dir: str | None = None
        self.warned_no_checkpoints = False
        self._oom_seen_at: float | None = None

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Minimize trials are extra work the user asked for: they do not use up --max-attempts.
        stop = stop_after_attempt_of(lambda: sum(1 for a in self.climb.attempts if a.kind != "minimize"),
                                     self.o.max_attempts)
        if self.o.max_time:
            stop = stop | stop_after_delay(self.o.max_time)
        retryer = Retrying(
            stop=stop,
            wait=wait_none(),
            retry=retry_if_result(lambda a: self.next_kind != "done"),
            retry_error_callback=lambda state: state.outcome.result(),
            reraise=True,
        )
        last: Attempt | None = None
        with self.interrupts:
            try:
                last = retryer(self._attempt)
            except KeyboardInterrupt:
                self.interrupts.signum = self.interrupts.signum or 2
        return self._finish(last)

    def _env(self, plan_path: Path, knobs: Knobs) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.o.extra_env)
        env[PLAN_ENV] = str(plan_path)
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + old if old else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.o.simulate_gpu:
            env[SIMULATE_ENV] = str(self.o.simulate_gpu)
        opts: dict[str, str] = {}
        if knobs.expandable_segments and not self.user_expandable:
            opts["expandable_segments"] = "True"
        if knobs.max_split_size_mb is not None and knobs.max_split_size_mb != self.user_max_split:
            opts["max_split_size_mb"] = str(knobs.max_split_size_mb)
        allocconf.merge(env, opts)  # into the variable torch reads, keeping the user's other options
        return env

    def _attempt(self) -> Attempt:
        c = self.climb
        kind = self.next_kind
        index = len(c.attempts) + 1
        without = self.min_trial if kind == "minimize" else None
        knobs = c.effective(without)[0]
        adir = self.run_dir / f"attempt-{index}"
        adir.mkdir(parents=True, exist_ok=True)
        remedies = c.remedies_in_force(without)
        probe = {"steps": self.o.probe_steps, "rows": 64} if kind in ("probe", "minimize") else None
        resume = self._resume_for(kind, index)
        plan = Plan(attempt=index, overrides=c.overrides(knobs), simulate_gpu=self.o.simulate_gpu,
                    gpu_memory=self.o.gpu_memory, crash_dir=str(adir), events=str(adir / "events.jsonl"),
                    remedies=remedies, probe=probe, resume=resume, preflight=self._preflight(),
                    checkpoint_every=self.o.checkpoint_every if kind == "run" else None)
        plan_path = write_json_atomic(adir / "plan.json", plan.to_dict())
        self.ui.attempt_start(index, self.o.max_attempts, remedies, plan.overrides, kind)
        if resume:
            self.ui.message(f"  {resume['mode']}: {resume['why']}")
        tail = EventTail(adir / "events.jsonl")
        seen: list[dict[str, Any]] = []
        self._oom_seen_at = None
        knobs_now = knobs
        if hasattr(self.ui, "state"):
            self.ui.state.capacity = self.capacity
        try:
            with self.ui.live():
                res = run_attempt(self.argv, self._env(plan_path, knobs), self.interrupts, grace=self.o.grace,
                                  echo=self.o.echo, on_tick=lambda: self._tick(tail, seen, kind, knobs_now))
        except FileNotFoundError:
            raise UsageError(f"command not found: {self.argv[0]}", EXIT_NOT_FOUND) from None
        except PermissionError:
            raise UsageError(f"permission denied: {self.argv[0]} is not executable", EXIT_NOT_EXECUTABLE) from None
        events = seen
        self._learn(events)
        attempt, diag = self._classify(index, res, adir, events, knobs, remedies)
        attempt.kind = kind
        broke = next((e for e in events if e.get("event") == "override_error"), None)
        self.override_error = broke if attempt.outcome == "failed" else None
        attempt.resume = resume
        for ev in events:
            if ev.get("event") == "generated" and ev.get("kind"):
                attempt.generated = {**(attempt.generated or {}),
                                     ev["kind"]: {"path": ev.get("path"), "config": ev.get("config"),
                                                  "replaces": ev.get("replaces")}}
        if kind != "run" and not any(e.get("event") == "config" for e in events):
            attempt.kind = "run"  # no GRPOConfig to shorten: the "probe" was the whole command
            attempt.note = "the command builds no GRPOConfig, so it ran in full instead of as a short probe"
        # The knobs as the child really ran them: the first attempt learns the user's config while it runs.
        attempt.knobs = c.effective(without)[0].to_dict()
        if self.guide is not None:
            est = self.guide.predict(c.facts, Knobs.from_dict(attempt.knobs))
            attempt.predicted_bytes = est.peak_bytes if est else None
            # a success teaches the steady state only once an optimizer step has run with its state in place
            steady = attempt.outcome != "ok" or (attempt.step or 0) >= 2
            if steady:
                self.guide.learn(c.facts, Knobs.from_dict(attempt.knobs), attempt.outcome, attempt.peak_bytes,
                                 diag.report if diag is not None else None)
            if steady and attempt.outcome == "ok" and kind == "run":  # what this machine teaches later runs
                self.guide.record(c.facts, Knobs.from_dict(attempt.knobs), attempt.peak_bytes,
                                  attempt.peak_reserved_bytes)
        c.record(attempt)
        self.ui.attempt_end(attempt, diag)
        self.next_kind = self._decide(attempt, diag)
        return attempt

    def _preflight(self) -> dict[str, Any] | None:
        """What the training process needs to stop a config the model is sure cannot fit (child/preflight.py)."""
        if self.guide is None or self.o.preflight_margin is None or self.o.replay:
            return None
        return {"capacity": self.capacity, "margin": self.o.preflight_margin, "simulated": self.guide.simulated,
                "coefficients": dataclasses.asdict(self.guide.coefficients)}

    def _tick(self, tail: EventTail, seen: list[dict[str, Any]], kind: str, knobs: Knobs) -> int | None:
        """While an attempt runs: take its new events; end a group whose rank died of OOM but which hangs."""
        fresh = tail.poll()
        state = getattr(self.ui, "state", None)
        if state is None:  # a reporter without a live view (--json-log): the progress state is kept here
            mine = getattr(self, "_progress", None)
            if mine is None or mine[0] is not seen:  # a new attempt
                from .ui import Progress

                without = self.min_trial if kind == "minimize" else None
                mine = (seen, Progress(index=len(self.climb.attempts) + 1, max_attempts=self.o.max_attempts,
                                       kind=kind, remedies=self.climb.remedies_in_force(without),
                                       capacity=self.capacity))
                self._progress = mine
            state = mine[1]
        for ev in fresh:
            name = ev.get("event")
            if name == "train_begin":  # a new trainer (a script may build several): its own counter and length
                state.step = int(ev.get("step") or 0)
                state.max_steps = int(ev["max_steps"]) if ev.get("max_steps") else None
            elif name in ("step", "train_end") and ev.get("step") is not None:
                state.step = int(ev["step"])
            if ev.get("peak") is not None:
                state.peak = max(state.peak or 0, int(ev["peak"]))
        if fresh:
            self.ui.progress(state)
        for ev in fresh:
            seen.append(ev)
            name = ev.get("event")
            if name == "train_begin" and kind == "run":
                self.output_dir = ev.get("output_dir") or self.output_dir
                if "no" in str(ev.get("save_strategy", "")).lower().split(".")[-1:] and not self.warned_no_checkpoints:
                    self.warned_no_checkpoints = True
                    self.ui.message("the script saves no checkpoints, so an OOM late in training restarts it from "
                                    "step 0; add --checkpoint-every N to lose at most N steps")
            elif name == "checkpoint" and kind == "run" and ev.get("path"):
                self.checkpoint, self.checkpoint_knobs = str(ev["path"]), knobs
            elif name == "oom" and self._oom_seen_at is None:
                self._oom_seen_at = time.monotonic()
        if self._oom_seen_at is not None:
            waited = time.monotonic() - self._oom_seen_at
            if waited > self.o.oom_grace + self.o.grace:
                return signal.SIGKILL
            if waited > self.o.oom_grace:
                return signal.SIGTERM  # a rank died of OOM; the others are stuck waiting for it
        return None

    def _resume_for(self, kind: str, index: int) -> dict[str, Any] | None:
        """How the next real run continues from the newest checkpoint, given the rungs climbed since it was saved."""
        if kind != "run" or not self.checkpoint or not Path(self.checkpoint).is_dir():
            return None
        ckpt = Path(self.checkpoint)
        # the rungs whose knobs differ from the checkpoint's run: climbed since, relaxed, or dropped by a choice
        changed = {r.knob for r in (self.checkpoint_knobs or Knobs()).diff(self.climb.effective()[0])}
        since = list({r.remedy.name: r.remedy for r in self.climb.climbed if set(r.remedy.changes) & changed}.values())
        new_run = sorted({r.name for r in since if r.resume == "new-run"})
        drift = sorted({r.name for r in since if r.resume == "continue-drift"})
        # flat under the user's own output dir, also when the run that saved the checkpoint already wrote into an
        # oomguard-attempt-N dir; never a dir that exists (a previous oomguard run's checkpoints stay untouched)
        base = Path(self.output_dir or ckpt.parent)
        while re.fullmatch(r"oomguard-attempt-\d+(-\d+)?", base.name):
            base = base.parent
        fresh = base / f"oomguard-attempt-{index}"
        n = 2
        while fresh.exists():
            fresh, n = base / f"oomguard-attempt-{index}-{n}", n + 1
        fresh_dir = str(fresh)
        if new_run:
            weights = any(ckpt.glob("model*.safetensors")) or any(ckpt.glob("pytorch_model*.bin"))
            if not weights:
                return {"mode": "restart", "checkpoint": str(ckpt), "output_dir": fresh_dir,
                        "why": f"{', '.join(new_run)} changes what is trained and {ckpt.name} holds only an adapter: "
                               f"the run starts again from step 0 in {fresh_dir} (your checkpoints stay as they are)"}
            return {"mode": "weights", "checkpoint": str(ckpt), "output_dir": fresh_dir,
                    "why": f"{', '.join(new_run)} changes the optimizer state, the adapters or the dtype, so "
                           f"{ckpt.name} cannot simply continue: a new run starts from its weights (step 0, fresh "
                           f"optimizer) and saves into {fresh_dir}"}
        why = f"continuing from {ckpt} (resume_from_checkpoint)"
        if drift:
            why += f"; {', '.join(drift)} changed the batch geometry, so the data position and LR schedule drift"
        return {"mode": "continue", "checkpoint": str(ckpt), "why": why}

    def _decide(self, attempt: Attempt, diag: Diagnosis | None) -> str:
        """What comes after this attempt: "probe", "minimize", "run", or "done"."""
        c = self.climb
        if (attempt.outcome == "failed" and self.override_error and self.newly and not self.interrupts.signum
                and not self.o.replay):
            # oomguard's own overrides broke the launch (a rung GRPO or PEFT rejects): take the rung back, go on
            err = self.override_error
            why = f"applying it failed in {err.get('where')}: {err.get('error')}"
            names, self.newly = self.newly, []
            c.take_back(names, why)
            attempt.note = f"oomguard's overrides broke the launch, not the script: took back {', '.join(names)}"
            self.ui.message(f"  took back {', '.join(names)}: {why}")
            return self._choose_after(attempt, self.last_diag)
        if self.interrupts.signum or attempt.outcome in ("failed", "interrupted"):
            return "done"
        if attempt.kind == "minimize":
            removed = self.min_trial
            if attempt.outcome == "ok" and removed is not None:
                c.drop(removed)
                attempt.note = f"{removed} is not needed: the probe fits without it"
            elif removed is not None:
                attempt.note = f"{removed} is needed: without it the probe runs out of memory"
            return self._next_minimize()
        if attempt.outcome == "ok":
            if attempt.kind == "run":
                return "done"
            if self.o.minimize and self.min_queue is None and c.applied:
                # quality trades first, the latest-listed (costliest) first, then speed, then free changes
                rank = {"quality": 0, "speed": 1, "host": 2, "nothing": 3}
                trades = {r.name: r.remedy.trades for r in c.applied}
                self.min_queue = sorted(reversed(c.remedies_in_force()), key=lambda n: rank.get(trades[n], 9))
                self.min_tried = [Knobs.from_dict(attempt.knobs)]
                return self._next_minimize()
            return "run"
        # out of memory, or stopped by the pre-flight check
        if self.o.replay:
            ex = c.give_up("lock", "a locked config is replayed without climbing")
            self.ui.climb([], ex, {})
            return "done"
        self.last_diag = diag
        return self._choose_after(attempt, diag)

    def _choose_after(self, attempt: Attempt, diag: Diagnosis | None) -> str:
        """Let the climb choose the next config after an OOM (or a pre-flight stop, or a rung taken back)."""
        c = self.climb
        before = set(c.remedies_in_force())
        fits = self.guide.fits(c.facts) if self.guide is not None else None
        peak = self.guide.peak(c.facts) if self.guide is not None else None
        decision = c.choose_next(diag, reachable(self.reached), fits=fits, peak=peak)
        attempt.climbed, attempt.skipped = decision.label(), decision.skipped_rows()
        if decision.exhausted is not None:
            self.ui.climb([], decision.exhausted, {})
            return "done"
        attempt.choice = decision.choice.to_dict() if decision.choice is not None else None
        self.newly = [n for n in c.remedies_in_force() if n not in before]
        self.ui.climb(decision.steps, None, decision.changes, attempt.skipped)
        for line in self._explain(decision):
            self.ui.message(line)
        return "probe" if self.o.probe_steps > 0 else "run"

    def _explain(self, decision: Decision) -> list[str]:
        """One line per rung dropped and per graded knob relaxed by the choice, with the prediction behind it."""
        ch = decision.choice
        if ch is None:
            return []
        cap = format_size(self.capacity) if self.capacity else "the device"
        lines = []
        if ch.dropped:
            peak = next(iter(ch.explain.values()), {}).get("predicted_bytes_without")
            why = f"predicted peak without {'it' if len(ch.dropped) == 1 else 'them'} {format_size(peak)} of {cap}" \
                if peak else "predicted to fit without"
            lines.append(f"  not needed: {', '.join(ch.dropped)} ({why})")
        for knob, climbed, chosen in ch.relaxed:
            lines.append(f"  relaxed {knob}: {climbed} → {chosen}, the value closest to yours predicted to fit")
        return lines

    def _next_minimize(self) -> str:
        c = self.climb
        while self.min_queue:
            candidate = self.min_queue.pop(0)
            if candidate not in c.remedies_in_force():
                continue
            knobs = c.effective(candidate)[0]
            if knobs in self.min_tried:
                continue  # the same overrides were probed already (a rung that changes nothing here)
            self.min_tried.append(knobs)
            self.min_trial = candidate
            return "minimize"
        self.min_trial = None
        return "run"

    def _learn(self, events: list[dict[str, Any]]) -> None:
        """Take what the training process reported: the script's own values (first report wins), and facts."""
        c = self.climb
        facts = c.facts
        for ev in events:
            kind = ev.get("event")
            if kind in ("config", "trainer", "model"):
                self.reached.add(str(kind))
            if kind in ("config", "trainer"):
                c.observe(ev.get("observed") or {})
                f = ev.get("facts") or {}
                facts = facts.replace(**{k: v for k, v in f.items() if k in RunFacts.__dataclass_fields__})
                if ev.get("world_size"):
                    facts = facts.replace(world_size=int(ev["world_size"]))
            elif kind == "dataset":
                facts = facts.replace(prompt_tokens_max=ev.get("prompt_tokens_max") or facts.prompt_tokens_max,
                                      prompt_tokens_p95=ev.get("prompt_tokens_p95") or facts.prompt_tokens_p95,
                                      dataset_rows=ev.get("rows") or facts.dataset_rows)
            elif kind == "model":
                facts = facts.replace(model_config=ev.get("config") or facts.model_config)
        c.facts = facts

    def _classify(self, index: int, res: ProcessResult, adir: Path, events: list[dict[str, Any]], knobs: Knobs,
                  remedies: list[str]) -> tuple[Attempt, Diagnosis | None]:
        steps = [e.get("step") for e in events if e.get("event") in ("step", "train_end") and e.get("step") is not None]
        peaks = [e.get("peak") for e in events if e.get("peak") is not None]
        reserved = [e.get("reserved") for e in events if e.get("reserved") is not None]
        attempt = Attempt(index=index, knobs=knobs.to_dict(), remedies=remedies, outcome="failed",
                          exit_code=res.exit_code, seconds=res.seconds, peak_bytes=max(peaks) if peaks else None,
                          step=max(steps) if steps else None,
                          peak_reserved_bytes=max(reserved) if reserved else None)
        if res.survivors:
            self.ui.message(f"{len(res.survivors)} process(es) of attempt {index} still alive after SIGKILL (pids "
                            f"{', '.join(map(str, res.survivors[:8]))}): the next attempt may find their memory in use")
        if res.interrupted:
            attempt.outcome = "interrupted"
            return attempt, None
        if res.returncode == 0:
            attempt.outcome = "ok"
            return attempt, None
        predicted = next((e for e in events if e.get("event") == "predicted"), None)
        if predicted is not None and res.returncode == EXIT_PREDICTED:
            attempt.outcome = "predicted"
            attempt.predicted_bytes = predicted.get("predicted_bytes")
            attempt.note = (f"stopped before generating: predicted {format_size(attempt.predicted_bytes or 0)}, "
                            f"more than {100 * float(predicted.get('margin') or 0):.0f}% over the capacity")
            return attempt, None
        crash = self._crash_record(adir)
        if crash is not None:
            d = diagnose(crash.report, crash.frames, phase=crash.phase)
            attempt.outcome = "oom"
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
            attempt.outcome = "oom"
            attempt.oom = finding("exit status", None, report, d)
            return attempt, d
        hits = scan_text(res.stderr_tail) or scan_text(res.stdout_tail)
        if hits:
            hit = hits[-1]
            attempt.outcome = "oom"
            attempt.oom = finding_from_hit("stderr", hit)
            return attempt, diagnose(hit.report, hit.frames)
        if sigkill:  # a kill -9, `timeout -s KILL`, a preemption: not ours to retry
            attempt.note = (f"killed by SIGKILL (exit {res.exit_code}) with no sign of the kernel's OOM killer "
                            f"({res.host_checked}): passed through as a failure, not retried")
            self.ui.message(f"attempt {index} was {attempt.note}")
        return attempt, None

    def _crash_record(self, adir: Path) -> CrashRecord | None:
        for p in sorted(adir.glob("crash-*.json"), key=lambda p: p.stat().st_mtime):
            try:
                return CrashRecord.read(p)
            except RecordError as e:
                self.ui.message(str(e))
        return None

    # -- the end -----------------------------------------------------------------------------------------------
    def _finish(self, last: Attempt | None) -> int:
        c = self.climb
        sig = self.interrupts.signum
        if sig or last is None or last.outcome == "interrupted":
            status, code = "interrupted", 128 + (sig or 2)
            message = "interrupted; no retry"
        elif last.outcome == "ok" and last.kind == "run":
            status, code = "stable", 0
            ooms = sum(1 for a in c.attempts if a.outcome == "oom" and a.kind != "minimize")
            stops = sum(1 for a in c.attempts if a.outcome == "predicted")
            if ooms or stops:
                message = f"stable after {ooms} out-of-memory attempt(s)" + (
                    f" and {stops} pre-flight stop(s) (predicted not to fit, stopped before generating)" if stops
                    else "")
            elif self.o.replay:
                message = (f"the locked config fit: replayed the lock's {len(self.o.replay.get('overrides') or {})} "
                           "override(s), no rung climbed")
            else:
                message = "the command fit on the first attempt; nothing changed"
        elif last.outcome == "ok":
            status, code = "exhausted", EXIT_EXHAUSTED
            message = f"the probe fits, but the budget (--max-attempts {self.o.max_attempts}) ran out before the run"
        elif last.outcome == "failed":
            status, code = "failed", last.exit_code if last.exit_code is not None else 1
            message = f"the command failed with exit code {code} (not an OOM); passed through without retrying"
        elif c.exhausted is not None:
            status, code = "exhausted", EXIT_EXHAUSTED
            if self.o.replay:
                message = "the locked config ran out of memory; run without --config to climb again"
            elif not self.reached:
                message = ("no rung can reach this command: it built no GRPOConfig or GRPOTrainer and loaded no "
                           "model with from_pretrained before running out of memory, so only allocator settings "
                           "apply")
            else:
                message = "the ladder is used up: no rung left that can help"
        else:
            status, code = "exhausted", EXIT_EXHAUSTED
            budget = (f"--max-time {self.o.max_time:g}s" if self.o.max_time and
                      time.time() - c.started >= self.o.max_time else f"--max-attempts {self.o.max_attempts}")
            message = f"stopped by the budget ({budget}) while the run still ran out of memory"
        report = c.report(status, message, code, command=self.argv,
                          device={"simulate_gpu": self.o.simulate_gpu, "gpu_memory": self.o.gpu_memory})
        if last is not None and last.generated:
            who = {r["knob"]: r["remedy"] for r in report.diff}
            for kind, g in last.generated.items():
                report.diff.append({"knob": f"{kind} config", "from": g.get("replaces"), "to": g.get("path"),
                                    "remedy": who.get("zero_stage") or who.get("offload_optimizer")
                                    or who.get("offload_params")})
        if report.device is not None:
            report.device["capacity"] = self.capacity
            if self.guide is not None:
                report.device["calibration"] = self.guide.describe()
        # each run keeps its own report; the top-level file is a copy of the latest, and an older one is kept aside
        kept = self.o.workdir / "kept"
        aside = publish(report.to_dict(), self.run_dir / "report.json", self.o.report_path, kept)
        if self.o.html_path:
            from .html import write_run_html

            breakdown = None
            if self.guide is not None and report.attempts:
                est = self.guide.predict(c.facts, Knobs.from_dict(report.attempts[-1].knobs))
                breakdown = dict(est.breakdown) if est else None
            write_run_html(self.o.html_path, report.to_dict(), breakdown)
        lock_path: Path | None = None
        if status == "stable":
            lock_path = self.o.lock_path
            final = Knobs.from_dict(report.attempts[-1].knobs)
            lock_aside = publish({
                "schema": LOCK_SCHEMA, "created": now_iso(), "command": self.argv, "ladder": self.o.ladder.name,
                "overrides": c.overrides(final), "original": report.original, "stable": report.stable,
                "world_size": c.facts.world_size, "diff": report.diff,
            }, self.run_dir / "lock.json", lock_path, kept)
            aside = aside or lock_aside
        if aside is not None:
            self.ui.message(f"an older report or lock (not kept by any run) was kept aside in {kept}/ before the new "
                            "one replaced it")
        self.ui.finish(report, self.o.report_path, lock_path)
        return code


def load_lock(path: str) -> dict[str, Any]:
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise UsageError(f"no such lock file: {path}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the lock file {path}: {e}") from None
    try:
        check_schema(data, LOCK_SCHEMA, path)
    except RecordError as e:
        raise UsageError(str(e)) from None
    # A lock is read back as Knobs are checked (types, ranges, optimizer names, GRPO's batch rules), before anything
    # runs: a hand-edited or corrupted lock is refused, never replayed or reported as a stable config.
    overrides = data.get("overrides")
    if overrides is None:
        overrides = data["overrides"] = {}
    if not isinstance(overrides, dict):
        raise UsageError(f"{path}: \"overrides\" must be an object of knob values; re-create the lock with "
                         "`oomguard run` (without --config)")
    world = data.get("world_size")
    world = world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else 1
    stable = data.get("stable")
    problems = check_values(stable, world) if isinstance(stable, dict) else []
    if not problems:
        base = TRL_DEFAULTS.merged(stable) if isinstance(stable, dict) else TRL_DEFAULTS
        problems = check_values(overrides, world, base=base)
    if problems:
        raise UsageError(f"{path}: not a usable lock: {'; '.join(problems)}; fix it or re-create it with "
                         "`oomguard run` (without --config)")
    return data


__all__ = ["EXIT_BUG", "EXIT_EXHAUSTED", "EXIT_OOM", "RunOptions", "Supervisor", "UsageError", "load_lock",
           "resolve_command"]
