"""Below PyTorch's allocators: the CUDA and HIP runtimes and drivers (THC's ``THCudaCheck FAIL`` included), the math
libraries (cuBLAS, cuDNN, MIOpen, rocBLAS, ...), NCCL and Level Zero.

These report that memory ran out, seldom how much: only NCCL names the size it failed to allocate, in its next line.
"""

from __future__ import annotations

import re
from typing import Any

from .patterns import CASELESS, GAP, Head, words

_P_NCCL_REQ = re.compile(words("Failed to") + GAP + r"(?:CUDA|HIP)" + GAP + r"(?:calloc|malloc|host" + GAP + r"alloc)"
                         + GAP + r"(\d+)" + GAP + r"bytes", CASELESS)


def _nccl_figures(core: str, text: str) -> dict[str, Any]:
    """NCCL: the size it could not allocate (from its following WARN line)."""
    kw: dict[str, Any] = {}
    m = _P_NCCL_REQ.search(core)
    kw["requested"] = int(m.group(1)) if m else None
    return kw


# The runtimes' and drivers' messages.
RUNTIME: tuple[Head, ...] = (
    Head("runtime", re.compile(r"\b(?P<dev>CUDA|HIP)" + GAP + words("error: out of memory")), backend=None),
    Head("driver", re.compile(r"\b(?P<dev>CUDA|HIP)" + GAP + words("driver error: out of memory")), backend=None),
    Head("runtime", re.compile(r"\b(?P<dev>cuda)" + GAP + words("runtime error (2) : out of memory"), re.IGNORECASE)),
    # torch <= 0.4 (THC): "THCudaCheck FAIL file=.../THCStorage.cu line=58 error=2 : out of memory".
    Head("runtime", re.compile(r"THCudaCheck" + GAP + r"FAIL\b.{0,400}?error" + GAP + "=" + GAP + "2" + GAP + ":" + GAP
                                + words("out of memory")), backend="cuda", precursor=True),
)

# Error codes: the runtimes' enums, the libraries' statuses, NCCL, Level Zero.
CODES: tuple[Head, ...] = (
    Head("runtime", re.compile(r"\bcudaErrorMemoryAllocation\b"), backend="cuda"),
    Head("runtime", re.compile(r"\bhipErrorOutOfMemory\b"), backend="hip"),
    Head(
        "library",
        re.compile(r"\b(?P<lib>CUBLAS|CUDNN|CUSOLVER|CUSPARSE|CUFFT|HIPBLAS|HIPBLASLT|MIOPEN|ROCBLAS)_(?:STATUS_)?"
                   r"ALLOC_FAILED\b"),
    ),
    Head("library", re.compile(r"\bmiopenStatusAllocFailed\b"), backend="hip"),
    Head("nccl", re.compile(r"\b(?P<dev>Cuda|HIP)" + GAP + r"failure" + GAP + r"(?:\d+" + GAP + r")?'out of memory'",
                             re.IGNORECASE),
          follow=re.compile(words("Failed to") + GAP + r"(?:CUDA|HIP)" + GAP + r"(?:calloc|malloc|host" + GAP
                            + r"alloc)" + GAP + r"\d+" + GAP + r"bytes", re.IGNORECASE), figures=_nccl_figures),
    Head("level-zero", re.compile(r"\b(?:UR|ZE)_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\b"), backend="xpu"),
)
