"""Pre-flight: stop a configuration the memory model is sure cannot fit, before it loads or generates anything.

The training process knows the model's shape before anything is placed on the device: from the checkpoint's config
(a model TRL loads by name, or one the script loads with ``from_pretrained``), or from the model already built. When
the predicted device peak exceeds the capacity by more than the margin (the memory model's measured error, chosen by
the supervisor: see ``oomguard.decide.plan.Judge.stop_margin``), running on would only cost a load or a generation and
a crash, and on a shared GPU an OOM that a neighbour feels. The process reports a ``predicted`` event, ends with
``how=predicted`` and exits with ``EXIT_PREDICTED``; the supervisor records the attempt with the outcome
``predicted`` (from the events, whatever code a launcher between them turns that exit into) and chooses the next
config as after an OOM. A prediction that is merely close runs as usual.

Three points check:

- :func:`check` when ``GRPOTrainer`` is built (the model, the knobs and the prompt lengths are known): the whole step;
- the same before TRL loads a model given to ``GRPOTrainer`` by name (``check`` with the checkpoint's config);
- :func:`check_load` before a script's own ``from_pretrained`` places the weights: the load alone (the weights in the
  load's dtype plus the context), since the rest of the config may not be known yet.

Pure apart from the process exit: no torch import here.

>>> verdict(PreflightPlan(capacity=100, margin=0.08), predicted=120)
'over'
>>> verdict(PreflightPlan(capacity=100, margin=0.08), predicted=107) is None
True
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from ..memory.estimate import (
    DEVICE_OVERPREDICTION,
    STOP_ALLOWANCE,
    Coefficients,
    ModelSpec,
    estimate,
    fed,
    load_bytes,
    load_fed,
    sure_limit,
    sure_to_fit,
)
from ..vocab.events import PreflightStop
from ..vocab.facts import RunFacts
from ..vocab.knobs import Knobs
from ..vocab.protocol import END_PREDICTED, EXIT_PREDICTED, PreflightPlan, SurePlan
from ..vocab.sizes import format_size
from ..vocab.trlrange import support
from .runtime import Runtime, rank

DEFAULT_MARGIN = DEVICE_OVERPREDICTION + STOP_ALLOWANCE  # when a plan names none (a plan of an older oomguard)
# A load is the weights themselves, known to the byte: its stop margin is the allocator's rounding, never the step's
# (the logits LM head of TRL 0.29-1.14 is stopped only 40% over: that error is the step's, not the weights'). On a
# card the CUDA context's spread comes on top; the simulated device rounds every block up, so a load predicted over it
# is over it (the half percent allows for a checkpoint whose parameter count the config misstates slightly).
LOAD_MARGIN = 0.1
SIMULATED_LOAD_MARGIN = 0.005


def verdict(preflight: PreflightPlan, predicted: int, facts: dict[str, Any] | None = None) -> str | None:
    """``"over"`` when ``predicted`` exceeds the capacity by more than the margin, else None (run as usual)."""
    cap = preflight.capacity
    if cap <= 0 or predicted <= cap * (1 + margin_of(preflight, facts)[0]):
        return None
    return "over"


def margin_of(preflight: PreflightPlan, facts: dict[str, Any] | None = None) -> tuple[float, str]:
    """The stop margin for the TRL this process runs, and where it comes from: the supervisor sends one per LM head
    and one for a TRL newer than the tested releases (``margins``, see ``Judge.stop_margins``); ``margin`` when it
    sends none (``--preflight-margin``, a machine's own calibration, a plan of an older oomguard).

    >>> pf = PreflightPlan(margin=0.1, margins={"logits": [0.2, "logits"], "fused": [0.1, "fused"], "untested": [2.0, "new"]})
    >>> margin_of(pf, {"trl_head": "logits", "trl_version": "1.10.0"}), margin_of(pf, {"trl_version": "1.99.0"})
    ((0.2, 'logits'), (2.0, 'new'))
    """
    margins = preflight.margins
    facts = facts or {}
    version = facts.get("trl_version")
    untested = (version and support(version).untested) or facts.get("stack_untested")
    key = "untested" if untested else facts.get("trl_head")
    if key in margins:
        m, source = margins[key]
        return float(m), str(source)
    margin = preflight.margin if preflight.margin is not None else DEFAULT_MARGIN
    return float(margin), preflight.margin_source or "the model error"


def _coefficients(preflight: PreflightPlan | SurePlan) -> Coefficients:
    fields = set(Coefficients.__dataclass_fields__)
    return Coefficients(**{k: v for k, v in preflight.coefficients.items() if k in fields})


def predict(rt: Runtime, preflight: PreflightPlan | SurePlan) -> int | None:
    """The predicted device peak of this attempt's config, or None when the model cannot judge it."""
    est = predict_estimate(rt, preflight)
    return est.peak_bytes if est is not None else None


def predict_estimate(rt: Runtime, preflight: PreflightPlan | SurePlan, config: dict[str, Any] | None = None) -> Any:
    """The memory model's Estimate of this attempt's config (of the model ``config``, default the one the process
    reported), or None when the model cannot judge it."""
    config = config or rt.model_config
    if not config:
        return None
    try:
        spec = ModelSpec.from_config(config)
        facts = RunFacts.from_dict(rt.facts())
        knobs = rt.knobs()
        est = estimate(spec, knobs, world_size=int(facts.world_size or 1), prompt_tokens=facts.prompt_tokens_max,
                       coefficients=_coefficients(preflight), simulated=preflight.simulated,
                       capacity=preflight.capacity, context=preflight.context, head=facts.trl_head,
                       **fed(spec, facts, knobs))
    except (ValueError, KeyError, TypeError):
        return None
    return est


def check(rt: Runtime, before: str = "generates") -> None:
    """Stop the process (exit ``EXIT_PREDICTED``) when the plan's pre-flight says this config cannot fit.

    ``before`` names what the stop saves, for the message: ``generates`` (the trainer is built) or ``loads`` (TRL
    has not loaded the model yet)."""
    pf = rt.plan.preflight
    if not pf:
        return
    est = predict_estimate(rt, pf)
    if est is None:
        return
    if verdict(pf, est.peak_bytes, rt.facts()) is not None:
        _stop(rt, pf, est.peak_bytes, f"this config is predicted to need {format_size(est.peak_bytes)}", before,
              rt.facts())
    if est.vllm_lacks:  # vLLM would refuse to start, whatever room the device has
        note = next((n for n in est.notes if n.startswith("vLLM's reservation")), "vLLM's reservation is too small")
        _stop(rt, pf, est.peak_bytes, note, before, rt.facts(), over=False)


def decide_probe(rt: Runtime, config: dict[str, Any] | None) -> None:
    """An attempt launched as a probe unless the memory model is sure of its config (the plan's ``unless_sure``,
    from ``Judge.sure_plan``): decide it once the config, the model's shape (``config``) and the prompt lengths are
    known, before anything is generated. Sure (``memory.estimate.sure_to_fit``: predicted clearly under the device,
    with the model's measured under-prediction for this TRL's LM head): this launch is the real run. Near the edge, a
    TRL or a stack around it that no measurement covers, something of the run oomguard could not observe (its
    prompts, its generation engine: ``RunFacts.unobserved``), or a model the memory model cannot read: a probe."""
    if not rt.probe_undecided():
        return
    us = (rt.plan.probe.unless_sure if rt.plan.probe is not None else None) or SurePlan()
    facts = rt.facts()
    version = facts.get("trl_version")
    cap = us.capacity
    if version and support(version).untested:
        rt.decide_probe("probe", f"TRL {version} is newer than the tested releases")
        return
    if rt.stack_facts or facts.get("stack_untested"):
        rt.decide_probe("probe", str(facts.get("stack_untested") or "a stack around TRL builds this trainer"))
        return
    if facts.get("unobserved"):  # what oomguard could not observe of the run (RunFacts.unobserved)
        rt.decide_probe("probe", f"not observed: {facts['unobserved'][0]}")
        return
    est = predict_estimate(rt, us, config)
    head = str(facts.get("trl_head") or "fused")
    under = us.under.get(head)
    if est is None or under is None or cap <= 0:
        rt.decide_probe("probe", "the memory model cannot judge this config")
        return
    pf = rt.plan.preflight
    if pf and verdict(pf, est.peak_bytes, facts) is not None:
        rt.probe_as = "probe"  # the pre-flight stops it next, and says why: nothing to decide
        return
    limit = sure_limit(cap, float(under))
    share = f"{format_size(est.peak_bytes)}, {100 * est.peak_bytes / cap:.0f}% of the {format_size(cap)} device"
    numbers = {"predicted_bytes": est.peak_bytes, "capacity": cap, "limit": limit}
    if est.vllm_lacks or not sure_to_fit(est.peak_bytes, cap, float(under)):
        rt.decide_probe("probe", f"predicted {share}: within the memory model's error of the edge (it is sure up to "
                                 f"{format_size(limit)})", **numbers)
    else:
        rt.decide_probe("run", f"predicted {share}: the memory model is sure it fits (up to {format_size(limit)})",
                        **numbers)


def check_load(rt: Runtime, config: dict[str, Any], knobs: Knobs) -> None:
    """Before ``from_pretrained`` places a model's weights: stop when the load alone is sure not to fit.

    ``config`` is the checkpoint's config (``config.json`` fields, already reported in a ``model`` event), ``knobs``
    carry the load's dtype and 4-bit."""
    pf = rt.plan.preflight
    if not pf:
        return
    try:
        spec = ModelSpec.from_config(config)
        need = load_bytes(spec, knobs, coefficients=_coefficients(pf), simulated=pf.simulated, context=pf.context,
                          **load_fed(RunFacts.from_dict(rt.facts())))
    except (ValueError, KeyError, TypeError):
        return
    margin = SIMULATED_LOAD_MARGIN if pf.simulated else LOAD_MARGIN
    load_pf = replace(pf, margin=min(margin, margin_of(pf, rt.facts())[0]), margins={})
    if verdict(load_pf, need) is None:
        return
    how = "4-bit" if knobs.load_in_4bit else knobs.dtype or "float32"
    _stop(rt, load_pf, need, f"loading this model needs {format_size(need)} (its weights in {how})", "loads")


def _stop(rt: Runtime, pf: PreflightPlan, need: int, what: str, before: str,
          facts: dict[str, Any] | None = None, over: bool = True) -> None:
    cap = pf.capacity
    margin, source = margin_of(pf, facts)
    rt.emit(PreflightStop(predicted_bytes=need, capacity=cap, margin=margin, before=before,
            **({} if over else {"reason": what})))
    if rank() in (None, 0):  # every rank predicts the same: one line for the job, not one per rank
        why = (f"{what}, {100 * (need / cap - 1):.0f}% over the {format_size(cap)} device (the stop margin is "
               f"{100 * margin:.1f}%, {source})" if over else what)
        sys.stderr.write(f"oomguard: pre-flight: {why}; stopping before it {before} (--no-preflight runs it "
                         "anyway)\n")
        sys.stderr.flush()
    rt.stopping_on_purpose()
    rt.end(END_PREDICTED)
    raise SystemExit(EXIT_PREDICTED)
