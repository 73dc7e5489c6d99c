"""Find every OOM in text: the scanner that strings, crash records and streamed files share, and ``parse_oom``.

A line is looked at only when the cheap filter passes it; a recognised head is joined with its continuation lines,
its figures are read by its source's reader, and one OOM reported several times (by a launcher's summary, a handler
that logs what it caught, NCCL before Python, the shell and Slurm for one kill) counts once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ...vocab.oomreport import Frame, OOMReport
from .heads import CHEAP_REGEXES, VETO, backend_for, might_be_oom, pid_of, recognitions
from .lines import (
    ELLIPSIS,
    MAX_CONTINUATION,
    MAX_FRAMES_LOOKBACK,
    assemble,
    frames_before,
    is_source_line,
    rank_of,
    same_rank,
    split_lines,
    strip_prefix,
    visible,
    vllm_process_of,
    with_follow,
)
from .patterns import Head


def _parse_figures(report: OOMReport, core: str, head: Head) -> OOMReport:
    """Read the figures with the head's reader. ``core`` is the message from its head on (log text before the head is
    not looked at); ``report.message`` is the whole joined text, which a few vLLM wordings need (their figures precede
    the head)."""
    kw = head.figures(core, report.message) if head.figures is not None else {}
    return replace(report, **{k: v for k, v in kw.items() if v is not None or k in ("other_processes",)})


def parse_oom(text: str) -> OOMReport | None:
    """Parse one message (possibly several lines) into an OOMReport, or ``None`` if it is not an OOM.

    >>> parse_oom("RuntimeError: MPS backend out of memory (MPS allocated: 33.48 GB, other allocations: 2.45 GB, "
    ...           "max allowed: 36.27 GB). Tried to allocate 600.15 MB on private pool.").backend
    'mps'
    >>> parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB. GPU 0 has a total "
    ...           "capacty of 14.75 GiB of which 11.06 MiB is free.").capacity  # the 2.1-era typo
    15837691904
    """
    hits = list(scan_lines(split_lines(text)))
    return hits[0].report if hits else None


@dataclass(frozen=True)
class Hit:
    """An OOM found in text: the 1-based line where its message starts, the report, and the frames before it."""

    line: int
    report: OOMReport
    frames: tuple[Frame, ...] = ()
    rank: int | None = None
    server: str | None = None  # the vLLM server process whose line it is ("EngineCore pid=7"), if any


_HOST_KILLS = ("oom-killer", "shell", "slurm")


def _followed_by_same(lines: list[str], index: int, head: Head, backend: str, rank: int | None) -> bool:
    """Whether a message of the same origin and backend starts within the next MAX_CONTINUATION lines (the limit
    keeps streaming and whole-text scanning in agreement: a streamed chunk always holds that many lines more)."""
    for j in range(index + 1, min(len(lines), index + 1 + MAX_CONTINUATION)):
        raw = lines[j]
        if rank_of(raw) not in (rank, None):
            continue
        s = strip_prefix(raw)
        if not might_be_oom(s):
            continue
        for h, m in recognitions(s):
            if h is not head and h.origin == head.origin and backend_for(h, m) == backend:
                return True
    return False


def _same_message(a: str, b: str) -> bool:
    """Equal, or one is the other cut short with an ellipsis (pytest's summary line, a terminal-width log)."""
    if a == b:
        return True
    short, long_ = (a, b) if len(a) <= len(b) else (b, a)
    if not short.endswith(ELLIPSIS):
        return False
    short = short.rstrip(".\u2026").rstrip()
    return len(short) >= 40 and long_.startswith(short)


class _Scanner:
    """Scans lines for OOM heads; remembers recent messages so that one OOM reported several times counts once.

    Launchers print the same message again (torchrun's failure summary, an app that logs what it caught, pytest's
    short summary), a sticky CUDA error repeats in every handler, and NCCL's own warning precedes the Python error.
    A repeat is the same origin and backend within a window (200 lines for an allocator message with the same
    text, 60 for the rest), on the same rank or where one side names no rank.
    """

    _WINDOW_ALLOCATOR = 200
    _WINDOW = 60

    def __init__(self) -> None:
        self.recent: dict[tuple[Any, ...], list[tuple[int, int | None, str]]] = {}
        self.consumed: set[int] = set()  # absolute line numbers used as continuation lines
        self.kills: list[list[Any]] = []  # host OOM kills: [last line, rank, pids, reported by Slurm]

    def _is_repeat(self, key: tuple[Any, ...], line_no: int, rank: int | None, core: str) -> bool:
        window = self._WINDOW_ALLOCATOR if key[0] == "allocator" else self._WINDOW
        entries = [e for e in self.recent.get(key, []) if line_no - e[0] <= window]
        repeat = False
        for k, (_, r, c) in enumerate(entries):
            if same_rank(r, rank) and (key[0] != "allocator" or _same_message(c, core)):
                entries[k] = (line_no, r if r is not None else rank, c if len(c) >= len(core) else core)
                repeat = True
                break
        if not repeat:
            entries.append((line_no, rank, core))
        self.recent[key] = entries
        return repeat

    def scan(self, lines: list[str], first_line: int, start: int, stop: int) -> Iterator[Hit]:
        for i in range(start, stop):
            line_no = first_line + i
            if line_no in self.consumed:
                continue
            raw = lines[i]
            stripped = strip_prefix(raw)
            if not might_be_oom(stripped):
                continue
            hit = self._hit(lines, i, line_no, raw, stripped)
            if hit is not None:
                yield hit

    def _hit(self, lines: list[str], i: int, line_no: int, raw: str, stripped: str) -> Hit | None:
        rank = rank_of(raw)
        for head, m in recognitions(stripped):
            if is_source_line(lines, i, stripped, m, rank):
                return None
            text, used = assemble(lines, i, head, rank)
            if head.follow is not None:
                text = with_follow(lines, i, head.follow, rank, text)
            core = text[m.start():]
            if head.requires is not None and not head.requires.search(core):
                continue
            if VETO.search(text):
                return None
            backend = backend_for(head, m)
            if head.precursor and _followed_by_same(lines, i, head, backend, rank):
                return None
            first = line_no - i
            self.consumed.update(first + j for j in used)
            message = " ".join(text.split())
            report = _parse_figures(
                OOMReport(backend=backend, origin=head.origin, message=message, pid=pid_of(m)), core, head
            )
            if head.origin in _HOST_KILLS:
                if self._is_host_kill_repeat(head.origin, report.pid, line_no, rank):
                    return None
            elif self._is_repeat((head.origin, report.backend, None), line_no, rank, " ".join(core.split())):
                return None
            return Hit(line_no, report, frames_before(lines, i, rank), rank, vllm_process_of(raw))
        return None

    def _is_host_kill_repeat(self, origin: str, pid: int | None, line_no: int, rank: int | None) -> bool:
        """One kill of the host's OOM killer is often reported twice: the kernel's or the shell's "Killed" line names
        the process, and Slurm's step report ("Detected 1 oom-kill event(s)") follows or precedes it. A Slurm report
        joins a recent kill, a kill joins a recent Slurm report that names no process yet, and a process killed
        again within the window is the same kill. Kills of two different processes stay two findings."""
        events = [e for e in self.kills if line_no - e[0] <= self._WINDOW]
        for e in events:
            if not same_rank(e[1], rank):
                continue
            pids, slurm = e[2], e[3]
            same = (origin == "slurm" or (pid is not None and pid in pids) or (slurm and not pids))
            if same:
                e[0] = line_no
                if origin == "slurm":
                    e[3] = True
                elif pid is not None:
                    pids.add(pid)
                self.kills = events
                return True
        events.append([line_no, rank, {pid} if pid is not None else set(), origin == "slurm"])
        self.kills = events
        return False


def scan_lines(lines: Iterable[str], *, first_line: int = 1) -> Iterator[Hit]:
    """Find every OOM in a sequence of lines, in order.

    >>> [h.line for h in scan_lines(["loss 0.1", "[rank0]: torch.OutOfMemoryError: CUDA out of memory. "
    ...                              "Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 7.9 GiB"])]
    [2]
    """
    lines = [visible(line) for line in lines]
    yield from _Scanner().scan(lines, first_line, 0, len(lines))


def scan_text(text: str) -> list[Hit]:
    """All OOMs in a string (a captured stderr tail, an exception's text). Lines are numbered as ``\\n`` splits them."""
    return list(scan_lines(text.split("\n")))


_MAX_LINE = 1 << 20  # a "line" longer than this is cut, so one runaway line cannot hold the whole file


class Readable(Protocol):
    """What a scan reads bytes from: a file opened "rb", a gzip stream, a stream that tees what it reads."""

    def read(self, size: int = -1, /) -> bytes: ...


def scan_stream(stream: Readable, *, chunk_size: int = 8 << 20, max_bytes: int | None = None) -> Iterator[Hit]:
    """Stream a (possibly huge) binary log and yield its OOMs in order, in bounded memory.

    Gives the same hits as ``scan_text`` on the decoded text. Only lines that contain a needle are looked at; the
    lines before them are kept for traceback frames, and a message near the end of a chunk waits for the next chunk
    so that its continuation lines are there.

    >>> import io
    >>> [h.report.backend for h in scan_stream(io.BytesIO(b"ok\\nMemoryError\\n"))]
    ['host']
    >>> list(scan_stream(io.BytesIO(b"")))
    []
    """
    scanner = _Scanner()
    chunk_size = max(1, chunk_size)
    # a candidate can sit in the last lines of the carry, and still sees the full frame look-back above it
    keep_lines = MAX_FRAMES_LOOKBACK + MAX_CONTINUATION + 2
    carry = b""
    carry_first = 1  # line number of carry's first line
    pending = 1  # first line number not yet scanned
    total = 0
    while True:
        want = chunk_size if max_bytes is None else max(0, min(chunk_size, max_bytes - total))
        chunk = stream.read(want) if want else b""
        total += len(chunk)
        eof = not chunk
        buf = carry + chunk
        if eof:
            cut = len(buf)
        else:
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                if len(buf) <= _MAX_LINE:
                    carry = buf
                    continue
                cut = len(buf)
        if cut == 0:
            return  # end of an empty stream
        newlines = buf.count(b"\n", 0, cut)
        n_lines = newlines + (0 if buf[cut - 1] == 10 else 1)
        limit = n_lines if eof else max(0, n_lines - (MAX_CONTINUATION + 1))
        candidates = [
            i for i in _candidate_lines(buf, cut)
            if i < limit and carry_first + i >= pending and carry_first + i not in scanner.consumed
        ]
        if candidates:
            lines = split_lines(buf[:cut].decode("utf-8", errors="replace"))
            for i in candidates:
                yield from scanner.scan(lines, carry_first, i, i + 1)
                pending = max(pending, carry_first + i + 1)
        pending = max(pending, carry_first + limit)
        if eof:
            return
        keep_from = _tail_start(buf, keep_lines, cut)
        carry_first += newlines - buf.count(b"\n", keep_from, cut)
        carry = buf[keep_from:]
        scanner.consumed = {n for n in scanner.consumed if n >= carry_first}


def _candidate_lines(buf: bytes, end: int | None = None) -> list[int]:
    """Sorted indices of the lines of ``buf[:end]`` that pass the cheap test."""
    end = len(buf) if end is None else end
    folded = buf.lower()  # ASCII only: byte offsets unchanged
    starts = sorted({buf.rfind(b"\n", 0, m.start()) + 1 for rx in CHEAP_REGEXES for m in rx.finditer(folded, 0, end)})
    out: list[int] = []
    prev_pos, prev_idx = 0, 0
    for st in starts:
        prev_idx += buf.count(b"\n", prev_pos, st)
        prev_pos = st
        out.append(prev_idx)
    return out


def _tail_start(region: bytes, n_lines: int, end: int | None = None) -> int:
    """Byte offset where the last ``n_lines`` lines of ``region[:end]`` (which ends with a newline) start."""
    pos = (len(region) if end is None else end) - 1
    for _ in range(n_lines):
        pos = region.rfind(b"\n", 0, pos)
        if pos == -1:
            return 0
    return pos + 1
