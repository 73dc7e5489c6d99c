"""Where a leak's memory is held: the allocation sites and the Python objects that grew between two steps.

A census is not free, so the training process takes one only when the trend says "leak" (:mod:`oomguard.oom.trend`):
:meth:`Census.start` at a step's end, :meth:`Census.take` at a later step's end (the first tally), and again a few
steps later: the second call returns the :class:`~oomguard.vocab.trace.Holder` records that grew in between, and
:meth:`Census.stop` ends it.

- **Sites**: the code line that allocated what stayed. On CUDA, from two memory snapshots
  (``torch.cuda.memory._snapshot()``, with ``_record_memory_history(enabled="state")`` on from :meth:`start`: stacks of
  live blocks only, no event trace); on the simulated device, from the site it records for each storage while a
  census runs. What was allocated before :meth:`start` has no site. A recording the user started is the user's: the
  census reads its snapshots as they are (with the stacks the user's settings keep) and never changes or stops it;
  where torch cannot say whether one is on (``torch._C._cuda_isHistoryEnabled``, what torch's own inductor asks), the
  census records nothing and names objects only.
- **Objects**: the Python containers (a list, a dict, an object's attribute, a module's global) that hold tensors
  that appeared between the two tallies and stayed, found with ``gc.get_referrers`` over the largest of those tensors
  (at most :data:`MAX_NEW`) and named by who holds them in turn. A container counts only if it also held tensors at the
  first tally: one that only holds new tensors was made anew (TRL's batch of the step), not grown. Works on any
  device, plain CPU included.

Cost, paid twice per census: a scan of the garbage collector's objects for tensors (a fraction of a second in a
training process), a memory snapshot on CUDA, and one ``gc.get_referrers`` pass.

>>> import torch, sys, types
>>> from oomguard.child import simulate
>>> _ = simulate.start(256 << 20)
>>> mod = types.ModuleType("my_rewards"); mod.CACHE = []; sys.modules["my_rewards"] = mod
>>> def leaky_reward(): mod.CACHE.append(torch.ones(1 << 20))  # 4 MiB a call
>>> leaky_reward()
>>> census = Census(); census.start(); leaky_reward(); census.take(1)
()
>>> for _ in range(3): leaky_reward()
>>> [(h.kind, h.name.split(" in ")[-1] if h.kind == "site" else h.name, h.grown >> 20, h.count)
...  for h in census.take(4)]
[('site', 'leaky_reward', 12, 3), ('object', 'list `CACHE` of module `my_rewards`', 12, 3)]
>>> census.stop(); simulate.stop(); del sys.modules["my_rewards"]
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from typing import Any

from ..oom.snapshot import grown, site_totals
from ..vocab.sizes import MiB
from ..vocab.trace import Holder

MAX_NEW = 64  # the largest new tensors whose holders are looked up (gc.get_referrers scans the whole heap once)
LEAST = 1 * MiB  # the least growth a holder is named for
_CONTAINERS = (list, tuple, dict, set, frozenset)


class Census:
    """Two tallies of live memory and what grew between them (see the module's docstring)."""

    def __init__(self, *, least: int = LEAST) -> None:
        self.least = least
        self._first: _Tally | None = None
        self._cuda_history = False  # sites come from CUDA's memory snapshots
        self._ours = False  # ... from a recording the census started (and stops), not the user's

    def start(self) -> None:
        """Begin recording the site of each allocation (the simulated device, or CUDA's memory history: the user's
        own recording where one is on, else one of the census's own)."""
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            dev.record_sites(True)
            return
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        recording = history_on(torch)
        if recording is None:
            return  # cannot tell: the user's recording, if any, is left as it is
        self._cuda_history = True
        if recording:
            return
        try:
            torch.cuda.memory._record_memory_history(enabled="state", context="alloc", stacks="python")
            self._ours = True
        except (RuntimeError, TypeError, AttributeError):
            self._cuda_history = False

    def stop(self) -> None:
        """Stop recording sites (a recording the census started; never the user's) and forget the tallies."""
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            dev.record_sites(False)
        if self._ours:
            torch = sys.modules.get("torch")
            if torch is not None:
                try:
                    torch.cuda.memory._record_memory_history(enabled=None)
                except (RuntimeError, TypeError, AttributeError):
                    pass
        self._cuda_history = self._ours = False
        self._first = None

    def take(self, step: int) -> tuple[Holder, ...]:
        """Tally live memory at ``step``'s end. The first call returns nothing; the next returns what grew since
        the first (sites first, then objects), and becomes the first for a call after it."""
        tally = _Tally(step, self._sites(), _live_storages())
        first, self._first = self._first, tally
        if first is None:
            return ()
        sites = grown("site", first.sites, tally.sites, least=self.least, since=first.step, until=step)
        objects = _grown_objects(first, self.least, first.step, step)
        tally.storages = _live_storages()  # what the objects' search kept alive is gone again
        return sites + objects

    def _sites(self) -> dict[str, tuple[int, int]]:
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            return dev.sites()
        if self._cuda_history:
            torch = sys.modules.get("torch")
            try:
                return site_totals(torch.cuda.memory._snapshot()) if torch is not None else {}
            except (RuntimeError, AttributeError):
                return {}
        return {}


def history_on(torch: Any) -> bool | None:
    """Whether CUDA's caching allocator records memory history now (someone called
    ``torch.cuda.memory._record_memory_history``): torch 2.13 has no public getter; ``torch._C._cuda_isHistoryEnabled``
    is what its own inductor asks before it turns recording on and off around CUDA graphs. None where it cannot be
    told (a build without it).

    >>> import types
    >>> history_on(types.SimpleNamespace(_C=types.SimpleNamespace(_cuda_isHistoryEnabled=lambda: True)))
    True
    >>> history_on(types.SimpleNamespace(_C=types.SimpleNamespace())) is None
    True
    """
    ask = getattr(getattr(torch, "_C", None), "_cuda_isHistoryEnabled", None)
    if ask is None:
        return None
    try:
        return bool(ask())
    except (RuntimeError, TypeError):
        return None


class _Tally:
    def __init__(self, step: int, sites: dict[str, tuple[int, int]], storages: dict[int, Any]) -> None:
        self.step = step
        self.sites = sites
        self.storages = storages  # id(storage) -> a weak reference to it


def _tensors() -> list[Any]:
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    tensor = torch.Tensor
    out = []
    for o in gc.get_objects():
        if issubclass(type(o), tensor):
            out.append(o)
    return out


def _storage(t: Any) -> Any:
    try:
        s = t.untyped_storage()
        return s if s.device.type != "meta" else None
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _live_storages() -> dict[int, Any]:
    out: dict[int, Any] = {}
    for t in _tensors():
        s = _storage(t)
        if s is not None and id(s) not in out:
            try:
                out[id(s)] = weakref.ref(s)
            except TypeError:
                continue
    return out


def _existed(s: Any, storages: dict[int, Any]) -> bool:
    ref = storages.get(id(s))
    return ref is not None and ref() is s


def _grown_objects(first: _Tally, least: int, since: int, until: int) -> tuple[Holder, ...]:
    """The containers holding tensors that appeared since ``first`` and stayed, and that held tensors then too."""
    tensor = sys.modules["torch"].Tensor
    size: dict[int, int] = {}  # id(tensor) -> bytes of its storage, for the tensors whose storage is new
    targets: list[Any] = []
    seen_storages: set[int] = set()
    for t in _tensors():
        s = _storage(t)
        if s is None or _existed(s, first.storages) or id(s) in seen_storages:
            continue
        seen_storages.add(id(s))
        size[id(t)] = int(s.nbytes())
        targets.append(t)
    t = s = None
    if not targets:
        return ()
    targets.sort(key=lambda x: -size[id(x)])
    del targets[MAX_NEW:]
    ours = {id(size), id(targets)}
    owners: dict[int, Any] = {}
    for r in gc.get_referrers(*targets):
        if id(r) not in ours and isinstance(r, _CONTAINERS):
            owners[id(r)] = r
    targets.clear()
    totals: dict[str, tuple[int, int]] = {}
    for owner in owners.values():
        items = list(owner.values()) if isinstance(owner, dict) else list(owner)
        grew, count, held_before = 0, 0, False
        for item in items:
            if id(item) in size:
                grew += size[id(item)]
                count += 1
            elif isinstance(item, tensor):
                st = _storage(item)
                held_before = held_before or (st is not None and _existed(st, first.storages))
        if grew >= least and held_before:
            name = _name(owner, ours | {id(owners), id(items)})
            b, c = totals.get(name, (0, 0))
            totals[name] = (b + grew, c + count)
        items.clear()
    return grown("object", {}, totals, least=least, since=since, until=until)


def _modules() -> dict[int, str]:
    return {id(vars(m)): name for name, m in list(sys.modules.items()) if isinstance(m, types.ModuleType)}


def _name(container: Any, skip: set[int]) -> str:
    """Who holds ``container``: ``list `CACHE` of module `my_rewards```, ``dict `cache` of a `Scorer` object``, or
    the container alone."""
    kind = type(container).__name__
    modules = _modules()
    for holder in gc.get_referrers(container):
        if id(holder) in skip or isinstance(holder, types.FrameType):
            continue
        if isinstance(holder, dict):
            key = next((k for k, v in holder.items() if v is container), None)
            if key is None:
                continue
            if id(holder) in modules:
                name = modules[id(holder)]
                where = getattr(sys.modules.get(name), "__file__", None)
                return f"{kind} `{key}` of module `{name}`" + (f" ({where})" if name == "__main__" and where else "")
            for obj in gc.get_referrers(holder):
                if getattr(obj, "__dict__", None) is holder:
                    return f"{kind} `{key}` of a `{type(obj).__name__}` object"
            return f"{kind} under the key `{key}` of a dict"
        if isinstance(holder, types.CellType):
            for fn in gc.get_referrers(holder):
                if isinstance(fn, tuple):
                    for f in gc.get_referrers(fn):
                        if isinstance(f, types.FunctionType) and f.__closure__ is fn:
                            return f"{kind} in a closure variable of `{f.__qualname__}`"
    return f"a {kind} of {len(container)} items"
