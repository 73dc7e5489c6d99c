"""Recognise out-of-memory errors in text and exceptions, and parse the allocator's figures into an OOMReport.

Every stack that can run out of memory words it differently: the CUDA/HIP/XPU/NPU caching allocators (four eras of
wording), MPS, the CPU allocator, the CUDA runtime and driver, cuBLAS/cuDNN, NCCL, vLLM's KV-cache checks, Python's
``MemoryError`` and the kernel's OOM killer. The patterns below are anchored on those device prefixes, so that
"out of memory slots" or a hint that merely names ``PYTORCH_CUDA_ALLOC_CONF`` never raises an alarm.

Logs wrap and prefix these messages (``[rank3]: ``, ``(EngineCore pid=7) ERROR ...``), so a message is read line by
line: the head line is recognised, known prefixes are stripped from the lines that follow (lines of other ranks are
passed over), and the pieces are joined without separators. Every pattern tolerates missing or extra whitespace
between words, which makes a hard wrap anywhere (even inside a number) harmless.

Lines are numbered as ``grep -n`` numbers them (split on ``\n``; a progress bar's ``\r`` redraws stay in their
line). One OOM reported several times (torchrun's failure summary, an application that logs what it caught, a sticky
CUDA error raised again in a handler, NCCL's warning before the Python error) counts once. A head quoted in a
traceback's source line (``raise ValueError("No available memory ...``) is not the message, and configuration
clashes worded as OOMs (Unsloth standby vs. expandable segments) are not OOMs.

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
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from ..vocab.oomreport import Frame, OOMReport, OtherProcess
from ..vocab.sizes import parse_size

# NVML reports 2^64-1 bytes when a value is not available; anything this large is not a measurement.
_NVML_GARBAGE = 2**60


# --------------------------------------------------------------------------------------------------------------
# Patterns. `_W` is "optional whitespace", used between every word so that hard-wrapped text still matches.
# Continuation lines are joined without a separator (a wrap can fall inside a number), so a word-wrap that dropped
# its blank glues words together ("GiBof which", "GPU 0has"): no pattern may rely on a word boundary after a unit or
# a number.

_W = r"\s*"
_NUM = r"(\d[\d,]*(?:\.\d+)?)"
_UNIT = r"(bytes|byte|KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)"
SIZE = _NUM + _W + _UNIT

# The CUDA allocator refuses any request of 2^60 bytes or more up front: "Tried to allocate more than 1EB memory."
_ONE_EB = 2**60


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
    requires: re.Pattern[str] | None = None  # checked on the joined message, from the head on
    # A line a few lines further on (blank lines between) that belongs to the message: NCCL reports the size it failed
    # to allocate in its next WARN line.
    follow: re.Pattern[str] | None = None
    # A first report of a failure whose proper message follows: THC printed "THCudaCheck FAIL" before raising the
    # RuntimeError that carries the traceback. When the same origin and backend are recognised within
    # _MAX_CONTINUATION lines, the later message is the finding.
    precursor: bool = False


_HEADS: tuple[_Head, ...] = (
    _Head(
        "allocator",
        re.compile(r"\b(?P<dev>CUDA|HIP|XPU|NPU|MTIA)" + _W + _words("out of memory") + _W + r"\."),
        # The figures end with "... but unallocated." (2.1+), "... reserved in total by PyTorch)" (1.4-2.0),
        # "... cached)" (<= 1.3) or the 1EB refusal. A line that merely ends in "memory in use." is not the end: the
        # message goes on with "Of the allocated memory ...".
        complete=re.compile(
            _words("but unallocated") + r"|" + _words("in total by PyTorch") + r"|cached\s*\)"
            r"|" + _words("more than 1") + _W + r"EB",
            re.IGNORECASE,
        ),
        requires=re.compile(_words("Tried to allocate"), re.IGNORECASE),
    ),
    _Head(
        "mps",
        re.compile(_words("MPS backend out of memory") + _W + r"\("),
        backend="mps",
        complete=re.compile(_words("Tried to allocate") + _W + SIZE + r".*?pool", re.IGNORECASE),
    ),
    _Head(
        "cpu-allocator",
        re.compile(r"DefaultCPUAllocator:" + _W + r"(?:can'?t" + _W + _words("allocate memory") + r"|"
                   + _words("not enough memory") + r")"),
        backend="cpu",
        complete=re.compile(_words("you tried to allocate") + _W + r"\d+", re.IGNORECASE),
    ),
    _Head("vllm-cumem", re.compile(_words("CUDA Error: out of memory at") + r".*cumem", re.IGNORECASE), backend="vllm"),
    _Head("runtime", re.compile(r"\b(?P<dev>CUDA|HIP)" + _W + _words("error: out of memory")), backend=None),
    _Head("driver", re.compile(r"\b(?P<dev>CUDA|HIP)" + _W + _words("driver error: out of memory")), backend=None),
    _Head("runtime", re.compile(r"\b(?P<dev>cuda)" + _W + _words("runtime error (2) : out of memory"), re.IGNORECASE)),
    # torch <= 0.4 (THC): "THCudaCheck FAIL file=.../THCStorage.cu line=58 error=2 : out of memory".
    _Head("runtime", re.compile(r"THCudaCheck" + _W + r"FAIL\b.{0,400}?error" + _W + "=" + _W + "2" + _W + ":" + _W
                                + _words("out of memory")), backend="cuda", precursor=True),
    # PyTorch's cudaMallocAsync backend. Builds that print the device index as a raw byte (a NUL for device 0) cut the
    # message short after "Allocation on device"; the full form lists its figures on the following lines. Error
    # reports (ComfyUI's) print the type and the message on separate lines.
    _Head(
        "async-allocator",
        re.compile(r"OutOfMemoryError:" + _W + _words("Allocation on device") + r"|" + _words("Allocation on device")
                   + _W + r"\d+" + _W + _words("would exceed allowed memory")),
        backend="cuda",
        complete=re.compile(r"memory" + _W + r"fraction" + _W + r"\)" + _W + r":?" + _W + SIZE
                            + r"|" + _words("Allocation on device") + r"[\s\x00]*$", re.IGNORECASE),
    ),
    _Head(
        "async-allocator",
        re.compile(_words("Exception Type") + r"\W{0,8}(?:torch\.(?:cuda\.)?)?OutOfMemoryError\b"),
        backend="cuda",
        complete=re.compile(_words("Allocation on device")),
        requires=re.compile(r"Exception" + _W + r"Message\W{0,8}" + _words("Allocation on device")),
    ),
    _Head("runtime", re.compile(r"\bcudaErrorMemoryAllocation\b"), backend="cuda"),
    _Head("runtime", re.compile(r"\bhipErrorOutOfMemory\b"), backend="hip"),
    _Head(
        "library",
        re.compile(r"\b(?P<lib>CUBLAS|CUDNN|CUSOLVER|CUSPARSE|CUFFT|HIPBLAS|HIPBLASLT|MIOPEN|ROCBLAS)_(?:STATUS_)?"
                   r"ALLOC_FAILED\b"),
    ),
    _Head("library", re.compile(r"\bmiopenStatusAllocFailed\b"), backend="hip"),
    _Head("nccl", re.compile(r"\b(?P<dev>Cuda|HIP)" + _W + r"failure" + _W + r"(?:\d+" + _W + r")?'out of memory'",
                             re.IGNORECASE),
          follow=re.compile(_words("Failed to") + _W + r"(?:CUDA|HIP)" + _W + r"(?:calloc|malloc|host" + _W
                            + r"alloc)" + _W + r"\d+" + _W + r"bytes", re.IGNORECASE)),
    _Head("level-zero", re.compile(r"\b(?:UR|ZE)_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\b"), backend="xpu"),
    _Head(
        "vllm-startup",
        re.compile(_words("Free memory on device") + r".*?" + _words("less than desired GPU memory utilization"),
                   re.IGNORECASE),
        backend="vllm",
    ),
    _Head(
        "vllm-startup",
        re.compile(_words("out of memory occurred when warming up"), re.IGNORECASE),
        backend="vllm",
    ),
    _Head("vllm-kv", re.compile(_words("No available memory for the cache blocks"), re.IGNORECASE), backend="vllm"),
    _Head("vllm-kv", re.compile(_words("larger than the available KV cache memory"), re.IGNORECASE), backend="vllm"),
    # vLLM before 0.6: "The model's max seq len (29000) is larger than the maximum number of tokens that can be stored
    # in KV cache (23648)."
    _Head("vllm-kv", re.compile(_words("max seq len") + _W + r"\(" + _W + r"\d+" + _W + r"\)" + _W
                                + _words("is larger than the maximum number of tokens that can be stored in KV cache"),
                                re.IGNORECASE), backend="vllm"),
    _Head(
        "oom-killer",
        re.compile(r"(?:Memory" + _W + r"cgroup" + _W + r")?" + _words("out of memory:") + _W + r"Kill(?:ed)?" + _W
                   + r"process" + _W + r"(?P<pid>\d+)", re.IGNORECASE),
        backend="host",
    ),
    _Head("slurm", re.compile(r"Detected" + _W + r"\d+" + _W + r"oom[-_]kill" + _W + r"event", re.IGNORECASE),
          backend="host"),
    _Head("slurm", re.compile(_words("killed by the cgroup out-of-memory handler"), re.IGNORECASE), backend="host"),
    _Head("shell", re.compile(r"\bline\s+\d+:\s+(?P<pid>\d+)\s+Killed\s+\S"), backend="host"),
    # Ray's memory monitor kills workers when the node's RAM passes its threshold: "Task was killed due to the node
    # running low on memory." (Ray <= 2.54), "N worker(s) were killed due to ..." (2.55+).
    _Head(
        "ray",
        re.compile(r"(?:\b(?:Task|Actor)" + _W + r"was|worker\(s\)" + _W + r"were)" + _W
                   + _words("killed due to the node running low on memory")),
        backend="host",
        complete=re.compile(_words("memory usage threshold of") + _W + r"\d", re.IGNORECASE),
    ),
    _Head("python", re.compile(r"^(?:[\w.]+\.)?(?:_Array)?MemoryError(?::|\s*$)"), backend="host"),
)

# Configuration clashes that libraries report in out-of-memory words. Unsloth's standby loader used to re-raise the
# expandable-segments assertion as ``MemoryError("... ran out of memory ...")``; no memory ran out, and no remedy that
# saves memory would help. A message that carries one of these phrases is never an OOM.
_VETO = re.compile(
    _words("Standby mode is not supported with expandable segments") + r"|"
    + _words("Expandable segments are not compatible with memory pool"),
    re.IGNORECASE,
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

_MAX_CONTINUATION = 14
_ELLIPSIS = ("...", "\u2026")  # a log or summary line cut to the terminal width
_MAX_FRAMES_LOOKBACK = 400
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


def rank_of(line: str) -> int | None:
    """The rank named in a line's prefix, if any."""
    m = _RANK.search(line[:40])
    if not m:
        return None
    return int(next(g for g in m.groups() if g is not None))


def _visible(line: str) -> str:
    """What a terminal shows of a line: trailing CR/LF dropped, and only the text after the last carriage return
    (progress bars redraw themselves with ``\\r``)."""
    line = line.rstrip("\r\n")
    if "\r" in line:
        line = line.rsplit("\r", 1)[-1]
    return line


def _split(text: str) -> list[str]:
    """Lines as editors and ``grep -n`` count them: split on ``\\n`` only (``\\r\\n`` included), ``\\r`` redraws kept
    within their line."""
    return [_visible(line) for line in text.split("\n")]


def _recognitions(stripped: str) -> Iterator[tuple[_Head, re.Match[str]]]:
    for head in _HEADS:
        m = head.pattern.search(stripped)
        if m:
            yield head, m


def _recognise(stripped: str) -> tuple[_Head, re.Match[str]] | None:
    return next(_recognitions(stripped), None)


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


# --------------------------------------------------------------------------------------------------------------
# Parsing of a complete message.

_F = re.IGNORECASE
_P_REQUESTED = re.compile(_words("Tried to allocate") + _W + SIZE, _F)
_P_REQ_EB = re.compile(_words("Tried to allocate more than 1") + _W + "EB", _F)
_P_DEVICE = re.compile(r"\b(?:GPU|NPU|XPU|device)" + _W + r"(\d+)", _F)
_P_CAPACITY = re.compile(_words("total") + _W + r"capac(?:ity|ty)" + _W + "of" + _W + SIZE, _F)  # 2.1: "capacty"
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
_P_MPS_ALLOC = re.compile(r"MPS" + _W + r"allocated:" + _W + SIZE, _F)
_P_MPS_CURRENT = re.compile(_words("currently allocated:") + _W + SIZE, _F)
_P_MPS_OTHER = re.compile(_words("other allocations:") + _W + SIZE, _F)
_P_MPS_MAX = re.compile(_words("max allowed:") + _W + SIZE, _F)
_P_CPU_REQ = re.compile(_words("you tried to allocate") + _W + r"(\d+)" + _W + r"bytes", _F)
_P_VLLM_FREE = re.compile(
    _words("Free memory on device") + _W + r"(?:\(?[\w:]*\)?\s*)?\(" + _W + _NUM + _W + r"/" + _W + _NUM + _W + _UNIT
    + _W + r"\)" + r".*?" + _words("utilization") + _W + r"\(" + _W + r"([\d.]+)" + _W + r"," + _W + SIZE,
    _F,
)
_P_VLLM_KV = re.compile(
    r"\(" + _W + SIZE + _W + _words("KV cache is needed") + r".*?" + _words("KV cache memory") + _W + r"\(" + _W + SIZE, _F
)
_P_VLLM_SEQ = re.compile(_words("max seq len") + _W + r"\(" + _W + r"(\d+)" + _W + r"\)", _F)
_P_VLLM_KV_TOKENS = re.compile(_words("stored in KV cache") + _W + r"\(" + _W + r"(\d+)" + _W + r"\)" + r"|"
                               + _words("estimated maximum model length is") + _W + r"(\d+)", _F)
_P_NCCL_REQ = re.compile(_words("Failed to") + _W + r"(?:CUDA|HIP)" + _W + r"(?:calloc|malloc|host" + _W + r"alloc)"
                         + _W + r"(\d+)" + _W + r"bytes", _F)
# cudaMallocAsync: "Currently allocated     : 54.14 GiB", "Requested : ...", "Device limit : ...",
# "Free (according to CUDA): ...", "PyTorch limit (set by user-supplied memory fraction)\n : ..."
_P_ASYNC_DEVICE = re.compile(_words("Allocation on device") + _W + r"(\d+)", _F)
_P_ASYNC_ALLOC = re.compile(_words("Currently allocated") + _W + r":" + _W + SIZE, _F)
_P_ASYNC_REQ = re.compile(r"Requested" + _W + r":" + _W + SIZE, _F)
_P_ASYNC_TOTAL = re.compile(_words("Device limit") + _W + r":" + _W + SIZE, _F)
_P_ASYNC_FREE = re.compile(r"Free" + _W + r"\(" + _W + r"according" + _W + r"to" + _W + r"\w+" + _W + r"\)" + _W + r":"
                           + _W + SIZE, _F)
_P_ASYNC_LIMIT = re.compile(r"memory" + _W + r"fraction" + _W + r"\)" + _W + r":?" + _W + SIZE, _F)
# Ray: "... pid=548, memory used=12.18GB) was running was 21.91GB / 33.28GB (0.658192), which exceeds the memory usage
# threshold of 0.65." (Ray writes decimal GB.)
_P_RAY_NODE = re.compile(r"was" + _W + SIZE + _W + r"/" + _W + SIZE + _W + r"\(" + _W + r"[\d.]+" + _W + r"\)", _F)
_P_RAY_THRESHOLD = re.compile(_words("memory usage threshold of") + _W + r"(\d+(?:\.\d+)?)", _F)
_P_RAY_TASK = re.compile(r"\bpid" + _W + r"=" + _W + r"(\d+)" + _W + r"," + _W + r"(?:actual" + _W + r")?"
                         + _words("memory used") + _W + r"=" + _W + SIZE, _F)
_P_RSS = re.compile(r"anon-rss:" + _W + r"(\d[\d,]*)" + _W + r"kB", _F)
_P_NP_REQ = re.compile(_words("Unable to allocate") + _W + SIZE, _F)


def _first(p: re.Pattern[str], text: str, *, binary_si: bool = False) -> int | None:
    m = p.search(text)
    return _size(m.group(1), m.group(2), binary_si=binary_si) if m else None


def _either(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _parse_figures(report: OOMReport, core: str) -> OOMReport:
    """Read the figures. ``core`` is the message from its head on (log text before the head is not looked at);
    ``report.message`` is the whole joined text, which a few vLLM wordings need (their figures precede the head)."""
    text = report.message
    o = report.origin
    kw: dict[str, Any] = {}
    if o == "allocator":
        kw["requested"] = _first(_P_REQUESTED, core)
        if kw["requested"] is None and _P_REQ_EB.search(core):
            kw["requested"] = _ONE_EB
        m = _P_DEVICE.search(core)
        kw["device"] = int(m.group(1)) if m else None
        kw["capacity"] = _either(_first(_P_CAPACITY, core), _first(_P_CAPACITY_OLD, core))
        kw["free"] = _either(_first(_P_FREE, core), _first(_P_FREE_OLD, core))
        kw["allowed"] = _first(_P_ALLOWED, core)
        kw["allocated"] = _either(_first(_P_ALLOC, core), _first(_P_ALLOC_OLD, core))
        kw["private_pools"] = _first(_P_PRIVATE, core)
        ru = _first(_P_RESV_UNALLOC, core)
        if ru is None:
            total = _first(_P_RESV_TOTAL, core)
            if total is not None and kw["allocated"] is not None:
                ru = max(0, total - kw["allocated"])
        if ru is None:
            ru = _first(_P_CACHED, core)
        kw["reserved_unallocated"] = ru
        kw["process"] = _first(_P_THIS_PROC, core)
        kw["other_processes"] = tuple(
            OtherProcess(int(m.group(1)), _size(m.group(2), m.group(3))) for m in _P_OTHER_PROC.finditer(core)
        )
    elif o == "mps":
        # Old MPS builds print binary values labelled KB/MB/GB; newer ones print KiB/MiB/GiB. Both read as binary.
        # "max allowed" is the high-watermark limit (it can exceed physical memory), so it is ``allowed``, not the
        # device's capacity. "MPS allocated" is PyTorch's share; "other allocations" the rest of the process's Metal
        # memory; the oldest builds print only "currently allocated", the process total.
        kw["requested"] = _first(_P_REQUESTED, core, binary_si=True)
        allocated = _first(_P_MPS_ALLOC, core, binary_si=True)
        other = _first(_P_MPS_OTHER, core, binary_si=True)
        limit = _first(_P_MPS_MAX, core, binary_si=True)
        kw["allowed"] = limit
        kw["allocated"] = allocated
        if allocated is not None:
            kw["process"] = allocated + (other or 0)
        else:
            kw["process"] = _first(_P_MPS_CURRENT, core, binary_si=True)
        if limit is not None and kw["process"] is not None:
            kw["free"] = max(0, limit - kw["process"])
    elif o == "cpu-allocator":
        m = _P_CPU_REQ.search(core)
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
        m = _P_VLLM_SEQ.search(text)
        kw["max_seq_len"] = int(m.group(1)) if m else None
        m = _P_VLLM_KV_TOKENS.search(text)
        kw["kv_cache_tokens"] = int(m.group(1) or m.group(2)) if m else None
    elif o == "async-allocator":
        m = _P_ASYNC_DEVICE.search(core)
        kw["device"] = int(m.group(1)) if m else None
        kw["allocated"] = _first(_P_ASYNC_ALLOC, core)
        kw["requested"] = _first(_P_ASYNC_REQ, core)
        kw["capacity"] = _first(_P_ASYNC_TOTAL, core)
        kw["free"] = _first(_P_ASYNC_FREE, core)
        limit = _first(_P_ASYNC_LIMIT, core)  # 2^64 (NVML-garbage sized, so None) when no fraction is set
        kw["allowed"] = limit if limit is None or kw["capacity"] is None or limit < kw["capacity"] else None
    elif o == "nccl":
        m = _P_NCCL_REQ.search(core)
        kw["requested"] = int(m.group(1)) if m else None
    elif o == "ray":
        m = _P_RAY_NODE.search(core)
        if m:
            used, total = _size(m.group(1), m.group(2)), _size(m.group(3), m.group(4))
            kw["capacity"] = total
            if used is not None and total is not None:
                kw["free"] = max(0, total - used)
            t = _P_RAY_THRESHOLD.search(core)
            if t and total is not None and 0 < float(t.group(1)) <= 1:
                kw["allowed"] = round(float(t.group(1)) * total)
        m = _P_RAY_TASK.search(core)
        if m:
            kw["pid"] = int(m.group(1))
            kw["process"] = _size(m.group(2), m.group(3))
    elif o in ("oom-killer", "shell"):
        m = _P_RSS.search(text)
        kw["process"] = int(m.group(1).replace(",", "")) * 1024 if m else None
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
    >>> parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB. GPU 0 has a total "
    ...           "capacty of 14.75 GiB of which 11.06 MiB is free.").capacity  # the 2.1-era typo
    15837691904
    """
    hits = list(scan_lines(_split(text)))
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


def _same_rank(a: int | None, b: int | None) -> bool:
    return a is None or b is None or a == b


def _frames_before(lines: list[str], index: int, rank: int | None) -> tuple[Frame, ...]:
    """The traceback frames above line ``index`` (outermost first), read back to the ``Traceback`` header.

    Lines of other ranks are skipped. Only a traceback that ends right above the message counts: once more than
    ``_MAX_FRAME_GAP`` lines pass without a frame the walk stops, so an unrelated traceback further up is not
    attributed to a message printed without one.
    """
    frames: list[Frame] = []
    gap = 0
    lo = max(0, index - _MAX_FRAMES_LOOKBACK)
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


def _is_source_line(lines: list[str], index: int, stripped: str, m: re.Match[str], rank: int | None) -> bool:
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


def _assemble(lines: list[str], index: int, head: _Head, rank: int | None) -> tuple[str, list[int]]:
    """Join the head line with continuation lines until the message is complete.

    Returns the text and the indices of the continuation lines used. Only lines of the head's rank continue it;
    lines from other ranks or sources in between are passed over (and left for the scanner).
    """
    text = strip_prefix(lines[index])
    used: list[int] = []
    if head.complete is None:
        return text, used
    j = index + 1
    while (not head.complete.search(text) and not text.rstrip().endswith(_ELLIPSIS) and j < len(lines)
           and j - index <= _MAX_CONTINUATION):
        raw = lines[j]
        j += 1
        if rank_of(raw) != rank:
            continue
        nxt = strip_prefix(raw)
        if not nxt.strip() or _NEW_RECORD.match(nxt.lstrip()) or _recognise(nxt):
            break
        text = text + nxt if not text.endswith((" ", "\t")) else text + nxt.lstrip()
        used.append(j - 1)
    return text, used


_HOST_KILLS = ("oom-killer", "shell", "slurm")
_FOLLOW_LINES = 4  # blank lines and NCCL INFO lines may sit between a NCCL WARN and the size it could not allocate


def _with_follow(lines: list[str], index: int, follow: re.Pattern[str], rank: int | None, text: str) -> str:
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


def _followed_by_same(lines: list[str], index: int, head: _Head, backend: str, rank: int | None) -> bool:
    """Whether a message of the same origin and backend starts within the next _MAX_CONTINUATION lines (the limit
    keeps streaming and whole-text scanning in agreement: a streamed chunk always holds that many lines more)."""
    for j in range(index + 1, min(len(lines), index + 1 + _MAX_CONTINUATION)):
        raw = lines[j]
        if rank_of(raw) not in (rank, None):
            continue
        s = strip_prefix(raw)
        if not _might_be_oom(s):
            continue
        for h, m in _recognitions(s):
            if h is not head and h.origin == head.origin and _backend_for(h, m) == backend:
                return True
    return False


def _same_message(a: str, b: str) -> bool:
    """Equal, or one is the other cut short with an ellipsis (pytest's summary line, a terminal-width log)."""
    if a == b:
        return True
    short, long_ = (a, b) if len(a) <= len(b) else (b, a)
    if not short.endswith(_ELLIPSIS):
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
            if _same_rank(r, rank) and (key[0] != "allocator" or _same_message(c, core)):
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
            if not _might_be_oom(stripped):
                continue
            hit = self._hit(lines, i, line_no, raw, stripped)
            if hit is not None:
                yield hit

    def _hit(self, lines: list[str], i: int, line_no: int, raw: str, stripped: str) -> Hit | None:
        rank = rank_of(raw)
        for head, m in _recognitions(stripped):
            if _is_source_line(lines, i, stripped, m, rank):
                return None
            text, used = _assemble(lines, i, head, rank)
            if head.follow is not None:
                text = _with_follow(lines, i, head.follow, rank, text)
            core = text[m.start():]
            if head.requires is not None and not head.requires.search(core):
                continue
            if _VETO.search(text):
                return None
            backend = _backend_for(head, m)
            if head.precursor and _followed_by_same(lines, i, head, backend, rank):
                return None
            first = line_no - i
            self.consumed.update(first + j for j in used)
            message = " ".join(text.split())
            report = _parse_figures(
                OOMReport(backend=backend, origin=head.origin, message=message, pid=_pid_of(m)), core
            )
            if head.origin in _HOST_KILLS:
                if self._is_host_kill_repeat(head.origin, report.pid, line_no, rank):
                    return None
            elif self._is_repeat((head.origin, report.backend, None), line_no, rank, " ".join(core.split())):
                return None
            return Hit(line_no, report, _frames_before(lines, i, rank), rank)
        return None

    def _is_host_kill_repeat(self, origin: str, pid: int | None, line_no: int, rank: int | None) -> bool:
        """One kill of the host's OOM killer is often reported twice: the kernel's or the shell's "Killed" line names
        the process, and Slurm's step report ("Detected 1 oom-kill event(s)") follows or precedes it. A Slurm report
        joins a recent kill, a kill joins a recent Slurm report that names no process yet, and a process killed
        again within the window is the same kill. Kills of two different processes stay two findings."""
        events = [e for e in self.kills if line_no - e[0] <= self._WINDOW]
        for e in events:
            if not _same_rank(e[1], rank):
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
    lines = [_visible(line) for line in lines]
    yield from _Scanner().scan(lines, first_line, 0, len(lines))


def scan_text(text: str) -> list[Hit]:
    """All OOMs in a string (a captured stderr tail, an exception's text). Lines are numbered as ``\\n`` splits them."""
    return list(scan_lines(text.split("\n")))


# The cheap filter: a line is looked at only if its lower-cased bytes match one of these. Each regex starts with a
# literal, so the regex engine skips through a chunk at literal-search speed (GB/s) and only OOM-shaped hits come
# back to Python; the context around the literal is checked in C by lookbehinds. Every head above contains one of
# these phrases (with single spaces); str and bytes use the very same test, so streaming a file and scanning a string
# always find the same messages.
_CHEAP_REGEXES = (
    re.compile(rb"memory(?:error|allocation| ?utilization|(?<=of memory)|(?<=ofmemory)|(?<=of-memory)|(?<=of_memory)"
               rb"|(?<=allocate memory)|(?<=enough memory)|(?<=device_memory)|(?<=low on memory))"),
    re.compile(rb"cache(?: ?blocks|(?<=kv cache)|(?<=kvcache))"),
    re.compile(rb"alloc_?failed"),
    re.compile(rb"kill(?:ed|(?<=oom-kill)|(?<=oom_kill))"),
)


def _cheap_match(folded: bytes) -> bool:
    return any(rx.search(folded) for rx in _CHEAP_REGEXES)


def _might_be_oom(s: str) -> bool:
    return _cheap_match(s.encode("utf-8", errors="replace").lower())


_MAX_LINE = 1 << 20  # a "line" longer than this is cut, so one runaway line cannot hold the whole file


def scan_stream(stream: BinaryIO, *, chunk_size: int = 8 << 20, max_bytes: int | None = None) -> Iterator[Hit]:
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
    keep_lines = _MAX_FRAMES_LOOKBACK + _MAX_CONTINUATION + 2
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
        limit = n_lines if eof else max(0, n_lines - (_MAX_CONTINUATION + 1))
        candidates = [
            i for i in _candidate_lines(buf, cut)
            if i < limit and carry_first + i >= pending and carry_first + i not in scanner.consumed
        ]
        if candidates:
            lines = _split(buf[:cut].decode("utf-8", errors="replace"))
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
    starts = sorted({buf.rfind(b"\n", 0, m.start()) + 1 for rx in _CHEAP_REGEXES for m in rx.finditer(folded, 0, end)})
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
    """The first exception in the chain that is an OOM (``exc`` itself first), or ``None``.

    Both links are followed (``__cause__`` before ``__context__``: ``raise X from Y`` inside an ``except`` block
    leaves the original error only in the context), as are the members of an ``ExceptionGroup``. Cycles end the walk.
    """
    seen: set[int] = set()
    stack = [exc] if exc is not None else []
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if _exception_is_oom(e):
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
    if text and _VETO.search(text):
        return False
    if any(cls.__name__ in _OOM_TYPE_NAMES for cls in type(exc).__mro__):
        return True
    if not text or not _might_be_oom(text):
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
