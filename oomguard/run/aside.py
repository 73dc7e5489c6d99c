"""What an attempt prints once a training process has ended it (a pre-flight stop, an uncaught OOM) goes to a file
of the attempt, not the terminal: a launcher's traceback of that end would read as a crash of its own."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from ..vocab.protocol import OOM_LINE


class Aside:
    """Where the output of an attempt goes once a training process has ended it on purpose (a pre-flight stop) or by
    an uncaught OOM: what a launcher then prints (torch elastic's ``ChildFailedError`` traceback and error summary,
    accelerate's ``CalledProcessError``, the other ranks' errors at a collective whose peer is gone) would read as a
    crash, so it goes to a file of the attempt instead of the terminal. Lines of oomguard's own (``oomguard...``,
    also behind a launcher's ``[rank1]:`` prefix) still reach the terminal.

    ``stopped()`` says whether a stop happened (the training process marks it before it exits, so anything a launcher
    prints about it comes after). An uncaught OOM is read in the output itself: the line the training process prints
    after its traceback (``OOM_LINE``), so that the traceback before it is still shown, in order, wherever the pipe's
    reads fall. ``why`` says which came first ("the stop", "the out-of-memory error")."""

    def __init__(self, stopped: Callable[[], bool], path: Any) -> None:
        self.stopped = stopped
        self.path = path
        self.lines = 0
        self.oom = False  # the OOM line was seen
        self._carry: dict[int, bytes] = {}
        self._partial: dict[int, bytes] = {}  # the line being written on each stream, before the end
        self._lock = threading.Lock()

    @property
    def why(self) -> str:
        return "the out-of-memory error" if self.oom else "the stop"

    def split(self, stream: int, b: bytes) -> bytes:
        """The part of ``b`` still for the terminal (everything before the end; after it, whole lines of oomguard's
        own); the rest is written aside."""
        shown = b""
        if not self.oom and not self.stopped():
            cut = self._oom_line_end(stream, b)
            if cut is None:
                return b
            shown, b = b[:cut], b[cut:]
            self.oom = True
        data = self._carry.pop(stream, b"") + b
        *lines, rest = data.split(b"\n")
        if rest:
            self._carry[stream] = rest
        show = [ln + b"\n" for ln in lines if _ours(ln)]
        hide = [ln + b"\n" for ln in lines if not _ours(ln)]
        if hide:
            self._write(b"".join(hide), len(hide))
        return shown + b"".join(show)

    def _oom_line_end(self, stream: int, b: bytes) -> int | None:
        """Where in ``b`` the training process's OOM line ends (just after its newline), or None."""
        before = self._partial.pop(stream, b"")
        data = before + b
        at = 0
        for line in data.split(b"\n")[:-1]:
            at += len(line) + 1
            if _ours(line, _OOM_LINE):
                return at - len(before)
        self._partial[stream] = data[at:][-4096:]  # a line split between two reads; a progress bar is never one
        return None

    def flush(self) -> None:
        """At the end: a last line without its newline goes aside too."""
        rest = b"".join(self._carry.values())
        self._carry.clear()
        if rest:
            self._write(rest, 1)

    def _write(self, data: bytes, lines: int) -> None:
        with self._lock:
            self.lines += lines
            try:
                with open(self.path, "ab") as f:
                    f.write(data)
            except OSError:
                pass


_OOM_LINE = OOM_LINE.encode()
_PREFIX = re.compile(rb"^\s*(\[[^\]\n]{1,40}\]:?\s*)?")  # a launcher's or torch's prefix: [rank1]:, [default0]:


def _ours(line: bytes, start: bytes = b"oomguard") -> bool:
    """Whether ``line`` is oomguard's own (it starts with ``start``, after a launcher's prefix).

    >>> _ours(b"  oomguard probe 1/8: stopped"), _ours(b"[rank1]: oomguard: out of memory", _OOM_LINE)
    (True, True)
    >>> _ours(b"Traceback (most recent call last):"), _ours(b"[default0]:RuntimeError: oomguard said so")
    (False, False)
    """
    m = _PREFIX.match(line)
    return line[m.end() if m else 0:].startswith(start)


__all__ = ["Aside"]
