"""Late OOMs told apart from a run's memory trace: a leak, a host leak, fragmentation that grows, a long sample.

The three call for different cures. Memory that a run keeps step after step (a reward function that appends to a
list, a cache that grows) runs out whatever the config, later or sooner: only a fix to the code cures it, and a
restart buys time. One long sample late in the data needs the config that fits it. Fragmentation that grows needs
the allocator's settings. :func:`assess` reads the :class:`~oomguard.vocab.trace.MemSample` of one process (one
attempt: a restart empties a leak, so traces are never joined across processes) and returns a :class:`Trend`, whose
verdicts are frozen dataclasses with their numbers; :func:`describe` is the one place they become sentences.

**Settling.** The first :data:`SETTLE` samples are left out: step 1 allocates the optimizer's state (its kept memory
jumps by it, and its peak holds the state being created), and step 2 is the first to start from that state, but it
still meets what a run allocates once (the first save, the first log, lazily built caches). From the third step on a
step is like the next. A warm-up that settles more slowly is told apart by persistence (below).

**Leak.** Kept memory (allocated at a step's end) that grows step after step, persistently, over the whole trace or
its most recent half or quarter (a leak may start late). All of these must hold in the window:

- the rise of kept memory (the median of the window's last third less that of its first third) is at least the
  growth floor (:func:`growth_floor`: 1 MiB, or 1/400 of the device), and so is that of the peak where peaks are
  known: a leak raises every later step's peak, so **a run whose peak stays within the floor is never a leak**;
- both halves of the window rise by at least half the floor, and the later half's slope is at least a third of the
  earlier half's: a warm-up that settles does not persist;
- most pairs of steps rise (Kendall's tau at least :data:`MIN_TAU`): noise does not.

The rate is the Theil–Sen slope (the median of the slopes between every two samples, so that a few outliers move it
little), and the device runs out at the latest at the step where the recent peak plus the rate times the steps to
come reaches the device: sooner where the allocator's cache is fragmented (a real run of the tests' tiny model on a
160 MiB simulated device, leaking 6 MiB a step, was projected full by step 15 and ran out at step 12, its peak at 146
MiB). The same rules on host RSS against the host's limit give a host leak.

**Fragmentation growth.** What the allocator reserves beyond the step's peak (``reserved - peak``) grows by the same
rules while the kept memory does not leak: the same work needs more and more cached memory.

**Long sample.** A step whose peak rises above the usual peak (the median) by the floor and a fifth of the usual
transient (``peak - kept``), while its kept memory stays at the usual, and whose longest prompt plus completion is at
least a tenth longer than usual (where the trace has lengths; without them it is named a long sample with that said).

>>> from oomguard.vocab.trace import MemSample
>>> MiB = 1 << 20
>>> leak = [MemSample(s, kept=64 * MiB + 6 * MiB * s, peak=90 * MiB + 6 * MiB * s) for s in range(1, 13)]
>>> t = assess(leak, capacity=200 * MiB)
>>> v = t.leak
>>> round(v.rate / MiB, 1), v.runs_out_at
(6.0, 19)
>>> describe(v)
'Leak: the memory kept at the end of each step grew by 6.00 MiB per step from step 3 to step 12 (from 82.00 MiB to 136.00 MiB), step after step; the peak rose with it. At that rate the device (200.00 MiB) is full by step 19 at the latest. Only a fix to the code that keeps the memory cures this; a smaller config only delays it.'
>>> flat = [MemSample(s, kept=64 * MiB, peak=90 * MiB + (40 * MiB if s == 9 else 0), completion_tokens=64 if s == 9
...       else 32) for s in range(1, 13)]
>>> [describe(v) for v in assess(flat, capacity=160 * MiB).verdicts]
['Long sample: step 9 peaked at 130.00 MiB, 40.00 MiB above the usual 90.00 MiB, with its lengths (a completion of 64 tokens, usually 32), while the memory kept between steps stayed at 64.00 MiB: a config that fits this step fits the run.']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from ..vocab.sizes import MiB, format_size
from ..vocab.trace import Holder, MemSample

SETTLE = 2  # samples left out at the start of a trace (see the module's docstring)
MIN_SAMPLES = 6  # settled samples a verdict on growth needs
MIN_TAU = 0.5  # Kendall's tau of a growth: most pairs of steps rise
MAX_POINTS = 96  # a window is thinned to this many samples (Theil-Sen compares every pair)
FLOOR_BYTES = 1 * MiB  # the least growth a verdict names, on a device
FLOOR_SHARE = 1 / 400  # ... or this share of the device (or host limit), where it is known
HOST_FLOOR_BYTES = 16 * MiB  # host RSS moves by more (the Python heap, malloc's arenas)
LONG_PEAK_SHARE = 0.2  # a long sample's peak rises above the usual by at least this share of the usual transient
LONG_TOKEN_SHARE = 0.1  # ... and its lengths are at least this share longer than usual
MAX_LONG = 3  # long samples named, the largest first


def growth_floor(limit: int | None, level: float | None = None, *, least: int = FLOOR_BYTES) -> int:
    """The least growth over a window that a verdict names: ``least``, or 1/400 of the device (host limit) where it
    is known, else 1/200 of the series' own level.

    >>> growth_floor(80 << 30) == 80 * (1 << 30) // 400, growth_floor(None, 50 << 20), growth_floor(64 << 20)
    (True, 1048576, 1048576)
    """
    if limit:
        return max(least, int(limit * FLOOR_SHARE))
    return max(least, int((level or 0) / 200))


# --------------------------------------------------------------------------------------------------------------
# Robust statistics


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of the slopes between every two points (0.0 with fewer than two distinct x).

    >>> theil_sen([1, 2, 3, 4, 5], [0, 6, 12, 18, 100])
    6.0
    """
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    return float(median(slopes)) if slopes else 0.0


def kendall_tau(ys: Sequence[float]) -> float:
    """(rising pairs - falling pairs) / all pairs, in order: 1.0 for a series that only rises, about 0 for noise.

    >>> round(kendall_tau([1, 2, 3, 3]), 3), round(kendall_tau([3, 1, 2]), 3)
    (0.833, -0.333)
    """
    n = len(ys)
    pairs = n * (n - 1) // 2
    if not pairs:
        return 0.0
    s = sum((ys[j] > ys[i]) - (ys[j] < ys[i]) for i in range(n) for j in range(i + 1, n))
    return s / pairs


def rise(ys: Sequence[float]) -> float:
    """The median of the last third less the median of the first third: how much a series rose, robust to a spike,
    and never more than its range.

    >>> rise([10, 11, 10, 50, 12, 13])
    2.0
    """
    k = max(1, len(ys) // 3)
    return float(median(ys[-k:]) - median(ys[:k]))


def _thin(items: Sequence[Any], most: int = MAX_POINTS) -> list[Any]:
    if len(items) <= most:
        return list(items)
    step = (len(items) - 1) / (most - 1)
    return [items[round(i * step)] for i in range(most)]


@dataclass(frozen=True)
class Growth:
    """A series that grows persistently over a window of steps: its slope (per step) and its fitted ends."""

    rate: float
    since: int
    until: int
    start: float
    end: float


def persistent_growth(xs: Sequence[int], ys: Sequence[float], floor: float,
                      follower: Sequence[float] | None = None) -> Growth | None:
    """The growth of ``ys`` over steps ``xs`` if it persists (the module's rules), else None. ``follower``, where
    given, must rise by the floor too (the peaks, for kept memory).

    >>> persistent_growth(list(range(10)), [100 + 5 * i for i in range(10)], 4).rate
    5.0
    >>> persistent_growth(list(range(10)), [100, 140, 160, 170, 175, 177, 178, 178, 179, 179], 4) is None
    True
    """
    n = len(ys)
    if n < MIN_SAMPLES or rise(ys) < floor:
        return None
    if follower is not None and rise(follower) < floor:
        return None
    if kendall_tau(ys) < MIN_TAU:
        return None
    h = n // 2
    first, second = (xs[: n - h], ys[: n - h]), (xs[h:], ys[h:])  # halves (the middle one in both when n is odd)
    if rise(first[1]) < floor / 2 or rise(second[1]) < floor / 2:
        return None
    s1, s2 = theil_sen(*first), theil_sen(*second)
    if s1 <= 0 or s2 <= 0 or s2 < s1 / 3:
        return None
    rate = theil_sen(xs, ys)
    if rate <= 0:
        return None
    mid = median(y - rate * x for x, y in zip(xs, ys, strict=True))
    return Growth(rate, xs[0], xs[-1], mid + rate * xs[0], mid + rate * xs[-1])


def _windows(samples: Sequence[MemSample]) -> list[list[MemSample]]:
    """The whole trace, its later half and its last quarter (a leak may start late), thinned."""
    n = len(samples)
    out = [_thin(samples)]
    for part in (2, 4):
        if n // part >= MIN_SAMPLES:
            out.append(_thin(samples[n - n // part:]))
    return out


def _first_growth(samples: Sequence[MemSample], value: Callable[[MemSample], int | None], floor: float,
                  follow: Callable[[MemSample], int | None] | None = None) -> Growth | None:
    known = [s for s in samples if value(s) is not None]
    for w in _windows(known):
        followed = [follow(s) for s in w] if follow is not None else None
        follower = [float(v) for v in followed if v is not None] if followed is not None else None
        if follower is not None and len(follower) < len(w) // 2:
            follower = None  # too few peaks to judge by
        g = persistent_growth([s.step for s in w], [float(value(s) or 0) for s in w], floor, follower)
        if g is not None:
            return g
    return None


# --------------------------------------------------------------------------------------------------------------
# Verdicts


@dataclass(frozen=True)
class Leak:
    """Memory kept step after step (``where``: ``device`` or ``host``), ``rate`` bytes per step from ``since`` to
    ``until`` (fitted ``start`` to ``end``). ``runs_out_at`` is the step at which ``limit`` is reached at that rate
    (``None`` without a limit). ``basis`` is what grew: ``kept`` (allocated at the step's end), ``peak`` (a log
    that shows only peaks: longer sequences would look the same), ``rss`` (the process's host memory) or ``used``
    (the machine's used host memory, where a log gives only that). ``holders`` says where the memory is held,
    where a census found it."""

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

    def _one(self, kind: str) -> Any:
        return next((v for v in self.verdicts if v.kind == kind), None)

    @property
    def leak(self) -> Leak | None:
        return self._one("leak")  # type: ignore[no-any-return]

    @property
    def host_leak(self) -> Leak | None:
        return self._one("host-leak")  # type: ignore[no-any-return]

    @property
    def fragmentation(self) -> FragmentationGrowth | None:
        return self._one("fragmentation-growth")  # type: ignore[no-any-return]

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


def _runs_out(limit: int | None, level: float | None, rate: float, last: int) -> int | None:
    if not limit or level is None or rate <= 0:
        return None
    return last + max(0, math.ceil((limit - level) / rate))


def assess(samples: Sequence[MemSample], *, capacity: int | None = None, host_limit: int | None = None,
           settle: int = SETTLE, host_basis: str = "rss") -> Trend:
    """The verdicts of one process's trace (see the module's docstring for the rules).

    ``capacity`` is the device's size (else the largest the samples carry), ``host_limit`` the host memory the
    process may use (its cgroup's ``memory.max``, else the machine's RAM). ``host_basis`` says what the samples'
    ``host_rss`` is: ``rss`` (the process's own) or ``used`` (the machine's used memory, as verl logs it). Samples
    are taken in step order; a step seen twice keeps its last sample.

    >>> assess([MemSample(s, kept=1 << 30, peak=2 << 30) for s in range(1, 30)]).verdicts
    ()
    """
    by_step = {s.step: s for s in samples}
    ordered = [by_step[k] for k in sorted(by_step)]
    settled = ordered[settle:]
    if capacity is None:
        capacity = max((s.capacity for s in ordered if s.capacity), default=None)
    verdicts: list[Verdict] = []
    if settled:
        verdicts.extend(_leaks(settled, capacity, host_limit, host_basis))
        frag = _fragmentation(settled, capacity, any(v.kind == "leak" for v in verdicts))
        if frag is not None:
            verdicts.append(frag)
        verdicts.extend(_long_samples(settled, capacity))
    return Trend(tuple(verdicts), len(settled), len(ordered) - len(settled), settled[0].step if settled else None,
                 settled[-1].step if settled else None)


def _leaks(settled: Sequence[MemSample], capacity: int | None, host_limit: int | None,
           host_basis: str) -> list[Leak]:
    out = []
    kept_known = any(s.kept is not None for s in settled)
    basis = "kept" if kept_known else "peak"
    levels = [s.kept if kept_known else s.peak for s in settled]
    level = median([v for v in levels if v is not None]) if any(v is not None for v in levels) else None
    floor = growth_floor(capacity, level)
    g = _first_growth(settled, (lambda s: s.kept) if kept_known else (lambda s: s.peak), floor,
                      (lambda s: s.peak) if kept_known else None)
    if g is not None:
        window = [s for s in settled if g.since <= s.step <= g.until]
        recent = window[len(window) - max(1, len(window) // 3):]
        peaks = [s.peak for s in recent if s.peak is not None]
        top = float(max(peaks)) if peaks else g.end
        out.append(Leak("device", g.rate, g.since, g.until, round(g.start), round(g.end), capacity,
                        _runs_out(capacity, top, g.rate, g.until), basis))
    rss = [s.host_rss for s in settled if s.host_rss is not None]
    if rss:
        h = _first_growth(settled, lambda s: s.host_rss, growth_floor(host_limit, median(rss), least=HOST_FLOOR_BYTES))
        if h is not None:
            out.append(Leak("host", h.rate, h.since, h.until, round(h.start), round(h.end), host_limit,
                            _runs_out(host_limit, h.end, h.rate, h.until), host_basis))
    return out


def _slack(s: MemSample) -> int | None:
    if s.reserved is None:
        return None
    base = s.peak if s.peak is not None else s.kept
    return None if base is None else s.reserved - base


def _fragmentation(settled: Sequence[MemSample], capacity: int | None, leaking: bool) -> FragmentationGrowth | None:
    if leaking:
        return None
    reserved = [s.reserved for s in settled if s.reserved is not None]
    if not reserved:
        return None
    g = _first_growth(settled, _slack, growth_floor(capacity, median(reserved)))
    if g is None:
        return None
    last = reserved[-1]
    return FragmentationGrowth(g.rate, g.since, g.until, round(g.start), round(g.end), last, capacity,
                               _runs_out(capacity, last, g.rate, g.until))


def _long_samples(settled: Sequence[MemSample], capacity: int | None) -> list[LongSample]:
    withpeak = [s for s in settled if s.peak is not None]
    if len(withpeak) < 3:
        return []
    usual_peak = median(s.peak for s in withpeak if s.peak is not None)
    transients = [s.transient for s in withpeak if s.transient is not None]
    usual_transient = median(transients) if transients else 0
    kept = [s.kept for s in withpeak if s.kept is not None]
    usual_kept = median(kept) if kept else None
    floor = growth_floor(capacity, usual_peak)
    tokens = [s.tokens for s in withpeak if s.tokens is not None]
    usual_tokens = median(tokens) if tokens else None
    found = []
    for s in withpeak:
        assert s.peak is not None
        if s.peak - usual_peak < max(floor, LONG_PEAK_SHARE * usual_transient):
            continue
        if usual_kept is not None and s.kept is not None and s.kept - usual_kept >= floor:
            continue  # it kept more too: not a passing sample
        if usual_tokens is not None and (s.tokens is None or s.tokens < (1 + LONG_TOKEN_SHARE) * usual_tokens):
            continue  # its lengths are the usual: the jump is something else (a save, an evaluation)
        found.append(LongSample(s.step, s.peak, round(usual_peak), s.kept, s.tokens,
                                round(usual_tokens) if usual_tokens is not None else None, s.prompt_tokens,
                                s.completion_tokens))
    found.sort(key=lambda v: -v.peak)
    return found[:MAX_LONG]


# --------------------------------------------------------------------------------------------------------------
# Words: the one place verdicts become sentences


LEAK_CURE = "Only a fix to the code that keeps the memory cures this; a smaller config only delays it."
HOST_LEAK_CURE = ("Only a fix to the code that keeps it (a cache in a reward function or a dataset held in memory) "
                  "cures this; a smaller GPU config does not.")


def _holders(holders: Sequence[Holder]) -> str:
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
        if v.runs_out_at is not None and v.limit:
            out += f" At that rate {limit} ({format_size(v.limit)}) is full by step {v.runs_out_at} at the latest."
        return out + _holders(v.holders) + " " + cure
    if isinstance(v, FragmentationGrowth):
        out = (f"Fragmentation growing: the memory the allocator reserves beyond each step's peak grew by "
               f"{format_size(v.rate)} per step from step {v.since} to step {v.until} (from {format_size(v.start)} "
               f"to {format_size(v.end)}) while the memory kept between steps did not grow")
        if v.runs_out_at is not None and v.capacity:
            out += (f"; at that rate the reserved memory ({format_size(v.reserved)} now) fills the device "
                    f"({format_size(v.capacity)}) from step {v.runs_out_at}")
        return out + ". The allocator's settings (expandable segments) cure this, not a smaller config."
    if v.tokens is not None and v.usual_tokens is not None:
        with_lengths = f", with its lengths ({_lengths(v)}, usually {v.usual_tokens})"
    else:
        with_lengths = " (the trace has no lengths: a long sample, most likely)"
    kept = (f", while the memory kept between steps stayed at {format_size(v.kept)}" if v.kept is not None
            else "")
    return (f"Long sample: step {v.step} peaked at {format_size(v.peak)}, {format_size(v.peak - v.usual_peak)} "
            f"above the usual {format_size(v.usual_peak)}{with_lengths}{kept}: a config that fits this step fits "
            "the run.")


def _lengths(v: LongSample) -> str:
    if v.prompt_tokens is not None and v.completion_tokens is not None:
        return f"prompt {v.prompt_tokens} + completion {v.completion_tokens} = {v.tokens} tokens"
    if v.completion_tokens is not None:
        return f"a completion of {v.tokens} tokens"
    if v.prompt_tokens is not None:
        return f"a prompt of {v.tokens} tokens"
    return f"{v.tokens} tokens"
