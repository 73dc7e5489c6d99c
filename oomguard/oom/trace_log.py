"""A run's memory trace read back from what it left: an events file, a trainer's metric logs, or a log that prints
memory per step. ``oomguard analyze`` runs :func:`oomguard.oom.trend.assess` on what these readers find.

What is read, and where each figure goes (:class:`~oomguard.vocab.trace.MemSample`):

- **oomguard's events** (``events.jsonl`` in a run's workdir): ``{"event": "mem", ...}`` lines, one process (``pid``)
  per trace, exactly as the training process measured them.
- **Metric logs**, one step per line, as a ``step:N - key:value - ...`` console line (verl's console logger), a Python
  dict (transformers' Trainer prints its logs so) or a JSON object (a ``trainer_state.json``'s ``log_history``, a
  metrics export), read by key (:data:`METRIC_KEYS`): verl's ``perf/max_memory_allocated_gb`` (the step's peak),
  ``perf/max_memory_reserved_gb`` and ``perf/cpu_memory_used_gb`` (the machine's used host memory), and its
  ``response_length/max`` and ``prompt_length/max``; TRL's ``completions/max_length``. TRL 1.16 and transformers 5.24
  log no memory per step (transformers' ``skip_memory_metrics=False`` reports memory deltas once, at the end of
  training), so a TRL log gives lengths only, unless oomguard's ``oomguard/kept_gib`` and ``oomguard/step_peak_gib``
  are there. A printed dict without a step counts as the next step.
- **Printed memory**, a line with a step number and labelled sizes, as scripts print ``torch.cuda.memory_allocated()``
  and its kin: ``step 12 | allocated 10.5 GB | max allocated 14.2 GB | reserved 16.0 GB``, ``[GRPO step 003/009]
  ... current=11.95GB peak_since_reset=21.38GB``, DeepSpeed's ``see_memory_usage`` (``MA 12.34 GB Max_MA 14.5 GB CA
  16.0 GB``, its step number on the line or on the message line just before). Allocated (``allocated``, ``alloc``,
  ``current``, ``MA``) is taken as what the step kept, the last such figure of a step; a peak (``max allocated``,
  ``peak``, ``Max_MA``) is the step's largest; reserved (``reserved``, ``cached``, ``CA``) its last.

A trace is cut where its steps go back (a restart: each process's memory starts again), and each part is read alone.
Only lines that hold one of a few words are parsed (``lloc``, ``eak``; ``see_memory_usage`` and ``"kept"`` where the
first chunk shows them), a printed line seen again is not parsed again, and a log whose first 64 MiB hold no memory
line is not looked at further: a log without memory prints costs two substring searches over its first 64 MiB.

>>> import io
>>> log = b"".join(b"step %d | allocated %d MiB | max allocated %d MiB\\n" % (s, 60 + 6 * s, 90 + 6 * s)
...                for s in range(1, 13))
>>> (trace,) = read_traces(io.BytesIO(log))
>>> len(trace.samples), trace.samples[-1]
(12, MemSample(step=12, kept=138412032, peak=169869312, reserved=None, host_rss=None, prompt_tokens=None, completion_tokens=None, capacity=None))
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

from ..vocab.events import MemHolders, MemSampled
from ..vocab.sizes import GiB, KiB, MiB
from ..vocab.trace import Holder, MemSample
from .parse.scan import Readable

# metric key -> (field, unit in bytes, or 1 for tokens); "host_used" is the machine's used host memory
METRIC_KEYS: dict[str, tuple[str, int]] = {
    "oomguard/kept_gib": ("kept", GiB),
    "oomguard/step_peak_gib": ("peak", GiB),
    "perf/max_memory_allocated_gb": ("peak", GiB),  # verl: torch's max_memory_allocated() / 1024**3
    "perf/max_memory_reserved_gb": ("reserved", GiB),
    "perf/cpu_memory_used_gb": ("host_used", GiB),  # verl: psutil.virtual_memory().used, the whole machine
    "response_length/max": ("completion_tokens", 1),
    "prompt_length/max": ("prompt_tokens", 1),
    "completions/max_length": ("completion_tokens", 1),
}
_STEP_KEYS = ("step", "global_step", "train/global_step", "trainer/global_step")
_UNITS = {"b": 1, "bytes": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB, "g": GiB, "gb": GiB,
          "gib": GiB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE = r"(\d+(?:\.\d+)?)\s*(GiB|GB|G|MiB|MB|M|KiB|KB|bytes|B)\b"
# a labelled size: "max allocated 14.2 GB", "peak_since_reset=21.38GB", "MA 12.34 GB", "reserved: 16 GiB"
_LABELLED = re.compile(
    r"(?i)(?<![\w/])(?P<label>max[ _]?(?:memory[ _]?)?allocated|max[ _]?alloc|max_ma|peak(?:[ _](?:memory|mem|"
    r"allocated|since[ _]reset))?|(?:memory[ _]|mem[ _]|gpu[ _]mem(?:ory)?[ _])?allocated|alloc|current|ma|"
    r"max[ _]?(?:memory[ _]?)?reserved|max_ca|(?:memory[ _]|mem[ _])?reserved|cached|ca|rss)"
    r"(?:[ _]?(?:gb|gib|mb|mib))?\s*[:=]?\s*" + _SIZE)
_STEP = re.compile(r"(?i)(?<![\w/])(?:global[ _])?step[\s:=#\[]*(\d+)")
_VERL = re.compile(r"^\s*step:(\d+) - ")
# the cheap filter: only lines that hold one of these are parsed. Each is a literal, found at the speed of a substring
# search but at the cost of a pass over the text, so the text is not lowered (another pass) and a log's first chunk
# decides which are looked for: "lloc" (allocated, Allocated, verl's max_memory_allocated) and "eak" (peak, Peak,
# oomguard's own logged peak) always; DeepSpeed's see_memory_usage (each of its lines names it; its step number is on
# its message line) and oomguard's "mem" events (they hold "kept") where the first chunk shows them
_ALWAYS = (re.compile(rb"lloc"), re.compile(rb"eak"))
_IF_SEEN = {b"see_memory_usage": re.compile(rb"see_memory_usage"), b'"event"': re.compile(rb'"kept"|"holders"')}
DORMANT_AFTER = 64 << 20  # bytes read without a memory line, after which a log is not looked at again
PENDING_LINES = 2  # a step number on a line of its own (DeepSpeed's see_memory_usage message) holds for the next two
CACHE_LINES = 1024  # printed lines parsed, kept by their text (a log repeats its lines)
MAX_LINE = 1 << 16  # longer lines are not parsed (a dump, not a log line)


def _field(label: str) -> str:
    label = label.lower().replace(" ", "_")
    if label == "max_ma" or label.startswith(("max_alloc", "max_memory_alloc", "maxalloc")):
        return "peak"
    if label.startswith(("max_reserved", "max_memory_reserved", "maxreserved", "max_ca")):
        return "reserved_max"  # used only where the line gives no current reserved
    if label.startswith("peak"):
        return "peak"
    if label.startswith(("current", "alloc")) or label == "ma" or label.endswith("allocated"):
        return "kept"
    if label.startswith(("reserved", "cached")) or label == "ca" or label.endswith("reserved"):
        return "reserved"
    return "host_rss" if label.startswith("rss") else ""


def _bytes(value: str, unit: str) -> int:
    return round(float(value) * _UNITS[unit.lower()])


@dataclass
class Trace:
    """One process's samples read from ``source``, from line ``first_line`` to ``last_line``; ``host_basis`` says what
    its host figure is (``rss``: the process's; ``used``: the machine's used memory); ``form``: events, metrics or
    printed."""

    source: str
    samples: list[MemSample] = field(default_factory=list)
    first_line: int | None = None
    last_line: int | None = None
    pid: int | None = None
    host_basis: str = "rss"
    form: str = ""
    holders: tuple[Holder, ...] = ()  # where a leak's memory is held (an events file's census)


class _Builder:
    """Samples per step, merged: a step's figures may come over several lines."""

    def __init__(self, source: str, form: str, pid: int | None = None) -> None:
        self.holders: tuple[Holder, ...] = ()
        self.traces: list[Trace] = []
        self.source, self.form, self.pid = source, form, pid
        self.current: Trace | None = None
        self.by_step: dict[int, dict[str, int]] = {}
        self.last_step: int | None = None

    def add(self, line: int, step: int, figures: dict[str, int], host_basis: str = "rss") -> None:
        if self.current is None or (self.last_step is not None and step < self.last_step):
            self._close()
            self.current = Trace(self.source, first_line=line, pid=self.pid, host_basis=host_basis, form=self.form)
        self.current.last_line = line
        self.last_step = step
        merged = self.by_step.setdefault(step, {})
        for k, v in figures.items():
            merged[k] = max(merged.get(k, v), v) if k == "peak" else v

    def _close(self) -> None:
        if self.current is not None:
            self.current.samples = [MemSample(step=s, **f) for s, f in sorted(self.by_step.items())]
            self.current.holders, self.holders = self.holders, ()
            if self.current.samples:
                self.traces.append(self.current)
        self.current, self.by_step, self.last_step = None, {}, None

    def done(self) -> list[Trace]:
        self._close()
        return self.traces


def _from_metrics(d: dict[str, Any]) -> tuple[int | None, dict[str, int], bool]:
    """(step, figures, whether the host figure is the machine's used memory) of one metrics dict."""
    step = next((d[k] for k in _STEP_KEYS if isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool)),
                None)
    figures: dict[str, int] = {}
    used = False
    for key, (name, unit) in METRIC_KEYS.items():
        v = d.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
            if name == "host_used":
                name, used = "host_rss", True
            figures[name] = round(v * unit)
    return (int(step) if step is not None else None), figures, used


def _memory(figures: dict[str, Any]) -> bool:
    return any(k in figures for k in ("kept", "peak", "reserved", "host_rss"))


class TraceReader:
    """Reads traces as bytes stream by (:meth:`feed`, then :meth:`done`)."""

    def __init__(self, source: str = "") -> None:
        self.source = source
        self._carry = b""
        self._overlong = False  # the carry was a line too long to parse: skip to its end
        self._line = 0
        self._events: dict[Any, _Builder] = {}
        self._metrics = _Builder(source, "metrics")
        self._printed = _Builder(source, "printed")
        self._unnumbered = 0  # metric dicts without a step (transformers prints its logs so): counted
        self._pending: tuple[int, int] | None = None  # (step, line) of a step number without figures
        self._cache: dict[bytes, tuple[int | None, dict[str, int]]] = {}
        self._last_raw = b""  # the last printed line with a step and figures
        self._needles: tuple[re.Pattern[bytes], ...] | None = None  # decided by the first chunk
        self._read = 0
        self._found = False  # a memory line was seen

    def feed(self, chunk: bytes) -> None:
        if self._needles is None:
            self._needles = _ALWAYS + tuple(rx for word, rx in _IF_SEEN.items() if word in chunk)
        self._read += len(chunk)
        if not self._found and self._read > DORMANT_AFTER + len(chunk):
            self._needles = ()  # nothing in the first 64 MiB: not looked at further
        if not self._needles:
            self._carry = b""
            return
        buf = self._carry + chunk
        cut = buf.rfind(b"\n") + 1
        self._carry = buf[cut:]
        text = buf[:cut]
        if self._overlong and cut:  # the rest of a line too long to parse: counted, not read
            text, self._overlong = text[text.find(b"\n") + 1:], False
            self._line += 1
        if len(self._carry) > MAX_LINE:
            self._carry, self._overlong = b"", True
        self._scan(text)

    def _scan(self, text: bytes) -> None:
        hits = sorted([m.start() for rx in self._needles or () for m in rx.finditer(text)])
        pos = 0  # text[:pos] counted in self._line
        for hit in hits:
            if hit < pos:
                continue  # a line already read
            start = text.rfind(b"\n", 0, hit) + 1
            end = text.find(b"\n", hit)
            end = len(text) if end < 0 else end
            self._line += text.count(b"\n", pos, start)
            pos = end
            if end - start <= MAX_LINE:
                self._parse(self._line + 1, text[start:end])
        self._line += text.count(b"\n", pos)

    def _parse(self, n: int, raw: bytes) -> None:
        if raw == self._last_raw and self._printed.current is not None:
            self._printed.current.last_line = n  # the same line again: nothing new
            return
        cached = self._cache.get(raw)
        if cached is not None:
            self._printed_line(n, *cached)
            if cached[0] is not None and _memory(cached[1]):
                self._last_raw = raw
            return
        line = raw.decode("utf-8", "replace")
        s = line.strip()
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            obj = _object(s[brace:])
            if isinstance(obj, dict):
                self._dict(n, obj)
                return
        verl = _VERL.match(line)
        if verl:
            pairs = {}
            for part in line.split(" - "):
                k, _, v = part.strip().partition(":")
                try:
                    pairs[k] = float(v)
                except ValueError:
                    continue
            step, figures, used = _from_metrics(pairs)
            if step is not None and figures:
                self._found = True
                self._metrics.add(n, step, figures, "used" if used else "rss")
            return
        step_m = _STEP.search(line)
        figures = {}
        for m in _LABELLED.finditer(line):
            name = _field(m.group("label"))
            if name:
                size = _bytes(m.group(2), m.group(3))
                figures[name] = max(figures.get(name, size), size) if name == "peak" else size
        top = figures.pop("reserved_max", None)
        if top is not None:
            figures.setdefault("reserved", top)
        step = int(step_m.group(1)) if step_m is not None else None
        if len(self._cache) >= CACHE_LINES:
            self._cache.clear()
        self._cache[raw] = (step, figures)
        self._printed_line(n, step, figures)
        if step is not None and _memory(figures):
            self._last_raw = raw

    def _dict(self, n: int, obj: dict[str, Any]) -> None:
        if obj.get("event") == MemHolders.name and isinstance(obj.get("holders"), list):
            key = obj.get("pid"), obj.get("rank")
            b = self._events.setdefault(key, _Builder(self.source, "events", obj.get("pid")))
            b.holders = tuple(Holder.from_dict(h) for h in obj["holders"] if isinstance(h, dict))
            return
        if obj.get("event") == MemSampled.name:
            sample = MemSample.from_event(obj)
            if sample is not None:
                key = obj.get("pid"), obj.get("rank")
                b = self._events.setdefault(key, _Builder(self.source, "events", obj.get("pid")))
                b.add(n, sample.step, {k: v for k, v in sample.to_event().items() if k != "step"})
                self._found = True
            return
        step, figures, used = _from_metrics(obj)
        if step is None and _memory(figures):
            self._unnumbered += 1
            step = self._unnumbered
        if step is not None and figures:
            self._found = self._found or _memory(figures)
            self._metrics.add(n, step, figures, "used" if used else "rss")

    def _printed_line(self, n: int, step: int | None, figures: dict[str, int]) -> None:
        if step is None:
            if self._pending is None or n - self._pending[1] > PENDING_LINES:
                return
            if _memory(figures):
                self._found = True
                self._printed.add(n, self._pending[0], figures)
            return
        if _memory(figures):
            self._found = True
            self._printed.add(n, step, figures)
        else:
            self._pending = (step, n)

    def done(self) -> list[Trace]:
        """Every trace found, in the order of their first line."""
        if self._carry and not self._overlong:
            self._scan(self._carry + b"\n")
        self._carry = b""
        traces = [t for b in self._events.values() for t in b.done()]
        traces += self._metrics.done() + self._printed.done()
        traces = [t for t in traces if any(_memory(s.to_event()) for s in t.samples)]
        return sorted(traces, key=lambda t: t.first_line or 0)


def _object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    if len(text) > 8192 or "(" in text:
        return None  # not a plain dict literal
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def read_traces(stream: BinaryIO, source: str = "", *, chunk_size: int = 8 << 20) -> list[Trace]:
    """The traces in a binary stream (a log, an events file)."""
    reader = TraceReader(source)
    while True:
        chunk = stream.read(chunk_size)
        if not chunk:
            break
        reader.feed(chunk)
    return reader.done()


def traces_from_state(data: dict[str, Any], source: str = "") -> list[Trace]:
    """The trace in a ``trainer_state.json`` (its ``log_history``), where its logs hold memory figures.

    >>> state = {"log_history": [{"step": s, "oomguard/kept_gib": 1.0, "oomguard/step_peak_gib": 2.0} for s in (1, 2)]}
    >>> [s.kept >> 30 for s in traces_from_state(state)[0].samples]
    [1, 1]
    """
    b = _Builder(source, "metrics")
    for i, entry in enumerate(data.get("log_history") or [], 1):
        if isinstance(entry, dict):
            step, figures, used = _from_metrics(entry)
            if step is not None and figures:
                b.add(i, step, figures, "used" if used else "rss")
    return [t for t in b.done() if any(_memory(s.to_event()) for s in t.samples)]


class Tee:
    """A binary stream that hands what it reads to a :class:`TraceReader` as well (one pass over a big log)."""

    def __init__(self, inner: Readable, reader: TraceReader) -> None:
        self.inner, self.reader = inner, reader

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        if data:
            self.reader.feed(data)
        return data


def with_capacity(trace: Trace, capacity: int | None) -> list[MemSample]:
    """The trace's samples, with the device's size where the trace lacks it (an OOM message in the same log says it)."""
    if capacity is None or any(s.capacity for s in trace.samples):
        return trace.samples
    return [replace(s, capacity=capacity) for s in trace.samples]
