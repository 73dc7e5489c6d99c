"""One verdict for "will it fit": the rule the training process's pre-flight, the Judge, the climb and `oomguard plan`
all ask, so that `plan` says what `run` does.

A predicted device peak is judged against the device with the memory model's measured error
(:func:`~.coefficients.measured_error`), carried as a :class:`~oomguard.vocab.protocol.JudgeSpec` (built here by
:func:`judge_spec`; the supervisor sends it to the training process in the plan):

- ``stop``: predicted over the device by more than the stop margin (the model's measured over-prediction for the
  installed TRL's LM head, plus STOP_ALLOWANCE; UNTESTED_FACTOR times the device for a TRL or a stack no measurement
  covers), or a colocated vLLM's share cannot hold what vLLM needs to start (where the model counts vLLM's memory:
  not Unsloth's standby, ``unmodelled.VLLM_NOT_MODELLED``). The pre-flight stops it before it loads
  or generates, and the climb chooses again.
- ``run``: predicted under the device by SURE_HEADROOM beyond the model's measured under-prediction, with nothing
  the model is unsure of: the first launch is the real run.
- ``probe``: in between, or the model cannot be sure (:class:`Doubts`): a short worst-case probe first.

:func:`chooses` is the climb's own test, stricter than "not stop" and looser than "run": the config it picks keeps the
Judge's margin free. :func:`launch_as` turns a verdict into how an attempt starts, given what the supervisor asked.

>>> from oomguard.memory.estimate import ModelSpec, estimate
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> tiny = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True)
>>> est = estimate(tiny, TRL_DEFAULTS.replace(max_completion_length=64), prompt_tokens=32, simulated=True)
>>> [verdict(est, judge_spec(int(est.peak_bytes * f), simulated=True, margin=0.02)).decision for f in (4, 1.1, 0.5)]
['run', 'probe', 'stop']
>>> verdict(est, judge_spec(4 * est.peak_bytes, simulated=True, margin=0.02), doubts=Doubts(unsure=("x",))).decision
'probe'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...vocab.facts import RunFacts
from ...vocab.protocol import JudgeSpec
from ...vocab.sizes import format_size
from ...vocab.trlrange import HEADS, support
from .coefficients import STOP_ALLOWANCE, SURE_HEADROOM, UNTESTED_FACTOR, measured_error
from .model import ModelSpec
from .unmodelled import VLLM_NOT_MODELLED, not_modelled

STOP, PROBE, RUN = "stop", "probe", "run"


def judge_spec(capacity: int, *, simulated: bool = False, margin: float, context: int | None = None,
               coefficients: dict[str, Any] | None = None, calibrated: tuple[float, str] | None = None,
               relax_margin: float | None = None, stop_margin: float | None = None) -> JudgeSpec:
    """The judge for a device of ``capacity`` bytes: the model's measured error for each LM head (``calibrated``:
    this machine's own over-prediction and its source, replacing the built-in one), the choice's ``margin`` and the
    one for relaxing graded knobs (``relax_margin``; None: each head's under-prediction), and ``stop_margin`` where
    the user set the pre-flight's (``--preflight-margin``).

    >>> js = judge_spec(2**30, simulated=True, margin=0.02)
    >>> js.errors["fused"][:2], js.untested_factor, js.headroom
    ([0.097, 0.12], 3.0, 0.1)
    """
    errors: dict[str, Any] = {}
    for h in HEADS:
        e = measured_error(simulated=simulated, head=h)
        over, source = calibrated if calibrated is not None else (e.over, e.source)
        errors[h] = [over, e.under, source]
    return JudgeSpec(capacity=int(capacity), simulated=simulated, context=context, coefficients=dict(coefficients or {}),
                     errors=errors, untested_factor=UNTESTED_FACTOR, headroom=SURE_HEADROOM, allowance=STOP_ALLOWANCE,
                     margin=margin, relax_margin=relax_margin, stop_margin=stop_margin)


def _error(spec: JudgeSpec, head: str | None) -> tuple[float, float, str]:
    over, under, source = spec.errors.get(head or "fused") or spec.errors.get("fused") or (0.0, 0.0, "no error")
    return float(over), float(under), str(source)


def stop_margin(spec: JudgeSpec, head: str | None = None, *, untested: bool = False) -> tuple[float, str]:
    """How far over the device a config must be predicted before the pre-flight stops it, and where the figure comes
    from: ``--preflight-margin``; for a TRL or stack no measurement covers (``untested``) only beyond
    ``untested_factor`` times the device; else the head's measured over-prediction plus the allowance.

    >>> js = judge_spec(2**30, margin=0.05)
    >>> round(stop_margin(js)[0], 3), round(stop_margin(js, untested=True)[0], 2)
    (0.084, 2.02)
    """
    if spec.stop_margin is not None:
        return float(spec.stop_margin), "--preflight-margin"
    allow = f", + {100 * spec.allowance:.0f}%"
    if untested:
        return (spec.untested_factor - 1 + spec.allowance,
                f"a TRL or stack newer than the tested releases: only beyond {spec.untested_factor:g} times the "
                f"device, the largest change measured between releases{allow}")
    over, _under, source = _error(spec, head)
    return over + spec.allowance, source + allow


def relax_margin(spec: JudgeSpec, head: str | None = None) -> float:
    """The headroom kept when a graded knob is relaxed towards the user's value (see ``Judge``)."""
    return spec.relax_margin if spec.relax_margin is not None else _error(spec, head)[1]


def chooses(est: Any, spec: JudgeSpec, *, head: str | None = None, relax: bool = False,
            margin: float | None = None) -> bool:
    """Whether the climb may choose a config predicted at ``est`` (an Estimate, or bare bytes such as a load's): its
    device peak leaves the Judge's margin free (``relax``: the margin for relaxing graded knobs; ``margin``: another),
    and a colocated vLLM's share holds what vLLM needs to start.

    >>> js = judge_spec(1000, margin=0.05)
    >>> chooses(950, js), chooses(960, js)
    (True, False)
    """
    m = margin if margin is not None else relax_margin(spec, head) if relax else spec.margin
    peak = est if isinstance(est, int) else est.peak_bytes
    lacks = 0 if isinstance(est, int) else est.vllm_lacks
    return spec.capacity > 0 and not lacks and peak * (1 + m) <= spec.capacity


@dataclass(frozen=True)
class Doubts:
    """What keeps the memory model from being sure of a config. ``untested``: what no measurement covers at all (a TRL
    newer than the tested releases, a stack's own trainer): stopped only beyond ``untested_factor`` times the device,
    never sure. ``unsure``: what the model does not measure here (a family measured on the simulated device only, on a
    GPU; a stack around TRL; what the model does not count): never sure, stopped as usual."""

    untested: str | None = None
    unsure: tuple[str, ...] = ()

    @property
    def reasons(self) -> tuple[str, ...]:
        return ((self.untested,) if self.untested else ()) + self.unsure


def doubts_of(spec: ModelSpec | None, facts: RunFacts, *, simulated: bool) -> Doubts:
    """What the model cannot be sure of in this run, beyond what its prediction says it does not count
    (``Estimate.unmodelled``, which :func:`verdict` reads: a family measured on the simulated device only, on a GPU; a
    vLLM server; Unsloth's own memory; packed batches): a TRL newer than the tested releases or a stack's trainer no
    measurement covers (``untested``); a stack around TRL (``unsure``). ``spec`` and ``simulated`` are for doubts a
    model's shape raises on a device.

    >>> doubts_of(None, RunFacts(trl_version="1.99.0"), simulated=True).untested
    'TRL 1.99.0 is newer than the tested releases'
    >>> doubts_of(None, RunFacts(stack="unsloth"), simulated=True).unsure
    ('a stack around TRL (unsloth) builds this trainer',)
    """
    untested = None
    if facts.trl_version and support(facts.trl_version).untested:
        untested = f"TRL {facts.trl_version} is newer than the tested releases"
    elif facts.stack_untested:
        untested = facts.stack_untested
    unsure: list[str] = []
    if facts.stack:
        unsure.append(f"a stack around TRL ({facts.stack}) builds this trainer")
    unsure.extend(f"not observed: {u}" for u in facts.unobserved)  # what the training process could not observe
    return Doubts(untested, tuple(unsure))


@dataclass(frozen=True)
class FitVerdict:
    """The verdict on one predicted config (:func:`verdict`): ``decision`` (``stop``, ``probe``, ``run``), with the
    figures that decide it: the predicted peak and the device, the largest peak the model is sure of (``sure_limit``,
    None where it is never sure), the peak beyond which the pre-flight stops (``stop_limit``) and its margin, what
    keeps the model from being sure (``reasons``), and for a stop which side is short and by how much (``short``:
    ``("training", bytes over the device)`` or ``("vllm", bytes its share lacks)``)."""

    decision: str
    predicted: int
    capacity: int
    sure_limit: int | None
    stop_limit: int
    stop_margin: float
    stop_source: str
    under: float
    headroom: float
    reasons: tuple[str, ...] = ()
    short: tuple[str, int] | None = None
    vllm_note: str = ""

    def share(self) -> str:
        """The predicted peak as a share of the device."""
        if self.capacity <= 0:
            return format_size(self.predicted)
        return (f"{format_size(self.predicted)}, {100 * self.predicted / self.capacity:.0f}% of the "
                f"{format_size(self.capacity)} device")

    def line(self) -> str:
        """One sentence with the bound that decides it (what the training process says, what `plan` prints)."""
        if self.short is not None and self.short[0] == "vllm":
            fits = (f"; training's peak, {format_size(self.predicted)}, fits the {format_size(self.capacity)} device"
                    if self.predicted <= self.capacity else "")
            return f"vLLM's share is {format_size(self.short[1])} short: {self.vllm_note}{fits}"
        if self.decision == STOP:
            return (f"predicted {format_size(self.predicted)}, {100 * (self.predicted / self.capacity - 1):.0f}% over "
                    f"the {format_size(self.capacity)} device: beyond the pre-flight's stop margin "
                    f"({100 * self.stop_margin:.1f}%, {self.stop_source})"
                    + (f"; and {self.vllm_note}" if self.vllm_note else ""))
        if self.capacity <= 0:
            return "the device's size is not known"
        if self.reasons:
            return f"predicted {self.share()}, but {'; '.join(self.reasons)}: the memory model cannot be sure of it"
        if self.decision == RUN:
            return f"predicted {self.share()}: the memory model is sure it fits (up to {format_size(self.sure_limit)})"
        return (f"predicted {self.share()}: within the memory model's error of the edge (it is sure up to "
                f"{format_size(self.sure_limit)})")

    def margins(self) -> str:
        """The margins that decide it, spelled out (`oomguard plan`'s second line)."""
        spare = self.capacity - self.predicted
        left = f"{format_size(spare)} to spare" if spare >= 0 else f"{format_size(-spare)} over the device"
        sure = ("never sure of this config" if self.sure_limit is None else
                f"sure up to {format_size(self.sure_limit)} ({100 * self.headroom:.0f}% of the device kept free beyond "
                f"the model's measured under-prediction, {100 * self.under:.1f}%)")
        return (f"{left}; {sure}; stopped beyond {format_size(self.stop_limit)} ({100 * self.stop_margin:.1f}% over: "
                f"{self.stop_source})")

    def to_dict(self) -> dict[str, Any]:
        """`oomguard plan --json`'s ``verdict``."""
        return {"decision": self.decision, "line": self.line(), "margins": self.margins(),
                "predicted_bytes": self.predicted,
                "capacity_bytes": self.capacity, "sure_limit_bytes": self.sure_limit,
                "stop_limit_bytes": self.stop_limit, "stop_margin": round(self.stop_margin, 4),
                "stop_margin_source": self.stop_source, "under": self.under, "headroom": self.headroom,
                "reasons": list(self.reasons),
                "short": {"side": self.short[0], "bytes": self.short[1]} if self.short else None}


def verdict(est: Any, spec: JudgeSpec, *, head: str | None = None, doubts: Doubts = Doubts()) -> FitVerdict:
    """The one verdict on a predicted config (``est``, an Estimate: what it says it does not count,
    ``Estimate.unmodelled``, is never sure) on the device ``spec`` judges for, with the LM head of the installed TRL
    (``head``; None: the newest TRL's) and what else keeps the model from being sure (``doubts``, :func:`doubts_of`).
    See the module for the rule."""
    cap = spec.capacity
    margin, source = stop_margin(spec, head, untested=doubts.untested is not None)
    under = _error(spec, head)[1]
    unmodelled = tuple(f"not modelled: {line}" for line in not_modelled(est.unmodelled))
    reasons = doubts.reasons + unmodelled + (() if cap > 0 else ("the device's size is not known",))
    sure = int(cap * (1 - spec.headroom) / (1 + under)) if cap > 0 and not reasons else None
    stop_limit = int(cap * (1 + margin))
    peak = int(est.peak_bytes)
    short: tuple[str, int] | None = None
    note = ""
    if cap > 0 and est.vllm_lacks and not VLLM_NOT_MODELLED & set(est.unmodelled):
        note = next((n for n in est.notes if n.startswith("vLLM's reservation")), "vLLM's reservation is too small")
    if cap > 0 and peak > stop_limit:  # training short names the stop, even where vLLM's share is short too: only
        decision, short = STOP, ("training", peak - cap)  # vLLM's own rungs answer a stop for its share
    elif note:
        decision, short = STOP, ("vllm", int(est.vllm_lacks))
    elif sure is not None and peak <= sure:
        decision = RUN
    else:
        decision = PROBE
    return FitVerdict(decision, peak, cap, sure, stop_limit, margin, source, under, spec.headroom, reasons, short,
                      note)


def launch_as(decision: str, *, probe: bool, deferred: bool, preflight: bool) -> str:
    """How an attempt starts where the verdict on its config is ``decision``, given what the supervisor asked of it:
    ``stop`` (the pre-flight, when on, stops it), ``run`` (launched as the real run, or as a probe ``deferred`` until
    the model is sure) or ``probe``. The training process decides with it; `oomguard plan` says the same.

    >>> launch_as("run", probe=True, deferred=True, preflight=True), launch_as("stop", probe=True, deferred=True,
    ...                                                                          preflight=False)
    ('run', 'probe')
    """
    if decision == STOP and preflight:
        return STOP
    if not probe:
        return RUN
    return RUN if deferred and decision == RUN else PROBE


__all__ = ["PROBE", "RUN", "STOP", "Doubts", "FitVerdict", "chooses", "doubts_of", "judge_spec", "launch_as",
           "relax_margin", "stop_margin", "verdict"]
