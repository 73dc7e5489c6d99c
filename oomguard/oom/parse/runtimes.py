"""Below PyTorch's allocators: the CUDA and HIP runtimes and drivers (THC's ``THCudaCheck FAIL`` included), the math
libraries (cuBLAS, cuDNN, MIOpen, rocBLAS, ...), NCCL and Level Zero.

These report that memory ran out, seldom how much: only NCCL names the size it failed to allocate, in its next line.
"""

from __future__ import annotations

import re
from typing import Any

from .patterns import _F, _W, _Head, _words

_P_NCCL_REQ = re.compile(_words("Failed to") + _W + r"(?:CUDA|HIP)" + _W + r"(?:calloc|malloc|host" + _W + r"alloc)"
                         + _W + r"(\d+)" + _W + r"bytes", _F)


def _nccl_figures(core: str, text: str) -> dict[str, Any]:
    """NCCL: the size it could not allocate (from its following WARN line)."""
    kw: dict[str, Any] = {}
    m = _P_NCCL_REQ.search(core)
    kw["requested"] = int(m.group(1)) if m else None
    return kw


# The runtimes' and drivers' messages.
RUNTIME: tuple[_Head, ...] = (
    _Head("runtime", re.compile(r"\b(?P<dev>CUDA|HIP)" + _W + _words("error: out of memory")), backend=None),
    _Head("driver", re.compile(r"\b(?P<dev>CUDA|HIP)" + _W + _words("driver error: out of memory")), backend=None),
    _Head("runtime", re.compile(r"\b(?P<dev>cuda)" + _W + _words("runtime error (2) : out of memory"), re.IGNORECASE)),
    # torch <= 0.4 (THC): "THCudaCheck FAIL file=.../THCStorage.cu line=58 error=2 : out of memory".
    _Head("runtime", re.compile(r"THCudaCheck" + _W + r"FAIL\b.{0,400}?error" + _W + "=" + _W + "2" + _W + ":" + _W
                                + _words("out of memory")), backend="cuda", precursor=True),
)

# Error codes: the runtimes' enums, the libraries' statuses, NCCL, Level Zero.
CODES: tuple[_Head, ...] = (
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
                            + r"alloc)" + _W + r"\d+" + _W + r"bytes", re.IGNORECASE), figures=_nccl_figures),
    _Head("level-zero", re.compile(r"\b(?:UR|ZE)_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\b"), backend="xpu"),
)
