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
- most pairs of steps rise (Kendall's tau at least :data:`MIN_TAU`): noise does not;
- the growth persists beyond its own time constant. A warm-up (lazily made optimizer state, caches sized by the
  largest batch so far) rises as ``A (1 - exp(-step / tau))``: its rate falls by ``e`` every ``tau`` steps, and a leak's
  does not. Where the whole trace's later half rises at less than half the rate of its earlier half (:data:`LINEAR`:
  a leak's noise keeps it above that), the trace is read as a warm-up of the time constant that fall implies, and only
  the steps after the point where such a warm-up has less than half the floor left to rise are judged
  (:func:`settled_from`). A warm-up still settling when the window ends has then too few steps left to be judged: no
  verdict until the trace is longer, whatever its amplitude.

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
from dataclasses import dataclass
from itertools import pairwise
from statistics import median
from typing import Any

from ..vocab.sizes import MiB
from ..vocab.trace import MemSample
from .trendwords import FragmentationGrowth, Leak, LongSample, Trend, Verdict, describe

SETTLE = 2  # samples left out at the start of a trace (see the module's docstring)
MIN_SAMPLES = 6  # settled samples a verdict on growth needs
# at an OOM that the growth itself foretold (:func:`at_oom`), fewer will do, if every step rose
MIN_SAMPLES_AT_OOM = 4
FORETOLD_EARLY = 3  # an OOM this many steps before the growth's projection still confirms it (fragmentation)
MIN_TAU = 0.5  # Kendall's tau of a growth: most pairs of steps rise
# A growth whose later half rises at less than this share of its earlier half's rate slows as a warm-up does
# (:func:`settled_from`). Noise of a quarter of the rate on each sample keeps a steady leak's share at 0.6 or more
# over 6 samples (0.65 over 8, more over more: tests/test_trend.py), so a leak is never read as a warm-up.
LINEAR = 1 / 2
# ... and at an OOM that a young growth foretold (4 or 5 settled steps, no noise allowed: every step must rise), a
# warm-up of a time constant up to 5 steps falls below this share; a leak's steady rate does not
YOUNG_LINEAR = 2 / 3
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
    # halves (the middle one in both when n is odd)
    if rise(ys[: n - h]) < floor / 2 or rise(ys[h:]) < floor / 2:
        return None
    s1, s2, _, _ = _halves(xs, ys)
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


def _halves(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float, float]:
    """The Theil–Sen slopes of a series' two halves and their middle steps (the middle sample in both when odd)."""
    n, h = len(ys), len(ys) // 2
    first, second = (xs[: n - h], ys[: n - h]), (xs[h:], ys[h:])
    return theil_sen(*first), theil_sen(*second), float(median(first[0])), float(median(second[0]))


def settled_from(xs: Sequence[int], ys: Sequence[float], floor: float) -> float:
    """The step from which a growth, read as a warm-up, has less than half the floor left to rise: the first step
    where its rate did not fall (a leak, or no growth at all).

    The later half's rate ``s2`` against the earlier half's ``s1``, their middles ``d`` steps apart, gives the time
    constant of a warm-up that slows so: ``tau = d / ln(s1 / s2)``. From the later middle such a warm-up still rises by
    ``s2 * tau``; it is within ``floor / 2`` of its level ``tau * ln(2 s2 tau / floor)`` steps later.

    >>> import math
    >>> xs = list(range(3, 21))
    >>> warm = [100 * (1 - math.exp(-x / 3)) for x in xs]  # a warm-up of 100 with a time constant of 3 steps
    >>> round(settled_from(xs, warm, 1.0), 1)  # exactly: 100 e^(-x/3) < 0.5 from x = 3 ln 200 = 15.9
    16.2
    >>> settled_from(xs, [5.0 * x for x in xs], 1.0)  # a steady rise: judged whole
    3
    """
    if len(ys) < MIN_SAMPLES:
        return xs[0]
    s1, s2, c1, c2 = _halves(xs, ys)
    if s1 <= 0 or s2 >= LINEAR * s1:
        return xs[0]
    if s2 <= 0:
        return c2  # the later half no longer rises: what comes after its middle is judged by itself
    tau = (c2 - c1) / math.log(s1 / s2)
    left = s2 * tau
    return c2 + tau * math.log(2 * left / floor) if left > floor / 2 else c2


def _first_growth(samples: Sequence[MemSample], value: Callable[[MemSample], int | None], floor: float,
                  follow: Callable[[MemSample], int | None] | None = None) -> Growth | None:
    known = [s for s in samples if value(s) is not None]
    whole = _thin(known)
    if whole:  # a warm-up seen over the whole trace: only what comes after it has settled is judged
        since = settled_from([s.step for s in whole], [float(value(s) or 0) for s in whole], floor)
        known = [s for s in known if s.step >= since]
    for w in _windows(known):
        followed = [follow(s) for s in w] if follow is not None else None
        follower = [float(v) for v in followed if v is not None] if followed is not None else None
        if follower is not None and len(follower) < len(w) // 2:
            follower = None  # too few peaks to judge by
        g = persistent_growth([s.step for s in w], [float(value(s) or 0) for s in w], floor, follower)
        if g is not None:
            return g
    return None


def at_oom(samples: Sequence[MemSample], *, step: int | None, capacity: int | None = None,
           host_limit: int | None = None, prompt_tokens: int | None = None, completion_tokens: int | None = None,
           dataset_prompt_max: int | None = None) -> Trend:
    """What one process's trace says of its OOM at ``step``: :func:`assess`'s verdicts, and a long sample at the
    step that ran out where nothing grew (no leak) and its lengths (the crash record's: ``prompt_tokens``,
    ``completion_tokens``) are a tenth above the usual; else (no widths, or the step before's: an OOM while
    generating), where the dataset's longest prompt (``dataset_prompt_max``) is a tenth above any prompt the steps
    before trained on.

    >>> MiB = 1 << 20
    >>> flat = [MemSample(s, kept=64 * MiB, peak=90 * MiB, prompt_tokens=20, completion_tokens=32) for s in range(1, 12)]
    >>> at_oom(flat, step=12, prompt_tokens=160, completion_tokens=32).long_samples[0].tokens
    192
    >>> at_oom(flat, step=12, prompt_tokens=20, completion_tokens=32).verdicts
    ()
    """
    trend = assess(samples, capacity=capacity, host_limit=host_limit)
    if trend.leak is not None or trend.host_leak is not None or step is None:
        return trend
    settled = sorted(samples, key=lambda s: s.step)[SETTLE:]
    short = _foretold_leak(settled, capacity or max((s.capacity for s in samples if s.capacity), default=None), step)
    if short is not None:
        return Trend((short, *(v for v in trend.verdicts if not isinstance(v, FragmentationGrowth))), trend.used,
                     trend.skipped, trend.first_step, trend.last_step)
    kept = [s.kept for s in settled if s.kept is not None]
    usual_kept = round(median(kept)) if kept else None
    tokens = [s.tokens for s in settled if s.tokens is not None]
    usual = median(tokens) if tokens else None
    long = None
    if prompt_tokens is not None or completion_tokens is not None:
        total = (prompt_tokens or 0) + (completion_tokens or 0)
        if usual is not None and total >= (1 + LONG_TOKEN_SHARE) * usual:
            long = LongSample(step, 0, 0, usual_kept, total, round(usual), prompt_tokens, completion_tokens,
                              at_oom=True)
    # the batch's widths may be the step before's (an OOM while generating, before the new batch is kept)
    if long is None and dataset_prompt_max is not None:
        seen = [s.prompt_tokens for s in settled if s.prompt_tokens is not None]
        if seen and dataset_prompt_max >= (1 + LONG_TOKEN_SHARE) * max(seen):
            long = LongSample(step, 0, 0, usual_kept, None, round(median(seen)), dataset_prompt_max, None,
                              at_oom=True)
    if long is None:
        return trend
    return Trend((*trend.verdicts, long), trend.used, trend.skipped, trend.first_step, trend.last_step)


def _foretold_leak(settled: Sequence[MemSample], capacity: int | None, step: int) -> Leak | None:
    """A leak too young for :func:`assess` (fewer than :data:`MIN_SAMPLES` settled steps) that the OOM foretells:
    kept memory and peak rose at every step, by the growth floor in all, the later steps as fast as the earlier ones
    (:data:`YOUNG_LINEAR`: a warm-up of a few steps' time constant slows), and the recent peak plus the rate reaches
    the device by the step that ran out (a step later at most, or up to :data:`FORETOLD_EARLY` steps sooner: the
    allocator's cache fragments as the kept memory grows). A run whose device is smaller than its leak's first
    steps need runs out before a full trace exists; this is its verdict, ``young``: a restart with the same config
    confirms it by getting further and growing again (``oomguard.decide.conductor``), else the shortfall stands.

    >>> MiB = 1 << 20
    >>> leak = [MemSample(s, kept=40 * MiB + 6 * MiB * s, peak=64 * MiB + 6 * MiB * s) for s in range(1, 8)]
    >>> round(at_oom(leak, step=8, capacity=112 * MiB).leak.rate / MiB, 1)
    6.0
    >>> at_oom(leak, step=8, capacity=200 * MiB).leak is None   # the growth does not explain this OOM
    True
    """
    if not capacity:
        return None
    rows = [s for s in settled if s.kept is not None and s.peak is not None]
    if not MIN_SAMPLES_AT_OOM <= len(rows) < MIN_SAMPLES or rows[-1].step + 1 < step:
        return None
    kept = [float(s.kept or 0) for s in rows]
    peaks = [float(s.peak or 0) for s in rows]
    floor = growth_floor(capacity, median(kept))
    if any(b <= a for a, b in pairwise(kept)) or kept[-1] - kept[0] < floor:
        return None
    if peaks[-1] - peaks[0] < floor:
        return None
    xs = [s.step for s in rows]
    s1, s2, _, _ = _halves(xs, kept)
    if s2 < YOUNG_LINEAR * s1:
        return None  # it slows as a warm-up does (a time constant of a few steps): the shortfall stands
    rate = theil_sen(xs, kept)
    if rate <= 0:
        return None
    full = _runs_out(capacity, max(peaks[-2:]), rate, xs[-1])
    if full is None or not full - FORETOLD_EARLY <= step <= full + 1:
        return None
    mid = median(y - rate * x for x, y in zip(xs, kept, strict=True))
    return Leak("device", rate, xs[0], xs[-1], round(mid + rate * xs[0]), round(mid + rate * xs[-1]), capacity, full,
                "kept", young=True)


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


__all__ = ["FragmentationGrowth", "Leak", "LongSample", "Trend", "Verdict", "assess", "at_oom", "describe", "growth_floor",
           "kendall_tau", "persistent_growth", "rise", "theil_sen"]
