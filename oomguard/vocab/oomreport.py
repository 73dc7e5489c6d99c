"""What one out-of-memory message says: the OOMReport, its traceback frames and the other processes it names.

Plain data with a JSON form. :mod:`oomguard.oom.parse` reads reports out of text and exceptions; crash records, run
reports, the diagnosis and the remedies carry them.

>>> r = OOMReport(backend="cuda", origin="allocator", message="CUDA out of memory.", requested=2**30,
...               other_processes=(OtherProcess(7, 2**30),))
>>> OOMReport.from_dict(r.to_dict()) == r, r.others_total == 2**30
(True, True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BACKENDS = ("cuda", "hip", "xpu", "mps", "npu", "cpu", "host", "vllm")

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

    ``origin`` says which layer reported it: ``allocator`` (a caching allocator), ``async-allocator`` (PyTorch's
    ``backend:cudaMallocAsync``), ``mps``, ``cpu-allocator``, ``runtime`` / ``driver`` (CUDA or HIP outside the
    allocator, THC's ``THCudaCheck FAIL`` included), ``library`` (cuBLAS, cuDNN, ...), ``nccl``, ``level-zero``,
    ``vllm-startup``, ``vllm-kv``, ``vllm-cumem``, ``python`` (MemoryError), ``oom-killer``, ``slurm``, ``shell``,
    ``ray`` (Ray's memory monitor killed a worker).

    ``allowed`` is a per-process allowance (``torch.cuda.set_per_process_memory_fraction``, which oomguard's
    ``--gpu-memory`` sets): the process may not reserve more, however much of the device is free. Where the
    allowance is inferred rather than printed (a memory snapshot records none), it lies between ``allowed_min`` and
    ``allowed``. For Ray it is the node's kill threshold times its memory; the raylet's memory-pressure summary gives
    ``workers_killed`` (how many workers its memory monitor killed) and ``node`` (the node's IP, where printed). For
    vLLM's KV-cache refusals, ``max_seq_len`` and ``kv_cache_tokens`` are token counts: the longest sequence the model
    was configured for, and what the KV cache can hold.

    For MPS, ``allowed`` is the high-watermark limit ("max allowed"), ``allocated`` PyTorch's share ("MPS
    allocated"), ``process`` all Metal memory of the process (allocated + "other allocations", or the oldest builds'
    "currently allocated") and ``free`` the room left under the limit; ``capacity`` is not given. A CUDA request
    refused as "more than 1EB" has ``requested`` = 2**60.
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
    max_seq_len: int | None = None
    kv_cache_tokens: int | None = None
    allowed_min: int | None = None
    workers_killed: int | None = None
    node: str | None = None

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
