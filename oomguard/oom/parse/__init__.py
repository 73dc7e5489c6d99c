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

The package has one module per source of OOM text, each with its recognisers ("heads") and the reader of its figures:
``allocators`` (PyTorch's allocators, per backend), ``runtimes`` (CUDA/HIP runtimes and drivers, the math libraries,
NCCL, Level Zero), ``vllm``, ``host`` (the OOM killer, a shell, ``MemoryError``) and ``cluster`` (Slurm, Ray).
``heads`` orders them; ``lines`` reads a log line by line; ``scan`` finds the messages in text and streams; ``live``
reads exceptions. PyTorch memory snapshots are read by :mod:`oomguard.oom.snapshot`.
"""

from __future__ import annotations

from .lines import rank_of, strip_prefix
from .live import first_in_chain, is_oom, oom_in_chain, report_from_exception
from .patterns import SIZE
from .scan import Hit, Readable, parse_oom, scan_lines, scan_stream, scan_text

__all__ = [
    "SIZE",
    "Hit",
    "Readable",
    "first_in_chain",
    "is_oom",
    "oom_in_chain",
    "parse_oom",
    "rank_of",
    "report_from_exception",
    "scan_lines",
    "scan_stream",
    "scan_text",
    "strip_prefix",
]
