"""oomguard's own peaks (one training step's, one guarded call's), measured without taking the user's counters.

The user's code may log ``torch.cuda.max_memory_allocated()`` (transformers' memory metrics do) and reset it when it
likes: what it reads must be what it would read without oomguard. oomguard measures its own peaks from a mark
(:func:`mark`) to now (:func:`since_mark`):

- **The simulated device** keeps a second watermark for oomguard (``AllocatorModel.mark``): its own counters, which
  the user's code and the tests read (``SimulatedDevice.peak``, ``stats()``), are never reset by oomguard.
- **CUDA** has one set of peak counters per device, so a mark resets them (the only exact per-step peak there is),
  after folding their peaks into what oomguard keeps for the user: ``torch.cuda.memory.memory_stats_as_nested_dict``,
  through which ``memory_stats``, ``max_memory_allocated``, ``max_memory_reserved`` and ``memory_summary`` read them,
  gives each ``peak`` as the larger of the counter's and the one kept since the user's own last reset;
  ``reset_peak_memory_stats`` (also through ``reset_max_memory_allocated``) forgets the kept ones. Both are wrapped
  when ``torch.cuda.memory`` is imported (the bootstrap's post-import hook, before the user's code can bind them by
  name), or at the first mark.

>>> import torch
>>> from oomguard.child import simulate
>>> dev = simulate.start(64 << 20)
>>> x = torch.zeros(4 << 20); del x   # 16 MiB, gone again
>>> mark(); since_mark()[0] < 16 << 20 <= dev.peak   # oomguard's peak starts again; the device's own does not
True
>>> simulate.stop()
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any

# device index -> the nested peaks (memory_stats_as_nested_dict's shape, "peak" leaves only) before oomguard's
# resets since the user's own last one
_KEPT: dict[int, dict[str, Any]] = {}
_REAL: dict[str, Any] = {}  # torch's own functions, once wrapped


def _torch() -> Any:
    return sys.modules.get("torch")


def _cuda_in_use(torch: Any) -> bool:
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def mark(stats: Mapping[str, Any] | None = None) -> None:
    """Start oomguard's peaks again from now (the simulated device's second watermark, or CUDA's counters with their
    peaks kept for the user); ``stats``: CUDA's counters as :func:`counters` just read them, so they are not read
    twice."""
    from . import simulate

    dev = simulate.device()
    if dev is not None:
        dev.model.mark()
        return
    torch = _torch()
    if not _cuda_in_use(torch):
        return
    install(torch.cuda.memory)
    index = torch.cuda.current_device()
    _KEPT[index] = _max_peaks(_KEPT.get(index), stats if stats is not None else _REAL["stats"](index))
    _REAL["reset"](index)


def counters() -> dict[str, Any] | None:
    """CUDA's counters of the current device as they are (nested, as ``memory_stats_as_nested_dict``), their peaks
    since oomguard's last :func:`mark`: one read of the allocator's host-side bookkeeping, no synchronisation. None
    without CUDA in use."""
    torch = _torch()
    if not _cuda_in_use(torch):
        return None
    read = _REAL.get("stats") or torch.cuda.memory.memory_stats_as_nested_dict
    return dict(read(torch.cuda.current_device()))


def since_mark() -> tuple[int | None, int | None]:
    """oomguard's peaks of allocated and reserved memory since the last :func:`mark` (None where unknown)."""
    from . import simulate

    dev = simulate.device()
    if dev is not None:
        return dev.model.mark_allocated, dev.model.mark_reserved
    stats = counters()
    return (leaf(stats, "allocated_bytes", "peak"), leaf(stats, "reserved_bytes", "peak")) if stats else (None, None)


def leaf(stats: Mapping[str, Any], name: str, which: str) -> int | None:
    """``stats[name]["all"][which]``: ``leaf(s, "allocated_bytes", "current")`` is ``allocated_bytes.all.current``."""
    v = stats.get(name, {}).get("all", {}).get(which)
    return int(v) if v is not None else None


def install(memory: Any) -> None:
    """Wrap ``torch.cuda.memory``'s peak readers and reset (and their names in ``torch.cuda``) so that the user reads
    the peaks oomguard's marks reset, as if they had not been; once per process."""
    if _REAL:
        return
    # torch's own functions, also where an earlier install (the guard's, in a process that imported oomguard anew)
    # left its wrappers
    stats = _real(memory.memory_stats_as_nested_dict)
    reset = _real(memory.reset_peak_memory_stats)
    _REAL.update(stats=stats, reset=reset)

    @functools.wraps(stats)
    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        out = stats(device)
        kept = _KEPT.get(_index(memory, device)) if out else None
        return _max_peaks(out, kept, whole=True) if kept else out

    @functools.wraps(reset)
    def reset_peak_memory_stats(device: Any = None) -> None:
        _KEPT.pop(_index(memory, device), None)
        return reset(device)

    memory_stats_as_nested_dict._oomguard_real = stats  # type: ignore[attr-defined]
    reset_peak_memory_stats._oomguard_real = reset  # type: ignore[attr-defined]
    memory.memory_stats_as_nested_dict = memory_stats_as_nested_dict
    memory.reset_peak_memory_stats = reset_peak_memory_stats
    cuda = sys.modules.get("torch.cuda")
    for name, fn in (("memory_stats_as_nested_dict", memory_stats_as_nested_dict),
                     ("reset_peak_memory_stats", reset_peak_memory_stats)):
        if cuda is not None and _real(getattr(cuda, name, None)) in (stats, reset):
            setattr(cuda, name, fn)


def _real(fn: Any) -> Any:
    """torch's own function behind an oomguard wrapper (or ``fn`` itself)."""
    return getattr(fn, "_oomguard_real", fn)


def _index(memory: Any, device: Any) -> int:
    try:
        return int(memory._get_device_index(device, optional=True))
    except Exception:  # a device torch cannot name: nothing kept under it
        return -1


def _max_peaks(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, whole: bool = False) -> dict[str, Any]:
    """``a`` with each ``peak`` leaf the larger of ``a``'s and ``b``'s; ``whole``: every other leaf of ``a`` kept too
    (else only the peaks, what is kept).

    >>> _max_peaks({"allocated_bytes": {"all": {"current": 5, "peak": 7}}, "num_ooms": 0},
    ...            {"allocated_bytes": {"all": {"peak": 9}}}, whole=True)
    {'allocated_bytes': {'all': {'current': 5, 'peak': 9}}, 'num_ooms': 0}
    """
    out: dict[str, Any] = {}
    for k in set(a or {}) | set(b or {}):
        x, y = (a or {}).get(k), (b or {}).get(k)
        if isinstance(x, Mapping) or isinstance(y, Mapping):
            sub = _max_peaks(x if isinstance(x, Mapping) else None, y if isinstance(y, Mapping) else None, whole)
            if sub:
                out[k] = sub
        elif k == "peak":
            out[k] = max(v for v in (x, y) if v is not None)
        elif whole and x is not None:
            out[k] = x
    return {k: out[k] for k in (*(a or {}), *(k for k in (b or {}) if k not in (a or {}))) if k in out}


__all__ = ["counters", "install", "leaf", "mark", "since_mark"]
