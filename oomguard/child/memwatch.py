"""The training process's watch over its memory trace: a sample per step, the trend now and then, and a census of
where a leak is held once the trend says "leak".

:class:`MemWatch` joins :class:`~oomguard.child.trace.StepTracer` (the samples), :func:`oomguard.oom.trend.assess` (the
verdicts, every :data:`CHECK_EVERY` steps: a few milliseconds at most) and :class:`~oomguard.child.census.Census` (two
tallies :data:`CENSUS_GAP` steps apart, started at the first leak verdict and taken once per process). Its
:meth:`~MemWatch.step_end` returns the events to send (``oomguard.vocab.events``):

- ``MemSampled`` at every step: the sample (:class:`oomguard.vocab.trace.MemSample`'s fields);
- ``MemTrend`` when the verdicts change (a leak appears, its projected step moves by more than a tenth, ...): the
  :class:`~oomguard.oom.trend.Trend` as a dict, each verdict with its sentence, for a live warning;
- ``MemHolders`` once the census is done: the holders that grew (:class:`oomguard.vocab.trace.Holder` dicts) and the
  leak's sentence with them.

>>> import torch, sys, types
>>> from oomguard.child import simulate
>>> _ = simulate.start(512 << 20)
>>> mod = types.ModuleType("my_rewards"); mod.CACHE = []; sys.modules["my_rewards"] = mod
>>> watch = MemWatch(check_every=1)
>>> sent = []
>>> for step in range(1, 14):
...     watch.step_begin()
...     mod.CACHE.append(torch.ones(3 << 20 >> 1))  # 6 MiB kept a step
...     sent += watch.step_end(step)
>>> [e.name for e in sent if e.name != "mem"]
['mem_trend', 'mem_holders']
>>> holders = [h["name"] for e in sent if isinstance(e, MemHolders) for h in e.holders]
>>> any("<doctest" in h for h in holders), "list `CACHE` of module `my_rewards`" in holders
(True, True)
>>> simulate.stop(); del sys.modules["my_rewards"]
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..oom.trend import Leak, Trend, assess, describe
from ..vocab.events import Event, MemHolders, MemSampled, MemTrend
from ..vocab.trace import MemSample
from .census import Census
from .runtime import Runtime
from .trace import StepTracer

CHECK_EVERY = 4  # steps between two looks at the trend
CENSUS_GAP = 2  # steps between the census's two tallies
MAX_KEPT = 4096  # samples kept; beyond, the older half is thinned (a slow leak shows over the whole run)


class MemWatch:
    """One per training process (see the module's docstring). ``host_limit``: the host memory this process may use,
    where the caller knows it (the cgroup's limit); ``capacity`` overrides the device's size the samples carry."""

    def __init__(self, rt: Runtime | None = None, *, capacity: int | None = None, host_limit: int | None = None,
                 check_every: int = CHECK_EVERY, census_gap: int = CENSUS_GAP, reset_peak: bool = True,
                 census_after: int | None = None) -> None:
        self.tracer = StepTracer(rt, reset_peak=reset_peak)
        self.capacity = capacity
        self.host_limit = host_limit
        self.check_every = max(1, check_every)
        self.census_gap = max(1, census_gap)
        # take the census after this many samples whatever the trend says (a run the supervisor knows leaks)
        self.census_after = census_after
        self.samples: list[MemSample] = []
        self.trend: Trend | None = None
        self._said: tuple[Any, ...] = ()
        self._census: Census | None = None
        self._census_at: int | None = None  # the step of the first tally
        self._census_done = False

    def step_begin(self) -> None:
        self.tracer.step_begin()

    def step_end(self, step: int, trainer: Any = None) -> list[Event]:
        """The events of the step that just ended (``state.global_step``)."""
        fields = self.tracer.sample(step, trainer)
        out: list[Event] = [MemSampled(**fields)]
        sample = MemSample.from_event(fields)
        if sample is not None:
            self._keep(sample)
        out.extend(self._census_step(step))
        if self.census_after is not None and len(self.samples) >= self.census_after:
            self._start_census(step)
        if len(self.samples) % self.check_every == 0:
            self.trend = assess(self.samples, capacity=self.capacity, host_limit=self.host_limit)
            said = _gist(self.trend)
            if said != self._said:
                self._said = said
                out.append(MemTrend(trend=self.trend.to_dict()))
            if self.trend.leak is not None:
                self._start_census(step)
        return out

    def _start_census(self, step: int) -> None:
        if self._census is None and not self._census_done:
            self._census = Census()
            self._census.start()
            self._census_at = step + 1

    def _census_step(self, step: int) -> list[Event]:
        if self._census is None or self._census_at is None:
            return []
        if step == self._census_at:
            self._census.take(step)
            return []
        if step < self._census_at + self.census_gap:
            return []
        holders = self._census.take(step)
        self._census.stop()
        self._census, self._census_done = None, True
        leak = self.trend.leak if self.trend is not None else None
        evidence = describe(replace(leak, holders=holders)) if isinstance(leak, Leak) else None
        return [MemHolders(since=self._census_at, until=step, holders=[h.to_dict() for h in holders],
                           evidence=evidence)]

    def _keep(self, sample: MemSample) -> None:
        self.samples.append(sample)
        if len(self.samples) > MAX_KEPT:
            half = len(self.samples) // 2
            self.samples = self.samples[:half:2] + self.samples[half:]


def _gist(t: Trend) -> tuple[Any, ...]:
    """What a trend says, coarsely enough that a new event means news: the verdicts' kinds, and a leak's projected
    step to a tenth of the steps left."""
    out: list[Any] = []
    for v in t.verdicts:
        if isinstance(v, Leak) and v.runs_out_at is not None:
            left = max(1, v.runs_out_at - v.until)
            out.append((v.kind, round(v.runs_out_at / max(1, left // 10 or 1))))
        elif v.kind == "long-sample":
            out.append((v.kind, getattr(v, "step", None)))
        else:
            out.append((v.kind,))
    return tuple(out)
