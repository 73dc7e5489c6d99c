"""The protocol the training process speaks to the supervisor: one JSON line per event in the attempt's events file,
one frozen dataclass per event, typed both ways.

The training process builds an event and hands it to ``Runtime.emit``, which adds who and when (``pid``, ``rank``,
``t``) and writes ``{"event": NAME, ...fields}``; the supervisor reads the lines back with :func:`parse_event`, which
is generic over each class's fields (their types from the annotations): nothing is read by string. Both sides are the
same package version, so an event or a field the reader does not know is a mistake of oomguard's own: an error where
``OOMGUARD_STRICT_EVENTS`` is set (the test suite sets it), else it is kept as :class:`OtherEvent` (an unknown field,
dropped) and the supervisor says so once.

>>> ev = StepDone(step=3, peak=100)
>>> line = ev.to_json()
>>> line["event"], parse_event({**line, "pid": 7}) == StepDone(step=3, peak=100, pid=7)
('step', True)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from .serial import coerce, hints

STRICT_ENV = "OOMGUARD_STRICT_EVENTS"
# what every event carries besides its own fields (Runtime.emit adds them)
ENVELOPE = ("event", "t", "pid", "rank")


class ProtocolError(ValueError):
    """An event the supervisor cannot read as oomguard's own training process writes it."""


@dataclass(frozen=True)
class Event:
    """An event of the training process. ``name`` is its ``event`` field; a class may take several names (one field
    of it then says which)."""

    name: ClassVar[str] = ""

    def event_name(self) -> str:
        return self.name

    def to_json(self) -> dict[str, Any]:
        """The event's line, without the envelope's ``t``, ``pid`` and ``rank`` (``Runtime.emit`` adds them)."""
        out: dict[str, Any] = {"event": self.event_name()}
        for f in fields(self):
            if f.name in ("pid", "rank") or f.metadata.get("implied"):
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class ProcessStarted(Event):
    """``start``: a Python process of the attempt with oomguard's bootstrap, where it runs (host and PID namespace)
    and whether multiprocessing started it to serve another (a ``helper``, never a training process)."""

    name: ClassVar[str] = "start"
    pid: int | None = None
    rank: int | None = None
    where: str | None = None
    helper: bool = False
    argv: tuple[str, ...] = ()
    executable: str | None = None


@dataclass(frozen=True)
class CodeSeen(Event):
    """``config`` (GRPOConfig built), ``trainer`` (GRPOTrainer built) or ``facts`` (facts measured once the trainer
    holds its model): the script's own values and run facts. ``resolved``: values the user's stack changed after the
    script set them (Unsloth turns bf16 off on a CPU without it), which replace the observed ones."""

    point: str = field(default="config", metadata={"implied": True})
    observed: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    world_size: int | None = None
    pid: int | None = None  # the process that passed it: a training process (see ``ProcessEnded``)
    rank: int | None = None
    resolved: dict[str, Any] = field(default_factory=dict)

    def event_name(self) -> str:
        return self.point


@dataclass(frozen=True)
class Ran(Event):
    """``ran``: the knobs the process runs at a construction point (``child/ran.py``); ``later``: who changed a knob
    oomguard set; ``resolved``: the user's values changed after the script set them; ``unmet``: a locked value it does
    not run, once it stops for it (``vocab.lock.Unmet``)."""

    name: ClassVar[str] = "ran"
    knobs: dict[str, Any] = field(default_factory=dict)
    later: dict[str, str] = field(default_factory=dict)
    resolved: dict[str, Any] = field(default_factory=dict)
    unmet: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    rank: int | None = None


@dataclass(frozen=True)
class ModelSeen(Event):
    """``model``: the shape of the model the script loaded (``config.json`` fields)."""

    name: ClassVar[str] = "model"
    config: dict[str, Any] | None = None
    params: int | None = None
    dtype: str | None = None
    reaches: tuple[str, ...] = ()  # before a load: construction points the script will pass after it (``trainer``)


@dataclass(frozen=True)
class DatasetSeen(Event):
    """``dataset``: prompt lengths in tokens, and what ``max_prompt_tokens`` dropped."""

    name: ClassVar[str] = "dataset"
    rows: int | None = None
    prompt_tokens_max: int | None = None
    prompt_tokens_p95: int | None = None
    dropped: int | None = None
    sampled: bool = False
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class ProbeDataset(Event):
    """``probe_dataset``: the probe trains on its longest prompt (``prompt_tokens``), repeated ``rows`` times, each
    with the images of row ``image_row`` (a vision-language model's largest image; None: no images)."""

    name: ClassVar[str] = "probe_dataset"
    rows: int | None = None
    prompt_tokens: int | None = None
    image_row: int | None = None


@dataclass(frozen=True)
class TrainBegin(Event):
    """``train_begin``: a trainer starts (a process may build several)."""

    name: ClassVar[str] = "train_begin"
    step: int = 0
    max_steps: int | None = None
    save_strategy: str = ""
    output_dir: str | None = None
    save_steps: float | None = None


@dataclass(frozen=True)
class StepDone(Event):
    """``step`` (an optimizer step ended) or ``train_end`` (``final``), with the peaks so far."""

    step: int | None = None
    peak: int | None = None
    reserved: int | None = None
    final: bool = field(default=False, metadata={"implied": True})
    pid: int | None = None

    def event_name(self) -> str:
        return "train_end" if self.final else "step"


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """``checkpoint``: the trainer saved one, with the device and host peaks the save reached."""

    name: ClassVar[str] = "checkpoint"
    step: int | None = None
    path: str | None = None
    peak: int | None = None
    host_peak: int | None = None


@dataclass(frozen=True)
class Saving(Event):
    """``saving``: a checkpoint save began (one that the kernel's OOM killer ends says nothing itself)."""

    name: ClassVar[str] = "saving"
    step: int | None = None


@dataclass(frozen=True)
class Evaluated(Event):
    """``evaluated``: an evaluation pass ended, with the peaks so far."""

    name: ClassVar[str] = "evaluated"
    step: int | None = None
    peak: int | None = None
    reserved: int | None = None
    host_peak: int | None = None


@dataclass(frozen=True)
class OOMRaised(Event):
    """``oom``: a rank died of OOM (its CrashRecord is at ``path``)."""

    name: ClassVar[str] = "oom"
    step: int | None = None
    phase: str | None = None
    path: str | None = None
    pid: int | None = None
    rank: int | None = None


@dataclass(frozen=True)
class ConfigGenerated(Event):
    """``generated``: a config oomguard wrote for this attempt (a DeepSpeed JSON)."""

    name: ClassVar[str] = "generated"
    kind: str = ""
    path: str | None = None
    config: Any = None
    replaces: Any = None


@dataclass(frozen=True)
class PreflightStop(Event):
    """``predicted``: the pre-flight check stopped the process before it generated."""

    name: ClassVar[str] = "predicted"
    predicted_bytes: int | None = None
    capacity: int | None = None
    margin: float = 0.0
    pid: int | None = None
    rank: int | None = None
    before: str = "generates"  # what the stop saved: "generates" (trainer built) or "loads" (before the weights)
    reason: str | None = None  # a stop that is not about the device's size: vLLM's reservation cannot hold it


@dataclass(frozen=True)
class ProbeDecided(Event):
    """``probe_decision``: an attempt launched as a probe unless the memory model is sure of its config, decided
    where the training process knows the config (before GRPOTrainer is built): ``run`` (predicted clearly under the
    device: this launch is the real run) or ``probe`` (near the edge, or a config the model cannot judge surely)."""

    name: ClassVar[str] = "probe_decision"
    decided: str = "probe"
    predicted_bytes: int | None = None
    capacity: int | None = None
    limit: int | None = None  # the largest predicted peak the model is sure of on this device
    why: str = ""


@dataclass(frozen=True)
class Adapted(Event):
    """``adapted``: oomguard set ``knob`` to ``value`` so that the command runs where it is launched (not for memory:
    ``use_cpu`` for DeepSpeed's CPU ranks), and why."""

    name: ClassVar[str] = "adapted"
    knob: str = ""
    value: Any = None
    why: str = ""


@dataclass(frozen=True)
class Resumed(Event):
    """``resume``: the trainer continues from ``checkpoint`` (the plan's resume, given to ``trainer.train``)."""

    name: ClassVar[str] = "resume"
    checkpoint: str | None = None


@dataclass(frozen=True)
class WeightsFrom(Event):
    """``weights_from``: a new run loads its weights from ``checkpoint`` (after a rung a checkpoint cannot continue)."""

    name: ClassVar[str] = "weights_from"
    checkpoint: str | None = None


@dataclass(frozen=True)
class DeviceMeasured(Event):
    """``device``: ``--gpu-memory`` on a real GPU: the context the process measured (or the model's figure, ``how``
    says which), what the allocator was capped at, the card's total; ``final`` once CUDA really holds it."""

    name: ClassVar[str] = "device"
    gpu_memory: int | None = None
    context_bytes: int | None = None
    measured_bytes: int | None = None
    how: str = ""
    allocator_bytes: int | None = None
    total: int | None = None
    final: bool = False


@dataclass(frozen=True)
class VLLMMemory(Event):
    """``vllm_memory``: what a colocated vLLM engine reserved on the simulated device, and how its KV cache came out."""

    name: ClassVar[str] = "vllm_memory"
    requested: int | None = None
    engine: int | None = None
    activations: int | None = None
    kv_cache: int | None = None
    capacity: int | None = None
    utilization: float | None = None


@dataclass(frozen=True)
class ProcessEnded(Event):
    """``end``: how one process of the attempt ended, in its own words (written once, at its end): ``exit`` with the
    ``code`` it passed to ``sys.exit`` (0 for a plain end), ``error`` (an uncaught exception, not an OOM), ``oom``
    (its CrashRecord at ``path``) or ``predicted`` (the pre-flight check stopped it). ``reached``: the construction
    points it passed (config, trainer, model). A process killed by a signal writes none."""

    name: ClassVar[str] = "end"
    how: str = "exit"
    pid: int | None = None
    rank: int | None = None
    code: int | None = None
    error: str | None = None
    path: str | None = None
    reached: tuple[str, ...] = ()


@dataclass(frozen=True)
class OverrideFailed(Event):
    """``override_error``: applying oomguard's overrides raised (in ``where``)."""

    name: ClassVar[str] = "override_error"
    where: str = ""
    error: str = ""
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class PatchFailed(Event):
    """``patch_failed``: one of oomguard's patches (``patch``) raised when ``module`` was imported, so the knobs it
    carries cannot reach the training process."""

    name: ClassVar[str] = "patch_failed"
    module: str = ""
    patch: str = ""
    error: str = ""

    def line(self) -> str:
        """What the report and the terminal say.

        >>> PatchFailed("trl.trainer.grpo_config", "patch_grpo_config", "KeyError: '__post_init__'").line()
        "oomguard's patch of trl.trainer.grpo_config (patch_grpo_config) failed: KeyError: '__post_init__'; the knobs it carries cannot reach the training (please report it)"
        """
        return (f"oomguard's patch of {self.module} ({self.patch}) failed: {self.error}; the knobs it carries "
                "cannot reach the training (please report it)")


@dataclass(frozen=True)
class MemSampled(Event):
    """``mem``: one optimizer step's memory, at its end (``vocab.trace.MemSample``'s fields; ``child/trace.py``)."""

    name: ClassVar[str] = "mem"
    step: int | None = None
    kept: int | None = None
    peak: int | None = None
    reserved: int | None = None
    host_rss: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    capacity: int | None = None
    pid: int | None = None
    rank: int | None = None

    def sample(self) -> Any:
        """The :class:`~oomguard.vocab.trace.MemSample` it carries (None without a step)."""
        from .trace import MemSample

        return MemSample.from_event({f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True)
class MemTrend(Event):
    """``mem_trend``: what the process's memory trace says now, when it says something new (a leak, its projected
    step, fragmentation that grows, a long sample): ``oom.trend.Trend.to_dict``, each verdict with its sentence."""

    name: ClassVar[str] = "mem_trend"
    trend: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    rank: int | None = None

    def sentences(self) -> list[str]:
        return [str(v.get("evidence")) for v in self.trend.get("verdicts") or [] if v.get("evidence")]


@dataclass(frozen=True)
class MemHolders(Event):
    """``mem_holders``: where a leak's memory is held, from two tallies ``since`` and ``until`` (steps): the sites
    and objects that grew (``vocab.trace.Holder`` dicts), and the leak's sentence with them."""

    name: ClassVar[str] = "mem_holders"
    since: int | None = None
    until: int | None = None
    holders: list[dict[str, Any]] = field(default_factory=list)
    evidence: str | None = None
    pid: int | None = None
    rank: int | None = None


@dataclass(frozen=True)
class OtherEvent(Event):
    """An event this supervisor does not know (never written by the same oomguard version): kept whole."""

    name: ClassVar[str] = ""
    kind: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def event_name(self) -> str:
        return self.kind


ChildEvent = Event
# event name -> its class; a class of several names (CodeSeen, StepDone) reads the name into one field
EVENTS: dict[str, type[Event]] = {
    cls.name: cls for cls in (ProcessStarted, Ran, ModelSeen, DatasetSeen, ProbeDataset, TrainBegin, CheckpointSaved,
                              Saving, Evaluated, OOMRaised, ConfigGenerated, PreflightStop, ProbeDecided, Adapted,
                              Resumed, WeightsFrom, DeviceMeasured, VLLMMemory, ProcessEnded, OverrideFailed,
                              PatchFailed, MemSampled, MemTrend, MemHolders)}
EVENTS.update({"config": CodeSeen, "trainer": CodeSeen, "facts": CodeSeen, "step": StepDone, "train_end": StepDone})
_IMPLIED: dict[str, dict[str, Any]] = {"config": {"point": "config"}, "trainer": {"point": "trainer"}, "facts": {"point": "facts"},
            "step": {"final": False}, "train_end": {"final": True}}


def strict() -> bool:
    """Whether an event or field oomguard does not know is an error (``OOMGUARD_STRICT_EVENTS``: the test suite)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes")


def parse_event(d: dict[str, Any]) -> Event:
    """One event line, typed by its ``event`` name, generically over the class's fields. Missing or malformed fields
    read as their empty values, never an exception; an unknown event or field raises :class:`ProtocolError` under
    ``OOMGUARD_STRICT_EVENTS``, else an unknown event is an :class:`OtherEvent` and an unknown field is dropped.

    >>> parse_event({"event": "step", "step": 3, "peak": 100})
    StepDone(step=3, peak=100, reserved=None, final=False, pid=None)
    >>> parse_event({"event": "resume", "checkpoint": "x"}).checkpoint
    'x'
    """
    name = str(d.get("event"))
    cls = EVENTS.get(name)
    if cls is None:
        if strict():
            raise ProtocolError(f"unknown event {name!r}: {json.dumps(d, default=str)[:300]}")
        return OtherEvent(kind=name, data=dict(d))
    known = hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names - set(ENVELOPE)
    if unknown and strict():
        raise ProtocolError(f"event {name!r} has field(s) {', '.join(sorted(unknown))} that {cls.__name__} lacks")
    values = {k: coerce(d[k], known[k]) for k in names if k in d}
    values.update(_IMPLIED.get(name, {}))
    return cls(**values)


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """The events a training process appended, typed; a torn last line (a crash mid-write) is skipped."""
    try:
        with open(path, "rb") as f:
            return [parse_event(d) for d in _json_dicts(f.read().split(b"\n"))]
    except OSError:
        return []


def _json_dicts(lines: list[bytes]) -> list[dict[str, Any]]:
    """The JSON objects among ``lines``; blank, torn or non-object lines are skipped."""
    out: list[dict[str, Any]] = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


class EventTail:
    """Reads the events a running attempt appends, as they arrive (only whole lines)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path, self.pos, self.buf = Path(path), 0, b""

    def poll(self) -> list[Event]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return []
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [parse_event(d) for d in _json_dicts(lines)]


__all__ = [
    "ENVELOPE", "EVENTS", "STRICT_ENV", "Adapted", "CheckpointSaved", "ChildEvent", "CodeSeen", "ConfigGenerated",
    "DatasetSeen", "DeviceMeasured", "Evaluated", "Event", "EventTail", "MemHolders", "MemSampled", "MemTrend",
    "ModelSeen", "OOMRaised", "OtherEvent", "OverrideFailed", "PatchFailed", "PreflightStop", "ProbeDataset",
    "ProbeDecided", "ProcessEnded", "ProcessStarted", "ProtocolError", "Ran", "Resumed", "Saving", "StepDone",
    "TrainBegin", "VLLMMemory", "WeightsFrom", "parse_event", "read_events", "strict"]
