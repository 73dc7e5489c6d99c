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
import sys
from typing import Any


def _visible_index() -> int:
    """NVML numbers devices physically; CUDA_VISIBLE_DEVICES decides which one the training process sees first."""
    return nvml_index(0) or 0


def nvml_index(cuda_index: int, env: dict[str, str] | None = None) -> int | None:
    """NVML's number for the device CUDA numbers ``cuda_index`` in this process (through CUDA_VISIBLE_DEVICES);
    None where the variable names devices by UUID or has fewer entries.

    >>> nvml_index(1, {"CUDA_VISIBLE_DEVICES": "3,5"}), nvml_index(2, {}), nvml_index(0, {"CUDA_VISIBLE_DEVICES": "GPU-8f"})
    (5, 2, None)
    """
    vis = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return cuda_index
    parts = [p.strip() for p in vis.split(",") if p.strip()]
    if cuda_index < len(parts) and parts[cuda_index].isdigit():
        return int(parts[cuda_index])
    return None


def _nvml() -> Any:
    if not _gpu_present():  # no driver here: NVML cannot answer, and a CPU machine need not load it
        return None
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
    """Total memory of the first visible GPU in bytes, or None without NVML or a GPU.

    A machine without NVIDIA's driver (a CPU machine) gets None quietly. A machine that has an NVIDIA GPU but where
    NVML fails (the library not mounted into the container, no permission, a lost GPU) gets one warning line: the
    memory model's predictions are off there, and the user can give the size instead.
    """
    nvml = _nvml()
    if nvml is None:
        if _gpu_present():
            _warn_once(f"this machine has an NVIDIA GPU but NVML cannot be used ({_nvml_error()}), so the memory "
                       "model does not know the device's size and its predictions are off; pass --gpu-memory SIZE "
                       "(the card's size) to turn them on")
        return None
    try:
        return int(_ask(nvml, index, nvml.nvmlDeviceGetMemoryInfo).total)
    except Exception as e:
        _warn_once(f"NVML could not read the GPU's memory ({type(e).__name__}: {str(e).splitlines()[0][:200]}), "
                   "so the memory model's predictions are off; pass --gpu-memory SIZE (the card's size) to turn "
                   "them on")
        return None


_warned = False


def _warn_once(text: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        sys.stderr.write(f"oomguard: warning: {text}\n")


def _gpu_present() -> bool:
    """The NVIDIA driver's device files: this machine has a GPU, whatever NVML says (``/dev/dxg``: WSL 2, where NVML
    reaches the Windows driver without them)."""
    return (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")
            or bool(_listdir("/proc/driver/nvidia/gpus")))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _nvml_error() -> str:
    """Why NVML cannot be used, in a few words."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}".rstrip(": ")
    try:
        pynvml.nvmlShutdown()
    except Exception:
        pass
    return "it failed once and then worked"


def gpu_name(index: int | None = None) -> str | None:
    """Name of the first visible GPU as NVML reports it (``"NVIDIA H100 80GB HBM3"``), or None without NVML or a GPU.

    The calibration store keys what it learns by this name (``oomguard.memory.calibration.machine_key``).
    """
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        name = _ask(nvml, index, nvml.nvmlDeviceGetName)
    except Exception:
        return None
    name = name.decode() if isinstance(name, bytes) else str(name)  # older pynvml returns bytes
    return name.strip() or None


def gpu_used_memory(index: int | None = None) -> int | None:
    """Memory in use on the visible GPU right now, by every process (NVML), or None without NVML or a GPU."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return int(_ask(nvml, index, nvml.nvmlDeviceGetMemoryInfo).used)
    except Exception:
        return None


def process_gpu_memory(pid: int, index: int | None = None) -> int | None:
    """What NVML says process ``pid`` holds on the visible GPU (its CUDA context included), or None where NVML cannot
    tell (no NVML, or a container whose process IDs NVML does not see)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        procs = _ask(nvml, index, nvml.nvmlDeviceGetComputeRunningProcesses)
    except Exception:
        return None
    used = [int(p.usedGpuMemory) for p in procs if int(p.pid) == pid and getattr(p, "usedGpuMemory", None)]
    return used[0] if used else None


def _ask(nvml: Any, index: int | None, query: Any) -> Any:
    """One NVML query about the visible GPU (``index`` or the first one CUDA sees), shutting NVML down after."""
    try:
        return query(nvml.nvmlDeviceGetHandleByIndex(_visible_index() if index is None else index))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
