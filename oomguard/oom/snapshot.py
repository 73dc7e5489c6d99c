"""Read PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``) safely, and summarise them.

A snapshot is a pickle, and unpickling can run arbitrary code. Snapshots hold only plain data, so the unpickler here
refuses every global: dicts, lists, tuples, strings, numbers, booleans and None load; anything else is rejected
with a one-line error and nothing from the file runs.

Both forms are accepted: the dict of ``torch.cuda.memory._snapshot()`` (``segments``, ``device_traces``, ...) and the
bare segment list of ``torch.cuda.memory_snapshot()``. Block states may be spelled ``active_pending_free`` (the C++
side) or ``active_awaiting_free`` (the Python docstring).

>>> import io, pickle
>>> seg = {"device": 0, "address": 0, "total_size": 20 << 20, "allocated_size": 2 << 20, "segment_type": "large",
...        "blocks": [{"address": 0, "size": 2 << 20, "state": "active_allocated", "frames": []},
...                   {"address": 2 << 20, "size": 18 << 20, "state": "inactive", "frames": []}]}
>>> s = summarize(load_snapshot_bytes(pickle.dumps({"segments": [seg], "device_traces": [[]]})))
>>> s.reserved, s.allocated, s.largest_free
(20971520, 2097152, 18874368)
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..vocab.oomreport import Frame, OOMReport
from ..vocab.trace import Holder

_ACTIVE = {"active_allocated", "active_pending_free", "active_awaiting_free"}


class SnapshotError(ValueError):
    """A file that is not a plain-data memory snapshot; the message says why."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(f"refuses to load {module}.{name}: a memory snapshot holds only plain data")


def looks_like_pickle(head: bytes) -> bool:
    """Pickle protocol 2+ starts with PROTO (0x80) and the protocol number."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def load_snapshot_bytes(data: bytes) -> dict[str, Any]:
    """Unpickle plain data only and normalise to the dict form."""
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            OverflowError, RecursionError, MemoryError) as e:
        raise SnapshotError(f"not a readable pickle ({e.__class__.__name__}: {e})") from None
    if isinstance(obj, list):
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("segments", []), list):
        raise SnapshotError("a pickle, but not a memory snapshot (no 'segments' list)")
    if "segments" not in obj and "device_traces" not in obj:
        raise SnapshotError("a pickle, but not a memory snapshot (no 'segments' or 'device_traces')")
    return obj


@dataclass(frozen=True)
class Block:
    size: int
    state: str
    frame: Frame | None
    segment_type: str


@dataclass(frozen=True)
class OOMEvent:
    device: int
    size: int
    device_free: int | None
    frames: tuple[Frame, ...]
    time_us: int | None


@dataclass
class PoolStats:
    segments: int = 0
    reserved: int = 0
    allocated: int = 0
    active: int = 0


@dataclass
class SnapshotSummary:
    reserved: int
    allocated: int
    largest_free: int
    pools: dict[str, PoolStats]
    largest_blocks: list[Block]
    oom_events: list[OOMEvent]
    devices: list[int]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def reserved_unallocated(self) -> int:
        return max(0, self.reserved - self.allocated)

    def allowance(self, ev: OOMEvent) -> tuple[int, int] | None:
        """The per-process allowance an OOM event ran into, as a range ``(at least, below)``, or ``None`` when the
        device itself was full.

        A snapshot records no allowance (``set_per_process_memory_fraction``, oomguard's ``--gpu-memory``), but the
        trace entry does record the device's free memory. When that was more than the request, the allocator refused
        it for its own limit: the limit was at least what the process had reserved (it got that much) and below
        reserved + request (or the request would have been served). Reserved is read from the snapshot, taken after
        the allocator released what it could before giving up.

        >>> s = SnapshotSummary(4 << 30, 3 << 30, 0, {}, [], [], [0])
        >>> s.allowance(OOMEvent(0, 300 << 20, 70 << 30, (), None)) == (4 << 30, (4 << 30) + (300 << 20))
        True
        >>> s.allowance(OOMEvent(0, 300 << 20, 10 << 20, (), None)) is None
        True
        """
        if ev.device_free is None or ev.size <= 0 or ev.device_free < ev.size or self.reserved <= 0:
            return None
        return self.reserved, self.reserved + ev.size

    @property
    def fragmentation(self) -> float:
        """Share of reserved-but-unallocated memory that is NOT in the largest free block (0 = one clean hole)."""
        free = self.reserved_unallocated
        return 0.0 if free <= 0 else max(0.0, 1.0 - self.largest_free / free)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reserved_bytes": self.reserved,
            "allocated_bytes": self.allocated,
            "reserved_unallocated_bytes": self.reserved_unallocated,
            "largest_free_block_bytes": self.largest_free,
            "fragmentation": round(self.fragmentation, 4),
            "pools": {k: vars(v) for k, v in self.pools.items()},
            "largest_blocks": [
                {"size": b.size, "state": b.state, "segment_type": b.segment_type,
                 "frame": b.frame.to_dict() if b.frame else None}
                for b in self.largest_blocks
            ],
            "oom_events": [
                {"device": e.device, "size": e.size, "device_free": e.device_free,
                 "limited_by": "allowance" if self.allowance(e) else "device",
                 "allowed_min_bytes": (self.allowance(e) or (None, None))[0],
                 "allowed_max_bytes": (self.allowance(e) or (None, None))[1],
                 "frames": [f.to_dict() for f in e.frames[-5:]]}
                for e in self.oom_events
            ],
            "devices": self.devices,
            "allocator_settings": self.settings,
        }


def _int(v: Any) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


def _frames(raw: Any) -> tuple[Frame, ...]:
    out = []
    for f in raw or ():
        if isinstance(f, dict):
            out.append(Frame(str(f.get("filename", "")), _int(f.get("line")), str(f.get("name", ""))))
    return tuple(out)


def top_python_frame(frames: Iterable[Frame]) -> Frame | None:
    """The innermost Python frame outside torch's own internals (snapshot frames list innermost first)."""
    fallback = None
    for f in frames:
        if not f.filename.endswith(".py"):
            continue
        fallback = fallback or f
        path = f.filename.replace("\\", "/")
        if "/torch/" not in path and "/site-packages/torch" not in path:
            return f
    return fallback


def summarize(snap: dict[str, Any], *, top: int = 10) -> SnapshotSummary:
    """Allocated vs reserved per segment type, the largest blocks with their top frame, fragmentation, OOM events."""
    pools: dict[str, PoolStats] = {}
    blocks: list[Block] = []
    largest_free = 0
    devices: set[int] = set()
    for seg in snap.get("segments") or []:
        if not isinstance(seg, dict):
            continue
        kind = str(seg.get("segment_type") or "unknown")
        ps = pools.setdefault(kind, PoolStats())
        ps.segments += 1
        ps.reserved += _int(seg.get("total_size"))
        devices.add(_int(seg.get("device")))
        seg_alloc = 0
        seg_active = 0
        for b in seg.get("blocks") or []:
            if not isinstance(b, dict):
                continue
            size = _int(b.get("size"))
            state = str(b.get("state", ""))
            if state == "active_allocated":
                seg_alloc += size
            if state in _ACTIVE:
                seg_active += size
                blocks.append(Block(size, state, top_python_frame(_frames(b.get("frames") or b.get("history"))), kind))
            elif state == "inactive":
                largest_free = max(largest_free, size)
        if not seg.get("blocks") and "allocated_size" in seg:
            seg_alloc = _int(seg.get("allocated_size"))
            seg_active = _int(seg.get("active_size", seg_alloc))
        ps.allocated += seg_alloc
        ps.active += seg_active
    events: list[OOMEvent] = []
    for dev, trace in enumerate(snap.get("device_traces") or []):
        for e in trace or []:
            if isinstance(e, dict) and e.get("action") == "oom":
                free = e.get("device_free", e.get("addr"))
                events.append(OOMEvent(dev, _int(e.get("size")), None if free is None else _int(free),
                                       _frames(e.get("frames")), e.get("time_us")))
                devices.add(dev)
    blocks.sort(key=lambda b: b.size, reverse=True)
    settings = snap.get("allocator_settings") if isinstance(snap.get("allocator_settings"), dict) else {}
    return SnapshotSummary(
        reserved=sum(p.reserved for p in pools.values()),
        allocated=sum(p.allocated for p in pools.values()),
        largest_free=largest_free,
        pools=pools,
        largest_blocks=blocks[:top],
        oom_events=events,
        devices=sorted(devices),
        settings=settings or {},
    )


def oom_reports(summary: SnapshotSummary) -> list[tuple[OOMReport, tuple[Frame, ...]]]:
    """One OOMReport per OOM event in the snapshot's traces, with the memory state the snapshot shows.

    The figures come from the snapshot taken after the failure: what was allocated and reserved then, the request
    size and the device's free memory as the trace entry recorded them. Snapshot frames are innermost first; the
    returned frames are outermost first, like a traceback.
    """
    out = []
    expandable = bool(summary.settings.get("expandable_segments"))
    for ev in summary.oom_events:
        bounds = summary.allowance(ev)
        msg = (f"CUDA out of memory (snapshot trace): tried to allocate {ev.size} bytes on device {ev.device}; "
               f"{ev.device_free} bytes free" + ("; expandable segments on" if expandable else "")
               + (f"; refused by a per-process allowance of at least {bounds[0]} and below {bounds[1]} bytes "
                  "(inferred: the device had room)" if bounds else ""))
        report = OOMReport(
            backend="cuda", origin="allocator", message=msg, requested=ev.size, free=ev.device_free,
            allocated=summary.allocated, reserved_unallocated=summary.reserved_unallocated, device=ev.device,
            process=None, allowed=bounds[1] if bounds else None, allowed_min=bounds[0] if bounds else None,
        )
        out.append((report, tuple(reversed(ev.frames))))
    return out


# --------------------------------------------------------------------------------------------------------------
# Where memory grew between two snapshots (a leak's evidence)


def site_name(f: Frame) -> str:
    """``file:line in function``, the file shortened to its path inside site-packages.

    >>> site_name(Frame("/venv/lib/python3.11/site-packages/trl/trainer/grpo_trainer.py", 2275, "_generate"))
    'trl/trainer/grpo_trainer.py:2275 in _generate'
    """
    path = f.filename.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{f.line} in {f.name}"


def site_totals(snap: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Live blocks by the site that allocated them (the innermost frame outside torch): ``{site: (bytes,
    blocks)}``. Blocks without frames (allocated before ``_record_memory_history`` was on) are left out.

    >>> blk = {"size": 6 << 20, "state": "active_allocated",
    ...        "frames": [{"filename": "/t/torch/random.py", "line": 3, "name": "randn"},
    ...                   {"filename": "/w/rewards.py", "line": 12, "name": "leaky_reward"}]}
    >>> site_totals({"segments": [{"blocks": [blk, blk, {"size": 2 << 20, "state": "active_allocated"}]}]})
    {'/w/rewards.py:12 in leaky_reward': (12582912, 2)}
    """
    out: dict[str, tuple[int, int]] = {}
    for seg in snap.get("segments") or []:
        if not isinstance(seg, dict):
            continue
        for b in seg.get("blocks") or []:
            if not isinstance(b, dict) or b.get("state") != "active_allocated":
                continue
            top = top_python_frame(_frames(b.get("frames")))
            if top is None:
                continue
            key = site_name(top)
            size, n = out.get(key, (0, 0))
            out[key] = (size + _int(b.get("size")), n + 1)
    return out


def grown(kind: str, before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], *, least: int,
          since: int | None = None, until: int | None = None, most: int = 5) -> tuple[Holder, ...]:
    """The holders (sites or objects, ``{name: (bytes, count)}`` at two steps) that gained at least ``least`` bytes,
    the most first.

    >>> grown("site", {"a.py:1 in f": (6 << 20, 1)}, {"a.py:1 in f": (54 << 20, 9), "b.py:2 in g": (1 << 10, 1)},
    ...       least=1 << 20, since=4, until=12)
    (Holder(kind='site', name='a.py:1 in f', grown=50331648, count=8, since=4, until=12),)
    """
    out = []
    for name, (size, n) in after.items():
        b, c = before.get(name, (0, 0))
        if size - b >= least:
            out.append(Holder(kind, name, size - b, max(0, n - c), since, until))
    out.sort(key=lambda h: -h.grown)
    return tuple(out[:most])
