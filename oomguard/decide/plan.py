"""Predict before running: the memory model applied to a configuration, the verdict `oomguard run` acts on, and the
cheapest rungs that make it fit.

``make_plan`` asks the one verdict (``memory.estimate.verdict``: sure to fit, probe first, predicted not to fit) and
how `oomguard run` starts the config (``Conductor.starts``). Where the climb would not keep the config as it is, it
climbs the ladder in its own order (never reordered) with the memory model as the judge up to the first prefix
predicted to fit, then keeps only what memory demands (``oomguard.decide.choose``: rungs not needed are dropped, graded
knobs relaxed towards the user's values). `oomguard plan` prints it; `oomguard run` and `guard` use the same climb after
an OOM to skip rungs predicted not to be enough.

>>> from oomguard.memory.estimate import ModelSpec
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> spec = ModelSpec(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
...                  intermediate_size=8192, tie_word_embeddings=True)
>>> p = make_plan(spec, TRL_DEFAULTS, 16 * 2**30)   # TRL loads a model given by name in float32
>>> p.first, p.then, p.fallback.lora_r   # bf16 weights would not learn at 1e-6: LoRA, if a cheaper trial runs out
('stop', 'probe', 16)
>>> [s.remedy.name for s in make_plan(spec, TRL_DEFAULTS.replace(learning_rate=1e-4), 16 * 2**30).steps][-1]
'bf16_load'
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..memory.estimate import (
    PROBE,
    RUN,
    STOP,
    Coefficients,
    Estimate,
    FitVerdict,
    ModelSpec,
    load_pixel_budget,
    not_modelled,
)
from ..vocab.diagnosis import Diagnosis
from ..vocab.ended import Ended
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.oomreport import OOMReport
from ..vocab.records import AttemptKind, Outcome
from ..vocab.trlrange import support
from .alternatives import Alternative
from .choose import Rung
from .climb import Climb
from .conductor import Conductor, Policy
from .fit import largest
from .judge import Judge
from .ladder import Ladder, Step, load_ladder
from .split import LENGTH_KNOB, SHARE_KNOB, SPLIT_KNOBS, length_split, share_split


@dataclass
class Prediction:
    estimate: Estimate
    capacity: int
    knobs: Knobs
    steps: list[Step] = field(default_factory=list)
    after: Estimate | None = None  # the prediction with the suggested rungs
    exhausted: bool = False
    rungs: list[Rung] = field(default_factory=list)  # the suggested rungs as the choice keeps them (relaxed values)
    choose_by: str = "cost"  # how the ladder chose them (its ``choose_by``)
    judge: Judge | None = None  # the judge, as `oomguard run` would judge
    facts: RunFacts | None = None
    climb: Climb | None = None  # the choice as `oomguard run` makes it (None when the config is kept as it is)
    verdict: FitVerdict | None = None  # the one verdict on the config as given (``memory.estimate.verdict``)
    first: str = "probe"  # how `oomguard run` starts it: ``run``, ``probe`` or ``stop`` (``Conductor.starts``)
    after_verdict: FitVerdict | None = None  # the verdict on the choice
    then: str | None = None  # how `oomguard run` starts the choice (None: no choice)
    fallback: Knobs | None = None  # where the choice is a cheaper trial: the config run takes if the trial runs out

    def alternatives(self) -> list[Alternative]:
        """Configs predicted to fit that trade differently from the suggestion (``Judge.alternatives``)."""
        if self.judge is None or self.climb is None or not self.steps or self.after is None:
            return []
        return self.judge.alternatives(self.climb, self.steps[-1].knobs)

    @property
    def fits(self) -> bool:
        """Whether the config is not predicted not to fit: the verdict is ``run`` or ``probe``, never ``stop``."""
        return self.verdict is None or self.verdict.decision != STOP

    def launches(self) -> dict[str, str | None]:
        """What `oomguard run` would do with this config on this device, by the same rules (the one verdict and
        ``Conductor.starts``): ``first`` is ``run`` (the memory model is sure it fits: one launch, the real run),
        ``probe`` (a short worst-case probe first) or ``stop`` (predicted not to fit: stopped before it generates,
        then the choice); ``then``: how the chosen config starts (``run`` or ``probe``), None where there is no
        choice."""
        return {"first": self.first, "then": self.then}

    @property
    def headroom(self) -> int:
        return self.capacity - self.estimate.peak_bytes

    @property
    def suggest(self) -> dict[str, Any]:
        """What `oomguard run` changes for its next launch: the choice, or the cheaper trial it probes first."""
        if not self.steps:
            return {}
        return self._changes(self.steps[-1].knobs)

    def _changes(self, final: Knobs) -> dict[str, Any]:
        return {r.knob: (list(r.after) if isinstance(r.after, tuple) else r.after) for r in self.knobs.diff(final)}

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "peak_bytes": e.peak_bytes,
            "capacity_bytes": self.capacity,
            "fits": self.fits,
            "headroom_bytes": self.headroom,
            "trainable_params": e.trainable_params,
            "total_params": e.total_params,
            "breakdown": dict(e.breakdown),
            "phases": dict(e.phases),
            "dominant_phase": e.dominant_phase,
            "suggest": self.suggest,
            "fallback": self._changes(self.fallback) if self.fallback is not None else None,
            "remedies": [s.remedy.name for s in self.steps],
            "peak_bytes_after": self.after.peak_bytes if self.after else None,
            "fits_after": self.after_verdict.decision != STOP if self.after_verdict else None,
            "run": self.launches(),
            "verdict": self.verdict.to_dict() if self.verdict else None,
            "verdict_after": self.after_verdict.to_dict() if self.after_verdict else None,
        }




def plan_images(spec: ModelSpec, knobs: Knobs, model_path: str | Path, per_prompt: int | None,
                size: str | None) -> tuple[dict[str, Any], Knobs]:
    """`oomguard plan`'s images for a vision-language model: RunFacts fields (images per prompt, default 1; the
    largest image's ``HxW``; the processor's least budget) and the knobs with its pixel budget (``max_pixels``: the
    one given, else the model directory's ``preprocessor_config.json``'s); nothing for a text model. A size that is
    not ``HxW`` raises ValueError.

    >>> from oomguard.memory.estimate import VisionSpec
    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> vl = replace(ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True), vision=VisionSpec("merger", 2, 64, 128, 4, 14, 256))
    >>> plan_images(vl, TRL_DEFAULTS, "/nonexistent", None, "1080x1920")[0]
    {'images_per_prompt': 1, 'image_height': 1080, 'image_width': 1920}
    """
    if spec.vision is None:
        if per_prompt or size:
            raise ValueError(f"{model_path} is not a vision-language model (no vision_config): --images-per-prompt "
                             "and --image-size apply only to one")
        return {}, knobs
    facts: dict[str, Any] = {"images_per_prompt": 1 if per_prompt is None else per_prompt}
    if size:
        h, sep, w = size.lower().partition("x")
        if not (sep and h.strip().isdigit() and w.strip().isdigit() and int(h) > 0 and int(w) > 0):
            raise ValueError(f"--image-size takes HEIGHTxWIDTH in pixels, e.g. 1080x1920, not {size!r}")
        facts.update(image_height=int(h), image_width=int(w))
    where = Path(model_path)
    low, high = load_pixel_budget(where if where.is_dir() else where.parent)
    if spec.vision.kind == "siglip":
        facts["pixel_budget_floor"] = spec.vision.image_size ** 2
    elif low:
        facts["pixel_budget_floor"] = low
    if knobs.max_pixels is None and high:
        knobs = knobs.replace(max_pixels=high)
    return facts, knobs


def make_plan(spec: ModelSpec, knobs: Knobs, capacity: int, *, ladder: Ladder | None = None,
              facts: RunFacts | None = None, prompt_tokens: int | None = None,
              coefficients: Coefficients | None = None, simulated: bool = False,
              device_name: str | None = None, context: int | None = None) -> Prediction:
    """Predict ``knobs`` on a device of ``capacity`` bytes, with the verdict `oomguard run` acts on and how it starts
    the config (a conductor with run's default policy); where the climb would not keep the config as it is, the
    config ``oomguard run`` would launch next: after the pre-flight's stop (verdict ``stop``), or after its probe ran
    out of memory (verdict ``probe``, predicted over the climb's headroom: the OOM's own figures, which run would learn
    from, are not known here), the same conductor's ``choose`` judged by the same ``Judge`` (the model's error kept
    free as headroom where a config has it; a cheaper trial first, with the choice as its ``fallback``), so plan never
    recommends a config run would not pick. The LM head is ``facts.trl_head`` (the installed TRL's or
    ``--trl-version``'s, where the caller knows it), else the newest TRL's; ``device_name``
    (NVML's) loads what earlier probes of this model on this machine taught, unless ``coefficients`` are given;
    ``context`` is the device's memory outside the allocator where known (a simulated device's)."""
    facts = (facts or RunFacts()).replace(model_source=(facts.model_source if facts else None) or "string",
                                          prompt_tokens_max=prompt_tokens or 256)  # the estimate's default
    judge = Judge(capacity, simulated=simulated, coefficients=coefficients, spec=spec, device_name=device_name,
                  context=context)
    # judged as `oomguard run` judges this TRL: a release newer than the tested ones, or a stack whose memory no
    # measurement covers, is verified by a probe (Conductor.take_trl)
    judge.set_trl(facts.trl_head, support(facts.trl_version).untested or bool(facts.stack_untested))
    facts = facts.replace(vllm_min_utilization=judge.vllm_floor(facts, knobs))
    est = judge.predict(facts, knobs)
    assert est is not None  # the spec is fixed: only knobs the model cannot judge fail, and those raise
    lad = ladder or load_ladder("default")
    climb = Climb(lad, base=knobs, facts=facts)
    run = Conductor(climb, judge, Policy(), capacity=capacity)  # how `oomguard run` starts a config
    v = judge.verdict(est, facts)
    plan = Prediction(estimate=est, capacity=capacity, knobs=knobs, judge=judge, facts=facts, verdict=v,
                      first=run.starts(v))
    if judge.judge(est) or plan.first == RUN:
        return plan  # the climb keeps it as it is
    # the first attempt as run ends it: stopped by the pre-flight, or its probe out of memory. What fits this card
    # (`--fit`) is the judge's before that ending, which marks the config failed and so every config above it
    plan.judge = copy.deepcopy(judge)
    run.take(Ended(knobs=knobs.to_dict(), remedies=[], exit_code=None, seconds=0.0, kind=AttemptKind.PROBE,
                   outcome=Outcome.PREDICTED if plan.first == STOP else Outcome.OOM))
    # the choice `oomguard run` would make: its conductor's, with nothing launched (every knob reaches); after a stop
    # for vLLM's share, on the diagnosis run's classify gives that stop. Where the choice changes what is trained or
    # learned and a cheaper config may fit, run probes that one first (a trial), and the choice only if it runs out
    nxt = run.choose(None, vllm_stop(v))
    decision = next(s.decision for s in nxt.said if s.decision is not None)
    plan.climb = climb
    plan.choose_by = lad.choose_by
    if decision.exhausted is not None:
        plan.exhausted = True
        return plan
    final = climb.effective()[0]
    kept = {r.name for r in climb.applied}
    steps = list({s.remedy.name: s for s in decision.steps if s.remedy.name in kept}.values())  # one per rung
    if steps:
        steps[-1] = replace(steps[-1], knobs=final)
    plan.steps, plan.rungs = steps, list(climb.applied)
    plan.after = judge.predict(facts, final) if steps else None
    if plan.after is not None:
        plan.after_verdict = judge.verdict(plan.after, facts)
        plan.then = run.starts(plan.after_verdict)
    if climb.trial_of is not None:
        plan.fallback = climb.trial_of.knobs
    return plan


def vllm_stop(v: FitVerdict) -> Diagnosis | None:
    """The diagnosis of a pre-flight stop for vLLM's share, as `oomguard run` reads the stop (``run.classify``: vLLM
    would refuse to start, its KV cache cannot hold one sequence); None for any other verdict."""
    if v.short is None or v.short[0] != "vllm":
        return None
    return Diagnosis(kind="vllm-reservation", phase="unknown", evidence=(v.vllm_note,),
                     report=OOMReport(backend="vllm", origin="vllm-kv", message=v.vllm_note))


def run_value(p: Prediction, knob: str) -> Any:
    """The value of ``knob`` `oomguard run` launches with on this card: the user's, unless the pre-flight stops their
    config (then its choice's; None where no choice is predicted to get past the pre-flight)."""
    if p.first != STOP:
        k = p.knobs
    elif p.steps and not p.exhausted and p.then != STOP:
        k = p.steps[-1].knobs
    else:
        return None
    value = getattr(k, knob)
    if value is None and knob == SHARE_KNOB:
        return 0.3  # TRL's default share
    if value is None and knob == LENGTH_KNOB and p.judge is not None and p.judge.fixed_spec is not None:
        return p.judge.fixed_spec.max_positions or 2048  # vLLM takes the model's whole window
    return value


def card_row(p: Prediction, gpu: str, fit: str | None, *, world_size: int = 1, upper: int | None = None
             ) -> dict[str, Any]:
    """One card's row of `oomguard plan --gpu A,B,...`: the predicted peak, the verdict `oomguard run` acts on, what
    run would change where it stops the config, and with ``fit`` the largest value of that knob that fits (for vLLM's
    share and context: the range where vLLM and training both fit, which side is short where none does, and the value
    run launches with)."""
    v = p.verdict
    assert v is not None and p.judge is not None and p.facts is not None
    row: dict[str, Any] = {"gpu": gpu, "capacity_bytes": p.capacity, "peak_bytes": p.estimate.peak_bytes,
                           "fits": p.fits, "verdict": v.decision, "verdict_line": v.line(),
                           "short": {"side": v.short[0], "bytes": v.short[1]} if v.short else None,
                           "suggest": p.suggest if p.first == STOP else {}, "exhausted": p.exhausted,
                           "not_modelled": not_modelled(p.estimate.unmodelled)}
    if fit in SPLIT_KNOBS:
        split = (share_split(p.judge, p.facts, p.knobs) if fit == SHARE_KNOB
                 else length_split(p.judge, p.facts, p.knobs, upper))
        row.update(fit_knob=fit, fit_value=split.high, **split.to_dict(), run_value=run_value(p, fit))
    elif fit is not None:
        judge = p.judge.fits(p.facts)
        row["fit_knob"] = fit
        row["fit_value"] = largest(judge, p.knobs, fit, world_size=world_size, upper=upper) if judge else None
    return row


def card_rows(spec: ModelSpec, knobs: Knobs, cards: list[tuple[str, int]], fit: str | None, *, ladder: Ladder,
              facts: RunFacts, prompt_tokens: int | None, world_size: int = 1,
              device_name: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """`oomguard plan` with several cards or ``--fit``: one row per ``(name, bytes)`` card (:func:`card_row`), and the
    verdict the exit code follows: the least favourable card's, or with ``fit`` ``run`` where some value fits every
    card, else ``stop``."""
    upper = None
    if fit == "max_completion_length" and spec.max_positions:  # the prompt and the completion share the context
        upper = max(1, spec.max_positions - (prompt_tokens or 256))
    elif fit == LENGTH_KNOB:
        upper = spec.max_positions  # vLLM refuses a context longer than the model's
    rows = [card_row(make_plan(spec, knobs, cap, ladder=ladder, facts=facts, prompt_tokens=prompt_tokens,
                               device_name=device_name), name, fit, world_size=world_size, upper=upper)
            for name, cap in cards]
    if fit:
        return rows, RUN if all(r["fit_value"] is not None for r in rows) else STOP
    return rows, min((r["verdict"] for r in rows), key=(STOP, PROBE, RUN).index)
