"""The simulated device: a memory budget on CPU that raises real ``torch.OutOfMemoryError``s.

It is a rehearsal and test device, never passed off as a GPU. A ``TorchDispatchMode`` sees every tensor an operator
creates; each new storage is placed by :class:`oomguard.memory.allocmodel.AllocatorModel` (the pure, torch-free model
of PyTorch's CUDA caching allocator: block rounding, segments, expandable granules, reserved versus allocated), and
a weak reference frees its block when the storage dies. So "allocated" is the real live tensor memory of this process,
rounded as the CUDA allocator rounds it, and "reserved" follows the caching allocator's segment rules. When the model
cannot place a storage, this module raises ``torch.OutOfMemoryError`` with the allocator's exact message format.
The allocator settings (``expandable_segments``, ``max_split_size_mb``) are read from the variable torch reads
(:mod:`oomguard.vocab.allocconf`).

Storages that exist before the mode starts (or that a loader maps straight from a file) are adopted with
:meth:`SimulatedDevice.adopt`. ``OOMGUARD_SIMULATE_TRACE=PATH`` records every allocation and free, for
``bench/min_budget.py`` to replay (``bench/_trace.py``).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from ..memory.allocmodel import AllocatorModel, Block
from ..vocab import allocconf
from ..vocab.sizes import format_size

TRACE_ENV = "OOMGUARD_SIMULATE_TRACE"
CONTEXT_ENV = "OOMGUARD_SIMULATE_CONTEXT"
SIMULATED_TAG = "  [oomguard simulated device: a memory budget on CPU, not a real GPU]"
def expandable_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether the allocator settings torch reads turn expandable segments on (see :mod:`oomguard.vocab.allocconf`)."""
    return allocconf.expandable(os.environ if env is None else env)


def max_split_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """``max_split_size_mb`` in bytes, if the allocator settings torch reads set it."""
    return allocconf.max_split_bytes(os.environ if env is None else env)


class SimulatedDevice:
    """A memory budget for this process's tensors, with the caching allocator's behaviour and message."""

    def __init__(self, capacity: int, expandable: bool | None = None, max_split: int | None = None,
                 context: int = 0) -> None:
        self.capacity = int(capacity)
        self.context = int(context)  # held outside the allocator, as a CUDA context is (see allocmodel.context_for)
        self.model = AllocatorModel(self.capacity - self.context,
                                    expandable_from_env() if expandable is None else expandable,
                                    max_split if max_split is not None else max_split_from_env())
        self._live: dict[int, tuple[Any, Block, int]] = {}
        self._lock = threading.RLock()
        self._mode: Any = None
        self.last_oom: str | None = None
        # A weakref callback can fire while this thread is inside the model (GC runs during any allocation);
        # such frees wait until the model is consistent again.
        self._busy = 0
        self._pending: list[int] = []
        # OOMGUARD_SIMULATE_TRACE=path records every allocation and free, so a run can be replayed through the
        # allocator model at other budgets (bench/min_budget.py) without running it again.
        self._trace: list[tuple[str, int, int]] | None = [] if os.environ.get(TRACE_ENV) else None
        self._ids: dict[int, int] = {}
        self._next_id = 0
        # the code line that allocated each live storage, while a census asks (record_sites): {key: site}
        self._sites: dict[int, str] | None = None
        if self._trace is not None:
            import atexit

            rank = os.environ.get("RANK")
            atexit.register(self.dump_trace, os.environ[TRACE_ENV] + (f".rank{rank}" if rank else ""))

    # -- storage tracking --------------------------------------------------------------------------------------
    def track(self, storage: Any) -> None:
        """Account for a storage; raise torch.OutOfMemoryError if it does not fit."""
        key = id(storage)
        with self._lock:
            entry = self._live.get(key)
            nbytes = storage.nbytes()
            if entry is not None:
                if entry[2] == nbytes:
                    return
                self._release(key)  # resized in place
            if nbytes == 0:
                return
            self._busy += 1
            try:
                block = self.model.malloc(nbytes)
            except MemoryError as e:
                request = int(e.args[0])
            else:
                request = 0
            finally:
                self._busy -= 1
                self._drain()
            if request:
                self._raise_oom(request)
            try:
                ref = weakref.ref(storage, lambda _r: self._release(key))
            except TypeError:
                self.model.free(block)
                return
            self._live[key] = (ref, block, nbytes)
            if self._sites is not None:
                self._sites[key] = allocation_site()
            if self._trace is not None:
                self._ids[key] = self._next_id
                self._trace.append(("a", self._next_id, nbytes))
                self._next_id += 1

    def _release(self, key: int) -> None:
        with self._lock:
            if self._busy:
                self._pending.append(key)
                return
            entry = self._live.pop(key, None)
            if self._sites is not None:
                self._sites.pop(key, None)
            if entry is not None and self._trace is not None and key in self._ids:
                self._trace.append(("f", self._ids.pop(key), 0))
            if entry is not None:
                self._busy += 1
                try:
                    self.model.free(entry[1])
                finally:
                    self._busy -= 1
                    self._drain()

    def _drain(self) -> None:
        while self._pending and not self._busy:
            self._release(self._pending.pop())

    def adopt(self, tensors: Any) -> int:
        """Account for tensors that already exist (model weights loaded before the mode saw them). Returns bytes.

        Weights that do not fit raise ``torch.OutOfMemoryError`` here, as loading them onto a CUDA device would: the
        caller is ``from_pretrained``, so the OOM is one "while loading"."""
        import torch

        before = self.model.allocated
        for t in tensors:
            try:
                if getattr(t, "device", None) is not None and t.device.type == "cpu":
                    self.track(t.untyped_storage())
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError, TypeError):
                continue
        return self.model.allocated - before

    def release_cached(self) -> None:
        with self._lock:
            self.model.release_cached()
            if self._trace is not None:
                self._trace.append(("e", 0, 0))

    def set_max_split(self, nbytes: int | None) -> None:
        """``max_split_size_mb`` in-process; it governs the blocks placed from now on."""
        with self._lock:
            self.model.max_split = nbytes

    def dump_trace(self, path: str) -> None:
        """Write the allocation trace: one line per event, ``a ID BYTES``, ``f ID`` or ``e`` (empty_cache).

        ``bench/_trace.py`` reads it back and replays it through the allocator model."""
        if not self._trace:
            return
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# oomguard simulated-device trace; expandable={int(self.model.expandable)}\n")
            for kind, i, n in self._trace:
                f.write(f"{kind} {i} {n}\n" if kind == "a" else (f"f {i}\n" if kind == "f" else "e\n"))

    def set_expandable(self, on: bool = True) -> None:
        """Switch allocator mode in-process, like ``torch.cuda.memory._set_allocator_settings``: the live blocks
        are placed again under the new mode."""
        with self._lock:
            if self.model.expandable == on:
                return
            model = AllocatorModel(self.capacity - self.context, on, self.model.max_split)
            for key, (ref, _block, nbytes) in list(self._live.items()):
                self._live[key] = (ref, model.malloc(nbytes), nbytes)
            self.model = model

    # -- where memory is held ----------------------------------------------------------------------------------
    def record_sites(self, on: bool = True) -> None:
        """Record the code line that allocates each storage from now on (a census of where memory grows,
        :mod:`oomguard.child.census`); it costs a walk of the Python stack per allocation, so it is on only while a
        census runs. Storages allocated before have no site."""
        with self._lock:
            self._sites = {} if on else None

    def sites(self) -> dict[str, tuple[int, int]]:
        """Live storages by the site that allocated them: ``{site: (bytes, storages)}`` (those recorded)."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for key, site in (self._sites or {}).items():
                entry = self._live.get(key)
                if entry is not None:
                    b, n = out.get(site, (0, 0))
                    out[site] = (b + entry[2], n + 1)
        return out

    def held(self, storage: Any) -> int:
        """The bytes this device counts for ``storage`` (0 where it counts none: a storage made before it started, or
        freed)."""
        entry = self._live.get(id(storage))
        return entry[2] if entry is not None and entry[0]() is storage else 0

    # -- facts -------------------------------------------------------------------------------------------------
    @property
    def peak(self) -> int:
        return self.model.peak_allocated

    def stats(self) -> dict[str, Any]:
        m = self.model
        return {
            "simulated": True,
            "capacity": self.capacity,
            "context": self.context,
            "expandable_segments": m.expandable,
            "allocated_bytes.all.current": m.allocated,
            "allocated_bytes.all.peak": m.peak_allocated,
            "reserved_bytes.all.current": m.reserved,
            "reserved_bytes.all.peak": m.peak_reserved,
            "num_alloc_retries": m.num_alloc_retries,
            "num_ooms": m.num_ooms,
        }

    def reset_peak(self) -> None:
        self.model.peak_allocated = self.model.allocated
        self.model.peak_reserved = self.model.reserved

    def oom_message(self, request: int) -> str:
        m = self.model
        free = max(0, self.capacity - self.context - m.reserved)
        return (
            f"CUDA out of memory. Tried to allocate {format_size(request)}. GPU 0 has a total capacity of "
            f"{format_size(self.capacity)} of which {format_size(free)} is free. Including non-PyTorch memory, this "
            f"process has {format_size(m.reserved + self.context)} memory in use. Of the allocated memory "
            f"{format_size(m.allocated)} "
            f"is allocated by PyTorch, and {format_size(m.reserved - m.allocated)} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)" + SIMULATED_TAG
        )

    def _raise_oom(self, request: int) -> None:
        import torch

        self.last_oom = self.oom_message(request)
        raise torch.OutOfMemoryError(self.last_oom)

    # -- the dispatch mode -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Enter the dispatch mode on this thread for the rest of the process."""
        if self._mode is not None:
            return
        self._mode = self.counting()
        self._mode.__enter__()

    def counting(self) -> Any:
        """A dispatch mode that counts what an operator creates, to enter on a thread (a mode counts on the thread
        that entered it only: :meth:`start` enters one on the main thread, a library's own worker thread enters its
        own, as ``child/stacks/paged.py`` does for transformers' continuous batching)."""
        import torch
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        device = self
        tensor_type = torch.Tensor
        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                out = func(*args, **(kwargs or {}))
                # every output is looked at, views included: a view is where a storage resized outside the
                # dispatcher (DeepSpeed's ZeRO-3 frees and gathers parameters with UntypedStorage.resize_) is seen
                leaves = (out,) if isinstance(out, tensor_type) else tree_flatten(out)[0]
                for t in leaves:
                    if isinstance(t, tensor_type) and t.device.type == "cpu":
                        # a compiler's tracing tensors (Dynamo's fake tensors, AOT autograd's functional wrappers
                        # around them) hold no memory, and their sizes are symbolic: never counted. They are
                        # subclasses; a plain tensor, nearly every one, is checked by its type alone.
                        plain = type(t) is tensor_type
                        if not plain and is_fake(t):
                            continue
                        try:
                            storage = t.untyped_storage()
                        except (RuntimeError, NotImplementedError, TypeError):
                            continue
                        if not plain and not isinstance(storage.nbytes(), int):
                            continue
                        try:
                            device.track(storage)
                        except torch.OutOfMemoryError as e:
                            raise e.with_traceback(None) from None  # the user's frames, not the simulator's
                return out

        return _Count()

    def stop(self) -> None:
        """Leave the dispatch mode (on the thread that started it): tensors are no longer counted."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


_OWN = os.path.dirname(os.path.abspath(__file__))


def _inside(filename: str, roots: tuple[str, ...]) -> bool:
    return filename.startswith(roots) or filename.startswith("<frozen")


def allocation_site() -> str:
    """``file:line in function`` of the innermost frame outside torch and oomguard's training-process side: the
    code that asked for the memory.

    >>> allocation_site().endswith("in <module>")
    True
    """
    import sys

    torch = sys.modules.get("torch")
    roots = (_OWN, os.path.dirname(os.path.abspath(torch.__file__))) if torch is not None and torch.__file__ \
        else (_OWN,)
    f = sys._getframe(1)
    while f is not None and _inside(f.f_code.co_filename, roots):
        f = f.f_back  # type: ignore[assignment]
    if f is None:
        return "(unknown)"
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


_DEVICE: SimulatedDevice | None = None


def device() -> SimulatedDevice | None:
    """The simulated device of this process, if one was started."""
    return _DEVICE


def start(capacity: int, expandable: bool | None = None, context: int = 0) -> SimulatedDevice:
    """Start this process's simulated device (once; later calls return the running one)."""
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = SimulatedDevice(capacity, expandable, context=context)
        _DEVICE.start()
    return _DEVICE


def stop() -> None:
    """Stop this process's simulated device, if one runs."""
    global _DEVICE
    if _DEVICE is not None:
        _DEVICE.stop()
        _DEVICE = None

