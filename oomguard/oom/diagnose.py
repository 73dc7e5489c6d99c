"""Work out why memory ran out: the kind of OOM from the figures, the phase from the traceback, and evidence.

The kinds call for different remedies. Fragmentation is fixed by the allocator's settings, and shrinking the model
would be wasted on it. A neighbour holding the GPU is not fixed by anything oomguard changes in this process. A
request larger than the whole device points at a shape, not a budget.

A diagnosis is made in two steps. :func:`verdict` decides: the kind from the report's figures, the phase from the
traceback (:mod:`oomguard.oom.phase`), and the facts each decision rests on (:class:`~oomguard.vocab.diagnosis.Facts`).
:func:`oomguard.oom.evidence.sentences` writes the evidence from that verdict, in that one place. No decision reads a
sentence, and what a caller knows beside the message (a stop's reason, the signs of the kernel's OOM killer, vLLM's
own engine process) is an argument of :func:`diagnose`, so that nothing edits a Diagnosis after it is made.

>>> from oomguard.oom.parse import parse_oom
>>> d = diagnose(parse_oom("CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total capacity of 15.73 GiB "
...     "of which 1.28 GiB is free. Including non-PyTorch memory, this process has 14.43 GiB memory in use. Of the "
...     "allocated memory 11.82 GiB is allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but unallocated."))
>>> d.kind
'fragmentation'
>>> d.evidence[0]
'2.41 GiB was reserved by PyTorch but unallocated, more than the 1.90 GiB requested: the memory is there but split into pieces too small for one block.'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..vocab.diagnosis import (
    FRAGMENTATION_HEADROOM,
    OVERFLOW_FACTOR,
    STATE_SHARE,
    Diagnosis,
    Facts,
    Live,
    Room,
    Verdict,
)
from ..vocab.oomreport import Frame, OOMReport
from ..vocab.sizes import MiB
from .evidence import OUTSIDE_ALLOCATOR, sentences
from .phase import VLLM_STARTUP, phase_from_frames, vllm_startup_frame
from .trendwords import Trend, describe

# phase_from_frames and vllm_startup_frame live in oom/phase.py; they are named here too for the callers that import
# them with diagnose.
__all__ = ["FRAGMENTATION_HEADROOM", "SMALL_REQUEST", "diagnose", "phase_from_frames", "verdict", "vllm_startup_frame"]

# Requests at or below this are the allocator's rounded small blocks (2 MiB, 20 MiB): memory died of a thousand
# cuts, not of one big tensor.
SMALL_REQUEST = 20 * MiB
_OVERFLOWED = 2**50  # a petabyte: no device holds it, whatever the message says about capacity


def diagnose(report: OOMReport, frames: Iterable[Frame] = (), *, phase: str | None = None,
             buffers: Mapping[str, int] | None = None, reason: str | None = None, host_signs: Sequence[str] = (),
             engine: str | None = None, trend: Trend | None = None, live: Live | None = None) -> Diagnosis:
    """Classify an OOM and explain it with the figures it gives: :func:`verdict`, written by
    :func:`oomguard.oom.evidence.sentences`.

    ``phase`` overrides the phase read from ``frames`` (the training process knows it better at times).
    ``buffers`` names the framework buffers the run allocates in one piece (``{description: bytes}``, from
    ``vocab.distributed.deepspeed_buckets``): a request of one's size is that buffer, whose size a config decides.
    What the caller knows beside the message: ``reason``, the training process's own words for a stop before vLLM
    started (they lead the evidence); ``host_signs``, what the supervisor saw of the kernel's OOM killer (its OOM-kill
    counter, its log, resident memory near the machine's RAM), one clause each, which close it; ``engine``, vLLM's own
    engine process the message came from (a vLLM server, or an engine in a process of its own); ``trend``, what the
    run's memory trace says of the OOM (``oom.trend.at_oom``): a leak is the kind ``leak`` (``host-leak`` for the
    host), whatever the figures said, fragmentation that grew makes a shortfall ``fragmentation``, and a long sample
    at the step that ran out is said beside the figures' kind. ``live``: what was live at the OOM by what holds it
    (:class:`~oomguard.vocab.diagnosis.Live`, the crash record's tally): a shortfall's kind and what it is short of
    (the long-lived state, the step's activations, generation's buffers) come from it, not from the request's size
    alone (``_with_live``).

    >>> d = diagnose(OOMReport("cuda", "allocator", "x", requested=2_000_000_000, capacity=1 << 30, free=1 << 29),
    ...              buffers={"DeepSpeed's gradient reduce bucket": 2_000_000_000})
    >>> d.kind, d.buffer
    ('impossible', "DeepSpeed's gradient reduce bucket")
    >>> diagnose(OOMReport("host", "oom-killer", "x"), host_signs=["the OOM-kill counter rose"]).evidence[-1]
    'The OOM-kill counter rose.'
    """
    v = verdict(report, frames, phase=phase, buffers=buffers, reason=reason, host_signs=host_signs, engine=engine,
                trend=trend, live=live)
    return Diagnosis(kind=v.kind, phase=v.phase, evidence=sentences(v), report=v.report, frame=v.frame,
                     buffer=v.buffer, facts=v.facts)


def verdict(report: OOMReport, frames: Iterable[Frame] = (), *, phase: str | None = None,
            buffers: Mapping[str, int] | None = None, reason: str | None = None, host_signs: Sequence[str] = (),
            engine: str | None = None, trend: Trend | None = None, live: Live | None = None) -> Verdict:
    """The decisions of :func:`diagnose` (same arguments), as values: the figures' verdict, then the phase, vLLM's
    own start-up (its reservation, whatever the figures said) and the framework buffer the request is.

    >>> v = verdict(OOMReport("cuda", "allocator", "x", requested=2**51, capacity=16 << 30, free=1 << 30))
    >>> v.kind, v.facts.overflowed, v.phase
    ('impossible', True, 'unknown')
    """
    frames = tuple(frames)
    found_phase, frame = phase_from_frames(frames)
    if phase is None or phase == "unknown":
        phase = found_phase
    else:
        frame = None
    v = _classify(report)
    v = replace(v, phase=phase, frame=frame,
                facts=replace(v.facts, reason=reason, host_signs=tuple(host_signs), engine=engine))
    started = vllm_startup_frame(frames) if v.kind not in ("host-ram", "vllm-reservation", "impossible") else None
    if started is not None:  # vLLM's reservation, taken beside what the trainer already holds
        v = replace(v, kind="vllm-reservation", report=replace(v.report, origin="vllm-startup"), phase="load",
                    frame=started, facts=replace(v.facts, vllm_startup=VLLM_STARTUP[started.name]))
    if v.kind not in ("host-ram", "vllm-reservation"):
        v = replace(v, buffer=_framework_buffer(v.report, frames, buffers or {}))
    if live is not None and live.total > 0:
        v = _with_live(v, live)
    return _with_trend(v, trend) if trend is not None else v


def _with_live(v: Verdict, live: Live) -> Verdict:
    """What was live at the OOM decides what a shortfall is short of, and whether it is small allocations: where the
    long-lived state (parameters, gradients, optimizer state) held at least STATE_SHARE of what the step needed (what
    was live, plus the failing request), that state; else the step's activations, or generation's buffers (its KV
    cache, logits) in generation. A small request is ``small-allocations`` only in the first case: the allocator's
    small blocks fill up with whatever is live.

    >>> from oomguard.vocab.oomreport import OOMReport
    >>> r = OOMReport("cuda", "allocator", "x", requested=16 << 20, capacity=341 << 20, free=2 << 20,
    ...               allocated=305 << 20)
    >>> v = _with_live(_classify(r), Live(parameters=3 << 20, gradients=1 << 20, optimizer=1 << 20, other=300 << 20))
    >>> v.kind, v.facts.short_of, v.facts.by_figures
    ('shortfall', 'activations', 'shortfall')
    """
    facts = replace(v.facts, live=live)
    if v.kind not in ("shortfall", "small-allocations"):
        return replace(v, facts=facts)
    if live.state >= STATE_SHARE * (live.total + (v.report.requested or 0)):
        kind, short = v.kind, "long-lived state"
    else:
        kind, short = "shortfall", "generation buffers" if v.phase == "generation" else "activations"
    return replace(v, kind=kind, facts=replace(facts, short_of=short, by_figures=kind))


# Kinds a leak on the device does not override: one request larger than the whole device, the host, the runtime's own
NOT_A_DEVICE_LEAK = ("impossible", "host-ram", "driver", "vllm-reservation")


def _with_trend(v: Verdict, trend: Trend) -> Verdict:
    """What the run's memory trace adds to the figures' verdict (see ``diagnose``)."""
    late = []
    kind, young = v.kind, False
    if v.kind == "host-ram" and trend.host_leak is not None:
        kind, late = "host-leak", [describe(trend.host_leak)]
    elif v.kind not in NOT_A_DEVICE_LEAK and trend.leak is not None:
        kind, late, young = "leak", [describe(trend.leak)], trend.leak.young
    elif v.kind in ("shortfall", "small-allocations") and trend.fragmentation is not None:
        kind, late = "fragmentation", [describe(trend.fragmentation)]
    late += [describe(s) for s in trend.long_samples if s.at_oom]
    if not late:
        return v
    return replace(v, kind=kind, facts=replace(v.facts, late=tuple(late), young_leak=young))


# DeepSpeed's default reduce bucket (500,000,000 elements) in 32- and 16-bit gradients, and the function of
# deepspeed/runtime/zero/stage_1_and_2.py that allocates the bucket at a backward's first gradient.
_DS_DEFAULT_BUCKETS = {"in float32": 2_000_000_000, "in 16-bit": 1_000_000_000}
_DS_BUCKET_FRAMES = {"setup_buckets"}
_MATCH = 0.005  # a message prints sizes to 2 decimals ("1.86 GiB"): within half a percent is the same request


def _framework_buffer(r: OOMReport, frames: Sequence[Frame], buffers: Mapping[str, int]) -> str | None:
    """Which framework buffer the failing request is: one of ``buffers`` by its size, else DeepSpeed's reduce bucket
    by the frame that allocates it, or by its default size in a traceback through DeepSpeed."""
    req = r.requested
    if req:
        for name, size in buffers.items():
            if size and abs(req - size) <= _MATCH * size:
                return name
    in_deepspeed = [f for f in frames if "deepspeed" in f.filename.replace("\\", "/").lower()]
    if any(f.name in _DS_BUCKET_FRAMES for f in in_deepspeed):
        return "DeepSpeed's gradient reduce bucket (reduce_bucket_size)"
    if req and in_deepspeed:
        for how, size in _DS_DEFAULT_BUCKETS.items():
            if abs(req - size) <= _MATCH * size:
                return (f"DeepSpeed's gradient reduce bucket (reduce_bucket_size: 500,000,000 elements, DeepSpeed's "
                        f"default where the config leaves it out, {how})")
    return None


def _classify(r: OOMReport) -> Verdict:
    """The figures' verdict: the kind, the facts it rests on, and the report as diagnosed."""
    if r.backend == "host" or r.origin == "cpu-allocator":
        return Verdict("host-ram", r, Facts(by_figures="host-ram"))
    if r.backend == "vllm":
        return Verdict("vllm-reservation", r, Facts(by_figures="vllm-reservation"))

    r, me = _self_among_others(r)
    limit = r.allowed if r.allowed is not None else r.capacity
    req = r.requested
    ru = r.reserved_unallocated
    alloc = r.allocated
    others = r.others_total
    non_torch = None
    if r.process is not None and alloc is not None:
        non_torch = max(0, r.process - alloc - (ru or 0))
    # The device still had room for the request, so the process's own allowance refused it, not the device.
    own_cap = (r.allowed is not None and (r.capacity is None or r.allowed < r.capacity) and req is not None
               and r.free is not None and r.free >= req)
    facts = Facts(nvml_self=me, own_cap=own_cap, outside_torch=non_torch)

    if req is not None and (req >= _OVERFLOWED or (limit and req > limit)):
        overflowed = req >= _OVERFLOWED or bool(limit and req > OVERFLOW_FACTOR * limit)
        return _found("impossible", r, facts, overflowed=overflowed)

    if req is not None and ru is not None and req > 0 and ru >= req:  # the cache holds more than the request
        usable = _usable(r, others, non_torch)
        if alloc is None or usable is None:
            return _found("fragmentation", r, facts, cache_fits=True)
        room = Room(live=alloc, need=alloc + req, usable=usable)
        if usable and room.left >= FRAGMENTATION_HEADROOM * usable:
            return _found("fragmentation", r, facts, cache_fits=True, room=room)
        facts = replace(facts, cache_fits=True, room=room, not_fragmentation=True)
    device_full = r.free is None or req is None or r.free < req
    share_of = r.capacity or limit
    if (others and share_of and device_full
            and (others >= 0.25 * share_of or (req is not None and others >= req))):
        return _found("neighbour", r, facts)
    if (non_torch is not None and limit and not own_cap and non_torch >= 0.25 * limit
            and (req is None or non_torch >= req)):
        return _found("non-pytorch", r, facts)
    if r.origin in OUTSIDE_ALLOCATOR:
        return _found("driver", r, facts)
    if req is None:
        return _found("unknown", r, facts)
    hidden = None
    if r.origin == "async-allocator" and r.capacity is not None and alloc is not None and r.free is not None:
        hidden = max(0, r.capacity - alloc - r.free)
    return _found("small-allocations" if req <= SMALL_REQUEST else "shortfall", r, facts, pool_hidden=hidden)


def _found(kind: str, r: OOMReport, facts: Facts, **more: Any) -> Verdict:
    return Verdict(kind, r, replace(facts, by_figures=kind, **more))


def _usable(r: OOMReport, others: int, non_torch: int | None) -> int | None:
    """The memory this process's tensors could occupy: the allowance where the process has one (it bounds what the
    allocator reserves; the CUDA context and other processes do not count against it), else the device less what
    other processes and this process's non-PyTorch memory hold. MPS counts its other Metal allocations against the
    limit too."""
    on_device = None
    if r.capacity is not None:
        on_device = max(0, r.capacity - others - (non_torch or 0))
    if r.allowed is None:
        return on_device
    # An inferred allowance is known only as a range: take its low end, so that fragmentation is never claimed on
    # room that may not exist.
    allowed = r.allowed if r.allowed_min is None else r.allowed_min
    if r.backend == "mps":
        allowed -= non_torch or 0
    return max(0, allowed if on_device is None else min(allowed, on_device))


def _self_among_others(r: OOMReport) -> tuple[OOMReport, int | None]:
    """Inside containers NVML cannot match PIDs, so this process shows up as "Process N has X memory in use".

    One listed process, no "this process has" sentence, and at least PyTorch's own reserved memory: that is us. The
    report with that memory moved to ``process``, and the pid (``None`` where no process was this one).
    """
    if r.process is not None or len(r.other_processes) != 1 or r.allocated is None:
        return r, None
    only = r.other_processes[0]
    if only.bytes is None or only.bytes < r.allocated + (r.reserved_unallocated or 0):
        return r, None
    return replace(r, process=only.bytes, other_processes=()), only.pid
