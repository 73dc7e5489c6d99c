"""The one owner of a climb's decisions, for `oomguard run`, `@oomguard.guard` and `oomguard plan` alike.

A front-end launches (or calls) and reports how each attempt ended; the conductor decides everything else: whether the
first config is probed, what the next attempt is (a probe, the real run, an undo trial, nothing), which config it
runs (``Climb``, judged by the memory model handed to it once: ``Judge``), what each attempt teaches the model, which
ladder a distributed run takes, and when the budget is spent. Its policy (``Policy``) is the user's options; its
state is the climb's and its own (the undo trials, the rungs the last choice put in force, the last diagnosis).

It drives the loop (``drive``): a front-end only launches the attempt it names (``launch(next) -> Ended``: how it
ended, as the front-end observed it), and the conductor alone builds the attempt's record (``Attempt``, ``take``),
writes its notes and counts it against the budget. What it decides comes back as data (``Next``): the next attempt's
kind (probe or run is decided here only: ``first`` and ``choose``, by ``may_skip_probe``; the training process
resolves a ``deferred`` probe by the one verdict), and what to tell the user, in order (``Said``: a line, or the
climb's decision for the front-end to show its way)::

    last = conductor.drive(launcher.launch, tell=show)

>>> from oomguard.decide.ladder import load_ladder
>>> c = Conductor(Climb(load_ladder("default")), None, Policy(probe_steps=0))
>>> c.first().kind
<AttemptKind.RUN: 'run'>
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ..memory.estimate import PROBE, FitVerdict, launch_as
from ..vocab.diagnosis import LEAK_KINDS, Diagnosis
from ..vocab.ended import Ended
from ..vocab.facts import RunFacts
from ..vocab.knobs import Knobs, reachable
from ..vocab.records import Attempt, AttemptKind, Outcome
from ..vocab.sizes import format_size
from ..vocab.trlrange import head_of, support
from .choose import Choice
from .climb import UNDO_BY_DEFAULT, Climb, Decision
from .judge import Judge
from .ladder import MULTI_GPU, distributed_reason_of, load_ladder
from .leaks import after_leak, resumed_step, unconfirmed
from .minimize import Minimizer
from .proofs import Proofs
from .repeat import Repeat
from .said import Next, Said, say

# The real run can allocate a little more than its probe (the last step's logging, the final save, evaluation, which
# the probe leaves out): 0.7% was measured on a TRL-docs client. A probe's peak counts this much higher when the
# memory model learns from it, so choices after a probe keep that room.
PROBE_TAIL = 0.01


@dataclass(frozen=True)
class Policy:
    """The user's options that shape a climb's decisions (``oomguard run``'s flags; the guard's arguments)."""

    max_attempts: int = 8
    max_time: float | None = None
    probe_steps: int = 2  # a short worst-case probe before a real run (0: never)
    always_probe: bool = False  # probe even a config the memory model is sure of
    refine: bool = True  # once a probe fits: choose again with what it measured; probe the changes it is unsure of
    minimize: bool = False  # prove every change needed with an undo trial
    replay: bool = False  # a lock replayed: its config runs as it is, never climbed
    preflight: bool = True  # the training process stops a config the model is sure cannot fit
    preflight_margin: float | None = None  # how far over the device that is; None: the model's measured error
    ladder_auto: bool = False  # --ladder not given: a run the training process reports distributed takes multi-gpu
    device: bool = True  # a device could run out of memory (an accelerator, a simulated or named size)
    leak_restart: bool = True  # after an OOM the memory trace shows is a leak: resume with the same config


class Conductor:
    """The decisions of one climb (see the module): ``first``, ``after`` each attempt, ``learn`` from it,
    ``take_facts`` the training process reports, ``choose`` after an OOM (also what ``oomguard plan`` asks)."""

    def __init__(self, climb: Climb, judge: Judge | None, policy: Policy, *, capacity: int | None = None,
                 launched: bool = False, subject: str = "the command") -> None:
        self.climb = climb
        self.subject = subject  # what runs the attempts, in the climb's sentences
        self.judge = judge  # the memory model; public so that a test can stand in what a probe taught it
        self.policy = policy
        self.capacity = capacity if capacity is not None else judge.capacity if judge is not None else None
        self.probe_steps = policy.probe_steps  # a TRL or stack no measurement covers is probed even under --no-probe
        self.minimizer = Minimizer()
        self.newly: list[str] = []  # rungs the last choice put in force (taken back if their overrides break)
        self.last_diag: Diagnosis | None = None  # the OOM the climb last answered
        # the construction points the command passed through (config, trainer, model): what its knobs reach; None where
        # nothing is launched (`oomguard plan`: every knob reaches)
        self.reached: set[str] | None = set() if launched else None
        self.trl_seen: tuple[str, str | None, str | None] | None = None
        self.unobserved_said: list[str] = []  # RunFacts.unobserved lines said so far
        self.leaks: list[int] = []  # the attempts that ran out of memory through a leak and were resumed as they were
        # a leak the trace showed over enough steps, or a young one a restart reproduced (got further, grew again)
        self.leak_confirmed = False
        self.checkpoint_every: int | None = None  # the checkpoint cadence a leak's restarts need
        self.proofs = Proofs()  # a prediction the run proved wrong (the model is unsure from then on), the OOMs

    # -- the start and the budget ------------------------------------------------------------------------------
    def first(self) -> Next:
        """The first attempt: the user's config (a lock's, replayed), probed unless there is nothing to probe."""
        if self.probe_steps > 0 and self.policy.device:
            return Next(AttemptKind.PROBE, deferred=self.may_skip_probe())
        return Next(AttemptKind.RUN)

    def may_skip_probe(self) -> bool:
        """Whether an attempt launched as a probe may become the real run where the training process finds the model
        sure of its config (``Judge.sure``): not after a real OOM in this run (the model was wrong here), nor with
        --always-probe or --minimize, nor while a change of what is trained or learned is in force (a probe is what
        can show it is not needed)."""
        if self.judge is None or self.policy.always_probe or self.policy.minimize or self.proofs.unsure:
            return False
        return self.climb.probe_may_be_skipped()

    def judging(self) -> dict[str, Any]:
        """What an attempt's plan carries for the training process to judge its config with (the one verdict,
        ``memory.estimate.verdict``; whether a probe becomes the real run where the model is sure is ``Next.deferred``):
        the Judge as it stands (``judge``, with --preflight-margin where given; None without a model), and whether the
        pre-flight stops a config the verdict is ``stop`` on (``preflight``: not under --no-preflight, for a replayed
        lock, nor once this run proved the model wrong: a probe measures instead, ``decide/miss.py``)."""
        judge = self.judge
        return {"judge": judge.judge_spec(self.policy.preflight_margin) if judge is not None else None,
                "preflight": (judge is not None and self.policy.preflight and not self.policy.replay
                              and not self.proofs.unsure)}

    def starts(self, v: FitVerdict | None) -> str:
        """How the config in force starts where the memory model's verdict on it is ``v`` (None: the model cannot
        judge it): ``stop``, ``probe`` or ``run``, as the training process decides it (``memory.estimate.launch_as``)
        for the attempt :meth:`first` launches, with what :meth:`judging` puts in its plan; what `oomguard plan` says
        `oomguard run` does."""
        nxt, parts = self.first(), self.judging()
        return launch_as(v.decision if v is not None and parts["judge"] is not None else PROBE,
                         probe=nxt.kind != AttemptKind.RUN, deferred=nxt.deferred, preflight=parts["preflight"])

    def spent(self) -> bool:
        """--max-attempts (undo trials are extra work the user asked for: they do not count; a leak's restarts do, so
        that a run can never loop) or --max-time."""
        c = self.climb
        counted = sum(1 for a in c.attempts if a.kind != AttemptKind.MINIMIZE)
        late = self.policy.max_time is not None and time.time() - c.started >= self.policy.max_time
        return counted >= self.policy.max_attempts or late

    def room_for(self, attempts: int, counted: bool = True) -> bool:
        """Whether the budget leaves room for this many more attempts, so that an optional probe never takes the
        real run's place: --max-attempts (for attempts it counts), and --max-time by the longest attempt so far."""
        c = self.climb
        if counted and sum(1 for a in c.attempts if a.kind != AttemptKind.MINIMIZE) + attempts > \
                self.policy.max_attempts:
            return False
        if self.policy.max_time is not None:
            longest = max((a.seconds for a in c.attempts), default=0.0)
            return time.time() - c.started + (attempts - 1) * longest < self.policy.max_time
        return True

    # -- what the training process reports ---------------------------------------------------------------------
    def take_facts(self, facts: RunFacts) -> list[str]:
        """Newer facts about the run: the climb learns them, the judge the LM head and device the training process
        found, the ladder follows a run the training process reports distributed (before anything was climbed on
        the other). Returns the lines to say."""
        c = self.climb
        if self.judge is not None:  # what vLLM needs on this device, for the rung that shrinks its reservation
            facts = facts.replace(vllm_min_utilization=self.judge.vllm_floor(facts, c.effective()[0]))
        c.learn(facts)
        lines = self.take_trl(facts.trl_version, facts.trl_head, facts.stack_untested)
        lines += self.take_unobserved(facts.unobserved)
        if self.policy.ladder_auto and c.ladder.name != MULTI_GPU and not c.climbed and \
                (why := distributed_reason_of(facts)):
            c.switch_ladder(load_ladder(MULTI_GPU))
            lines.append(ladder_line(why))
        return lines

    def take_trl(self, version: str | None, head: str | None, stack_untested: str | None = None) -> list[str]:
        """The command's TRL, read before launching or reported by the training process: a release newer than the
        tested ones (or a stack whose memory no measurement covers) gets one line, and a probe verifies its first
        choice even under --no-probe; the judge models its LM head (the reported one, else the one its release is
        known to have) and its measured error."""
        if version is None or (version, head, stack_untested) == self.trl_seen:
            return []
        s = support(version)
        untested = s.untested or bool(stack_untested)
        lines = []
        if untested and (self.trl_seen is None or self.trl_seen[0] != version or self.trl_seen[2] != stack_untested):
            lines.append(str(s.message) if s.untested else
                         f"{stack_untested}: the pre-flight stops only far over the device, and a probe verifies the "
                         "first choice")
            self._probe_first()
        self.trl_seen = (version, head, stack_untested)
        if self.judge is not None:
            self.judge.set_trl(head or head_of(version), untested)
        return lines

    def _probe_first(self) -> None:
        """The model cannot be sure of this run (a TRL or stack no measurement covers, what was not observed, a
        prediction proven wrong): configs are probed first even under --no-probe, at the user's probe length where
        they gave one; a replayed lock runs as it is."""
        if self.probe_steps <= 0 and not self.policy.replay:
            self.probe_steps = 2

    def take_unobserved(self, unobserved: tuple[str, ...]) -> list[str]:
        """What the training process could not observe of the run (its prompts, its generation engine: one line each,
        ``RunFacts.unobserved``): each is said once, the judge is never sure of the run, and a probe verifies the
        first choice even under --no-probe, as for a TRL no measurement covers."""
        new = [line for line in unobserved if line not in self.unobserved_said]
        self.unobserved_said.extend(new)
        if self.judge is not None:
            self.judge.unobserved = tuple(self.unobserved_said)
        if new:
            self._probe_first()
        return [f"not observed: {line} (the memory model is unsure of this run: a probe goes first)" for line in new]

    def take_device(self, total: int | None, from_nvml: bool) -> str | None:
        """The size of the device the training process computes on, as CUDA reports it there: where the size came
        from NVML and differs (a device order or a MIG layout NVML could not resolve), it is the one judged."""
        if not total or not from_nvml or total == self.capacity:
            return None
        old, self.capacity = self.capacity, total
        if self.judge is not None:
            self.judge.set_capacity(total)
        return (f"the training process sees a device of {format_size(total)}"
                + (f", not the {format_size(old)} NVML reported" if old else "") + ": predictions use its size from now on")

    def record(self, attempt: Attempt, diag: Diagnosis | None) -> None:
        """An attempt ended: the memory model learns from it (``learn``), and the climb records it."""
        self.learn(attempt, diag)
        self.climb.record(attempt)

    def drive(self, launch: Callable[[Next], Ended], tell: Callable[[Next], None],
              ended: Callable[[Attempt, Diagnosis | None], bool] = lambda _a, _d: False) -> Attempt | None:
        """The loop of every front-end: ``launch`` the next attempt (how it ended comes back), record it (``take``),
        let the front-end show it (``ended``; True: stop here, as after an interrupt), decide what comes ``after`` and
        ``tell`` it, until nothing comes next or the budget is spent. Returns the last attempt's record, if any."""
        nxt, last = self.first(), None
        while nxt.kind is not None and (last is None or not self.spent()):
            e = launch(nxt)
            last = self.take(e)
            if ended(last, e.diagnosis):
                break
            if e.fresh_process is not None:  # only a fresh process could help a call in this one: no next config
                self.climb.give_up("fresh_process", e.fresh_process)
                last.skipped = [{"remedy": "fresh_process", "reason": e.fresh_process}]
                break
            nxt = self.after(last, e.diagnosis, read_fields=e.read_fields)
            for d in (s.decision for s in nxt.said if s.decision is not None and s.decision.exhausted is None):
                last.skipped += [{"remedy": st.remedy.name, "reason": "needs a fresh process"} for st in d.steps
                                 if st.remedy.name in e.not_here]
            tell(nxt)
        return last

    def take(self, e: Ended) -> Attempt:
        """The record of the attempt that ended as ``e`` (the next index; built here only), recorded (``record``)."""
        kept = {f.name for f in fields(Attempt)}
        attempt = Attempt(index=len(self.climb.attempts) + 1, **{k: v for k, v in vars(e).items() if k in kept})
        self.record(attempt, e.diagnosis)
        return attempt

    def learn(self, attempt: Attempt, diag: Diagnosis | None) -> None:
        """What an attempt teaches the memory model, the same for a launch and a guarded call: its prediction is
        recorded on it; a success teaches the steady state only once an optimizer step has run with its state in
        place (``step`` at least 2, or a call that ran to its end without counting steps); a probe's peak counts
        PROBE_TAIL higher; an OOM teaches a lower bound (not a leak's: the code ran out, not the config); a passing probe
        is kept in this machine's calibration."""
        judge, c = self.judge, self.climb
        if judge is None:
            return
        knobs = Knobs.from_dict(attempt.knobs)
        est = judge.predict(c.facts, knobs)
        if attempt.outcome != Outcome.PREDICTED:  # a stop keeps the figure it was stopped on (a load, perhaps)
            attempt.predicted_bytes = est.peak_bytes if est else None
        if est is not None and self.proofs.learn(est, attempt, diag, simulated=judge.simulated,
                                                 head=judge.head_for(c.facts)):
            self._probe_first()  # proven wrong
        if attempt.outcome == Outcome.OK and attempt.step is not None and attempt.step < 2:
            return
        if diag is not None and diag.kind in LEAK_KINDS:  # the code's leak ran out, not the config
            return
        peak = attempt.peak_bytes
        if peak and attempt.kind != AttemptKind.RUN:
            peak = int(peak * (1 + PROBE_TAIL))
        judge.learn(c.facts, knobs, attempt.outcome, peak, diag.report if diag else None,
                    phase=diag.phase if diag else None, fragmented=diag is not None and diag.kind == "fragmentation")
        if attempt.outcome == Outcome.OK and attempt.kind != AttemptKind.RUN:
            # what this machine teaches later runs of this model: a probe's worst case, like the prediction's
            judge.record(c.facts, knobs, attempt.peak_bytes, attempt.peak_reserved_bytes)

    # -- what comes next ---------------------------------------------------------------------------------------
    def after(self, attempt: Attempt, diag: Diagnosis | None, *, read_fields: frozenset[str] | None = None) -> Next:
        """The next attempt after ``attempt`` ended (``record``-ed already), or ``Next(None)``. ``read_fields``: the
        knobs that reach the code, where the front-end knows them (a guarded call); else what the command passed
        through. What the attempt proved of the model's prediction is said first."""
        nxt = self._after(attempt, diag, read_fields)
        nxt.said[:0] = [Said(line=f"  {line}") for line in self.proofs.said()]
        return nxt

    def _after(self, attempt: Attempt, diag: Diagnosis | None, read_fields: frozenset[str] | None) -> Next:
        c, p = self.climb, self.policy
        repeat = None if p.replay else self.proofs.repeat(attempt, diag, c.effective()[1], c.facts.world_size)
        if repeat is not None and repeat.fixed:
            return self._repeated(attempt, diag, repeat, read_fields)
        if attempt.outcome == Outcome.INTERRUPTED:
            return Next(None)
        if attempt.outcome != Outcome.FAILED:
            self.newly = []  # the rungs in force launched: a later failure is not theirs
        trial_of = c.trial_of
        if c.settle_rechoice(attempt.outcome == Outcome.OK) and attempt.outcome != Outcome.OK:
            if trial_of is not None:  # a cheaper trial did not fit: the choice it stood in for, probed in its turn
                c.trial_of = None
                attempt.note = ("the cheaper config tried first did not fit: back to the config the memory model "
                                "chose, which changes what is trained or learned")
                return self.probe_or_run(Next(AttemptKind.PROBE).line(f"  {attempt.note}"))
            # the config chosen again after a probe fit did not hold: back to that one, which needs no new probe
            attempt.note = "the config chosen again did not hold: back to the config the probe before showed to fit"
            return self._after_fit(attempt, Next(None).line(f"  {attempt.note}"))
        if attempt.outcome == Outcome.FAILED:
            if attempt.override_error is not None and self.newly and not p.replay:
                return self._take_back(attempt, attempt.override_error)
            return Next(None)
        if attempt.kind == AttemptKind.MINIMIZE:
            attempt.note = self.minimizer.settle(c, attempt.outcome == Outcome.OK)
            return self._after_fit(attempt, Next(None))
        if attempt.outcome == Outcome.OK:
            return Next(None) if attempt.kind == AttemptKind.RUN else self._after_fit(attempt, Next(None))
        # out of memory, or stopped by the pre-flight check
        if diag is not None and diag.kind in LEAK_KINDS:
            return after_leak(self, attempt, diag)
        if self.leaks and not self.leak_confirmed:  # the restart after a young leak ran out without growing again
            unconfirmed(self, attempt, "the restart after it ran out of memory without the growth")
        if p.replay:
            exhausted = c.give_up("lock", "a locked config is replayed without climbing")
            return Next(None, said=[Said(decision=Decision(exhausted=exhausted))])
        self.last_diag = diag
        if repeat is not None:
            return self._repeated(attempt, diag, repeat, read_fields)
        return self.choose(attempt, diag, read_fields=read_fields)

    def choose(self, attempt: Attempt | None, diag: Diagnosis | None, *,
               read_fields: frozenset[str] | None = None) -> Next:
        """Let the climb choose the next config after an OOM (or a pre-flight stop), judged by the memory model, and
        say what it chose and why. ``read_fields``: the knobs that reach the code (default: what the command passed
        through). Also what `oomguard plan` asks (``attempt`` None)."""
        c, judge = self.climb, self.judge
        if read_fields is None and self.reached is not None:
            read_fields = reachable(self.reached)
        before = set(c.remedies_in_force())
        fits = judge.fits(c.facts) if judge is not None else None
        peak = judge.peak(c.facts) if judge is not None else None
        relax = judge.fits(c.facts, judge.relax_margin) if judge is not None else None
        plausible = judge.plausible(c.facts, self.doubt()) if judge is not None and self.probe_steps > 0 else None
        # what the pre-flight would let run: predicted over the device by no more than its margin
        launchable = (judge.plausible(c.facts, self.stop_margin()[0]) if judge is not None and self.policy.preflight
                      and not self.policy.replay else None)
        # the weights' load as the pre-flight judges it: a trial the unsure model makes must at least load
        loads = judge.loads(c.facts, self.stop_margin()[0]) if judge is not None else None
        decision = c.choose_next(diag, read_fields, subject=self.subject, fits=fits, peak=peak, relax_fits=relax,
                                 plausible=plausible, launchable=launchable, unsure=self.proofs.unsure, loads=loads)
        if attempt is not None:
            attempt.climbed, attempt.skipped = decision.label(), decision.skipped_rows()
        if decision.exhausted is not None:
            if (why := dict(decision.exhausted.skipped).get("predicted")) is not None and attempt is not None:
                margin, source = self.stop_margin()  # a config the pre-flight would stop again is not launched
                attempt.note = f"{why}: none launched, the pre-flight stops beyond {100 * margin:.1f}% over ({source})"
                return Next(None).line(f"  {attempt.note}")
            return Next(None, said=[Said(decision=decision)])
        if attempt is not None:
            attempt.choice = decision.choice.to_dict() if decision.choice is not None else None
        self.newly = [n for n in c.remedies_in_force() if n not in before]
        nxt = Next(AttemptKind.RUN, said=[Said(decision=decision)])
        if decision.choice is not None:
            for line in self.explain(decision.choice):
                nxt.line(line)
        if decision.trial and c.trial_of is not None:
            kept = ", ".join(dict.fromkeys(r.name for r in c.trial_of.rungs))
            then = (f"the choice, {kept}, follows if it does not fit" if self.room_for(2) else
                    f"the budget leaves no launch for the choice, {kept}, after it")
            nxt.line(f"  first without what changes the experiment: {', '.join(c.remedies_in_force())} is predicted "
                     f"within the memory model's error of the device ({then})")
        if self.probe_steps <= 0:
            return nxt
        if c.effective()[0] in c.verified:  # a probe already ran this config: no second probe
            return self._after_fit(attempt, nxt.line("  back to a config a probe already showed to fit"))
        nxt.kind, nxt.deferred = AttemptKind.PROBE, self.may_skip_probe()
        return self.probe_or_run(nxt)

    def probe_or_run(self, nxt: Next) -> Next:
        """``nxt``, a probe, unless it is the last launch the budget allows (--max-attempts, --max-time): then the run
        itself, since a probe that fit would leave no launch for the run it stands in for."""
        if self.room_for(2):
            return nxt
        nxt.kind, nxt.deferred = AttemptKind.RUN, False
        return nxt.line("  the last launch the budget allows is the run itself, not a probe")

    def doubt(self) -> float | None:
        """How far over the device a config may be predicted and still be worth a probe: the model's doubt, but not so
        far that the pre-flight would stop the probe."""
        if self.judge is None:
            return None
        return min(self.judge.doubt, self.stop_margin()[0]) if self.policy.preflight else self.judge.doubt

    def _repeated(self, attempt: Attempt, diag: Diagnosis | None, repeat: Repeat,
                  read_fields: frozenset[str] | None) -> Next:
        """An OOM as the last (``decide/repeat.py``): the rungs between them go; a fixed allocation ends the climb."""
        c, attempt.note = self.climb, repeat.took_back()
        c.take_back([n for n in repeat.rungs if n in c.remedies_in_force()], attempt.note)
        open_rungs = {r.name for r in c.ladder.rungs} - set(c.refused) - set(c.remedies_in_force())
        if not repeat.fixed or repeat.sized_by(c.facts.generation_engine, open_rungs):
            nxt = self.choose(attempt, diag, read_fields=read_fields)
        else:
            est = self.judge.predict(c.facts, c.effective()[0]) if self.judge is not None else None
            attempt.note = repeat.fixed_line(est.peak_alloc_bytes if est is not None else None)
            c.give_up("fixed-allocation", attempt.note)
            nxt = Next(None).line(f"  {attempt.note}")
        nxt.said.insert(0, Said(line=f"  {repeat.took_back()}"))
        return nxt

    def stop_margin(self) -> tuple[float, str]:
        """The pre-flight's margin: --preflight-margin, else the memory model's measured error."""
        if self.policy.preflight_margin is not None:
            return self.policy.preflight_margin, "--preflight-margin"
        assert self.judge is not None
        return self.judge.stop_margin()

    def _after_fit(self, attempt: Attempt | None, nxt: Next) -> Next:
        """After a probe fits (or an undo trial settles): a config the user prefers that the model, calibrated by
        what the probe measured, now predicts to fit (probed next); else the next undo trial (every rung with
        --minimize; by default those whose removal the model is unsure of); else the real run."""
        c, p = self.climb, self.policy
        judge = self.judge if p.refine else None
        if judge is not None and self.room_for(2) and (fits := judge.fits(c.facts)) is not None:
            choice = c.rechoose(fits, judge.peak(c.facts), judge.fits(c.facts, judge.relax_margin))
            if choice is not None:
                if attempt is not None:
                    attempt.choice = {**choice.to_dict(), "after": "probe"}
                nxt.line("  re-chose with what the probe measured: a config closer to yours is predicted to fit")
                for line in self.explain(choice):
                    nxt.line(line)
                nxt.kind = AttemptKind.PROBE
                return nxt
        # a change the model is unsure of, but not so unsure that the pre-flight check would stop the trial
        worth = judge.plausible(c.facts, self.doubt()) if judge is not None else None
        if not self.minimizer.started and c.applied and (p.minimize or worth is not None):
            # by default only what changes the experiment is worth a launch to undo; --minimize tries every change
            self.minimizer.start(c, None if p.minimize else UNDO_BY_DEFAULT)
        if (self.minimizer.started and self.room_for(2, counted=False)
                and (name := self.minimizer.next_trial(c, None if p.minimize else worth))):
            why = "--minimize" if p.minimize else "predicted just over the device without it, within the model's error"
            nxt.line(f"  is {name} needed? one probe without it ({why})")
            nxt.kind, nxt.without = AttemptKind.MINIMIZE, name
            return nxt
        nxt.kind = AttemptKind.RUN
        return nxt

    def _take_back(self, attempt: Attempt, err: dict[str, Any]) -> Next:
        """oomguard's own overrides broke the launch (a rung GRPO or PEFT rejects, a 4-bit load a loader cannot make):
        take back the rungs just put in force that set the overrides named where it broke (else all of them), go on."""
        why, broke = f"applying it failed in {err.get('where')}: {err.get('error')}", set(err.get("overrides") or ())
        names = [r.name for r in self.climb.applied if r.name in self.newly and broke & set(r.remedy.changes)]
        names, self.newly = list(dict.fromkeys(names)) or self.newly, []
        self.climb.take_back(names, why)
        attempt.note = f"oomguard's overrides broke the launch, not the script: took back {', '.join(names)}"
        nxt = self.choose(attempt, self.last_diag)
        nxt.said.insert(0, Said(line=f"  took back {', '.join(names)}: {why}"))
        return nxt

    def explain(self, ch: Choice) -> list[str]:
        """What the choice dropped and relaxed, with the prediction behind it (``Choice.lines``)."""
        return ch.lines(self.capacity, load_only=self.judge is not None and Judge.load_only(self.climb.facts))


def ladder_line(why: str) -> str:
    """The line that says which ladder oomguard picked by itself, and why."""
    return (f"ladder {MULTI_GPU}: {why}, so the rungs that only apply to distributed runs (DeepSpeed's buffers, ZeRO "
            "stages, offload) come before any trade of quality; --ladder NAME picks another")


__all__ = ["PROBE_TAIL", "Conductor", "Ended", "Next", "Policy", "Said", "ladder_line", "resumed_step", "say"]
