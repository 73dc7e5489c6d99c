"""Memory of a failed guarded attempt: measured, and really given back before the next attempt.

``@oomguard.guard`` retries in the same process, so what the failed attempt still holds is taken from the next one.
accelerate's ``release_memory`` collects while the traceback still pins the failed frames; here the order is: leave
the ``except`` block, :func:`drop_traceback` (its frames pin tensors, pytorch #18853 and #27600), then
:func:`release`. Measurements read the simulated device when one runs, else CUDA when it is in use, else nothing.

torch is never imported here: it is used only when the training code has loaded it already.

>>> try:
...     raise MemoryError("out of memory")
... except MemoryError as e:
...     err = e
>>> drop_traceback(err)
>>> err.__traceback__ is None
True
"""

from __future__ import annotations

import gc
import sys
import traceback
from typing import Any

from ..oom.parse import is_oom


def loaded_torch() -> Any:
    """torch when the process has imported it, else None (never imported here).

    >>> import subprocess, sys
    >>> code = "from oomguard.inprocess.release import loaded_torch; print(loaded_torch())"
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    'None'
    >>> import torch; loaded_torch() is torch
    True
    """
    return sys.modules.get("torch")


def cuda_in_use() -> bool:
    """Whether this process has started CUDA (a process that never touched the GPU has nothing to measure or free).

    >>> import torch
    >>> cuda_in_use() == (torch.cuda.is_available() and torch.cuda.is_initialized())
    True
    """
    torch = loaded_torch()
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def live_bytes() -> int | None:
    """Bytes of live tensors now: on the simulated device, else on CUDA; None when neither is in use.

    >>> import torch
    >>> from oomguard.child import simulate
    >>> _ = simulate.start(64 << 20)
    >>> before = live_bytes(); x = torch.ones(1 << 20)  # 4 MiB of float32
    >>> live_bytes() - before, peak_bytes() >= live_bytes()
    (4194304, True)
    >>> del x; reset_peak(); peak_bytes() == live_bytes() == before
    True
    >>> simulate.stop()
    """
    from ..child import simulate

    dev = simulate.device()
    if dev is not None:
        return dev.model.allocated
    if cuda_in_use():
        return int(loaded_torch().cuda.memory_allocated())
    return None


def peak_bytes() -> int | None:
    """The peak of live tensor bytes since :func:`reset_peak`, on the same device as :func:`live_bytes` (its
    example shows both)."""
    from ..child import peaks

    return peaks.since_mark()[0]


def reset_peak() -> None:
    """Start a new peak (each attempt reports its own; :func:`live_bytes` shows it): oomguard's own
    (``oomguard.child.peaks``), so the peak counters the guarded code reads stay what they would be without the
    guard."""
    from ..child import peaks

    peaks.mark()


def release() -> None:
    """After leaving the except block and dropping the traceback: collect, give the cache back, reset the peak.

    What else can keep a failed attempt's memory, and what is done about it:

    - an OOM that an earlier failure left in ``sys.last_exc`` / ``sys.last_value`` (a notebook keeps the last
      unhandled exception for ``%debug``): its frames are cleared;
    - an OOM inside ``backward()`` leaves the autograd engine holding the failed step's gradients until the next
      backward runs (pytorch #82218). CPU work runs on the calling thread, CUDA work on the device's own engine
      thread, so a scalar backward is run on each (on the current CUDA device too), then a second collection;
    - cuBLAS and cuBLASLt keep a workspace per (handle, stream), allocated through the caching allocator and never
      freed: 32 MiB each on Hopper and Blackwell, one handle for the forward's thread and one for the backward's
      engine thread (65 MiB live after a failed attempt in a real 4 GiB-capped run). They are cleared
      (``torch._C._cuda_clearCublasWorkspaces``) and come back on the next matmul.

    >>> import torch
    >>> from oomguard.child import simulate
    >>> _ = simulate.start(64 << 20)
    >>> def attempt():
    ...     held = torch.ones(1 << 20)  # 4 MiB that the failed attempt's frame still holds
    ...     raise MemoryError("out of memory")
    >>> try:
    ...     attempt()
    ... except MemoryError as e:
    ...     err = e
    >>> before = live_bytes(); drop_traceback(err); release(); before - live_bytes()
    4194304
    >>> simulate.stop()
    """
    clear_last_oom()
    gc.collect()
    torch = loaded_torch()
    if torch is not None:
        try:  # a tiny backward frees autograd's cached graph; on a device still full (a leak) even that may fail
            torch.zeros((), requires_grad=True).sum().backward()
            if cuda_in_use():
                torch.zeros((), device="cuda", requires_grad=True).sum().backward()
        except torch.OutOfMemoryError:
            pass
        gc.collect()
    from ..child import simulate

    dev = simulate.device()
    if dev is not None:
        dev.release_cached()
    if cuda_in_use():
        clear = getattr(loaded_torch()._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            loaded_torch().cuda.synchronize()
            clear()
        loaded_torch().cuda.empty_cache()
    reset_peak()


def drop_traceback(exc: BaseException, detach: bool = True) -> None:
    """Clear the frames of every traceback in the chain, so their locals (tensors) can be freed.

    Every link is followed, as :func:`oomguard.oom.parse.oom_in_chain` follows them to decide that this was an OOM: both
    ``__cause__`` and ``__context__`` (``raise X from Y`` inside ``except OOM`` leaves the OOM only in the context)
    and the members of an ``ExceptionGroup``. Clearing the frames (not only dropping our reference) matters because
    the code may keep the exception elsewhere: a log record of ``logger.exception``, an error list. ``detach=False``
    clears the frames but leaves each ``__traceback__`` in place (for an exception the user may still inspect).

    >>> try:
    ...     try:
    ...         raise MemoryError("out of memory")
    ...     except MemoryError:
    ...         raise RuntimeError("the step failed")
    ... except RuntimeError as e:
    ...     err = e
    >>> drop_traceback(err)
    >>> err.__traceback__ is None and err.__context__.__traceback__ is None
    True
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            if detach:
                e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
        members = getattr(e, "exceptions", None)
        if isinstance(members, (list, tuple)):
            stack += [m for m in members if isinstance(m, BaseException)]


def clear_last_oom() -> None:
    """Clear the frames of an OOM that the interpreter keeps as the last unhandled exception (notebooks do, for
    ``%debug``): their locals are the failed run's tensors. The exception and its traceback stay for the user.

    >>> clear_last_oom()
    """
    for name in ("last_exc", "last_value"):
        e = getattr(sys, name, None)
        if isinstance(e, BaseException) and is_oom(e):
            drop_traceback(e, detach=False)
            tb = getattr(sys, "last_traceback", None)
            if tb is not None:
                traceback.clear_frames(tb)
