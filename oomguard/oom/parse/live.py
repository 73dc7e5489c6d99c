"""Live exceptions: whether one is an OOM (anywhere in its chain), and its OOMReport. No torch import: types are
matched by name and messages by the same catalogue as logs.
"""

from __future__ import annotations

from collections.abc import Callable

from ...vocab.oomreport import OOMReport
from .heads import VETO, might_be_oom
from .scan import parse_oom

_OOM_TYPE_NAMES = {"OutOfMemoryError", "MemoryError", "_ArrayMemoryError"}


def is_oom(exc: BaseException | None) -> bool:
    """True when ``exc``, or any exception in its ``__cause__``/``__context__`` chain, is an out-of-memory error.

    Works without importing torch: the type is matched by name (``torch.OutOfMemoryError``, ``MemoryError``) and
    the message by the same catalogue as log analysis, so ``torch.AcceleratorError: CUDA error: out of memory``,
    MPS and cuBLAS failures are caught too.

    >>> is_oom(RuntimeError("CUDA error: out of memory"))
    True
    >>> try:
    ...     try:
    ...         raise MemoryError()
    ...     except MemoryError as inner:
    ...         raise ValueError("wrapped") from inner
    ... except ValueError as outer:
    ...     is_oom(outer)
    True
    >>> is_oom(RuntimeError("Expandable segments are not compatible with memory pool"))
    False
    """
    return oom_in_chain(exc) is not None


def oom_in_chain(exc: BaseException | None) -> BaseException | None:
    """The first exception in the chain that is an OOM (``exc`` itself first), or ``None`` (:func:`first_in_chain`)."""
    return first_in_chain(exc, _exception_is_oom)


def first_in_chain(exc: BaseException | None, test: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception in ``exc``'s chain for which ``test`` holds (``exc`` itself first), or ``None``.

    Both links are followed (``__cause__`` before ``__context__``: ``raise X from Y`` inside an ``except`` block
    leaves the original error only in the context), as are the members of an ``ExceptionGroup``. Cycles end the walk.

    >>> try:
    ...     raise RuntimeError("engine start-up failed") from KeyError("x")
    ... except RuntimeError as e:
    ...     first_in_chain(e, lambda x: isinstance(x, KeyError))
    KeyError('x')
    """
    seen: set[int] = set()
    stack = [exc] if exc is not None else []
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if test(e):
            return e
        linked = [x for x in (e.__cause__, e.__context__) if x is not None]
        members = getattr(e, "exceptions", None)
        if isinstance(members, (list, tuple)):
            linked += [x for x in members if isinstance(x, BaseException)]
        stack.extend(reversed(linked))
    return None


def _exception_text(exc: BaseException) -> str | None:
    try:
        return str(exc)
    except Exception:
        return None


def _exception_is_oom(exc: BaseException) -> bool:
    text = _exception_text(exc)
    if text and VETO.search(text):
        return False
    if any(cls.__name__ in _OOM_TYPE_NAMES for cls in type(exc).__mro__):
        return True
    if not text or not might_be_oom(text):
        return False
    return parse_oom(text) is not None


def report_from_exception(exc: BaseException) -> OOMReport:
    """Parse the OOM in an exception chain; falls back to a bare report when the text has no figures."""
    oom = oom_in_chain(exc) or exc
    text = _exception_text(oom) or ""
    report = parse_oom(text) if text else None
    if report is None and text:
        # Some messages are recognised only with their exception type in front, as a traceback prints them
        # (cudaMallocAsync's "Allocation on device", Ray's OutOfMemoryError).
        report = parse_oom(f"{type(oom).__name__}: {text}")
    if report is None:
        name = type(oom).__name__
        backend = "host" if name in ("MemoryError", "_ArrayMemoryError") else "cuda"
        report = OOMReport(backend=backend, origin="python" if backend == "host" else "allocator",
                           message=f"{name}: {text}".strip().rstrip(":"))
    return report
