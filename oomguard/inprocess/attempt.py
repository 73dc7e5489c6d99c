"""One attempt of a guarded function: call it once, and turn what happened into plain data.

The same call runs in this process and, for ``guard(isolate=True)``, in a spawned one
(:mod:`oomguard.inprocess.isolate`), so its result is a picklable :class:`CallResult`: the value on success, or the
facts of the OOM (its OOMReport, frames and phase). The exception itself never leaves :func:`call_once`: its frames
pin the failed attempt's tensors, so they are cleared before it returns. Any other exception propagates unchanged.

How the knobs reach the function, in the two styles of ``@oomguard.guard``:

(a) it takes no ``knobs`` and builds a TRL ``GRPOTrainer`` itself: the same patches as ``oomguard run`` (GRPOConfig,
    GRPOTrainer, from_pretrained) are installed for the call and removed afterwards;
(b) it declares a parameter ``knobs``: it gets :class:`~oomguard.inprocess.tracked.TrackedKnobs`, which record
    what it reads.

>>> from oomguard.vocab.knobs import Knobs
>>> def train(knobs):
...     if knobs.per_device_train_batch_size > 4:
...         raise MemoryError("out of memory")
...     return "trained"
>>> reads: set[str] = set()
>>> failed = call_once(train, True, Knobs(per_device_train_batch_size=8), {}, reads, (), {})
>>> failed.ok, failed.report.backend, sorted(failed.reads)
(False, 'host', ['per_device_train_batch_size'])
>>> call_once(train, True, Knobs(per_device_train_batch_size=4), {}, reads, (), {}).value
'trained'
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..memory.allocmodel import context_for
from ..oom.diagnose import phase_from_frames
from ..oom.parse import is_oom, oom_in_chain, report_from_exception
from ..vocab.knobs import Knobs
from ..vocab.oomreport import Frame, OOMReport
from ..vocab.trace import MemSample
from .release import drop_traceback, peak_bytes
from .tracked import track


@dataclass
class CallResult:
    """What one call produced, as plain data: never the exception, whose frames would keep its tensors alive."""

    ok: bool
    value: Any = None  # the function's return value, when ok
    report: OOMReport | None = None  # the OOM's facts, when not ok
    frames: tuple[Frame, ...] = ()
    phase: str = "unknown"  # read from the frames
    peak: int | None = None  # peak live bytes of the call (simulated device or CUDA)
    reads: set[str] = field(default_factory=set)  # the knobs a style-(b) function read
    observed: dict[str, Any] = field(default_factory=dict)  # style (a): what the code set (GRPOConfig, ...)
    reached: set[str] = field(default_factory=set)  # style (a): the construction points the call went through
    facts: dict[str, Any] = field(default_factory=dict)  # style (a): model shape, prompt lengths, ...
    samples: list[MemSample] = field(default_factory=list)  # style (a): the trainer's memory trace, one per step


def call_once(fn: Callable[..., Any], takes_knobs: bool, knobs: Knobs, overrides: dict[str, Any], reads: set[str],
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallResult:
    """Call ``fn`` once with ``knobs`` (style (b)) or with the run patches carrying ``overrides`` (style (a)).

    Returns plain data; re-raises anything that is not an OOM. ``reads`` collects the fields a style-(b) function
    read, across attempts.
    """
    rt = None
    if takes_knobs:
        kwargs = {**kwargs, "knobs": track(knobs, reads)}
    else:
        rt = _install_patches(overrides)
    try:
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:
            if not is_oom(e):
                raise
            oom = oom_in_chain(e) or e
            frames = tuple(Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(oom.__traceback__))
            out = CallResult(ok=False, report=report_from_exception(oom), frames=frames,
                             phase=phase_from_frames(frames)[0])
            del oom
            drop_traceback(e)
        else:
            out = CallResult(ok=True, value=value)
        out.peak = peak_bytes()
        out.reads = set(reads)
        if rt is not None:
            out.observed = dict(rt.observed)
            out.reached = set(rt.reached)
            facts = rt.facts()
            if rt.model_config:
                facts["model_config"] = rt.model_config
            out.facts = facts
            if rt.memwatch is not None:
                out.samples = list(rt.memwatch.samples)
        return out
    finally:
        if rt is not None:
            _remove_patches(rt)


def start_simulation(size: int) -> bool:
    """Start the simulated device for this call; False if one already runs (it is then left as it is).

    >>> start_simulation(1 << 30) and stop_simulation()
    True
    """
    from ..child import simulate

    if simulate.device() is not None:
        return False
    simulate.start(size, context=context_for(size))
    return True


def stop_simulation() -> bool:
    """Stop the simulated device that :func:`start_simulation` started; returns True.

    >>> stop_simulation()
    True
    """
    from ..child import simulate

    simulate.stop()
    return True


def _install_patches(overrides: dict[str, Any]) -> Any:
    """The run patches for one call (style (a)), with a runtime that logs to oomguard's records, not the trainer."""
    from ..child import bootstrap
    from ..child.runtime import Runtime, set_runtime
    from ..vocab.protocol import Plan

    rt = Runtime(Plan(attempt=1, overrides=overrides, log_to_trainer=False))
    set_runtime(rt)
    bootstrap.install_hooks(rt)
    return rt


def _remove_patches(rt: Any) -> None:
    from ..child import patches
    from ..child.hooks import forget_hooks
    from ..child.runtime import set_runtime

    rt.trainer = None  # the trainer holds the model; nothing of a finished call may outlive it
    patches.remove()
    forget_hooks()
    set_runtime(None)
