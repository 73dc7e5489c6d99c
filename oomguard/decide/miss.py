"""A prediction the run proved wrong: a measured peak beyond twice the memory model's stated error from what it
predicted, and which of its terms missed.

The conductor asks :func:`find_miss` after each attempt with the prediction it made for that attempt's config. A
success measures its peak (a probe's is the worst case, so it shows a prediction too high as well as one too low; a
real run's completions may stop early, so it shows only one too low); an OOM measures a lower bound, what was live
plus the failing request. Which term missed comes from what the training process measured against the estimate's
breakdown: the long-lived state (weights, a reference model, the optimizer's state) against what the step before
kept (the per-step trace) or what was live at the OOM (the crash record's tally, ``Diagnosis.facts.live``), and the
step's own memory (activations, logits, generation's buffers, gradients) as the rest.

A miss makes the model unsure for the rest of the run (``Conductor``): probes first, and no precision, capacity or
signal change on its word alone where a speed or allocator change has not been tried.

>>> from oomguard.memory.estimate import Estimate
>>> from oomguard.vocab.records import Attempt
>>> est = Estimate(peak_bytes=200 << 20, peak_alloc_bytes=186 << 20, phases={}, trainable_params=0, total_params=0,
...                breakdown={"weights": 4 << 20, "optimizer": 1 << 20, "activations": 181 << 20},
...                dominant_phase="forward_backward")
>>> ok = Attempt(2, {}, [], "ok", 0, 1.0, peak_bytes=314 << 20, step=2, trace=[{"step": 2, "kept": 5 << 20}])
>>> miss = find_miss(est, ok, None, under=0.12, over=0.12)
>>> round(miss.factor, 2), miss.term
(1.69, 'activations')
>>> find_miss(est, Attempt(2, {}, [], "ok", 0, 1.0, peak_bytes=190 << 20, step=2), None, under=0.12, over=0.12)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..memory.estimate import Estimate
from ..vocab.diagnosis import Diagnosis
from ..vocab.records import Attempt, AttemptKind, Outcome
from ..vocab.sizes import format_size

# A measured peak beyond this many times the model's stated error (its measured under- or over-prediction) is a miss.
MISS_FACTOR = 2.0
# The estimate's terms that live from step to step (the rest of a phase is the step's own memory).
STATE_TERMS = ("weights", "reference", "optimizer")
# How a term is named, by where the step's memory was measured.
TERM_WORDS = {"state": "the long-lived state (weights, a reference model, the optimizer's state)",
              "activations": "the step's own memory (activations, logits, gradients)",
              "generation buffers": "generation's buffers (its KV cache, logits and inputs)"}
PHASE_WORDS = {"forward_backward": "the forward and backward pass", "generation": "generation", "scoring": "scoring",
               "optimizer": "the optimizer step", "evaluation": "evaluation"}


@dataclass(frozen=True)
class Miss:
    """A prediction proven wrong by attempt ``attempt``: ``predicted`` (the allocated peak) against ``measured`` (at
    least that much where ``at_least``: an OOM), and the term that missed most (``term``: ``state``,
    ``activations`` or ``generation buffers``; None where the measurements cannot split it) with its own figures."""

    attempt: int
    predicted: int
    measured: int
    at_least: bool = False
    term: str | None = None
    term_predicted: int | None = None
    term_measured: int | None = None
    phase: str | None = None

    @property
    def factor(self) -> float:
        """measured / predicted (above 1: the model predicted too little)."""
        return self.measured / max(1, self.predicted)

    def how_far(self) -> str:
        """``1.69x the prediction`` or ``0.41x``, for both sides alike."""
        return f"{self.factor:.2f}x the prediction"

    def line(self, stable: bool = False) -> str:
        """What the run says of it, once."""
        measured = ("needed at least" if self.at_least else "measured") + f" {format_size(self.measured)}"
        where = f" in {PHASE_WORDS.get(self.phase or '', self.phase)}" if self.phase else ""
        said = (f"the memory model was wrong here: it predicted an allocated peak of {format_size(self.predicted)} "
                f"and attempt {self.attempt} {measured}{where} ({self.how_far()})")
        if self.term is not None and self.term_predicted is not None and self.term_measured is not None:
            said += (f"; what missed: {TERM_WORDS[self.term]}, predicted {format_size(self.term_predicted)}, "
                     f"{'at least ' if self.at_least and self.term != 'state' else ''}"
                     f"{format_size(self.term_measured)} measured")
        if stable:
            return said + "; the config held, but predictions of this run are not to be trusted this far"
        return (said + "; from here on the model is unsure: each config is probed first, and no precision, capacity or "
                "signal change is made on its word alone before a speed or allocator change is tried")

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_bytes": self.predicted, "measured_bytes": self.measured, "at_least": self.at_least,
                "factor": round(self.factor, 3), "term": self.term, "term_predicted_bytes": self.term_predicted,
                "term_measured_bytes": self.term_measured, "phase": self.phase}


def _kept(attempt: Attempt) -> int | None:
    """What the step before kept, once the optimizer's state exists (step 2 on): the long-lived state measured."""
    kept = [k for s in attempt.trace if isinstance(s, dict) and (s.get("step") or 0) >= 2 and (k := s.get("kept"))]
    return int(kept[-1]) if kept else None


def measured_of(attempt: Attempt, diag: Diagnosis | None) -> tuple[int, bool, int | None, str | None] | None:
    """(the peak measured, whether it is a lower bound, the long-lived state measured, the phase), or None where
    the attempt measured nothing to judge a prediction by (a pre-flight stop, a failure, a leak, the host, vLLM's own
    reservation, an overflowed shape)."""
    if attempt.outcome == Outcome.OK and attempt.peak_bytes:
        return attempt.peak_bytes, False, _kept(attempt), None
    if attempt.outcome != Outcome.OOM or diag is None:
        return None
    r = diag.report
    if (diag.kind in ("leak", "host-leak", "host-ram", "vllm-reservation", "neighbour", "non-pytorch", "driver")
            or diag.facts.overflowed or r.allocated is None):
        return None
    live = diag.facts.live
    state = None
    if live is not None:
        state = live.parameters + live.optimizer if live.source == "tally" else live.parameters
    return r.allocated + (r.requested or 0), True, state, diag.phase


def find_miss(est: Estimate, attempt: Attempt, diag: Diagnosis | None, *, under: float, over: float) -> Miss | None:
    """The miss ``attempt`` shows of ``est`` (the prediction for its config), or None: measured more than
    MISS_FACTOR times the model's under-prediction ``under`` above it, or (a probe's worst case, once its optimizer
    state exists) predicted more than MISS_FACTOR times its over-prediction ``over`` above what it measured."""
    got = measured_of(attempt, diag)
    predicted = est.peak_alloc_bytes
    if got is None or predicted <= 0:
        return None
    measured, bound, state, phase = got
    too_low = measured > predicted * (1 + MISS_FACTOR * under)
    worst_case = attempt.kind != AttemptKind.RUN and (attempt.step or 0) >= 2
    too_high = not bound and worst_case and predicted > measured * (1 + MISS_FACTOR * over)
    if not (too_low or too_high):
        return None
    term, t_pred, t_meas = None, None, None
    if state is not None:
        state_pred = sum(est.breakdown.get(k, 0) for k in STATE_TERMS)
        step_pred, step_meas = max(1, predicted - state_pred), max(0, measured - state)
        step_term = "generation buffers" if (phase or est.dominant_phase) == "generation" else "activations"
        # the term that missed most the way the whole missed (a first step's missing optimizer state is no miss)
        off = {"state": math.log(max(1, state) / max(1, state_pred)),
               step_term: math.log(max(1, step_meas) / step_pred)}
        term = max(off, key=lambda k: off[k] if too_low else -off[k])
        t_pred, t_meas = (state_pred, state) if term == "state" else (step_pred, step_meas)
    return Miss(attempt.index, predicted, measured, bound, term, t_pred, t_meas, phase or est.dominant_phase)


__all__ = ["MISS_FACTOR", "Miss", "find_miss", "measured_of"]
