"""Pre-flight: stop a configuration the memory model is sure cannot fit, before it loads or generates anything, and
decide whether an attempt launched as a probe is the real run.

The training process knows the model's shape before anything is placed on the device: from the checkpoint's config
(a model TRL loads by name, or one the script loads with ``from_pretrained``), or from the model already built. It
asks the one verdict (``memory.estimate.verdict``) with the plan's judge (``vocab.protocol.JudgeSpec``, the
supervisor's Judge as it stands), as the supervisor's climb and `oomguard plan` do:

- ``stop`` (predicted over the device by more than the stop margin, or a colocated vLLM's share that cannot hold what
  vLLM needs): running on would only cost a load or a generation and a crash, and on a shared GPU an OOM that a
  neighbour feels. The process reports a ``predicted`` event, ends with ``how=predicted`` and exits with
  ``EXIT_PREDICTED``; the supervisor records the attempt with the outcome ``predicted`` (from the events, whatever
  code a launcher between them turns that exit into) and chooses the next config as after an OOM.
- ``run`` or ``probe``: an attempt launched as a probe unless the model is sure (``ProbePlan.unless_sure``) becomes
  the real run, or stays a probe (``decide_probe``, ``memory.estimate.launch_as``).

Three points check:

- :func:`check` when ``GRPOTrainer`` is built (the model, the knobs and the prompt lengths are known): the whole step;
- the same before TRL loads a model given to ``GRPOTrainer`` by name (``check`` with the checkpoint's config);
- :func:`check_load` before a script's own ``from_pretrained`` places the weights: the load alone (the weights in the
  load's dtype plus the context), since the rest of the config may not be known yet.

Pure apart from the process exit: no torch import here.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from ..memory.estimate import (
    STOP,
    Coefficients,
    FitVerdict,
    ModelSpec,
    doubts_of,
    estimate,
    fed,
    launch_as,
    load_bytes,
    load_fed,
    verdict,
)
from ..memory.estimate.fitverdict import stop_margin
from ..vocab.events import PreflightStop
from ..vocab.facts import RunFacts
from ..vocab.knobs import Knobs
from ..vocab.protocol import END_PREDICTED, EXIT_PREDICTED, JudgeSpec
from ..vocab.sizes import format_size
from .runtime import Runtime, rank

# A load is the weights themselves, known to the byte: its stop margin is the allocator's rounding, never the step's
# (the logits LM head of TRL 0.29-1.14 is stopped only 40% over: that error is the step's, not the weights'). On a
# card the CUDA context's spread comes on top; the simulated device rounds every block up, so a load predicted over it
# is over it (the half percent allows for a checkpoint whose parameter count the config misstates slightly).
LOAD_MARGIN = 0.1
SIMULATED_LOAD_MARGIN = 0.005


def _coefficients(js: JudgeSpec) -> Coefficients:
    fields = set(Coefficients.__dataclass_fields__)
    return Coefficients(**{k: v for k, v in js.coefficients.items() if k in fields})


def judged(rt: Runtime, config: dict[str, Any] | None = None) -> tuple[Any, FitVerdict] | None:
    """The memory model's Estimate of this attempt's config (of the model ``config``, default the one the process
    reported) and the verdict on it with the plan's judge, or None when there is no judge or the model cannot judge
    the config."""
    js = rt.plan.judge
    config = config or rt.model_config
    if js is None or not config:
        return None
    try:
        spec = ModelSpec.from_config(config)
        facts = RunFacts.from_dict(rt.facts())
        knobs = rt.knobs()
        est = estimate(spec, knobs, world_size=int(facts.world_size or 1), prompt_tokens=facts.prompt_tokens_max,
                       coefficients=_coefficients(js), simulated=js.simulated, capacity=js.capacity,
                       context=js.context, head=facts.trl_head, **fed(spec, facts, knobs))
    except (ValueError, KeyError, TypeError):
        return None
    return est, verdict(est, js, head=facts.trl_head, doubts=doubts_of(spec, facts, simulated=js.simulated))


def check(rt: Runtime, before: str = "generates") -> None:
    """Stop the process (exit ``EXIT_PREDICTED``) where the pre-flight is on and the verdict on this config is
    ``stop``.

    ``before`` names what the stop saves, for the message: ``generates`` (the trainer is built) or ``loads`` (TRL
    has not loaded the model yet)."""
    if not rt.plan.preflight:
        return
    j = judged(rt)
    if j is not None and j[1].decision == STOP:
        v = j[1]
        if v.short is not None and v.short[0] == "vllm":  # vLLM would refuse to start, whatever room the device has
            _stop(rt, v, v.vllm_note, before, over=False)
        _stop(rt, v, f"this config is predicted to need {format_size(v.predicted)}", before)


def decide_probe(rt: Runtime, config: dict[str, Any] | None) -> None:
    """An attempt launched as a probe unless the memory model is sure of its config (``ProbePlan.unless_sure``):
    decide it once the config, the model's shape (``config``) and the prompt lengths are known, before anything is
    generated, by the one verdict (``memory.estimate.verdict``) with the plan's judge: sure (predicted clearly under
    the device, with the model's measured under-prediction for this TRL's LM head): this launch is the real run. Near
    the edge, a TRL or a stack around it that no measurement covers, a family measured on the simulated device only
    (on a GPU), or a model the memory model cannot read: a probe. A config the pre-flight stops is left to
    :func:`check`."""
    if not rt.probe_undecided():
        return
    j = judged(rt, config)
    if j is None:
        rt.decide_probe("probe", "the memory model cannot judge this config")
        return
    v = j[1]
    how = launch_as(v.decision, probe=True, deferred=True, preflight=rt.plan.preflight)
    if how == STOP:
        rt.probe_as = "probe"  # the pre-flight stops it next, and says why: nothing to decide
        return
    rt.decide_probe(how, v.line(), predicted_bytes=v.predicted, capacity=v.capacity, limit=v.sure_limit)


class _Load:
    """A load's prediction, judged by the same verdict as a step's: the weights and the context, no vLLM."""

    vllm_lacks, notes, unmodelled = 0, (), ()

    def __init__(self, need: int) -> None:
        self.peak_bytes = need


def check_load(rt: Runtime, config: dict[str, Any], knobs: Knobs) -> None:
    """Before ``from_pretrained`` places a model's weights: stop when the load alone is sure not to fit (the verdict
    with the load's own stop margin, :data:`LOAD_MARGIN`, at most the step's).

    ``config`` is the checkpoint's config (``config.json`` fields, already reported in a ``model`` event), ``knobs``
    carry the load's dtype and 4-bit."""
    js = rt.plan.judge
    if js is None or not rt.plan.preflight:
        return
    try:
        spec = ModelSpec.from_config(config)
        facts = RunFacts.from_dict(rt.facts())
        need = load_bytes(spec, knobs, coefficients=_coefficients(js), simulated=js.simulated, context=js.context,
                          **load_fed(facts))
    except (ValueError, KeyError, TypeError):
        return
    untested = doubts_of(spec, facts, simulated=js.simulated).untested is not None
    margin = min(SIMULATED_LOAD_MARGIN if js.simulated else LOAD_MARGIN,
                 stop_margin(js, facts.trl_head, untested=untested)[0])
    v = verdict(_Load(need), replace(js, stop_margin=margin), head=facts.trl_head)
    if v.decision != STOP:
        return
    how = "4-bit" if knobs.load_in_4bit else knobs.dtype or "float32"
    _stop(rt, v, f"loading this model needs {format_size(need)} (its weights in {how})", "loads")


def _stop(rt: Runtime, v: FitVerdict, what: str, before: str, over: bool = True) -> None:
    cap = v.capacity
    rt.emit(PreflightStop(predicted_bytes=v.predicted, capacity=cap, margin=v.stop_margin, before=before,
                          reason=None if over else what))
    if rank() in (None, 0):  # every rank predicts the same: one line for the job, not one per rank
        why = (f"{what}, {100 * (v.predicted / cap - 1):.0f}% over the {format_size(cap)} device (the stop margin is "
               f"{100 * v.stop_margin:.1f}%, {v.stop_source})" if over else what)
        sys.stderr.write(f"oomguard: pre-flight: {why}; stopping before it {before} (--no-preflight runs it "
                         "anyway)\n")
        sys.stderr.flush()
    rt.stopping_on_purpose()
    rt.end(END_PREDICTED)
    raise SystemExit(EXIT_PREDICTED)
