"""Device facts for the supervisor, read through NVML (pynvml from nvidia-ml-py), never through torch.

A CUDA context in the supervisor would take about 0.5 GiB from every GPU and seconds of start-up, so the parent
asks the driver's management library instead. Everything degrades to ``None`` where there is no NVIDIA GPU.

>>> gpu_total_memory() is None or gpu_total_memory() > 0
True
>>> gpu_name() is None or isinstance(gpu_name(), str)
True
"""

from __future__ import annotations

import os
from typing import Any


def _visible_index() -> int:
    """NVML numbers devices physically; CUDA_VISIBLE_DEVICES decides which one the training process sees first."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(vis) if vis.isdigit() else 0


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    return pynvml


def gpu_total_memory(index: int | None = None) -> int | None:
    """Total memory of the first visible GPU in bytes, or None without NVML or a GPU."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(_visible_index() if index is None else index)
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def gpu_name(index: int | None = None) -> str | None:
    """Name of the first visible GPU as NVML reports it (``"NVIDIA H100 80GB HBM3"``), or None without NVML or a GPU.

    The calibration store keys what it learns by this name (``oomguard.calibration.machine_key``).
    """
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(_visible_index() if index is None else index)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)  # older pynvml returns bytes
        return name.strip() or None
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
