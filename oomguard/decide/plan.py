"""Predict before running: the memory model applied to a configuration, and the cheapest rungs that make it fit.

``make_plan`` climbs the ladder in its own order (never reordered) with the memory model as the judge up to the first
prefix predicted to fit, then keeps only what memory demands (``oomguard.decide.choose``: rungs not needed are dropped,
graded knobs relaxed towards the user's values). `oomguard plan` prints it; `oomguard run` and `guard` use the same climb after an OOM
to skip rungs predicted not to be enough.

>>> from oomguard.memory.estimate import ModelSpec
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> spec = ModelSpec(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
...                  intermediate_size=8192, tie_word_embeddings=True)
>>> p = make_plan(spec, TRL_DEFAULTS, 16 * 2**30)   # TRL loads a model given by name in float32
>>> p.fits, p.after.fits(16 * 2**30), [s.remedy.name for s in p.steps][-1]   # bf16 weights would not learn at 1e-6
(False, True, 'lora')
>>> [s.remedy.name for s in make_plan(spec, TRL_DEFAULTS.replace(learning_rate=1e-4), 16 * 2**30).steps][-1]
'bf16_load'
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..memory.estimate import (
    Coefficients,
    Estimate,
    ModelSpec,
    load_pixel_budget,
)
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.trlrange import support
from .alternatives import Alternative
from .choose import Rung
from .climb import Climb
from .conductor import Conductor, Policy
from .judge import Judge
from .ladder import Ladder, Step, load_ladder


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
    climb: Climb | None = None  # the choice as `oomguard run` makes it (None when the config fits as it is)

    def alternatives(self) -> list[Alternative]:
        """Configs predicted to fit that trade differently from the suggestion (``Judge.alternatives``)."""
        if self.judge is None or self.climb is None or not self.steps or self.after is None:
            return []
        return self.judge.alternatives(self.climb, self.steps[-1].knobs)

    @property
    def fits(self) -> bool:
        return self.estimate.fits(self.capacity)

    def launches(self) -> dict[str, str | None]:
        """What `oomguard run` would do with this config on this device, by the same rules: ``first`` is ``run``
        (the memory model is sure it fits: one launch, the real run), ``probe`` (a short worst-case probe first) or
        ``stopped`` (predicted over the device by more than the pre-flight's margin: stopped before it generates,
        then the choice); ``then``, after a stop or where the config does not fit: how the chosen config starts
        (``run`` or ``probe``), None where there is no choice."""
        judge = self.judge
        if judge is None:
            return {"first": "probe", "then": None}
        margin = judge.stop_margin()[0]
        if judge.sure(self.estimate):
            first = "run"
        elif self.estimate.peak_bytes > self.capacity * (1 + margin):
            first = "stopped"
        else:
            first = "probe"
        then = None
        if self.after is not None and self.climb is not None:
            then = "run" if judge.sure(self.after) and self.climb.probe_may_be_skipped() else "probe"
        return {"first": first, "then": then}

    @property
    def headroom(self) -> int:
        return self.capacity - self.estimate.peak_bytes

    @property
    def suggest(self) -> dict[str, Any]:
        if not self.steps:
            return {}
        final = self.steps[-1].knobs
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
            "remedies": [s.remedy.name for s in self.steps],
            "peak_bytes_after": self.after.peak_bytes if self.after else None,
            "fits_after": self.after.fits(self.capacity) if self.after else None,
            "run": self.launches(),
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
              device_name: str | None = None) -> Prediction:
    """Predict ``knobs`` on a device of ``capacity`` bytes; if it does not fit, the config ``oomguard run`` would
    choose: the same ``Conductor.choose`` judged by the same ``Judge`` (the model's error kept free as headroom where
    a config has it), so plan never recommends a config run would not pick. The LM head is ``facts.trl_head`` (the
    installed TRL's or ``--trl-version``'s, where the caller knows it), else the newest TRL's; ``device_name`` (NVML's) loads what earlier
    probes of this model on this machine taught, unless ``coefficients`` are given."""
    facts = (facts or RunFacts()).replace(model_source=(facts.model_source if facts else None) or "string",
                                          prompt_tokens_max=prompt_tokens)
    judge = Judge(capacity, simulated=simulated, coefficients=coefficients, spec=spec, device_name=device_name)
    # judged as `oomguard run` judges this TRL: a release newer than the tested ones, or a stack whose memory no
    # measurement covers, is verified by a probe (Conductor.take_trl)
    judge.set_trl(facts.trl_head, support(facts.trl_version).untested or bool(facts.stack_untested))
    facts = facts.replace(vllm_min_utilization=judge.vllm_floor(facts, knobs))
    est = judge.predict(facts, knobs)
    assert est is not None  # the spec is fixed: only knobs the model cannot judge fail, and those raise
    plan = Prediction(estimate=est, capacity=capacity, knobs=knobs, judge=judge, facts=facts)
    if est.fits(capacity):
        return plan
    lad = ladder or load_ladder("default")
    climb = Climb(lad, base=knobs, facts=facts)
    # the choice `oomguard run` would make after its first OOM: its conductor's, with nothing launched (every knob
    # reaches) and no probe to settle a cheaper trial
    nxt = Conductor(climb, judge, Policy(probe_steps=0), capacity=capacity).choose(None, None)
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
    return plan


