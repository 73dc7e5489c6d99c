"""Device facts for the supervisor, read through NVML (pynvml from nvidia-ml-py), never through torch.

A CUDA context in the supervisor would take about 0.5 GiB from every GPU and seconds of start-up, so the parent
asks the driver's management library instead. Everything degrades to ``None`` where there is no NVIDIA GPU.

The device asked about is the one the training process will see as ``cuda:0`` (``visible``): CUDA_VISIBLE_DEVICES'
first entry, an index in CUDA's order (``CUDA_DEVICE_ORDER``: PCI bus order, which is NVML's, or CUDA's default
fastest-first order), a ``GPU-<uuid>`` (or a unique prefix of one), or a ``MIG-<uuid>`` slice, whose size is the
slice's own, not its card's. Where the order cannot be known for sure (fastest first on cards that differ), the
training process's own ``torch.cuda.mem_get_info`` corrects the size once it runs (``RunFacts.device_total``).

>>> nvml = FakeNVML([("Tesla V100-SXM2-32GB", 32 << 30, (7, 0), "GPU-aaa", []),
...                  ("NVIDIA H100 80GB HBM3", 80 << 30, (9, 0), "GPU-bbb", [])])
>>> handle_of(nvml, {}), handle_of(nvml, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})  # CUDA counts the fastest first
('1', '0')
>>> [handle_of(nvml, {"CUDA_VISIBLE_DEVICES": v}) for v in ("1", "GPU-aa", "GPU-ccc", "")]
['0', '0', None, None]
>>> mig = FakeNVML([("NVIDIA A100-SXM4-80GB", 80 << 30, (8, 0), "GPU-aaa", ["MIG-a1", "MIG-a2"])])
>>> handle_of(mig, {"CUDA_VISIBLE_DEVICES": "MIG-a2"}), handle_of(mig, {})  # a card with MIG on shows CUDA a slice
('MIG-a2', 'MIG-a1')
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from typing import Any


def handle_of(nvml: Any, env: Mapping[str, str] | None = None, cuda_index: int = 0) -> Any:
    """NVML's handle of the device the training process sees as ``cuda:<cuda_index>``, or None when
    CUDA_VISIBLE_DEVICES names nothing NVML has (a stale UUID, an index out of range, an empty list)."""
    env = os.environ if env is None else env
    vis = env.get("CUDA_VISIBLE_DEVICES")
    count = int(nvml.nvmlDeviceGetCount())
    order = _cuda_order(nvml, count, env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))
    if vis is None:
        return _whole_or_slice(nvml, order[cuda_index]) if cuda_index < len(order) else None
    parts = [p.strip() for p in vis.split(",") if p.strip()]
    if cuda_index >= len(parts):
        return None
    entry = parts[cuda_index]
    if entry.isdigit():
        i = int(entry)
        return _whole_or_slice(nvml, order[i]) if i < len(order) else None
    if entry.startswith("MIG-"):
        return _mig_by_uuid(nvml, count, entry)
    matches = [h for h in (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count))
               if _text(nvml.nvmlDeviceGetUUID(h)).startswith(entry if entry.startswith("GPU-") else f"GPU-{entry}")]
    return _whole_or_slice(nvml, matches[0]) if len(matches) == 1 else None


def _cuda_order(nvml: Any, count: int, order: str) -> list[Any]:
    """The devices in CUDA's numbering: NVML's (PCI bus) order under ``PCI_BUS_ID``; else CUDA's fastest-first
    order, taken as the newest compute capability first, then the most memory, PCI order breaking ties (exact for
    cards that are all alike, the usual node)."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    if order.upper() == "PCI_BUS_ID":
        return handles

    def speed(h: Any) -> tuple[Any, ...]:
        try:
            cc = tuple(nvml.nvmlDeviceGetCudaComputeCapability(h))
        except Exception:
            cc = (0, 0)
        try:
            mem = int(nvml.nvmlDeviceGetMemoryInfo(h).total)
        except Exception:
            mem = 0
        return (-cc[0], -cc[1], -mem)

    return sorted(handles, key=speed)


def _whole_or_slice(nvml: Any, handle: Any) -> Any:
    """A card with MIG on shows CUDA its first slice, not the whole card."""
    try:
        current, _ = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:
        return handle
    if not current:
        return handle
    for j in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            return nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except Exception:
            continue
    return handle


def _mig_by_uuid(nvml: Any, count: int, uuid: str) -> Any:
    for i in range(count):
        parent = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))
        except Exception:
            continue
        for j in range(slots):
            try:
                h = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, j)
            except Exception:
                continue
            if _text(nvml.nvmlDeviceGetUUID(h)) == uuid:
                return h
    return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_index(cuda_index: int, env: Mapping[str, str] | None = None) -> int | None:
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


def accelerator_present() -> bool:
    """Whether this machine has an accelerator a training process could run out of memory on, read without torch:
    an NVIDIA GPU (its driver's device files or NVML), AMD's ROCm (``/dev/kfd``), Apple silicon (MPS), Intel's GPUs
    (a render node with the xe or i915 driver), Gaudi (``/dev/accel``) or Ascend (``/dev/davinci*``). Where there is
    none (and no simulated device) a probe could find nothing to run out of: ``oomguard run`` starts the real run.

    >>> isinstance(accelerator_present(), bool)
    True
    """
    if _gpu_present() or os.path.exists("/dev/kfd") or bool(_listdir("/dev/accel")):
        return True
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return True
    if any(name.startswith("davinci") and name[7:].isdigit() for name in _listdir("/dev")):
        return True
    for card in _listdir("/sys/class/drm"):
        driver = os.path.join("/sys/class/drm", card, "device", "driver")
        if card.startswith("renderD") and os.path.basename(os.path.realpath(driver)) in ("xe", "i915"):
            return True
    return _nvml() is not None and _count_gpus() > 0


def _count_gpus() -> int:
    try:
        return int(_nvml().nvmlDeviceGetCount())
    except Exception:
        return 0


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


def gpu_bf16(index: int | None = None) -> bool | None:
    """Whether the visible GPU computes in bfloat16 (compute capability 8.0, Ampere, or newer), or None where NVML
    cannot tell. A V100 (7.0) or T4 (7.5) has no bfloat16: QLoRA computes in float16 there, and bf16 weights are
    never a rung."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        major, _minor = _ask(nvml, index, _parent_capability(nvml))
    except Exception:
        return None
    return int(major) >= 8


def _parent_capability(nvml: Any) -> Any:
    def cap(h: Any) -> Any:
        try:
            return nvml.nvmlDeviceGetCudaComputeCapability(h)
        except Exception:  # a MIG slice: its card's
            return nvml.nvmlDeviceGetCudaComputeCapability(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h))

    return cap


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
    """One NVML query about a GPU (NVML's ``index``, else the one the training process sees first: ``handle_of``),
    shutting NVML down after."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index) if index is not None else handle_of(nvml)
        if handle is None:
            raise LookupError("CUDA_VISIBLE_DEVICES names no device NVML has")
        return query(handle)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


class FakeNVML:
    """An NVML with the cards given, for tests and doctests: ``(name, total bytes, compute capability, uuid, [MIG
    slice uuids])`` each; a slice has an eighth of its card's memory."""

    class _Mem:
        def __init__(self, total: int) -> None:
            self.total, self.used, self.free = total, 0, total

    Card = tuple[str, int, tuple[int, int], str, list[str]]

    def __init__(self, cards: list[Card]) -> None:
        self.cards = cards

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return str(i)

    def _card(self, h: str) -> Card:
        if h.startswith("MIG-"):
            return next(c for c in self.cards if h in c[4])
        return self.cards[int(h)]

    def nvmlDeviceGetUUID(self, h: str) -> str:
        return h if h.startswith("MIG-") else self._card(h)[3]

    def nvmlDeviceGetName(self, h: str) -> str:
        return self._card(h)[0]

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        total = self._card(h)[1]
        return self._Mem(total // 8 if h.startswith("MIG-") else total)

    def nvmlDeviceGetCudaComputeCapability(self, h: str) -> tuple[int, int]:
        if h.startswith("MIG-"):
            raise RuntimeError("NVMLError_NotSupported")
        return self._card(h)[2]

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: str) -> str:
        return str(self.cards.index(self._card(h)))

    def nvmlDeviceGetMigMode(self, h: str) -> tuple[int, int]:
        on = int(bool(self._card(h)[4]))
        return on, on

    def nvmlDeviceGetMaxMigDeviceCount(self, h: str) -> int:
        return len(self._card(h)[4])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: str, j: int) -> str:
        return self._card(h)[4][j]

    def nvmlShutdown(self) -> None:
        pass
