"""The state of a climb up the ladder, shared by `oomguard run` and `@oomguard.guard`.

It holds the three layers of knobs (TRL defaults, what the code itself set, the rungs in force), replays the rungs
to get the effective knobs, decides the config after each OOM (``choose_next``: climb the ladder, then keep only
what memory demands, see ``oomguard.decide.choose``), and builds the RunReport with the diff. Nothing outside it changes
its state: run and guard call ``record``, ``learn``, ``choose_next``, ``drop`` and ``give_up``; run also
``rechoose`` after a probe fits and ``settle_rechoice`` when that config's probe ends.

>>> from oomguard.decide.ladder import load_ladder
>>> c = Climb(load_ladder("default"))
>>> c.observe({"max_completion_length": 1024})
>>> c.effective()[0].max_completion_length
1024
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..strategies import REGISTRY, Context, make_remedy
from ..vocab.diagnosis import Diagnosis
from ..vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from ..vocab.knobtable import TABLE
from ..vocab.records import Attempt, RunReport, now_iso
from ..vocab.sizes import format_size
from .cheapest import CostPreference, cheapest
from .choose import Choice, Preference, Rung, choose, replay
from .experiment import Change, Experiment, summarise
from .ladder import Exhausted, Ladder, Step
from .runreport import climb_report

# The cost classes whose changes a default run probes without, when the model cannot rule out that they are not needed:
# what is trained and what GRPO learns from. A speed or precision change stays unless --minimize proves it.
UNDO_BY_DEFAULT = ("capacity", "signal")
# How the diff and the report name a change oomguard made so that a command runs where it is launched, not for memory.
ADAPTATION = "adaptation"
# The cost classes a model the run proved wrong tries before any other (``choose_next``'s ``unsure``).
FREE_OR_SPEED = ("none", "speed")


@dataclass(frozen=True)
class Decision:
    """What ``Climb.choose_next`` decided: the rungs climbed (or Exhausted), the knobs changed for the next attempt,
    the rungs passed over with why, and the choice below the ceiling (rungs dropped, graded knobs relaxed)."""

    steps: list[Step] = field(default_factory=list)
    exhausted: Exhausted | None = None
    changes: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    choice: Choice | None = None
    trial: bool = False  # the config in force is a cheaper trial of the choice's (``Climb.trial_of``)

    def skipped_rows(self) -> list[dict[str, str]]:
        return [{"remedy": n, "reason": why} for n, why in self.skipped.items()]

    def label(self) -> str | None:
        """The rungs climbed, ``+``-joined (None when exhausted; ``choose`` when no new rung was needed)."""
        if self.exhausted is not None:
            return None
        return "+".join(s.remedy.name for s in self.steps) or "choose"


@dataclass
class Climb:
    ladder: Ladder
    base: Knobs = field(default_factory=Knobs)  # the user's own starting values (guard(knobs=...)): original
    pinned: Knobs = field(default_factory=Knobs)  # a lock file's overrides, replayed: oomguard's, not the user's
    pinned_by: dict[str, str] = field(default_factory=dict)  # the remedy the lock names for each pinned knob
    # what oomguard changed so that the command runs where it is launched, not for memory (``use_cpu`` for DeepSpeed's
    # CPU ranks; a checkpoint cadence a leak's restarts need): knob -> (value, why); in the diff and the lock like any
    # change, so that a replay runs the same
    adapted: dict[str, tuple[Any, str]] = field(default_factory=dict)
    env_knobs: dict[str, Any] = field(default_factory=dict)  # allocator settings found in the environment
    facts: RunFacts = field(default_factory=RunFacts)
    observed: dict[str, Any] = field(default_factory=dict)
    climbed: list[Rung] = field(default_factory=list)  # every rung climbed, in order: the ceiling
    applied: list[Rung] = field(default_factory=list)  # the rungs in force: climbed, or what choose() kept of them
    choice: Choice | None = None  # the last choice, for the report
    failed: list[Knobs] = field(default_factory=list)  # configs that ran out of memory (or were predicted to)
    verified: list[Knobs] = field(default_factory=list)  # configs an attempt (a probe) ran without running out
    fallback: tuple[list[Rung], Choice | None] | None = None  # what a re-chosen config replaced, until its probe ends
    # the config a cheaper trial stands in for (``choose_next``'s ``plausible``): not yet probed itself, so a trial
    # that does not fit is followed by a probe of it
    trial_of: Choice | None = None
    rechoosing: bool = True  # off once a re-chosen config did not pass, or a real run outran its probe
    refused: dict[str, str] = field(default_factory=dict)  # rungs taken back because they broke a launch, with why
    attempts: list[Attempt] = field(default_factory=list)
    exhausted: Exhausted | None = None
    started: float = field(default_factory=time.time)
    started_iso: str = field(default_factory=now_iso)

    # the knobs the command has reported its own value of (None included: TRL's default applies), and the construction
    # points at which it reported them (``config``, ``trainer``); None where nothing is launched (the guard, plan)
    seen: set[str] = field(default_factory=set)
    points: set[str] | None = None

    # -- knobs -------------------------------------------------------------------------------------------------
    def observe(self, values: dict[str, Any], point: str | None = None) -> None:
        """Record what the code set; the first report of each knob wins. ``point``: the construction point that
        reported them (a launched command's; ``unseen`` follows them)."""
        for k, v in values.items():
            if k in TRL_DEFAULTS.to_dict() and v is not None:
                self.observed.setdefault(k, tuple(v) if isinstance(v, list) else v)
        self.seen.update(values)
        if point is not None:
            self.points = {*(self.points or ()), point}

    def unseen(self) -> list[str]:
        """The knobs whose value the command has not said yet: no report of it, and no construction point through
        which it reaches passed (a notebook's load stopped before its GRPOConfig exists). ``original()`` can only take
        TRL's defaults for them; the report says they are not known. Empty for a climb without a launched command.

        >>> from oomguard.decide.ladder import load_ladder
        >>> c = Climb(load_ladder("default"))
        >>> c.observe({"dtype": "bfloat16", "load_in_4bit": False}, point="facts")
        >>> "num_generations" in c.unseen(), "lora_r" in c.unseen(), "dtype" in c.unseen()
        (True, True, False)
        >>> c.observe({"num_generations": 4}, point="config")
        >>> "num_generations" in c.unseen(), "lora_r" in c.unseen()
        (False, True)
        """
        if self.points is None:
            return []
        known = self.seen | set(self.base.to_dict(only_set=True)) | set(self.env_knobs)
        return [k for k, info in TABLE.items() if k not in known and (reach := set(info.reaches) - {"env"})
                and not reach & self.points]

    def resolve(self, values: dict[str, Any]) -> None:
        """Values the user's stack resolved after the script set them: they replace the observed ones (what the
        user's command trains with when oomguard changes nothing)."""
        for k, v in values.items():
            if k in TRL_DEFAULTS.to_dict() and v is not None:
                self.observed[k] = tuple(v) if isinstance(v, list) else v
        self.seen.update(values)

    def original(self) -> Knobs:
        """The user's own config: TRL defaults, the allocator settings in the environment, then the code's values."""
        return TRL_DEFAULTS.merged(self.env_knobs).merged(self.observed).merged(self.base)

    def effective(self, without: str | None = None) -> tuple[Knobs, dict[str, str]]:
        """The knobs for the next attempt, replayed from the original, and which remedy set each changed knob.

        ``without`` leaves out one rung in force (by remedy name, every pass of it), to test whether it is still
        needed (``--minimize``).
        """
        original = self.original()
        knobs = original.merged(self.pinned)
        who: dict[str, str] = {r.knob: self.pinned_by.get(r.knob) or "lock" for r in original.diff(knobs)}
        adapted = {k: v for k, (v, _why) in self.adapted.items() if getattr(knobs, k) != v}
        if adapted:
            knobs = knobs.merged(adapted)
            who.update(dict.fromkeys(adapted, ADAPTATION))
        knobs, changed = replay(knobs, [r for r in self.applied if r.name != without], self.facts)
        return knobs, {**who, **changed}

    def start(self) -> Knobs:
        """Where every choice starts: the user's config, a replayed lock's values and oomguard's adaptations (so that a
        config chosen is compared with those that ran, which carried the adaptations, as they ran)."""
        return self.original().merged(self.pinned).merged({k: v for k, (v, _why) in self.adapted.items()})

    def overrides(self, knobs: Knobs | None = None) -> dict[str, Any]:
        """What oomguard changes relative to the original: the values a plan carries to the training code, and the
        lock writes. Every value oomguard sets whatever the user's is (``fixed``) is among them, also where it equals
        what the climb takes for the user's value.

        >>> from oomguard.decide.ladder import load_ladder
        >>> replay = Climb(load_ladder("default"), pinned=Knobs(per_device_train_batch_size=8,
        ...                                                     gradient_accumulation_steps=8))
        >>> replay.overrides()  # before the command reported its own values: 8 is TRL's default, and is sent
        {'gradient_accumulation_steps': 8, 'per_device_train_batch_size': 8}
        """
        knobs = knobs if knobs is not None else self.effective()[0]
        out = {r.knob: r.after for r in self.original().diff(knobs)}
        for k in self.fixed():
            if getattr(knobs, k) is not None:
                out.setdefault(k, getattr(knobs, k))
        return out

    def fixed(self) -> list[str]:
        """The knobs oomguard sets whatever the user's value is: every knob a replayed lock pins, and each value a
        chosen rung fixed (``Rung.values``) for a knob the command has not reported yet. A diff against the user's
        config would leave out such a value where it equals what the climb takes for the user's (TRL's default,
        before the command reported its own), and the command's own value would run instead."""
        known = set(self.observed) | set(self.base.to_dict(only_set=True))
        # a rung's values may hold more than knobs (generation_rounds' rows per round): only knobs are sent
        chosen = [k for r in self.applied for k, _v in r.values or () if k in TABLE and k not in known]
        return list(dict.fromkeys([*self.pinned.to_dict(only_set=True), *chosen]))

    def experiment(self, final: Knobs | None = None,
                   slowdown: Callable[[Knobs, Knobs], float | None] | None = None) -> Experiment:
        """What ``final`` (default: the config in force) keeps of the user's experiment and what it changes, in cost
        classes, each rung in force once (``oomguard.decide.experiment``); ``slowdown`` predicts a speed change's
        time."""
        knobs, who = self.effective()
        remedies = list({r.name: r.remedy for r in self.applied}.values())
        for name in dict.fromkeys(self.pinned_by.values()):  # a replayed lock's changes, by the rungs that made them
            if name in REGISTRY and name not in {r.name for r in remedies}:
                remedies.append(make_remedy(name))
        exp = summarise(self.original(), knobs if final is None else final, remedies, who,
                        world_size=self.facts.world_size, slowdown=slowdown, facts=self.facts,
                        seen=bool(self.observed))
        done = knobs if final is None else final
        for knob, (value, why) in self.adapted.items():
            if getattr(self.original(), knob) != value and getattr(done, knob) == value:
                exp.changed.append(Change(ADAPTATION, "none", f"{knob}={value} ({why})"))
        return exp

    def adapt(self, knob: str, value: Any, why: str) -> None:
        """oomguard changed ``knob`` to ``value`` so that the command runs where it is launched, or can resume (the
        training process said so, and why): the latest value stays (a leak's restarts save more and more often), with
        the first word for it."""
        if knob in TRL_DEFAULTS.to_dict() and self.adapted.get(knob, (None,))[0] != value:
            self.adapted[knob] = (value, why)

    def remedies_in_force(self, without: str | None = None) -> list[str]:
        return [n for n in dict.fromkeys(r.name for r in self.applied) if n != without]

    def actions_in_force(self, without: str | None = None) -> list[str]:
        """The rungs in force, each named by what it really changes (``Remedy.name_for``): a fewer_generations rung
        that kept the user's num_generations reads ``fewer_prompts_per_step``."""
        knobs, who = self.effective(without)
        return [self.action(name, self.overrides(knobs), who) for name in self.remedies_in_force(without)]

    def action(self, name: str, changes: dict[str, Any], who: dict[str, str]) -> str:
        """Rung ``name`` named by what it changed of ``changes`` (``who`` set each knob)."""
        remedy = next((r.remedy for r in self.applied if r.name == name), None)
        mine = {k: v for k, v in changes.items() if who.get(k) == name}
        return remedy.name_for(mine) if remedy is not None else name

    # -- the attempts ------------------------------------------------------------------------------------------
    def record(self, attempt: Attempt) -> None:
        """Add an attempt that ended; a config that ran out of memory (or was predicted to) is never chosen again."""
        self.attempts.append(attempt)
        if attempt.outcome in ("oom", "predicted"):
            self.failed.append(Knobs.from_dict(attempt.knobs))
            if attempt.outcome == "oom" and attempt.kind == "run":
                # the real run needed more than its probe showed: a passing probe no longer proves a config fits
                self.verified.clear()
                self.rechoosing = False
        elif attempt.outcome == "ok":
            self.verified.append(Knobs.from_dict(attempt.knobs))

    def probe_may_be_skipped(self) -> bool:
        """Whether the config in force may start its real run without a probe where the memory model is sure it
        fits: not after a real OOM in this run (the model was wrong about this run once), nor while a rung in force
        changes what is trained or learned (cost class capacity or signal: a probe is what can show it unneeded).

        >>> from oomguard.decide.ladder import load_ladder
        >>> Climb(load_ladder("default")).probe_may_be_skipped()
        True
        """
        if any(a.outcome == "oom" for a in self.attempts) or self.fallback is not None:
            return False  # the model was wrong once, or a trial (or a re-chosen config) waits for its probe
        return not any(r.remedy.cost in UNDO_BY_DEFAULT for r in self.applied)

    def learn(self, facts: RunFacts) -> None:
        """Take newer facts about the run (model shape, prompt lengths, world size) from the training code."""
        self.facts = facts

    def switch_ladder(self, ladder: Ladder) -> None:
        """Climb ``ladder`` instead, before anything was climbed (a run the training process reports distributed takes
        the multi-gpu ladder): nothing climbed on the other is lost."""
        assert not self.climbed, "the ladder changes only before the first rung is climbed"
        self.ladder = ladder

    def give_up(self, reason: str, why: str) -> Exhausted:
        """Stop climbing for a reason outside the ladder (a replayed lock, a poisoned CUDA context)."""
        self.exhausted = Exhausted(((reason, why),))
        return self.exhausted

    # -- choosing ----------------------------------------------------------------------------------------------
    def choose_next(self, diag: Diagnosis | None, read_fields: frozenset[str] | None = None,
                    subject: str = "the command", fits: Callable[[Knobs], bool] | None = None,
                    peak: Callable[[Knobs], int | None] | None = None,
                    relax_fits: Callable[[Knobs], bool] | None = None,
                    plausible: Callable[[Knobs], bool] | None = None,
                    launchable: Callable[[Knobs], bool] | None = None, unsure: bool = False,
                    loads: Callable[[Knobs], bool] | None = None) -> Decision:
        """After an out-of-memory attempt (the last one recorded): the config for the next one.

        Without the memory model (``fits`` None) the next rung of the ladder is climbed, as a ladder always did. With
        it, the ladder is climbed straight to the first prefix predicted to fit (the ceiling); then ``choose`` drops
        the rungs the prediction says are not needed and relaxes graded knobs towards the user's values. When a
        chosen config runs out of memory, the model has learned from it and the choice is made again below the same
        ceiling (putting back part of what was dropped); only when nothing below it fits is the ladder climbed on.
        ``relax_fits`` (default ``fits``) judges how far graded knobs are relaxed (``choose``).

        Never a costlier class on a guess: where the choice changes what is trained or learned (cost class capacity or
        signal) and a config of the cheaper rungs climbed is ``plausible`` (predicted within the model's error of the
        device), that config is put in force first, as a trial (``Decision.trial``) a probe settles: if it does not
        fit, ``settle_rechoice`` puts the choice back, to be probed in turn. Where the run proved the model wrong
        (``unsure``), the trial is the strongest config of the rungs that cost nothing or only speed, where the choice
        costs precision or more and that config has not run but loads (``loads``): the model's word is not enough.

        Where nothing the ladder reaches is predicted to fit: with ``launchable`` (what the pre-flight would let run),
        the cheapest config it lets run below everything the ladder reaches, chosen together, never a chain of stops
        one rung at a time; none: the climb ends (``Exhausted`` of reason ``predicted``), no config launched that the
        pre-flight would stop again. Without it, one rung, as a ladder always climbed."""
        before = self.effective()[0]
        start = self.start()
        pruned = self.applied != self.climbed  # the config in force is a choice below the ceiling
        steps: list[Step] = []
        skipped: dict[str, str] = {}
        choice = None
        if fits is not None and pruned:
            choice = self._choose(start, fits, peak, relax_fits)
        found = None  # where nothing is predicted to fit: what the pre-flight lets run (or an unsure model's trial)
        if choice is None:
            ceiling = replay(start, self.climbed, self.facts)[0]
            used = Counter(r.name for r in self.climbed)
            ctx = Context(knobs=ceiling, facts=self.facts, diagnosis=diag, used=dict(used), read_fields=read_fields,
                          subject=subject, refused=self.refused)
            if fits is not None:
                steps, ran_out = self._climb(ctx, fits, relax_fits)
                if ran_out is not None and launchable is None:
                    steps = steps[:1]
                elif ran_out is not None and launchable is not None:
                    ceiling_rungs = [*self.climbed, *(Rung(s.remedy, diag) for s in steps)]
                    found = (self._launchable(start, ceiling_rungs, launchable, peak)
                             or self._cheap_ceiling(start, ceiling_rungs, unsure))
                    if found is None:
                        return self._none_launchable(start, ceiling_rungs, steps, peak)
            if not steps:
                step = self.ladder.next(ctx)
                if isinstance(step, Exhausted):
                    self.exhausted = step
                    return Decision(exhausted=step, skipped=dict(step.skipped))
                steps = [step]
            for s in steps:
                for n, why in s.skipped:
                    skipped.setdefault(n, why)
            self.climbed = ceiling_rungs if found is not None else self.climbed + [Rung(s.remedy, diag) for s in steps]
            choice = self._choose(start, fits, peak, relax_fits) if fits is not None else None
            choice = choice or found
        trial = self._cheaper_trial(start, choice, plausible, peak, unsure, loads) if choice is not None else None
        self.applied = list(choice.rungs) if choice is not None else list(self.climbed)
        self.choice = choice
        if trial is not None:
            self.fallback, self.trial_of = (list(self.applied), choice), choice
            self.applied, self.choice = list(trial.rungs), trial
        after = self.effective()[0]
        climbed = {s.remedy.name for s in steps}
        return Decision(steps=steps, changes={r.knob: r.after for r in before.diff(after)},
                        skipped={n: why for n, why in skipped.items() if n not in climbed}, choice=self.choice,
                        trial=trial is not None)

    def _cheaper_trial(self, start: Knobs, choice: Choice, plausible: Callable[[Knobs], bool] | None,
                       peak: Callable[[Knobs], int | None] | None, unsure: bool = False,
                       loads: Callable[[Knobs], bool] | None = None) -> Choice | None:
        """The config of the climbed rungs that cost only speed or precision that the model puts within its error of
        the device, where ``choice`` changes what is trained or learned; None when there is none (or nothing to
        trade). Where the model is ``unsure``: the rungs that cost nothing or only speed, at their strongest, where
        ``choice`` costs precision or more, that config has not been tried and its weights load (``loads``: a model
        proven wrong about the step still knows the weights as placed)."""
        if unsure:
            if not {r.remedy.cost for r in choice.rungs} - set(FREE_OR_SPEED):
                return None
            cheap = self._cheap_ceiling(start, self.climbed, unsure)
            ok = cheap is not None and cheap.knobs != choice.knobs and (loads is None or loads(cheap.knobs))
            return cheap if ok else None
        if plausible is None or not {r.remedy.cost for r in choice.rungs} & set(UNDO_BY_DEFAULT):
            return None
        cheaper = [r for r in self.climbed if r.remedy.cost not in UNDO_BY_DEFAULT]
        if not cheaper:
            return None
        found = cheapest(start, cheaper, lambda k: plausible(k) and k not in self.verified, order=self._order(),
                         facts=self.facts, avoid=self.failed, user=self.original(), peak=peak)
        return found if found is not None and found.knobs != choice.knobs else None

    def _cheap_ceiling(self, start: Knobs, rungs: list[Rung], unsure: bool) -> Choice | None:
        """Where the model is ``unsure``: the rungs of ``rungs`` that cost nothing or only speed, at their strongest,
        where that config has not run; None otherwise."""
        cheap = [r for r in rungs if r.remedy.cost in FREE_OR_SPEED]
        if not unsure or not cheap:
            return None
        knobs = replay(start, cheap, self.facts)[0]
        if knobs in self.failed or knobs in self.verified:
            return None
        return Choice(rungs=tuple(cheap), knobs=knobs)

    def _launchable(self, start: Knobs, ceiling: list[Rung], launchable: Callable[[Knobs], bool],
                    peak: Callable[[Knobs], int | None] | None) -> Choice | None:
        """Where nothing is predicted to fit: the cheapest config below ``ceiling`` that the pre-flight would let run
        (predicted over the device by no more than the model's error), its probe to tell."""
        return cheapest(start, ceiling, lambda k: k in self.verified or launchable(k), order=self._order(),
                        facts=self.facts, avoid=self.failed, user=self.original(), peak=peak)

    def _none_launchable(self, start: Knobs, ceiling: list[Rung], steps: list[Step],
                         peak: Callable[[Knobs], int | None] | None) -> Decision:
        """The end of a climb whose every config the pre-flight would stop: ``Exhausted`` of reason ``predicted``,
        naming the least of them (everything the ladder reaches)."""
        least = peak(replay(start, ceiling, self.facts)[0]) if peak is not None else None
        names = ", ".join(dict.fromkeys(r.name for r in ceiling)) or "nothing"
        why = (f"every config the ladder reaches is predicted over the device, beyond the error the pre-flight allows: "
               f"the least, with {names}, " + (f"needs {format_size(least)}" if least else "does not fit"))
        skipped = [(n, w) for s in steps for n, w in s.skipped]
        self.exhausted = Exhausted((("predicted", why), *skipped))
        return Decision(exhausted=self.exhausted, skipped=dict(self.exhausted.skipped))

    def rechoose(self, fits: Callable[[Knobs], bool], peak: Callable[[Knobs], int | None] | None = None,
                 relax_fits: Callable[[Knobs], bool] | None = None) -> Choice | None:
        """After a probe fits: make the choice again below the same ceiling, with what the probe taught the model.

        The new choice is put in force only when the user would prefer it (``Preference``: fewer or cheaper trades,
        graded knobs closer to theirs, fewer free changes) to the config in force, which the probe showed to fit;
        else nothing changes and None is returned. Each adoption is strictly preferred to the last, so repeating this
        after every passing probe ends. The config it replaces is kept until ``settle_rechoice`` hears how the new
        one's probe ended."""
        if not self.climbed or not self.applied or not self.rechoosing:
            return None
        current = self.effective()[0]
        choice = self._choose(self.start(), fits, peak, relax_fits, headroom_only=True)
        if choice is None or choice.knobs == current:
            return None
        pref = self.preference()
        if pref.key([r.name for r in choice.rungs], choice.knobs) >= pref.key(self.remedies_in_force(), current):
            return None
        self.fallback = (list(self.applied), self.choice)
        self.applied, self.choice = list(choice.rungs), choice
        return choice

    def settle_rechoice(self, fits: bool) -> bool:
        """The probe of a re-chosen config ended: keep it if it fit; else put back the config it replaced (which its
        own probe showed to fit) and re-choose no more in this run: the model, calibrated as well as one probe allows,
        cannot tell the configs near the device's edge apart. Returns whether a re-chosen config was pending."""
        if self.fallback is None:
            return False
        if not fits:
            self.applied, self.choice = self.fallback
            self.rechoosing = False
        else:
            self.trial_of = None  # the trial fit: the costlier choice it stood in for is not needed
        self.fallback = None
        return True

    def _order(self) -> list[str]:
        return [r.name for r in (*self.ladder.rungs, *self.ladder.host_rungs)]

    def preference(self) -> Preference | CostPreference:
        """How the user ranks configs below the ceiling: by what they cost the experiment (the ladder's ``choose_by
        = "cost"``) or by the ladder's order."""
        if self.ladder.choose_by == "cost":
            return CostPreference.of(self.climbed, self._order(), self.original(), self.facts.world_size, self.facts)
        return Preference.of(self.climbed, self._order(), self.original())

    def _climb(self, ctx: Context, fits: Callable[[Knobs], bool],
               relax_fits: Callable[[Knobs], bool] | None) -> tuple[list[Step], Exhausted | None]:
        """The ceiling: the ladder climbed to the first config predicted to fit. By cost, with the model's error as
        headroom (``relax_fits``) where any config has it, so that a first choice is not a coin flip at the device's
        edge; else with the plain margin (``fits``)."""
        if self.ladder.choose_by != "cost":
            return self.ladder.climb_to_fit(ctx, fits)
        found = self.ladder.climb_by_cost(ctx, relax_fits or fits)
        if found[1] is not None and relax_fits is not None:
            found = self.ladder.climb_by_cost(ctx, fits)
        return found

    def _choose(self, start: Knobs, fits: Callable[[Knobs], bool], peak: Callable[[Knobs], int | None] | None,
                relax_fits: Callable[[Knobs], bool] | None = None, headroom_only: bool = False) -> Choice | None:
        """The best config below the ceiling. By cost: the cheapest that fits with the model's error as headroom
        (``relax_fits``), else (unless ``headroom_only``) the cheapest that fits with the plain margin. By order:
        ``oomguard.decide.choose.choose``, whose relaxed graded knobs keep the headroom."""
        def shown_or(judge: Callable[[Knobs], bool]) -> Callable[[Knobs], bool]:
            # a config a probe ran fits, whatever the model now says
            return lambda k: k in self.verified or judge(k)

        if self.ladder.choose_by == "cost":
            judges = [relax_fits] if relax_fits is not None else []
            if not (headroom_only and judges):
                judges.append(fits)
            for judge in judges:
                choice = cheapest(start, self.climbed, shown_or(judge), order=self._order(), facts=self.facts,
                                  avoid=self.failed, user=self.original(), peak=peak)
                if choice is not None:
                    return choice
            return None
        return choose(start, self.climbed, shown_or(fits), order=self._order(), facts=self.facts,
                      avoid=self.failed, user=self.original(), peak=peak,
                      relax_fits=shown_or(relax_fits) if relax_fits is not None else None)

    def take_back(self, names: list[str], why: str) -> None:
        """Take rungs out for good because applying them broke the launch (an error in oomguard's own overrides, not
        the user's failure): they leave the ceiling and the ladder passes over them from now on, saying why."""
        for n in names:
            self.refused[n] = why
        self.climbed = [r for r in self.climbed if r.name not in names]
        self.applied = [r for r in self.applied if r.name not in names]

    def drop(self, name: str) -> None:
        """Take a rung out of force for good (``--minimize`` showed it is not needed)."""
        self.applied = [r for r in self.applied if r.name != name]

    # -- the end -----------------------------------------------------------------------------------------------
    def report(self, status: str, message: str, exit_code: int | None, **extra: Any) -> RunReport:
        """The run's report as the climb ends it (``decide.runreport``)."""
        return climb_report(self, status, message, exit_code, **extra)
