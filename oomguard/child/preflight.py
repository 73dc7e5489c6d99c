"""Pre-flight: stop a configuration the memory model is sure cannot fit, before it generates anything.

At ``GRPOTrainer`` construction the training process knows the model's shape, the knobs and the prompt lengths. When
the predicted device peak exceeds the capacity by a clear margin (the supervisor's ``--preflight-margin``, 15% by
default), running on would only cost a generation and a crash, and on a shared GPU an OOM that a neighbour feels. The
process reports a ``predicted`` event, ends with ``how=predicted`` and exits with ``EXIT_PREDICTED``; the supervisor
records the attempt with the outcome ``predicted`` (from the events, whatever code a launcher between them turns that
exit into) and chooses the next config as after an OOM. A prediction that is merely close runs as usual.

Pure apart from the process exit: no torch import here.

>>> verdict({"capacity": 100, "margin": 0.15}, predicted=120)
'over'
>>> verdict({"capacity": 100, "margin": 0.15}, predicted=110) is None
True
"""

from __future__ import annotations

import sys
from typing import Any

from ..estimate import Coefficients, ModelSpec, estimate
from ..sizes import format_size
from .runtime import END_PREDICTED, EXIT_PREDICTED, Runtime


def verdict(preflight: dict[str, Any], predicted: int) -> str | None:
    """``"over"`` when ``predicted`` exceeds the capacity by more than the margin, else None (run as usual)."""
    cap = int(preflight.get("capacity") or 0)
    margin = float(preflight.get("margin", 0.15))
    if cap <= 0 or predicted <= cap * (1 + margin):
        return None
    return "over"


def predict(rt: Runtime, preflight: dict[str, Any]) -> int | None:
    """The predicted device peak of this attempt's config, or None when the model cannot judge it."""
    if not rt.model_config:
        return None
    try:
        spec = ModelSpec.from_config(rt.model_config)
        fields = set(Coefficients.__dataclass_fields__)
        co = Coefficients(**{k: v for k, v in (preflight.get("coefficients") or {}).items() if k in fields})
        facts = rt.facts()
        est = estimate(spec, rt.knobs(), world_size=int(facts.get("world_size") or 1),
                       prompt_tokens=facts.get("prompt_tokens_max"), coefficients=co,
                       simulated=bool(preflight.get("simulated")), capacity=int(preflight.get("capacity") or 0))
    except (ValueError, KeyError, TypeError):
        return None
    return est.peak_bytes


def check(rt: Runtime) -> None:
    """Stop the process (exit ``EXIT_PREDICTED``) when the plan's pre-flight says this config cannot fit."""
    pf = rt.plan.preflight
    if not pf:
        return
    peak = predict(rt, pf)
    if peak is None or verdict(pf, peak) is None:
        return
    cap = int(pf["capacity"])
    rt.emit("predicted", predicted_bytes=peak, capacity=cap, margin=float(pf.get("margin", 0.15)))
    sys.stderr.write(f"oomguard: pre-flight: this config is predicted to need {format_size(peak)}, "
                     f"{100 * (peak / cap - 1):.0f}% over the {format_size(cap)} device; stopping before it "
                     "generates (--no-preflight runs it anyway)\n")
    sys.stderr.flush()
    rt.end(END_PREDICTED)
    raise SystemExit(EXIT_PREDICTED)
