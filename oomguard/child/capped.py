"""``--gpu-memory SIZE`` on a real GPU: rehearse a card of SIZE, whose memory the CUDA context shares.

``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator only; the CUDA context (the driver's
state, cuBLAS and cuDNN handles and their kernels: 0.68 GiB in a bare process, 0.74-0.84 GiB in GRPO processes on an
H100) comes on top. A cap of SIZE would rehearse a card of SIZE plus the context. So the allocator gets SIZE minus the
context this process holds: when CUDA starts, the memory model's ``m_ctx`` (nothing is measured then: the libraries
load at the first matmul, and asking a device this process does not use would create a context on it); after the
first training step, what is measured on the device the process uses. Each figure is reported (event ``device``), so
the report says which was used. Nothing here may break the user's program: a measurement or a cap that fails leaves
the allocator as it is and says so.

The context is measured as NVML's figure for this process minus what the allocator reserved; where NVML cannot see
this process (a container with its own process IDs), on a single visible device, as the device's use now minus its
use before this process started CUDA, minus what the allocator reserved.

>>> round(cap_fraction(16 * 2**30, 800 * 2**20, 80 * 2**30), 4)
0.1902
>>> cap_fraction(2**30, 2**31, 80 * 2**30)
0.0
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..memory import device
from ..memory.estimate import Coefficients
from ..vocab.events import DeviceMeasured
from .runtime import Runtime

ASSUMED_CONTEXT = Coefficients().m_ctx  # until measured: what GRPO processes held at their real OOMs
PLAUSIBLE = (64 * 2**20, 8 * 2**30)  # a measured context outside this range is another process's memory, not ours


def cap_fraction(size: int, context: int, total: int) -> float:
    """The share of the card's ``total`` that leaves the allocator ``size`` minus ``context``."""
    return max(0.0, min(1.0, (size - context) / total)) if total > 0 else 0.0


def measure(torch: Any, index: int, baseline: int | None) -> tuple[int | None, str]:
    """This process's memory outside the allocator on device ``index`` (one it uses: it has a context there), and how
    it was measured (None: not measurable here)."""
    reserved = int(torch.cuda.memory_reserved(index))
    nvml = device.nvml_index(index)
    own = device.process_gpu_memory(os.getpid(), nvml) if nvml is not None else None
    if own is not None and PLAUSIBLE[0] <= own - reserved <= PLAUSIBLE[1]:
        return own - reserved, "NVML's figure for this process minus the allocator's reserved memory"
    if baseline is not None and torch.cuda.device_count() == 1:
        free, total = torch.cuda.mem_get_info(index)
        ctx = int(total - free) - baseline - reserved
        if PLAUSIBLE[0] <= ctx <= PLAUSIBLE[1]:
            return ctx, "the device's use since this process started CUDA, minus the allocator's reserved memory"
    return None, "not measurable here"


def _report(rt: Runtime, size: int, context: int, measured: int | None, how: str, total: int, final: bool) -> None:
    rt.emit(DeviceMeasured(gpu_memory=size, context_bytes=context, measured_bytes=measured, how=how,
            allocator_bytes=size - context, total=total, final=final))


def at_start(rt: Runtime, torch: Any, size: int) -> None:
    """When CUDA starts: cap every visible device at ``size`` minus the memory model's context."""
    try:
        for i in range(torch.cuda.device_count()):
            total = int(torch.cuda.get_device_properties(i).total_memory)
            torch.cuda.set_per_process_memory_fraction(cap_fraction(size, ASSUMED_CONTEXT, total), i)
        _report(rt, size, ASSUMED_CONTEXT, None, f"assumed ({ASSUMED_CONTEXT >> 20} MiB, the memory model's figure) "
                "until measured after the first step", total, final=False)
    except Exception as e:  # never break the user's program for a rehearsal
        sys.stderr.write(f"oomguard: warning: --gpu-memory could not cap the allocator ({type(e).__name__}: {e})\n")


def after_first_step(rt: Runtime, torch: Any, size: int, baseline: int | None) -> None:
    """After the first training step: cap the device this process uses at ``size`` minus the context it holds."""
    try:
        i = torch.cuda.current_device()
        total = int(torch.cuda.get_device_properties(i).total_memory)
        ctx, how = measure(torch, i, baseline)
        used = ctx if ctx is not None else ASSUMED_CONTEXT
        if ctx is None:
            how = f"assumed ({ASSUMED_CONTEXT >> 20} MiB, the memory model's figure): {how}"
        torch.cuda.set_per_process_memory_fraction(cap_fraction(size, used, total), i)
        _report(rt, size, used, ctx, how, total, final=True)
    except Exception as e:
        sys.stderr.write(f"oomguard: warning: --gpu-memory could not measure the CUDA context ({type(e).__name__}: "
                         f"{e}); the allocator keeps SIZE minus {ASSUMED_CONTEXT >> 20} MiB\n")


def install(rt: Runtime, torch: Any, size: int) -> None:
    """Cap the allocator when CUDA starts, and again after the first training step (``rt.after_first_step``)."""
    baseline = device.gpu_used_memory()  # before this process starts CUDA (a single visible device only)
    torch.cuda._lazy_call(lambda: at_start(rt, torch, size))
    rt.after_first_step.append(lambda: after_first_step(rt, torch, size, baseline))
