"""Reading a log line by line, as a person would: the prefixes loggers and launchers put on each line, the rank a
line belongs to, traceback frames, and the continuation lines that complete a wrapped message.
"""

from __future__ import annotations

import re

from ...vocab.oomreport import Frame
from .heads import recognise
from .patterns import Head

# Prefixes that loggers, launchers and notebooks put on every line.
_PREFIX = re.compile(
    r"^(?:\s*(?:"
    r"\[rank\s*\d+\]:?|rank\s*\d+:|\[default\d+\]:?|\[\d+\]<std(?:err|out)>:?"
    r"|\((?:[\w.-]+\s+)?pid=\d+(?:,\s*ip=[\d.:a-f]+)?\)"
    r"|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
    r"|\[\d{4}-\d\d-\d\d[^\]]{0,40}\]"
    r"|\d\d-\d\d\s+\d\d:\d\d:\d\d(?:\.\d+)?"
    r"|\d\d:\d\d:\d\d(?:[.,]\d+)?"
    r"|\[\s*\d+\.\d+\]"
    r"|(?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL):[\w.]+:"  # Python logging's default "LEVEL:logger:"
    r"|(?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL)\b:?"
    r"|\[[\w./-]+\.py:\d+\]|[\w-]+\.py:\d+\]"
    r"|[\w.-]+-\d+\s+\|"  # docker compose: "vllm-1  | "
    r"|E(?=\s{2,})"
    r"|[|:>-](?=\s)"
    r")\s*)+"
)
_RANK = re.compile(r"\[rank\s*(\d+)\]|rank\s*(\d+):|\[default(\d+)\]")
# Traceback frames: CPython ('File "x.py", line 3, in f') and IPython 8 ('File ~/x.py:3, in Cls.f(a, b)', 'Cell In[4],
# line 9[, in f(...)]').
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')
_FRAME_IPY = re.compile(r"^\s*File (?P<file>\S.*?):(?P<line>\d+), in (?P<name>[^\s(]+)")
_FRAME_CELL = re.compile(r"^\s*(?P<file>Cell In\s*\[\d+\]), line (?P<line>\d+)(?:, in (?P<name>[^\s(]+))?")
_TRACEBACK = "Traceback (most recent call last)"
_NEW_RECORD = re.compile(
    r"^(?:Traceback \(most recent call last\)|File \"|During handling|The above exception|"
    r"(?:[\w.]+\.)?\w*(?:Error|Exception|Warning|Interrupt|Exit)\b:|\{|\[\s*\d|#|[=_*~-]{4,})"
)

MAX_CONTINUATION = 14
ELLIPSIS = ("...", "\u2026")  # a log or summary line cut to the terminal width
MAX_FRAMES_LOOKBACK = 400
_MAX_FRAME_GAP = 16  # lines without a frame (source, carets, IPython context) before the frames are given up
_SOURCE_LOOKBACK = 6  # a frame this close above a quoted head means the head is the frame's source line


def strip_prefix(line: str) -> str:
    """Remove launcher/logger prefixes such as ``[rank3]: `` or ``(EngineCore pid=7) ERROR 01-02 03:04:05 [x.py:1]``.

    >>> strip_prefix("[rank3]: torch.OutOfMemoryError: CUDA out of memory.")
    'torch.OutOfMemoryError: CUDA out of memory.'
    >>> strip_prefix("WARNING:root:CUDA out of memory.")
    'CUDA out of memory.'
    """
    m = _PREFIX.match(line)
    return line[m.end():] if m else line


# The process tags of vLLM's own multiprocessing (``vllm serve``, ``trl vllm-serve``, any engine it starts in
# processes of its own): a line of the server, never of a colocated vLLM, which runs in the trainer's process.
_VLLM_PROCESS = re.compile(r"^\s*\((APIServer|EngineCore(?:_DP\d+)?|(?:Vllm)?Worker(?:_\w+)?)\s+pid=(\d+)\)")


def vllm_process_of(line: str) -> str | None:
    """The vLLM server process a log line comes from (``"EngineCore pid=7"``), or None.

    >>> vllm_process_of("(EngineCore_DP0 pid=25890) ERROR 11-26 18:57:01 [core.py:1] ValueError: No available memory")
    'EngineCore_DP0 pid=25890'
    >>> vllm_process_of("[rank0]: ValueError: No available memory for the cache blocks.") is None
    True
    """
    m = _VLLM_PROCESS.match(line)
    return f"{m.group(1)} pid={m.group(2)}" if m else None


def rank_of(line: str) -> int | None:
    """The rank named in a line's prefix, if any."""
    m = _RANK.search(line[:40])
    if not m:
        return None
    return int(next(g for g in m.groups() if g is not None))


def visible(line: str) -> str:
    """What a terminal shows of a line: trailing CR/LF dropped, and only the text after the last carriage return
    (progress bars redraw themselves with ``\\r``)."""
    line = line.rstrip("\r\n")
    if "\r" in line:
        line = line.rsplit("\r", 1)[-1]
    return line


def split_lines(text: str) -> list[str]:
    """Lines as editors and ``grep -n`` count them: split on ``\\n`` only (``\\r\\n`` included), ``\\r`` redraws kept
    within their line."""
    return [visible(line) for line in text.split("\n")]


def _frame_of(stripped: str) -> Frame | None:
    m = _FRAME.search(stripped)
    if m:
        return Frame(m.group("file"), int(m.group("line")), m.group("name"))
    m = _FRAME_IPY.match(stripped) or _FRAME_CELL.match(stripped)
    if m:
        # IPython prints qualified names ("Adam._init_group"); keep the function name, as CPython does.
        name = (m.group("name") or "<cell>").rsplit(".", 1)[-1]
        return Frame(m.group("file"), int(m.group("line")), name)
    return None


def same_rank(a: int | None, b: int | None) -> bool:
    return a is None or b is None or a == b


def frames_before(lines: list[str], index: int, rank: int | None) -> tuple[Frame, ...]:
    """The traceback frames above line ``index`` (outermost first), read back to the ``Traceback`` header.

    Lines of other ranks are skipped. Only a traceback that ends right above the message counts: once more than
    ``_MAX_FRAME_GAP`` lines pass without a frame the walk stops, so an unrelated traceback further up is not
    attributed to a message printed without one.
    """
    frames: list[Frame] = []
    gap = 0
    lo = max(0, index - MAX_FRAMES_LOOKBACK)
    for j in range(index - 1, lo - 1, -1):
        raw = lines[j]
        if rank is not None and rank_of(raw) not in (rank, None):
            continue
        s = strip_prefix(raw)
        if _TRACEBACK in s:
            break
        frame = _frame_of(s)
        if frame is not None:
            frames.append(frame)
            gap = 0
            continue
        if frames and (s.startswith("During handling") or s.startswith("The above exception")):
            break
        gap += 1
        if gap > _MAX_FRAME_GAP:
            break
    frames.reverse()
    return tuple(frames)


_EXCEPTION_LINE = re.compile(r"(?:[\w.]+\.)?\w*(?:Error|Exception|Warning|Interrupt|Exit)\b:")


def _inside_literal(code: str) -> bool:
    """Whether ``code`` ends inside a string literal. A quote opens a literal only where code can start one (not
    after a letter or digit, so "models's" or "can't" in prose do not count), string prefixes (f, r, b, u) allowed."""
    quote = ""
    i = 0
    while i < len(code):
        c = code[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            j = i - 1
            while j >= 0 and code[j] in "rRbBuUfF" and i - j <= 2:
                j -= 1
            if j < 0 or not (code[j].isalnum() or code[j] == "_"):
                quote = c
        i += 1
    return bool(quote)


def is_source_line(lines: list[str], index: int, stripped: str, m: re.Match[str], rank: int | None) -> bool:
    """True when the head sits inside a string literal of a traceback's source line, such as
    ``raise ValueError("No available memory for the cache blocks. "`` under its ``File "...", line N`` frame.
    The real message follows a few lines down."""
    if _EXCEPTION_LINE.match(stripped.lstrip()) or not _inside_literal(stripped[: m.start()]):
        return False
    for j in range(index - 1, max(-1, index - 1 - _SOURCE_LOOKBACK), -1):
        raw = lines[j]
        if rank is not None and rank_of(raw) not in (rank, None):
            continue
        s = strip_prefix(raw)
        if _frame_of(s) is not None:
            return True
        if _EXCEPTION_LINE.match(s.lstrip()):
            return False  # that traceback already ended with its exception line
    return False


def assemble(lines: list[str], index: int, head: Head, rank: int | None) -> tuple[str, list[int]]:
    """Join the head line with continuation lines until the message is complete.

    Returns the text and the indices of the continuation lines used. Only lines of the head's rank continue it;
    lines from other ranks or sources in between are passed over (and left for the scanner).
    """
    text = strip_prefix(lines[index])
    used: list[int] = []
    if head.complete is None:
        return text, used
    j = index + 1
    while (not head.complete.search(text) and not text.rstrip().endswith(ELLIPSIS) and j < len(lines)
           and j - index <= MAX_CONTINUATION):
        raw = lines[j]
        j += 1
        if rank_of(raw) != rank:
            continue
        nxt = strip_prefix(raw)
        if not nxt.strip() or _NEW_RECORD.match(nxt.lstrip()) or recognise(nxt):
            break
        text = text + nxt if not text.endswith((" ", "\t")) else text + nxt.lstrip()
        used.append(j - 1)
    return text, used


_FOLLOW_LINES = 4  # blank lines and NCCL INFO lines may sit between a NCCL WARN and the size it could not allocate


def with_follow(lines: list[str], index: int, follow: re.Pattern[str], rank: int | None, text: str) -> str:
    """``text`` with the part of a nearby line that ``follow`` matches appended (NCCL's "Failed to CUDA calloc N
    bytes" after its "Cuda failure 'out of memory'")."""
    for j in range(index + 1, min(len(lines), index + 1 + _FOLLOW_LINES)):
        raw = lines[j]
        if rank_of(raw) not in (rank, None):
            continue
        m = follow.search(raw)
        if m:
            return f"{text.rstrip()} {raw[m.start():].strip()}"
    return text
