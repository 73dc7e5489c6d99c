"""The per-step memory trace, training-process side: one sample at each optimizer step's end.

:class:`StepTracer` reads what the step kept (allocated memory after the optimizer step and ``zero_grad``), the step's
own peak, the reserved memory, the process's host memory and the step's longest prompt and completion, and returns
them as the fields of a ``mem`` event (:class:`oomguard.vocab.trace.MemSample`). The callback calls
:meth:`StepTracer.sample` from ``on_step_end``, and :meth:`StepTracer.step_begin` from ``on_step_begin`` so that a
step's peak is its own (a save or an evaluation between steps would otherwise count in the next step's peak).

Cost: the step already synchronised (its loss was read for logging, its optimizer step ran); this adds none. CUDA's
counters are the caching allocator's host-side bookkeeping (``torch.cuda.memory_stats``, no kernel and no
synchronisation); the simulated device's are Python integers; host memory is one read of ``/proc/self/statm``; the
lengths are the shapes of the batch TRL already built (``trainer._buffered_inputs``), or a number TRL already turned
into a Python float (``trainer._metrics["train"]["completions/max_length"]``). ``bench/trace_cost.py`` measures it.

The step's peak is oomguard's own, from a mark at each step (:mod:`oomguard.child.peaks`): the peak counters the
user's code reads (``torch.cuda.max_memory_allocated()``, transformers' memory metrics, the simulated device's
``peak``) give what they would without oomguard. The process's peak is still what :meth:`Runtime.peak_bytes
<oomguard.child.runtime.Runtime.peak_bytes>` reports (the progress events, the crash record, the logged
``oomguard/peak_gib``): before each mark the tracer hands the peaks to :meth:`Runtime.keep_peaks`.
``reset_peak=False`` measures no per-step peak (and marks nothing).

>>> import torch
>>> from oomguard.child import simulate
>>> dev = simulate.start(256 << 20)
>>> tracer = StepTracer()
>>> kept = torch.zeros(1 << 20)  # 4 MiB kept from step to step
>>> tracer.step_begin()
>>> scratch = torch.zeros(4 << 20); del scratch  # 16 MiB used and freed during the step
>>> s = tracer.sample(1)
>>> s["peak"] - s["kept"] >= 16 << 20, s["capacity"] == 256 << 20, s["host_rss"] > 0
(True, True, True)
>>> dev.model.mark_allocated == dev.model.allocated < dev.peak  # oomguard's peak starts again; the device's does not
True
>>> simulate.stop()
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

from . import peaks


class KeepsPeaks(Protocol):
    """What the tracer needs of the process's Runtime (``child.runtime``, which reads the batch's lengths from here
    when it writes a crash record: this module does not import it back)."""

    def keep_peaks(self, allocated: int | None, reserved: int | None) -> None: ...


class StepTracer:
    """Samples one optimizer step's memory; one per training process.

    ``rt`` is the process's :class:`Runtime` (the tracer keeps its process-wide peaks true across the marks);
    ``reset_peak=False`` measures no per-step peak.
    """

    def __init__(self, rt: KeepsPeaks | None = None, *, reset_peak: bool = True) -> None:
        self.rt = rt
        self.reset_peak = reset_peak
        self._capacity: int | None = None
        self._stats: dict[str, Any] | None = None  # CUDA's counters as last read (a mark keeps their peaks for the user)
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    # -- the device ---------------------------------------------------------------------------------------------
    def _read(self) -> tuple[int | None, int | None, int | None, int | None, int | None]:
        """(allocated now, its peak since the last mark, reserved now, its peak since the mark, capacity), without
        synchronising."""
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            m = dev.model
            return m.allocated, m.mark_allocated, m.reserved, m.mark_reserved, dev.capacity
        self._stats = stats = peaks.counters()  # one call: the allocator's host-side counters
        if stats is None:
            return None, None, None, None, None
        torch = sys.modules["torch"]
        if self._capacity is None:
            try:
                self._capacity = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
            except (RuntimeError, AssertionError):
                self._capacity = None
        return (peaks.leaf(stats, "allocated_bytes", "current"), peaks.leaf(stats, "allocated_bytes", "peak"),
                peaks.leaf(stats, "reserved_bytes", "current"), peaks.leaf(stats, "reserved_bytes", "peak"),
                self._capacity)

    def _reset(self, peak: int | None, reserved_peak: int | None) -> None:
        if not self.reset_peak:
            return
        if self.rt is not None:
            self.rt.keep_peaks(peak, reserved_peak)
        peaks.mark(self._stats)

    def step_begin(self) -> None:
        """Start the step's peak here (what ran between two steps folds into the process's peak, not the step's)."""
        _, peak, _, reserved_peak, _ = self._read()
        self._reset(peak, reserved_peak)

    def sample(self, step: int, trainer: Any = None) -> dict[str, Any]:
        """The ``mem`` event's fields for the step that just ended (``step``: ``state.global_step``), and the
        peak counters reset for the next one. Unknown values are left out."""
        kept, peak, reserved, reserved_peak, capacity = self._read()
        self._reset(peak, reserved_peak)
        prompt, completion = batch_lengths(trainer) if trainer is not None else (None, None)
        rss = self.host_rss()
        if rss is not None and kept is not None and _simulated():
            rss = max(0, rss - kept)  # the simulated device's tensors live in host memory: not counted twice
        out = {"step": step, "kept": kept, "peak": peak if self.reset_peak else None, "reserved": reserved,
               "host_rss": rss, "prompt_tokens": prompt, "completion_tokens": completion, "capacity": capacity}
        return {k: int(v) for k, v in out.items() if v is not None}

    # -- the host -----------------------------------------------------------------------------------------------
    def host_rss(self) -> int | None:
        """This process's resident anonymous memory (resident less file-backed and shared pages): a memory-mapped
        dataset read step by step raises the resident total without being a leak, so it is left out."""
        try:
            with open("/proc/self/statm", "rb") as f:
                fields = f.read().split()
            return (int(fields[1]) - int(fields[2])) * self._page
        except (OSError, IndexError, ValueError):
            pass
        try:
            import psutil

            info = psutil.Process().memory_info()
            return int(info.rss - getattr(info, "shared", 0))
        except Exception:  # no psutil, or a platform without the figure
            return None


def _simulated() -> bool:
    from . import simulate

    return simulate.device() is not None


def batch_lengths(trainer: Any) -> tuple[int | None, int | None]:
    """The longest prompt and completion (tokens) of the step that just ended, as GRPOTrainer holds them.

    TRL's GRPOTrainer keeps the generation batch it trains on in ``_buffered_inputs`` (one dict per micro-step, its
    ``prompt_ids`` left-padded to the longest prompt and ``completion_ids`` right-padded to the longest completion:
    the widths its memory is spent on, read from the shapes). Without it, the longest completion TRL logged
    (``_metrics["train"]["completions/max_length"]``, the last generation's, over every rank). Reads nothing from the
    device.

    >>> class T: _metrics = {"train": {"completions/max_length": [12.0, 31.0]}}
    >>> batch_lengths(T())
    (None, 31)
    """
    prompt = completion = None
    buffered = getattr(trainer, "_buffered_inputs", None)
    if isinstance(buffered, (list, tuple)):
        for batch in buffered:
            if not isinstance(batch, dict):
                continue
            p, c = _width(batch.get("prompt_ids")), _width(batch.get("completion_ids"))
            if p is not None:
                prompt = max(prompt or 0, p)
            if c is not None:
                completion = max(completion or 0, c)
    if completion is None:
        metrics = getattr(trainer, "_metrics", None)
        try:
            logged = metrics["train"]["completions/max_length"] if isinstance(metrics, dict) else None
            if logged:
                completion = int(logged[-1])
        except (KeyError, TypeError, ValueError, IndexError):
            pass
    return prompt, completion


def _width(t: Any) -> int | None:
    shape = getattr(t, "shape", None)
    try:
        return int(shape[-1]) if shape is not None and len(shape) >= 2 else None
    except (TypeError, IndexError):
        return None


__all__ = ["StepTracer", "batch_lengths"]
