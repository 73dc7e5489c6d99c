"""The memory model as the judge of every climb (`oomguard run`, `@oomguard.guard` and `oomguard plan`): whether a
config fits the device with the model's measured error as headroom, how far over the device it may be and still fit
(the doubt a probe settles), what each attempt teaches it, online and across runs on this machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, NamedTuple

from ..memory.calibration import (
    Calibration,
    builtin_description,
    load_calibration,
    machine_key,
    model_key,
    record_run,
)
from ..memory.estimate import (
    Coefficients,
    Doubts,
    Estimate,
    FitVerdict,
    ModelSpec,
    chooses,
    doubts_of,
    estimate,
    fed,
    judge_spec,
    load_bytes,
    load_fed,
    verdict,
)
from ..memory.estimate import fitverdict as rule
from ..memory.estimate.vllm import vllm_memory
from ..memory.steptime import slowdown
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.protocol import JudgeSpec
from .alternatives import Alternative, alternatives
from .climb import Climb


def predictor(spec: ModelSpec, capacity: int, *, facts: RunFacts | None = None,
              coefficients: Coefficients | None = None, simulated: bool = False, context: int | None = None,
              head: str | None = None) -> Callable[[Knobs], Estimate]:
    """A function Knobs -> Estimate for one model and device (and the installed TRL's LM head, ``head``), with what
    the run feeds the model beyond the knobs read from ``facts`` (its world size, prompt length, images, a loader that
    keeps the dtype under 4-bit: ``memory.estimate.fed``)."""
    facts = facts or RunFacts()

    def predict(k: Knobs) -> Estimate:
        # None lets estimate() pick the coefficients for the device (the simulated device has its own fit)
        return estimate(spec, k, world_size=facts.world_size, prompt_tokens=facts.prompt_tokens_max,
                        coefficients=coefficients, simulated=simulated, capacity=capacity, context=context, head=head,
                        **fed(spec, facts, k))

    return predict


# The diagnosis's phases (``vocab.diagnosis.PHASES``) as the memory model splits a step (``Estimate.phases``); a load,
# a save or an unknown phase has no estimate of its own
ESTIMATE_PHASE = {"generation": "generation", "scoring": "scoring", "forward": "forward_backward",
                  "backward": "forward_backward", "optimizer": "optimizer", "evaluation": "evaluation"}


Alloc = tuple[bool, int | None]  # the allocator settings that decide how a cache fragments (``allocator``)


class Ceiling(NamedTuple):
    """What a config that ran out of memory in ``phase`` allocated there as predicted (``total``, and ``mine``, its
    own part of it: ``Estimate.own``), each times the share a config must stay below (``Judge._failed_phases``);
    ``whole``: the failed config's total itself; ``alloc``: the allocator settings it ran out under where they are
    what can help (a fragmentation), else None: any settings."""

    phase: str
    total: int
    mine: int
    whole: int
    alloc: Alloc | None = None


def allocator(k: Knobs) -> Alloc:
    """The allocator settings of ``k`` that decide how its cache fragments."""
    return bool(k.expandable_segments), k.max_split_size_mb


def below(est: Estimate, k: Knobs, ceilings: list[Ceiling]) -> bool:
    """Whether ``est`` (the prediction for ``k``) allocates less than each ceiling that holds for ``k`` in its phase
    (``Judge._failed_phases``): in all, or, no more in all, in the phase's own memory (fewer rows generated at once, a
    smaller micro-batch), where the model's error lies when the long-lived state is the same. One from a fragmentation
    holds only under the allocator settings it ran out with.

    >>> e, k = Estimate(30, 30, {}, {"generation": 20, "optimizer": 30}, 0, 0, "optimizer", state=10), Knobs()
    >>> below(e, k, [Ceiling("generation", 21, 20, 22)]), below(e, k, [Ceiling("generation", 20, 10, 22)])
    (True, False)
    >>> below(e, k, [Ceiling("generation", 18, 11, 22)])  # about as much in all, less of its own: fewer rows at once
    True
    >>> below(e, k, [Ceiling("generation", 18, 11, 19)])  # less of its own, but more in all (more long-lived state)
    False
    >>> below(e, k, [Ceiling("generation", 20, 10, 22, (True, None))])  # a fragmentation under expandable segments
    True
    """
    return all(est.phases.get(c.phase, 0) < c.total
               or (est.phases.get(c.phase, 0) <= c.whole and est.own(c.phase) < c.mine)
               for c in ceilings if c.alloc is None or c.alloc == allocator(k))


class Judge:
    """The memory model as the climb's judge during a run, calibrated online by every attempt.

    After a successful attempt the measured peak sets the scale (measured / predicted). After an OOM the model
    learns a lower bound (what was allocated plus the failing request), and if it had predicted a fit, it raises its
    scale until the configuration no longer fits. So each failure makes the next decision more conservative.

    ``margin`` is kept free on top of the predicted device peak when judging a config: the model's error on real
    GPUs (a few percent) and on the simulated device (about 1%) must not turn a predicted fit into an OOM.
    ``relax_margin`` is kept free when a graded knob is relaxed towards the user's value: relaxing pushes a config to
    the device's edge for a few tokens or rows, so it stops where the model can be wrong the other way (on the
    simulated device, fragmentation up to 12% more than predicted; on a GPU the same ``margin``).

    ``doubt`` is the other side of that error: a config predicted over the device by less than this fraction may
    still fit (``plausible``), and only a probe can tell. It is the model's measured over-prediction
    (:meth:`stop_margin`): what is left after a probe has calibrated the allocated scale is mostly fragmentation,
    which depends on the order and sizes of allocations. The pre-flight stops only configs predicted over the device
    by more than it, and a config that ran out of memory in this run makes every config predicted within the doubt of
    it (or above it) count as not fitting (``failed``).

    The error is the one measured for the installed TRL's LM head (``set_trl``; the newest TRL's until the training
    process reports its own). A TRL newer than the tested releases is stopped before it runs only beyond
    ``UNTESTED_FACTOR`` times the device; its doubt stays that of its head, since the first probe calibrates the scale.
    """

    def __init__(self, capacity: int, *, simulated: bool = False, margin: float | None = None,
                 coefficients: Coefficients | None = None, context: int | None = None,
                 device_name: str | None = None, warn: Any = None, spec: ModelSpec | None = None) -> None:
        self.capacity = capacity
        self.simulated = simulated
        self.margin = (0.02 if simulated else 0.05) if margin is None else margin
        self.fixed_margin = margin is not None
        self.head: str | None = None  # the installed TRL's LM head, once known (RunFacts.trl_head)
        self.untested = False  # the installed TRL is newer than the newest tested release
        self._spec: tuple[Any, JudgeSpec] | None = None  # the judge as last built, and what it was built from
        self.unobserved: tuple[str, ...] = ()  # what the training process could not observe (RunFacts.unobserved)
        base = Coefficients.for_simulated() if simulated else Coefficients()
        self.context = context  # the device's memory outside the allocator when known (else the model's m_ctx)
        self.base = base
        # configs that ran out of memory in this run, each with the memory model's phase it ran out in (None: not
        # known) and the allocator settings it ran out under where they are what can help (a fragmentation)
        self.failed: list[tuple[RunFacts, Knobs, str | None, Alloc | None]] = []
        # what earlier runs on this machine learned (never for the simulated device: tests must not write ~/.cache)
        self.key = None if simulated or not device_name else machine_key(device_name, simulated=False)
        self.warn = warn
        self.fixed_spec = spec  # `oomguard plan`: the model is known before anything runs
        # what earlier probes of the same model on this machine learned: loaded once the model is known
        self.calibration: Calibration | None = None
        self.calibrated_for: str | None = None
        self.given = coefficients is not None
        self.coefficients = coefficients or base
        self.relax_margin = self._relax_margin()
        if spec is not None:
            self._calibrate(spec)
        self.doubt, self.doubt_source = self.stop_margin()

    def _calibrate(self, spec: ModelSpec) -> None:
        """Load what earlier worst-case probes of this model on this machine taught (``memory.calibration``), the
        first time the model is known and before this run has taught anything: another model's runs never apply."""
        mk = model_key(spec)
        if self.key is None or self.given or mk == self.calibrated_for:
            return
        first = self.calibrated_for is None
        self.calibrated_for = mk
        if not first:
            return  # the coefficients already carry what this run learned
        kw = {"warn": self.warn} if self.warn else {}
        self.calibration = load_calibration(self.key, model=mk, **kw)
        if self.calibration is not None:
            self.coefficients = self.calibration.apply(self.base)
            self.doubt, self.doubt_source = self.stop_margin()

    def judge_spec(self, stop_margin: float | None = None) -> JudgeSpec:
        """The judge as it stands (device, coefficients, measured error, margins: ``vocab.protocol.JudgeSpec``), the
        one plan part the training process decides with; ``stop_margin`` where the user set the pre-flight's."""
        key = (self.capacity, self.context, self.coefficients, id(self.calibration), self.margin, stop_margin)
        if self._spec is None or self._spec[0] != key:
            cal = self.calibration
            spread = cal.device_error() if cal is not None else None
            calibrated = None
            if cal is not None and spread is not None:
                calibrated = (max(0.0, spread), f"this machine's {cal.runs} recorded runs: up to "
                                                f"{100 * spread:.1f}% over")
            js = judge_spec(self.capacity, simulated=self.simulated, margin=self.margin, context=self.context,
                            coefficients=asdict(self.coefficients), calibrated=calibrated,
                            relax_margin=self.margin if self.fixed_margin or not self.simulated else None,
                            stop_margin=stop_margin)
            self._spec = (key, js)
        return self._spec[1]

    def _relax_margin(self) -> float:
        return rule.relax_margin(self.judge_spec(), self.head)

    def set_trl(self, head: str | None, untested: bool = False) -> None:
        """The installed TRL's LM head (``fused``/``logits``, None: not known) and whether it is newer than the newest
        tested release: predictions, margins and doubt follow them from now on."""
        self.head, self.untested = head, untested
        self.relax_margin = self._relax_margin()
        self.doubt, self.doubt_source = self.stop_margin(tested=True)

    def stop_margin(self, head: str | None = None, *, untested: bool | None = None,
                    tested: bool = False) -> tuple[float, str]:
        """How far over the device a config must be predicted before the pre-flight stops it, and where the figure
        comes from (``memory.estimate.fitverdict.stop_margin``): this machine's recorded runs, once there are enough
        of them, else the built-in fit's measured over-prediction for the installed TRL's LM head (H100 rows, or the
        simulated device's), plus :data:`~oomguard.memory.estimate.STOP_ALLOWANCE`; for a TRL newer than tested
        (``untested``, default: as :meth:`set_trl` said) only beyond UNTESTED_FACTOR times the device, unless
        ``tested`` asks for its head's own.

        >>> round(Judge(24 * 2**30).stop_margin()[0], 3), round(Judge(2**28, simulated=True).stop_margin()[0], 3)
        (0.084, 0.117)
        >>> Judge(2**28, simulated=True).stop_margin(untested=True)[0]
        2.02
        """
        untested = self.untested if untested is None else untested
        return rule.stop_margin(self.judge_spec(), head or self.head, untested=untested and not tested)

    def doubts(self, facts: RunFacts | None = None) -> Doubts:
        """What keeps the model from being sure of the run's configs (``memory.estimate.doubts_of``), with the TRL
        :meth:`set_trl` was told of."""
        facts = facts or RunFacts()
        d = doubts_of(self.spec(facts), facts, simulated=self.simulated)
        extra = tuple(f"not observed: {u}" for u in self.unobserved if f"not observed: {u}" not in d.unsure)
        if extra:
            d = Doubts(d.untested, d.unsure + extra)
        if self.untested and d.untested is None:
            d = Doubts("the installed TRL, or a stack around it, is newer than the tested releases", d.unsure)
        return d

    def verdict(self, est: Estimate, facts: RunFacts | None = None, stop_margin: float | None = None) -> FitVerdict:
        """The one verdict on ``est`` (``memory.estimate.verdict``): ``stop``, ``probe`` or ``run``, as the training
        process decides it with the plan's judge."""
        facts = facts or RunFacts()
        return verdict(est, self.judge_spec(stop_margin), head=self.head_for(facts), doubts=self.doubts(facts))

    def set_capacity(self, capacity: int) -> None:
        """The device's size as the training process sees it (it may differ from NVML's): judged from now on."""
        self.capacity = int(capacity)

    def set_context(self, context: int) -> None:
        """The context the training process measured outside the allocator (``--gpu-memory``): predictions from now
        on count it instead of the built-in figure."""
        self.context = int(context)

    def describe(self) -> str:
        """Which calibration the predictions use, for the report and `oomguard plan`."""
        if self.calibration is not None:
            return self.calibration.describe()
        return builtin_description(simulated=self.simulated)

    def head_for(self, facts: RunFacts) -> str | None:
        """The LM head to model: the one the training process reported, else the one :meth:`set_trl` was told."""
        return facts.trl_head or self.head

    def record(self, facts: RunFacts, knobs: Knobs, peak: int | None, reserved: int | None) -> None:
        """Keep a passing worst-case probe's measured peaks in this machine's calibration for this model
        (``oomguard.memory.calibration``): the probe runs the worst case the prediction is for."""
        if self.key is None or not peak:
            return
        spec = self.spec(facts)
        if spec is None:
            return
        try:
            est = predictor(spec, self.capacity, facts=facts, coefficients=self.base, simulated=self.simulated,
                            context=self.context, head=self.head_for(facts))(knobs)
        except ValueError:
            return
        kw = {"warn": self.warn} if self.warn else {}
        record_run(self.key, est.peak_alloc_bytes, peak, reserved, expandable=bool(knobs.expandable_segments),
                   model=model_key(spec), **kw)

    def spec(self, facts: RunFacts) -> ModelSpec | None:
        if self.fixed_spec is not None:
            return self.fixed_spec
        if not facts.model_config:
            return None
        try:
            spec = ModelSpec.from_config(facts.model_config)
        except (ValueError, KeyError, TypeError):
            return None
        self._calibrate(spec)
        return spec

    def predict(self, facts: RunFacts, knobs: Knobs) -> Estimate | None:
        spec = self.spec(facts)
        if spec is None:
            return None
        try:
            return predictor(spec, self.capacity, facts=facts, coefficients=self.coefficients,
                             simulated=self.simulated, context=self.context, head=self.head_for(facts))(knobs)
        except ValueError:  # EstimateError: knobs the model cannot judge (e.g. an unknown dtype)
            return None

    def learn(self, facts: RunFacts, knobs: Knobs, outcome: str, peak: int | None, report: Any = None,
              phase: str | None = None, fragmented: bool = False) -> None:
        """What an attempt teaches: a success its measured peak (the scale); an OOM a lower bound, the config it
        ran out with and the phase it ran out in (``phase``, the diagnosis's: judged per phase by :meth:`fits` and
        :meth:`plausible`; where the diagnosis is fragmentation, ``fragmented``, only under the same allocator
        settings, which are what can help it)."""
        est = self.predict(facts, knobs)
        if est is None:
            return
        co = self.coefficients
        if outcome == "ok" and peak:
            self.coefficients = co.calibrated(peak, est.peak_alloc_bytes)
        if outcome == "oom" and not (report is not None and report.backend == "host"):  # a device OOM
            self.ran_out(facts, knobs, phase, fragmented)
        if outcome == "oom" and report is not None:
            big = report.requested if report.requested and report.requested > 20 * 2**20 else 0  # not a rounded block
            lower = (report.allocated or 0) + big
            if lower > est.peak_alloc_bytes:
                co = co.calibrated(lower, est.peak_alloc_bytes)
            # it predicted a fit, and memory ran out: not conservative enough. Where the phase is known, the configs
            # that allocate as much there are judged not to fit (``_failed_phases``), and no other phase is known
            # wrong: those that run out there no longer, with fewer rows at once, keep their prediction
            if self.judge(est) and ESTIMATE_PHASE.get(phase or "") not in est.phases:
                limit = self.capacity / (1 + self.margin)
                co = co.calibrated(int(est.peak_alloc_bytes * limit / max(1, est.peak_bytes) * 1.05) + 1,
                                   est.peak_alloc_bytes)
            self.coefficients = co

    def ran_out(self, facts: RunFacts, knobs: Knobs, phase: str | None = None, fragmented: bool = False) -> None:
        """Keep a config that ran out of memory on the device in this run, the phase it ran out in (the diagnosis's
        word) and, for a fragmentation, the allocator settings it ran out under."""
        self.failed.append((facts, knobs, ESTIMATE_PHASE.get(phase or ""), allocator(knobs) if fragmented else None))

    def judge(self, est: Estimate, margin: float | None = None) -> bool:
        """Whether a predicted peak fits the device with the margin (default ``self.margin``) to spare, and a colocated
        vLLM's reservation holds what vLLM needs to start."""
        return chooses(est, self.judge_spec(), margin=margin)

    def fits(self, facts: RunFacts, margin: float | None = None) -> Any:
        """A Knobs -> bool judge for the climb, or None when the model cannot be read. A config predicted within the
        doubt of one that ran out of memory in this run (or above it) does not fit, whatever the device's size
        says: the model was wrong about that one, and as wrong about its neighbours. ``margin`` (default
        ``self.margin``; ``self.relax_margin`` for relaxing graded knobs) is kept free."""
        spec = self.spec(facts)
        if spec is None:
            return None
        if self.load_only(facts):
            return self.loads(facts, margin)
        ceiling = self.failed_ceiling(facts)
        phases = self._failed_phases(facts, 1 - self.doubt)

        def judge(k: Knobs) -> bool:
            est = self.predict(facts, k)
            return (est is not None and self.judge(est, margin) and (ceiling is None or est.peak_bytes < ceiling)
                    and below(est, k, phases))

        return judge

    def loads(self, facts: RunFacts, margin: float | None = None) -> Any:
        """A Knobs -> bool: the weights' load fits the device with ``margin`` to spare (default ``self.margin``), as
        the training process's pre-flight judges a load (``load_bytes``: the weights as the device places them, nearly
        exact whatever else the model gets wrong); None without a model."""
        spec = self.spec(facts)
        if spec is None:
            return None

        def load_fits(k: Knobs) -> bool:
            try:
                need = load_bytes(spec, k, coefficients=self.coefficients, simulated=self.simulated,
                                  context=self.context, **load_fed(facts))
            except ValueError:
                return False
            return chooses(need, self.judge_spec(), margin=margin)

        return load_fits

    @staticmethod
    def load_only(facts: RunFacts) -> bool:
        """Whether only the load can be judged: the run stopped before GRPOTrainer was built (a load the pre-flight
        judged alone), so the step's shapes are not known yet, the load is. A config whose load fits is worth a
        launch: its trainer's pre-flight judges the rest, with the prompt lengths."""
        return facts.model_source is None and facts.prompt_tokens_max is None

    def failed_ceiling(self, facts: RunFacts) -> int | None:
        """Below what predicted peak a config must be to be tried after the OOMs of this run whose phase is not known:
        the smallest predicted peak of such a config, less the doubt (None before any). An OOM in a known phase holds
        for that phase alone (:meth:`_failed_phases`): the phases after it never ran."""
        peaks = self._failed_peaks(facts)
        return int(min(peaks) * (1 - self.doubt)) if peaks else None

    def _failed_peaks(self, facts: RunFacts) -> list[int]:
        return [e.peak_bytes for _f, k, ph, _a in self.failed
                if (e := self.predict(facts, k)) is not None and (ph is None or ph not in e.phases)]

    def _failed_phases(self, facts: RunFacts, share: float = 1.0) -> list[Ceiling]:
        """Below what predicted allocation a config must be in each phase a config ran out in (``share`` of that
        config's prediction for the phase, in all or in the phase's own memory): a config that allocates as much in
        the phase an OOM happened in runs out there again, whatever it saves elsewhere (a micro-batch split after an
        OOM in generation generates the same rows at once); one that generates fewer rows at once may not, though
        the long-lived state it shares with the failed config is most of both."""
        return [Ceiling(ph, int(e.phases[ph] * share), int(e.own(ph) * share), e.phases[ph], alloc)
                for _f, k, ph, alloc in self.failed
                if ph is not None and (e := self.predict(facts, k)) is not None and ph in e.phases]

    def plausible(self, facts: RunFacts, doubt: float | None = None) -> Any:
        """A Knobs -> bool: the config may fit (predicted at most ``doubt``, default ``self.doubt``, over the
        device, and below every config that ran out of memory on the device in this run); None without a model.

        What ``oomguard run`` probes after the chosen config fits, to learn whether a change it kept is needed. The
        model's error is mostly common to configs of one run, so one predicted to need as much as a config that ran
        out of memory here (the same, less a change that saves memory) is not worth a probe, however large the
        model's error is (the logits LM head of TRL 0.29-1.14: 40%)."""
        if self.spec(facts) is None:
            return None
        limit = self.capacity * (1 + (self.doubt if doubt is None else doubt))
        failed = self._failed_peaks(facts)
        if failed:
            limit = min(limit, min(failed) - 1)
        phases = self._failed_phases(facts)

        def maybe(k: Knobs) -> bool:
            est = self.predict(facts, k)
            return est is not None and est.peak_bytes <= limit and below(est, k, phases)

        return maybe

    def vllm_floor(self, facts: RunFacts, knobs: Knobs) -> float | None:
        """The least ``vllm_gpu_memory_utilization`` with which a colocated vLLM starts on this device, with its
        ``vllm_max_model_length`` no longer than the run's sequences (as the ``vllm_memory`` rung sets it) and the
        model's margin kept free; None without vLLM colocate or a model.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> cfg = {"vocab_size": 724, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        ...        "num_key_value_heads": 2, "intermediate_size": 1024, "tie_word_embeddings": True}
        >>> Judge(150 * 2**20, simulated=True).vllm_floor(RunFacts(model_config=cfg, prompt_tokens_max=20),
        ...                                               TRL_DEFAULTS.replace(use_vllm=True))
        0.46
        """
        spec = self.spec(facts)
        if spec is None or not knobs.use_vllm or (knobs.vllm_mode or "colocate") != "colocate":
            return None
        length = (facts.prompt_tokens_max or 256) + int(knobs.max_completion_length or 512)
        v = vllm_memory(spec, knobs.replace(vllm_max_model_length=length), self.capacity)
        if v is None:
            return None
        return min(1.0, math.ceil(100 * v.floor * (1 + self.margin) / self.capacity) / 100)

    def alternatives(self, climb: Climb, final: Knobs) -> list[Alternative]:
        """Configs predicted to fit with the model's error as headroom that trade differently from ``final``, the
        config ``climb`` chose (``oomguard.decide.alternatives``): one computation for `oomguard run`'s end and
        `oomguard plan`."""
        fits = self.fits(climb.facts, self.relax_margin)
        if fits is None:
            return []
        return alternatives(climb.original(), final, climb.applied, climb.facts, fits, self.peak(climb.facts),
                            ladder=climb.ladder, skip=tuple(climb.refused), slowdown=self.slowdown(climb.facts))

    def slowdown(self, facts: RunFacts) -> Any:
        """A (before, after) -> how much longer a step of ``after`` is predicted to take (0.1 for 10%), or None;
        None without a model (``oomguard.memory.steptime``)."""
        spec = self.spec(facts)
        if spec is None:
            return None

        def longer(before: Knobs, after: Knobs) -> float | None:
            return slowdown(spec, before, after, prompt_tokens=facts.prompt_tokens_max, world_size=facts.world_size)

        return longer

    def peak(self, facts: RunFacts) -> Any:
        """A Knobs -> predicted device peak (bytes or None), for the report's reasons."""
        def predicted(k: Knobs) -> int | None:
            est = self.predict(facts, k)
            return est.peak_bytes if est is not None else None

        return predicted
