"""Recognise out-of-memory errors in text and exceptions, and parse the allocator's figures into an OOMReport.

Every stack that can run out of memory words it differently: the CUDA/HIP/XPU/NPU caching allocators (four eras of
wording), MPS, the CPU allocator, the CUDA runtime and driver, cuBLAS/cuDNN, NCCL, vLLM's KV-cache checks, Python's
``MemoryError`` and the kernel's OOM killer. The patterns below are anchored on those device prefixes, so that
"out of memory slots" or a hint that merely names ``PYTORCH_CUDA_ALLOC_CONF`` never raises an alarm.

Logs wrap and prefix these messages (``[rank3]: ``, ``(EngineCore pid=7) ERROR ...``), so a message is read line by
line: the head line is recognised, known prefixes are stripped from the lines that follow, and the pieces are joined
without separators. Every pattern tolerates missing or extra whitespace between words, which makes a hard wrap
anywhere (even inside a number) harmless.

>>> r = parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total "
...               "capacity of 15.73 GiB of which 1.28 GiB is free.")
>>> r.backend, r.requested, r.capacity
('cuda', 2040109466, 16889958892)
>>> parse_oom("the cache is out of memory slots") is None
True
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, BinaryIO

from .sizes import parse_size

BACKENDS = ("cuda", "hip", "xpu", "mps", "npu", "cpu", "host", "vllm")

# NVML reports 2^64-1 bytes when a value is not available; anything this large is not a measurement.
_NVML_GARBAGE = 2**60


@dataclass(frozen=True)
class Frame:
    """One traceback frame: where the code was when memory ran out."""

    filename: str
    line: int
    name: str

    def to_dict(self) -> dict[str, Any]:
        return {"filename": self.filename, "line": self.line, "name": self.name}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Frame:
        return cls(str(d.get("filename", "")), int(d.get("line") or 0), str(d.get("name", "")))


@dataclass(frozen=True)
class OtherProcess:
    pid: int
    bytes: int | None


@dataclass(frozen=True)
class OOMReport:
    """The facts in one out-of-memory message. A figure is ``None`` where the text does not give it.

    ``origin`` says which layer reported it: ``allocator`` (a caching allocator), ``mps``, ``cpu-allocator``,
    ``runtime`` / ``driver`` (CUDA or HIP outside the allocator), ``library`` (cuBLAS, cuDNN, ...), ``nccl``,
    ``level-zero``, ``vllm-startup``, ``vllm-kv``, ``vllm-cumem``, ``python`` (MemoryError), ``oom-killer``,
    ``slurm``, ``shell``.
    """

    backend: str
    origin: str
    message: str
    requested: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    process: int | None = None
    other_processes: tuple[OtherProcess, ...] = ()
    allowed: int | None = None
    private_pools: int | None = None
    device: int | None = None
    pid: int | None = None

    @property
    def others_total(self) -> int:
        return sum(p.bytes or 0 for p in self.other_processes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["other_processes"] = [{"pid": p.pid, "bytes": p.bytes} for p in self.other_processes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OOMReport:
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["other_processes"] = tuple(
            OtherProcess(int(p["pid"]), p.get("bytes")) for p in d.get("other_processes") or ()
        )
        return cls(**kw)


# --------------------------------------------------------------------------------------------------------------
# Patterns. `_W` is "optional whitespace", used between every word so that hard-wrapped text still matches.

_W = r"\s*"
_NUM = r"(\d[\d,]*(?:\.\d+)?)"
_UNIT = r"(bytes|byte|KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)\b"
SIZE = _NUM + _W + _UNIT


def _words(text: str) -> str:
    """'out of memory' -> r'out\\s*of\\s*memory'."""
    return _W.join(re.escape(w) for w in text.split())


def _size(num: str, unit: str, *, binary_si: bool = False) -> int | None:
    try:
        value = parse_size(num.replace(",", "") + unit, si_is_binary=binary_si)
    except ValueError:
        return None
    return None if value >= _NVML_GARBAGE else value


@dataclass(frozen=True)
class _Head:
    """A recogniser: the regex that starts a message, its origin, and how to tell the message is complete."""

    origin: str
    pattern: re.Pattern[str]
    backend: str | None = None  # None: taken from the `dev` group
    complete: re.Pattern[str] | None = None  # None: one line is the whole message
    requires: re.Pattern[str] | None = None  # checked on the joined message


_HEADS: tuple[_Head, ...] = (
    _Head(
        "allocator",
        re.compile(r"\b(?P<dev>CUDA|HIP|XPU|NPU|MTIA)" + _W + _words("out of memory") + _W + r"\."),
        complete=re.compile(
            r"(?:" + _words("but unallocated") + r"|" + _words("in total by PyTorch") + r"|cached\s*\)"
            r"|" + _words("is free") + r"\.\s*(?:Process|Including|Of)?.*" + _words("memory in use") + r"\.?\s*$)",
            re.IGNORECASE,
        ),
        requires=re.compile(_words("Tried to allocate"), re.IGNORECASE),
    ),
    _Head(
        "mps",
        re.compile(_words("MPS backend out of memory") + _W + r"\("),
        backend="mps",
        complete=re.compile(_words("Tried to allocate") + _W + SIZE + r".*?\bpool\b", re.IGNORECASE),
    ),
    _Head(
        "cpu-allocator",
        re.compile(r"DefaultCPUAllocator:" + _W + r"(?:can'?t" + _W + _words("allocate memory") + r"|" + _words("not enough memory") + r")"),
        backend="cpu",
        complete=re.compile(_words("you tried to allocate") + _W + r"\d+", re.IGNORECASE),
    ),
    _Head("vllm-cumem", re.compile(_words("CUDA Error: out of memory at") + r".*cumem", re.IGNORECASE), backend="vllm"),
    _Head("runtime", re.compile(r"\b(?P<dev>CUDA|HIP)" + _W + _words("error: out of memory")), backend=None),
    _Head("driver", re.compile(r"\b(?P<dev>CUDA|HIP)" + _W + _words("driver error: out of memory")), backend=None),
    _Head("runtime", re.compile(r"\b(?P<dev>cuda)" + _W + _words("runtime error (2) : out of memory"), re.IGNORECASE)),
    _Head("runtime", re.compile(r"\bcudaErrorMemoryAllocation\b"), backend="cuda"),
    _Head("runtime", re.compile(r"\bhipErrorOutOfMemory\b"), backend="hip"),
    _Head(
        "library",
        re.compile(r"\b(?P<lib>CUBLAS|CUDNN|CUSOLVER|CUSPARSE|CUFFT|HIPBLAS|HIPBLASLT|MIOPEN|ROCBLAS)_(?:STATUS_)?ALLOC_FAILED\b"),
    ),
    _Head("library", re.compile(r"\bmiopenStatusAllocFailed\b"), backend="hip"),
    _Head("nccl", re.compile(r"\b(?P<dev>Cuda|HIP)" + _W + r"failure" + _W + r"(?:\d+" + _W + r")?'out of memory'", re.IGNORECASE)),
    _Head("level-zero", re.compile(r"\b(?:UR|ZE)_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\b"), backend="xpu"),
    _Head(
        "vllm-startup",
        re.compile(_words("Free memory on device") + r".*?" + _words("less than desired GPU memory utilization"), re.IGNORECASE),
        backend="vllm",
    ),
    _Head(
        "vllm-startup",
        re.compile(_words("out of memory occurred when warming up"), re.IGNORECASE),
        backend="vllm",
    ),
    _Head("vllm-kv", re.compile(_words("No available memory for the cache blocks"), re.IGNORECASE), backend="vllm"),
    _Head("vllm-kv", re.compile(_words("larger than the available KV cache memory"), re.IGNORECASE), backend="vllm"),
    _Head("vllm-kv", re.compile(_words("Available KV cache memory:") + _W + r"-\s*\d"), backend="vllm"),
    _Head(
        "oom-killer",
        re.compile(r"(?:Memory" + _W + r"cgroup" + _W + r")?" + _words("out of memory:") + _W + r"Kill(?:ed)?" + _W + r"process" + _W + r"(?P<pid>\d+)", re.IGNORECASE),
        backend="host",
    ),
    _Head("slurm", re.compile(r"Detected" + _W + r"\d+" + _W + r"oom[-_]kill" + _W + r"event", re.IGNORECASE), backend="host"),
    _Head("slurm", re.compile(_words("killed by the cgroup out-of-memory handler"), re.IGNORECASE), backend="host"),
    _Head("shell", re.compile(r"\bline\s+\d+:\s+(?P<pid>\d+)\s+Killed\s+\S"), backend="host"),
    _Head("python", re.compile(r"^(?:[\w.]+\.)?(?:_Array)?MemoryError(?::|\s*$)"), backend="host"),
)

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
    r"|(?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL)\b:?"
    r"|\[[\w./-]+\.py:\d+\]|[\w-]+\.py:\d+\]"
    r"|E(?=\s{2,})"
    r"|[|:>-](?=\s)"
    r")\s*)+"
)
_RANK = re.compile(r"\[rank\s*(\d+)\]|rank\s*(\d+):|\[default(\d+)\]")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>[^\s]+)')
_NEW_RECORD = re.compile(
    r"^(?:Traceback \(most recent call last\)|File \"|During handling|The above exception|"
    r"(?:[\w.]+\.)?\w*(?:Error|Exception|Warning|Interrupt|Exit)\b:|\{|\[\s*\d|#)"
)

_MAX_CONTINUATION = 14
_MAX_FRAMES_LOOKBACK = 400


def strip_prefix(line: str) -> str:
    """Remove launcher/logger prefixes such as ``[rank3]: `` or ``(EngineCore pid=7) ERROR 01-02 03:04:05 [x.py:1]``.

    >>> strip_prefix("[rank3]: torch.OutOfMemoryError: CUDA out of memory.")
    'torch.OutOfMemoryError: CUDA out of memory.'
    """
    m = _PREFIX.match(line)
    return line[m.end():] if m else line


def rank_of(line: str) -> int | None:
    """The rank named in a line's prefix, if any."""
    m = _RANK.search(line[:40])
    if not m:
        return None
    return int(next(g for g in m.groups() if g is not None))


def _recognise(stripped: str) -> tuple[_Head, re.Match[str]] | None:
    for head in _HEADS:
        m = head.pattern.search(stripped)
        if m:
            return head, m
    return None


# --------------------------------------------------------------------------------------------------------------
# Parsing of a complete message.

_F = re.IGNORECASE
_P_REQUESTED = re.compile(_words("Tried to allocate") + _W + SIZE, _F)
_P_DEVICE = re.compile(r"\b(?:GPU|NPU|XPU|device)" + _W + r"(\d+)\b", _F)
_P_CAPACITY = re.compile(_words("total capacit") + r"y?" + _W + "of" + _W + SIZE, _F)
_P_CAPACITY_OLD = re.compile(SIZE + _W + _words("total capacity"), _F)
_P_FREE = re.compile(_words("of which") + _W + SIZE + _W + _words("is free"), _F)
_P_FREE_OLD = re.compile(SIZE + _W + r"free\b", _F)
_P_ALLOWED = re.compile(SIZE + _W + r"allowed\b", _F)
_P_ALLOC = re.compile(_words("Of the allocated memory") + _W + SIZE + _W + _words("is allocated by PyTorch"), _F)
_P_ALLOC_OLD = re.compile(SIZE + _W + _words("already allocated"), _F)
_P_PRIVATE = re.compile(r"with" + _W + SIZE + _W + _words("allocated in private pools"), _F)
_P_RESV_UNALLOC = re.compile(SIZE + _W + _words("is reserved by PyTorch but unallocated"), _F)
_P_RESV_TOTAL = re.compile(SIZE + _W + _words("reserved in total by PyTorch"), _F)
_P_CACHED = re.compile(SIZE + _W + r"cached\b", _F)
_P_THIS_PROC = re.compile(_words("this process has") + _W + SIZE + _W + _words("memory in use"), _F)
_P_OTHER_PROC = re.compile(r"Process" + _W + r"(\d+)" + _W + r"has" + _W + SIZE + _W + _words("memory in use"), _F)
_P_MPS_ALLOC = re.compile(r"(?:MPS|currently)" + _W + r"allocated:" + _W + SIZE, _F)
_P_MPS_OTHER = re.compile(_words("other allocations:") + _W + SIZE, _F)
_P_MPS_MAX = re.compile(_words("max allowed:") + _W + SIZE, _F)
_P_CPU_REQ = re.compile(_words("you tried to allocate") + _W + r"(\d+)" + _W + r"bytes", _F)
_P_VLLM_FREE = re.compile(
    _words("Free memory on device") + _W + r"(?:\(?[\w:]*\)?\s*)?\(" + _W + _NUM + _W + r"/" + _W + _NUM + _W + _UNIT + r"\)"
    + r".*?" + _words("utilization") + _W + r"\(" + _W + r"([\d.]+)" + _W + r"," + _W + SIZE,
    _F,
)
_P_VLLM_KV = re.compile(
    r"\(" + _W + SIZE + _W + _words("KV cache is needed") + r".*?" + _words("KV cache memory") + _W + r"\(" + _W + SIZE, _F
)
_P_VLLM_AVAIL = re.compile(_words("Available KV cache memory:") + _W + r"(-?)" + _W + SIZE, _F)
_P_RSS = re.compile(r"anon-rss:" + _W + r"(\d+)" + _W + r"kB", _F)
_P_NP_REQ = re.compile(_words("Unable to allocate") + _W + SIZE, _F)


def _first(p: re.Pattern[str], text: str, *, binary_si: bool = False) -> int | None:
    m = p.search(text)
    return _size(m.group(1), m.group(2), binary_si=binary_si) if m else None


def _parse_figures(report: OOMReport) -> OOMReport:
    text = report.message
    o = report.origin
    kw: dict[str, Any] = {}
    if o == "allocator":
        kw["requested"] = _first(_P_REQUESTED, text)
        m = _P_DEVICE.search(text)
        kw["device"] = int(m.group(1)) if m else None
        kw["capacity"] = _first(_P_CAPACITY, text) or _first(_P_CAPACITY_OLD, text)
        kw["free"] = _first(_P_FREE, text)
        if kw["free"] is None:
            kw["free"] = _first(_P_FREE_OLD, text)
        kw["allowed"] = _first(_P_ALLOWED, text)
        kw["allocated"] = _first(_P_ALLOC, text)
        if kw["allocated"] is None:
            kw["allocated"] = _first(_P_ALLOC_OLD, text)
        kw["private_pools"] = _first(_P_PRIVATE, text)
        ru = _first(_P_RESV_UNALLOC, text)
        if ru is None:
            total = _first(_P_RESV_TOTAL, text)
            if total is not None and kw["allocated"] is not None:
                ru = max(0, total - kw["allocated"])
        if ru is None:
            ru = _first(_P_CACHED, text)
        kw["reserved_unallocated"] = ru
        kw["process"] = _first(_P_THIS_PROC, text)
        kw["other_processes"] = tuple(
            OtherProcess(int(m.group(1)), _size(m.group(2), m.group(3))) for m in _P_OTHER_PROC.finditer(text)
        )
    elif o == "mps":
        # Old MPS builds print binary values labelled KB/MB/GB; newer ones print KiB/MiB/GiB. Both read as binary.
        kw["requested"] = _first(_P_REQUESTED, text, binary_si=True)
        kw["allocated"] = _first(_P_MPS_ALLOC, text, binary_si=True)
        other = _first(_P_MPS_OTHER, text, binary_si=True)
        cap = _first(_P_MPS_MAX, text, binary_si=True)
        kw["capacity"] = cap
        kw["allowed"] = cap
        if kw["allocated"] is not None:
            kw["process"] = kw["allocated"] + (other or 0)
        if cap is not None and kw.get("process") is not None:
            kw["free"] = max(0, cap - kw["process"])
    elif o == "cpu-allocator":
        m = _P_CPU_REQ.search(text)
        kw["requested"] = int(m.group(1)) if m else None
    elif o == "vllm-startup":
        m = _P_VLLM_FREE.search(text)
        if m:
            unit = m.group(3)
            kw["free"] = _size(m.group(1), unit)
            kw["capacity"] = _size(m.group(2), unit)
            kw["requested"] = _size(m.group(5), m.group(6))
    elif o == "vllm-kv":
        m = _P_VLLM_KV.search(text)
        if m:
            kw["requested"] = _size(m.group(1), m.group(2))
            kw["free"] = _size(m.group(3), m.group(4))
        m = _P_VLLM_AVAIL.search(text)
        if m and m.group(1) == "-":
            kw["free"] = 0
    elif o in ("oom-killer", "shell"):
        m = _P_RSS.search(text)
        kw["process"] = int(m.group(1)) * 1024 if m else None
    elif o == "python":
        kw["requested"] = _first(_P_NP_REQ, text)
    return replace(report, **{k: v for k, v in kw.items() if v is not None or k in ("other_processes",)})


def _backend_for(head: _Head, m: re.Match[str]) -> str:
    if head.backend:
        return head.backend
    groups = m.groupdict()
    if groups.get("dev"):
        dev = groups["dev"].lower()
        return {"mtia": "cuda"}.get(dev, dev)
    lib = (groups.get("lib") or "").upper()
    if lib.startswith(("HIP", "MIOPEN", "ROC")):
        return "hip"
    return "cuda"


def _pid_of(m: re.Match[str]) -> int | None:
    pid = m.groupdict().get("pid")
    return int(pid) if pid else None


def parse_oom(text: str) -> OOMReport | None:
    """Parse one message (possibly several lines) into an OOMReport, or ``None`` if it is not an OOM.

    >>> parse_oom("RuntimeError: MPS backend out of memory (MPS allocated: 33.48 GB, other allocations: 2.45 GB, "
    ...           "max allowed: 36.27 GB). Tried to allocate 600.15 MB on private pool.").backend
    'mps'
    """
    hits = list(scan_lines(text.splitlines() or [text]))
    return hits[0].report if hits else None


# --------------------------------------------------------------------------------------------------------------
# Line scanning (shared by strings, crash records and streamed files).


@dataclass(frozen=True)
class Hit:
    """An OOM found in text: the 1-based line where its message starts, the report, and the frames before it."""

    line: int
    report: OOMReport
    frames: tuple[Frame, ...] = ()
    rank: int | None = None


def _frames_before(lines: list[str], index: int, rank: int | None) -> tuple[Frame, ...]:
    frames: list[Frame] = []
    lo = max(0, index - _MAX_FRAMES_LOOKBACK)
    for j in range(index - 1, lo - 1, -1):
        raw = lines[j]
        if rank is not None and rank_of(raw) not in (rank, None):
            continue
        s = strip_prefix(raw)
        m = _FRAME.search(s)
        if m:
            frames.append(Frame(m.group("file"), int(m.group("line")), m.group("name")))
            continue
        if s.startswith("Traceback (most recent call last)"):
            break
        if frames and (s.startswith("During handling") or s.startswith("The above exception")):
            break
    frames.reverse()
    return tuple(frames)


def _assemble(lines: list[str], index: int, head: _Head) -> tuple[str, int]:
    """Join the head line with continuation lines until the message is complete. Returns (text, lines used)."""
    text = strip_prefix(lines[index])
    used = 1
    if head.complete is None:
        return text, used
    while not head.complete.search(text) and used <= _MAX_CONTINUATION and index + used < len(lines):
        nxt = strip_prefix(lines[index + used])
        if not nxt.strip() or _NEW_RECORD.match(nxt.lstrip()) or _recognise(nxt):
            break
        text = text + nxt if not text.endswith((" ", "\t")) else text + nxt.lstrip()
        used += 1
    return text, used


class _Scanner:
    """Scans lines for OOM heads; remembers recent messages so a message repeated by a launcher counts once."""

    def __init__(self) -> None:
        self.recent: dict[str, int] = {}
        self.next_index = 0  # index after the last line consumed by scan()

    def scan(self, lines: list[str], first_line: int, start: int, stop: int) -> Iterator[Hit]:
        i = start
        while i < stop:
            raw = lines[i]
            stripped = strip_prefix(raw)
            found = _recognise(stripped) if _might_be_oom(stripped) else None
            if not found:
                i += 1
                continue
            head, m = found
            text, used = _assemble(lines, i, head)
            if head.requires is not None and not head.requires.search(text):
                i += 1
                continue
            rank = rank_of(raw)
            message = " ".join(text.split())
            report = _parse_figures(
                OOMReport(backend=_backend_for(head, m), origin=head.origin, message=message, pid=_pid_of(m))
            )
            # A launcher may print the same message again (torchrun's summary, a re-raise); an OOM killer or a CUDA
            # runtime error spreads over a few lines that each match. Count each once.
            key = f"{rank}|{head.origin}|{report.backend}|{message if head.origin == 'allocator' else ''}"
            line_no = first_line + i
            seen = self.recent.get(key)
            if seen is None or line_no - seen > (50 if head.origin == "allocator" else 6):
                yield Hit(line_no, report, _frames_before(lines, i, rank), rank)
            self.recent[key] = line_no
            i += used
        self.next_index = i


def scan_lines(lines: Iterable[str], *, first_line: int = 1) -> Iterator[Hit]:
    """Find every OOM in a sequence of lines, in order.

    >>> [h.line for h in scan_lines(["loss 0.1", "[rank0]: torch.OutOfMemoryError: CUDA out of memory. "
    ...                              "Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 7.9 GiB"])]
    [2]
    """
    lines = lines if isinstance(lines, list) else list(lines)
    yield from _Scanner().scan(lines, first_line, 0, len(lines))


def scan_text(text: str) -> list[Hit]:
    """All OOMs in a string (a captured stderr tail, an exception's text)."""
    return list(scan_lines(text.splitlines()))


_CHEAP_PATTERN = (
    r"out[\s_-]*of[\s_-]*memory|OutOfMemory|MemoryError|ALLOC_FAILED|AllocFailed|oom[-_]kill|\bKilled\b|KV\s*cache"
    r"|cache\s*blocks|memory\s*utilization|OUT_OF_DEVICE_MEMORY|cudaErrorMemoryAllocation|allocate\s*memory"
    r"|not\s*enough\s*memory"
)
_CHEAP = re.compile(_CHEAP_PATTERN, re.IGNORECASE)
_CHEAP_BYTES = re.compile(_CHEAP_PATTERN.encode(), re.IGNORECASE)


def _might_be_oom(s: str) -> bool:
    return _CHEAP.search(s) is not None


# Byte needles for streaming: every line that _CHEAP accepts contains one of them. bytes.find runs at GB/s, far
# faster than a regex with alternatives, so streaming a large log costs little more than reading it.
NEEDLES = (b"emory", b"EMORY", b"ALLOC_FAILED", b"AllocFailed", b"oom-kill", b"oom_kill", b"Killed", b"KV cache",
           b"cache blocks")
_MAX_LINE = 1 << 20  # a "line" longer than this is cut, so one runaway line cannot hold the whole file


def scan_stream(stream: BinaryIO, *, chunk_size: int = 4 << 20, max_bytes: int | None = None) -> Iterator[Hit]:
    """Stream a (possibly huge) binary log and yield its OOMs in order, in bounded memory.

    Only lines that contain a needle are looked at; the lines before them are kept for traceback frames, and a
    message near the end of a chunk waits for the next chunk so that its continuation lines are there.

    >>> import io
    >>> [h.report.backend for h in scan_stream(io.BytesIO(b"ok\\nMemoryError\\n"))]
    ['host']
    """
    scanner = _Scanner()
    keep_lines = max(_MAX_FRAMES_LOOKBACK, _MAX_CONTINUATION + 2)
    carry = b""
    carry_first = 1  # line number of carry's first line
    pending = 1  # first line number not yet scanned
    total = 0
    while True:
        chunk = stream.read(chunk_size if max_bytes is None else max(0, min(chunk_size, max_bytes - total)))
        total += len(chunk)
        eof = not chunk
        buf = carry + chunk
        cut = len(buf) if eof else buf.rfind(b"\n") + 1
        if cut == 0:
            if len(buf) <= _MAX_LINE:
                carry = buf
                continue
            cut = len(buf)
        region, rest = buf[:cut], buf[cut:]
        n_lines = region.count(b"\n") + (0 if region.endswith(b"\n") else 1)
        limit = n_lines if eof else max(0, n_lines - (_MAX_CONTINUATION + 1))
        candidates = [i for i in _candidate_lines(region) if i < limit and carry_first + i >= pending]
        if candidates:
            lines = region.decode("utf-8", errors="replace").split("\n")
            for i in candidates:
                if carry_first + i < pending:
                    continue  # part of a message already read
                yield from scanner.scan(lines, carry_first, i, i + 1)
                pending = carry_first + scanner.next_index
        pending = max(pending, carry_first + limit)
        if eof:
            return
        keep_from = _tail_start(region, keep_lines)
        carry_first += region.count(b"\n", 0, keep_from)
        carry = region[keep_from:] + rest


def _candidate_lines(region: bytes) -> list[int]:
    """Sorted indices of the lines of ``region`` that pass the cheap byte test."""
    starts: set[int] = set()
    for nd in NEEDLES:
        p = region.find(nd)
        while p != -1:
            s = region.rfind(b"\n", 0, p) + 1
            starts.add(s)
            e = region.find(b"\n", p)
            p = region.find(nd, len(region) if e == -1 else e)
    out: list[int] = []
    prev_pos, prev_idx = 0, 0
    for s in sorted(starts):
        e = region.find(b"\n", s)
        line = region[s: len(region) if e == -1 else e]
        prev_idx += region.count(b"\n", prev_pos, s)
        prev_pos = s
        if _CHEAP_BYTES.search(line):
            out.append(prev_idx)
    return out


def _tail_start(region: bytes, n_lines: int) -> int:
    """Byte offset where the last ``n_lines`` lines of ``region`` (which ends with a newline) start."""
    pos = len(region) - 1
    for _ in range(n_lines):
        pos = region.rfind(b"\n", 0, pos)
        if pos == -1:
            return 0
    return pos + 1


# --------------------------------------------------------------------------------------------------------------
# Live exceptions.

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
    """The first exception in the chain that is an OOM (``exc`` itself first), or ``None``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _exception_is_oom(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _exception_is_oom(exc: BaseException) -> bool:
    if any(cls.__name__ in _OOM_TYPE_NAMES for cls in type(exc).__mro__):
        return True
    try:
        text = str(exc)
    except Exception:
        return False
    if not text or not _might_be_oom(text):
        return False
    return parse_oom(text) is not None


def report_from_exception(exc: BaseException) -> OOMReport:
    """Parse the OOM in an exception chain; falls back to a bare report when the text has no figures."""
    oom = oom_in_chain(exc) or exc
    text = str(oom)
    report = parse_oom(text) if text else None
    if report is None:
        name = type(oom).__name__
        backend = "host" if name in ("MemoryError", "_ArrayMemoryError") else "cuda"
        report = OOMReport(backend=backend, origin="python" if backend == "host" else "allocator",
                           message=f"{name}: {text}".strip().rstrip(":"))
    return report
