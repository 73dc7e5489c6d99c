"""The Supervisor: launch the user's command, watch it, and after an OOM let the climb choose the next config.

``Supervisor.run`` reads top to bottom like torchrun's elastic agent (``_invoke_run``): launch an attempt in a fresh
process group, classify how it ended, decide what comes next, stop. It is a plain loop rather than a tenacity
``Retrying``: what comes next is the climb's decision (probe, run, minimize trial, done), not a retry policy, and
there is nothing for tenacity to add (no waits, no exceptions to retry); the budget (``--max-attempts``,
``--max-time``) is one test at the top of the loop.

The supervisor never imports torch: everything it learns about the training process comes from the typed events of
the plan's events file, the CrashRecord, the exit status and the tail of the output. ``Climb`` owns the knobs (the
rungs in force, the configs tried, the choice); this module owns the order of attempts (probe, undo trial, run) and
what it needs for that: the rungs the last choice put in force (taken back if their overrides break the launch), the
last diagnosis, the undo trials (``Minimizer``) and the newest checkpoint. Its other parts are modules of their own:
one attempt (``attempts``), what the training process teaches (``learning``), the end (``ending``), and
``classify``, ``resume_plan`` and ``conclude``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..decide.choose import Choice
from ..decide.climb import Climb
from ..memory.allocmodel import context_for
from ..memory.device import accelerator_present, gpu_bf16, gpu_name, gpu_total_memory
from ..vocab import allocconf
from ..vocab.diagnosis import Diagnosis
from ..vocab.knobs import Knobs, RunFacts, reachable
from ..vocab.protocol import EXIT_OOM, whereabouts
from ..vocab.records import (
    Attempt,
    AttemptKind,
    Outcome,
)
from ..vocab.sizes import format_size
from .attempts import Attempts
from .command import (
    EXIT_BUG,
    EXIT_EXHAUSTED,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    UsageError,
    load_lock,
    resolve_command,
)
from .ending import Ending
from .follower import follow
from .group import Group, GroupError
from .learning import Learning
from .minimize import Minimizer
from .options import BOOT_DIR, PROBE_TAIL, UNDO_BY_DEFAULT, Reporter, RunOptions
from .proc import Interrupts, become_subreaper


def pinned_by(lock: dict[str, Any] | None) -> dict[str, str]:
    """The remedy a lock's diff names for each knob it pins, so that a replay's diff still says which rung made each
    change (a row without one reads ``lock``).

    >>> pinned_by({"diff": [{"knob": "dtype", "from": "float32", "to": "bfloat16", "remedy": "bf16_load"}]})
    {'dtype': 'bf16_load'}
    """
    rows = (lock or {}).get("diff") or []
    return {r["knob"]: r["remedy"] for r in rows if isinstance(r, dict) and isinstance(r.get("knob"), str)
            and isinstance(r.get("remedy"), str) and r["remedy"]}


class Supervisor(Attempts, Learning, Ending):
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
            pinned_by=pinned_by(options.replay),
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
        self.trl_seen: tuple[str, str | None, str | None] | None = None  # (TRL version, head, stack_untested) modelled
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
        kind: AttemptKind | None = AttemptKind.PROBE if self._probes() else AttemptKind.RUN
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

    def _probes(self) -> bool:
        """Whether the first config is probed (or launched as a probe unless the memory model is sure of it): not
        with --no-probe, nor where no device could run out of memory (no accelerator, no simulated or named size)."""
        if self.o.probe_steps <= 0:
            return False
        return bool(self.capacity) or accelerator_present()

    def _may_skip_probe(self) -> bool:
        """Whether an attempt launched as a probe may become the real run where the training process finds the memory
        model sure of its config (``Guide.sure``): not after a real OOM in this run (the model was wrong here), nor
        with --always-probe or --minimize, nor while a rung that changes what is trained or learned is in force (a
        probe is what can show it is not needed)."""
        if self.guide is None or self.o.always_probe or self.o.minimize:
            return False
        return self.climb.probe_may_be_skipped()

    def _budget_spent(self) -> bool:
        """--max-attempts (minimize trials are extra work the user asked for: they do not count) or --max-time."""
        counted = sum(1 for a in self.climb.attempts if a.kind != AttemptKind.MINIMIZE)
        late = self.o.max_time is not None and time.time() - self.climb.started >= self.o.max_time
        return counted >= self.o.max_attempts or late

    # -- what comes next ---------------------------------------------------------------------------------------
    def _decide(self, attempt: Attempt, diag: Diagnosis | None) -> AttemptKind | None:
        """The kind of the next attempt, or None when the run is done."""
        c = self.climb
        if self.interrupts.signum or attempt.outcome == Outcome.INTERRUPTED:
            return None
        if attempt.outcome != Outcome.FAILED:
            self.newly = []  # the rungs in force launched: a later failure is not theirs
        trial_of = c.trial_of
        if c.settle_rechoice(attempt.outcome == Outcome.OK) and attempt.outcome != Outcome.OK:
            if trial_of is not None:  # a cheaper trial did not fit: the choice it stood in for, probed in its turn
                c.trial_of = None
                attempt.note = ("the cheaper config tried first did not fit: back to the config the memory model "
                                "chose, which changes what is trained or learned")
                self.ui.message(f"  {attempt.note}")
                return AttemptKind.PROBE
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
        plausible = None
        if self.guide is not None and self.o.probe_steps > 0:  # a cheaper trial needs a probe to settle it
            doubt = min(self.guide.doubt, self._stop_margin()[0]) if self.o.preflight else self.guide.doubt
            plausible = self.guide.plausible(c.facts, doubt)
        decision = c.choose_next(diag, reachable(self.reached), fits=fits, peak=peak, relax_fits=relax,
                                 plausible=plausible)
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
        if decision.trial and c.trial_of is not None:
            kept = ", ".join(dict.fromkeys(r.name for r in c.trial_of.rungs))
            self.ui.message(f"  first a probe without what changes the experiment: {', '.join(c.remedies_in_force())} "
                            f"is predicted within the memory model's error of the device (the choice, {kept}, "
                            "follows if it does not fit)")
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


__all__ = ["BOOT_DIR", "EXIT_BUG", "EXIT_EXHAUSTED", "EXIT_NOT_EXECUTABLE", "EXIT_NOT_FOUND", "EXIT_OOM", "PROBE_TAIL",
           "UNDO_BY_DEFAULT", "Reporter", "RunOptions", "Supervisor", "UsageError", "load_lock", "resolve_command"]
