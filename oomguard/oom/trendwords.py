"""The verdicts a run's memory trace gives (``oomguard.oom.trend.assess`` finds them) and their words: the one place
a verdict becomes a sentence. A leak (on the device or the host), fragmentation that grows, a long sample; each a
frozen dataclass with its numbers, and :func:`describe` its sentence (never parsed back).

>>> describe(Leak("device", 6 << 20, 3, 12, 82 << 20, 136 << 20, 200 << 20, 19))[:60]
'Leak: the memory kept at the end of each step grew by 6.00 M'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..vocab.sizes import format_size
from ..vocab.trace import Holder

V = TypeVar("V")


@dataclass(frozen=True)
class Leak:
    """Memory kept step after step (``where``: ``device`` or ``host``), ``rate`` bytes per step from ``since`` to
    ``until`` (fitted ``start`` to ``end``). ``runs_out_at`` is the step at which ``limit`` is reached at that rate
    (``None`` without a limit). ``basis`` is what grew: ``kept`` (allocated at the step's end), ``peak`` (a log
    that shows only peaks: longer sequences would look the same), ``rss`` (the process's host memory) or ``used``
    (the machine's used host memory, where a log gives only that). ``holders`` says where the memory is held,
    where a census found it. ``young``: foretold at an OOM by fewer steps than a verdict on a trace needs, so a
    restart that grows again must confirm it."""

    where: str
    rate: float
    since: int
    until: int
    start: int
    end: int
    limit: int | None
    runs_out_at: int | None
    basis: str = "kept"
    holders: tuple[Holder, ...] = ()
    young: bool = False

    @property
    def kind(self) -> str:
        return "leak" if self.where == "device" else "host-leak"


@dataclass(frozen=True)
class FragmentationGrowth:
    """What the allocator reserves beyond each step's peak grew by ``rate`` bytes per step from ``since`` to ``until``
    (``start`` to ``end``); ``reserved`` is the last step's reserved memory, ``runs_out_at`` the step at which it
    reaches ``capacity`` at that rate."""

    rate: float
    since: int
    until: int
    start: int
    end: int
    reserved: int
    capacity: int | None
    runs_out_at: int | None
    kind: str = field(default="fragmentation-growth", init=False)


@dataclass(frozen=True)
class LongSample:
    """Step ``step`` peaked at ``peak``, above the ``usual_peak``, while its ``kept`` memory stayed at the usual; its
    ``tokens`` (longest prompt plus completion) against the ``usual_tokens``, where the trace has lengths."""

    step: int
    peak: int
    usual_peak: int
    kept: int | None
    tokens: int | None
    usual_tokens: int | None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    at_oom: bool = False  # the step that ran out of memory (its lengths from the crash record or the dataset)
    kind: str = field(default="long-sample", init=False)


Verdict = Leak | FragmentationGrowth | LongSample


@dataclass(frozen=True)
class Trend:
    """What a trace says: its verdicts (leaks first, then fragmentation, then long samples) and what it was read from.

    ``used`` samples from ``first_step`` to ``last_step``, after ``skipped`` settling samples."""

    verdicts: tuple[Verdict, ...]
    used: int
    skipped: int
    first_step: int | None
    last_step: int | None

    def _one(self, kind: str, cls: type[V]) -> V | None:
        return next((v for v in self.verdicts if v.kind == kind and isinstance(v, cls)), None)

    @property
    def leak(self) -> Leak | None:
        return self._one("leak", Leak)

    @property
    def host_leak(self) -> Leak | None:
        return self._one("host-leak", Leak)

    @property
    def fragmentation(self) -> FragmentationGrowth | None:
        return self._one("fragmentation-growth", FragmentationGrowth)

    @property
    def long_samples(self) -> tuple[LongSample, ...]:
        return tuple(v for v in self.verdicts if isinstance(v, LongSample))

    def evidence(self) -> tuple[str, ...]:
        """One sentence per verdict (:func:`describe`)."""
        return tuple(describe(v) for v in self.verdicts)

    def to_dict(self) -> dict[str, Any]:
        def plain(v: Verdict) -> dict[str, Any]:
            d = {k: getattr(v, k) for k in v.__dataclass_fields__}
            if isinstance(v, Leak):
                d["holders"] = [h.to_dict() for h in v.holders]
                d["rate"] = round(v.rate)
            elif isinstance(v, FragmentationGrowth):
                d["rate"] = round(v.rate)
            d["kind"] = v.kind
            d["evidence"] = describe(v)
            return d

        return {"verdicts": [plain(v) for v in self.verdicts], "used": self.used, "skipped": self.skipped,
                "first_step": self.first_step, "last_step": self.last_step}


LEAK_CURE = "Only a fix to the code that keeps the memory cures this; a smaller config only delays it."
HOST_LEAK_CURE = ("Only a fix to the code that keeps it (a cache in a reward function or a dataset held in memory) "
                  "cures this; a smaller GPU config does not.")


def held(holders: Sequence[Holder]) -> str:
    """Where grown memory is held, as one sentence (empty without holders).

    >>> held([Holder("object", "list `CACHE` of module `rewards`", 12 << 20, 2, 3, 5)])
    ' It is held here: list `CACHE` of module `rewards` holds 12.00 MiB more between steps 3 and 5 (2 tensor(s) that stayed).'
    """
    if not holders:
        return ""
    parts = []
    for h in holders[:4]:
        span = f" between steps {h.since} and {h.until}" if h.since is not None and h.until is not None else ""
        what = "tensor(s)" if h.kind == "object" else "allocation(s)"
        verb = "holds" if h.kind == "object" else "allocated"
        parts.append(f"{h.name} {verb} {format_size(h.grown)} more{span} ({h.count} {what} that stayed)")
    return " It is held here: " + "; ".join(parts) + "."


def describe(v: Verdict) -> str:
    """The sentence of one verdict, with its numbers (never parsed back)."""
    if isinstance(v, Leak):
        if v.where == "host":
            whose = "the machine's used host memory" if v.basis == "used" else \
                "the training process's resident host memory"
            head = (f"Host leak: {whose} grew by {format_size(v.rate)} per step "
                    f"from step {v.since} to step {v.until} (from {format_size(v.start)} to {format_size(v.end)}), "
                    "step after step.")
            limit = "the host's memory limit"
            cure = HOST_LEAK_CURE
        elif v.basis == "peak":
            head = (f"Leak, likely: the peak of each step grew by {format_size(v.rate)} per step from step {v.since} to "
                    f"step {v.until} (from {format_size(v.start)} to {format_size(v.end)}), step after step; the trace "
                    "shows no kept memory, so sequences that grow longer would look the same.")
            limit = "the device"
            cure = LEAK_CURE
        else:
            head = (f"Leak: the memory kept at the end of each step grew by {format_size(v.rate)} per step from step "
                    f"{v.since} to step {v.until} (from {format_size(v.start)} to {format_size(v.end)}), step after "
                    "step; the peak rose with it.")
            limit = "the device"
            cure = LEAK_CURE
        out = head
        if v.young:
            out += (f" That rests on {v.until - v.since + 1} step(s), too few to be sure: a restart with the same config "
                    "that gets further and grows again confirms it.")
        if v.runs_out_at is not None and v.limit:
            out += f" At that rate {limit} ({format_size(v.limit)}) is full by step {v.runs_out_at} at the latest."
        return out + held(v.holders) + " " + cure
    if isinstance(v, FragmentationGrowth):
        out = (f"Fragmentation growing: the memory the allocator reserves beyond each step's peak grew by "
               f"{format_size(v.rate)} per step from step {v.since} to step {v.until} (from {format_size(v.start)} "
               f"to {format_size(v.end)}) while the memory kept between steps did not grow")
        if v.runs_out_at is not None and v.capacity:
            out += (f"; at that rate the reserved memory ({format_size(v.reserved)} now) fills the device "
                    f"({format_size(v.capacity)}) from step {v.runs_out_at}")
        return out + ". The allocator's settings (expandable segments) cure this, not a smaller config."
    if v.at_oom:
        return _long_at_oom(v)
    if v.tokens is not None and v.usual_tokens is not None:
        with_lengths = f", with its lengths ({_lengths(v)}, usually {v.usual_tokens})"
    else:
        with_lengths = " (the trace has no lengths: a long sample, most likely)"
    kept = (f", while the memory kept between steps stayed at {format_size(v.kept)}" if v.kept is not None
            else "")
    return (f"Long sample: step {v.step} peaked at {format_size(v.peak)}, {format_size(v.peak - v.usual_peak)} "
            f"above the usual {format_size(v.usual_peak)}{with_lengths}{kept}: a config that fits this step fits "
            "the run.")


def _long_at_oom(v: LongSample) -> str:
    kept = (f"; the memory kept between steps stayed at {format_size(v.kept)}, so it is no leak" if v.kept is not None
            else "")
    if v.tokens is None:  # only the dataset's longest prompt is known
        return (f"Long sample, most likely: step {v.step} ran out of memory, and the dataset holds prompts of up to "
                f"{v.prompt_tokens} tokens, longer than any of the steps before (usually {v.usual_tokens}){kept}: "
                "a config that fits the longest sample fits the run.")
    return (f"Long sample: step {v.step} ran out of memory on a batch longer than the usual ({_lengths(v)}, usually "
            f"{v.usual_tokens}){kept}: a config that fits this sample fits the run.")


def _lengths(v: LongSample) -> str:
    if v.prompt_tokens is not None and v.completion_tokens is not None:
        return f"prompt {v.prompt_tokens} + completion {v.completion_tokens} = {v.tokens} tokens"
    if v.completion_tokens is not None:
        return f"a completion of {v.tokens} tokens"
    if v.prompt_tokens is not None:
        return f"a prompt of {v.tokens} tokens"
    return f"{v.tokens} tokens"


__all__ = ["HOST_LEAK_CURE", "LEAK_CURE", "FragmentationGrowth", "Leak", "LongSample", "Trend", "Verdict",
           "describe", "held"]
