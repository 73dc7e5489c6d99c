"""``--gpu-memory SIZE`` on a real GPU: rehearse a card of SIZE, whose memory the CUDA context shares.

``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator only; the CUDA context (the driver's
state, cuBLAS and cuDNN handles and their kernels: 0.68 GiB in a bare process, 0.74-0.84 GiB in GRPO processes on an
H100) comes on top. A cap of SIZE would rehearse a card of SIZE plus the context. So the allocator gets SIZE minus the
context this process really holds: at CUDA's start, the larger of what is measured then and the memory model's
``m_ctx`` (the libraries load later, at the first matmul); after the first training step, what is measured then.
Each figure is reported (event ``device``), so the report says which was used.

The context is measured as NVML's figure for this process minus what the allocator reserved; where NVML cannot see
this process (a container with its own process IDs), as the device's use now minus its use before this process
started CUDA, minus what the allocator reserved.

>>> round(cap_fraction(16 * 2**30, 800 * 2**20, 80 * 2**30), 4)
0.1902
>>> cap_fraction(2**30, 2**31, 80 * 2**30)
0.0
"""

from __future__ import annotations

import os
from typing import Any

from .. import device
from ..estimate import Coefficients
from .runtime import Runtime

ASSUMED_CONTEXT = Coefficients().m_ctx  # until measured: what GRPO processes held at their real OOMs
PLAUSIBLE = (64 * 2**20, 8 * 2**30)  # a measured context outside this range is another process's memory, not ours


def cap_fraction(size: int, context: int, total: int) -> float:
    """The share of the card's ``total`` that leaves the allocator ``size`` minus ``context``."""
    return max(0.0, min(1.0, (size - context) / total)) if total > 0 else 0.0


def measure(torch: Any, index: int, baseline: int | None) -> tuple[int | None, str]:
    """This process's memory outside the allocator on device ``index``, and how it was measured (None: unknown)."""
    reserved = int(torch.cuda.memory_reserved(index))
    own = device.process_gpu_memory(os.getpid(), index if index else None)
    if own is not None and PLAUSIBLE[0] <= own - reserved <= PLAUSIBLE[1]:
        return own - reserved, "NVML's figure for this process minus the allocator's reserved memory"
    if baseline is not None:
        free, total = torch.cuda.mem_get_info(index)
        ctx = int(total - free) - baseline - reserved
        if PLAUSIBLE[0] <= ctx <= PLAUSIBLE[1]:
            return ctx, "the device's use since this process started CUDA, minus the allocator's reserved memory"
    return None, "not measurable here"


def apply(rt: Runtime, torch: Any, size: int, baseline: int | None, *, final: bool) -> None:
    """Cap every visible device at ``size`` minus the context, and report the figures used (event ``device``).

    ``final=False`` at CUDA's start (the libraries are not loaded yet: the context counts at least
    :data:`ASSUMED_CONTEXT`), ``True`` after the first training step."""
    for i in range(torch.cuda.device_count()):
        total = int(torch.cuda.get_device_properties(i).total_memory)
        ctx, how = measure(torch, i, baseline if i == 0 else None)
        used = max(ctx or 0, ASSUMED_CONTEXT) if not final else (ctx if ctx is not None else ASSUMED_CONTEXT)
        if final and ctx is None:
            how = f"assumed ({ASSUMED_CONTEXT >> 20} MiB, the memory model's figure): {how}"
        elif not final:
            how = (f"at CUDA's start, the larger of {how} ({(ctx or 0) >> 20} MiB) and the memory model's "
                   f"{ASSUMED_CONTEXT >> 20} MiB" if ctx is not None else
                   f"assumed ({ASSUMED_CONTEXT >> 20} MiB, the memory model's figure) until measured")
        torch.cuda.set_per_process_memory_fraction(cap_fraction(size, used, total), i)
        if i == 0:
            rt.emit("device", gpu_memory=size, context_bytes=used, measured_bytes=ctx, how=how,
                    allocator_bytes=size - used, total=total, final=final)


def install(rt: Runtime, torch: Any, size: int) -> None:
    """At CUDA's start, cap the allocator (``apply``); after the first training step, cap it again with the context
    measured then (``rt.after_first_step``)."""
    baseline = device.gpu_used_memory()  # before this process starts CUDA

    def at_start() -> None:
        apply(rt, torch, size, baseline, final=False)

    torch.cuda._lazy_call(at_start)
    rt.after_first_step.append(lambda: apply(rt, torch, size, baseline, final=True))
