"""What is live on the device when memory runs out, by what holds it: the model's parameters, their gradients, the
optimizer's state, and the rest (the step's activations, generation's buffers, whatever else the run holds).

The crash record carries it (``CrashRecord.live``) so that the diagnosis decides from what was live (a shortfall of
activations, of the long-lived state, of generation's buffers: ``oom.diagnose``) rather than from the failing
request's size alone, and so that a prediction proven wrong can say which of its terms missed (``decide/miss.py``).

The tally counts each storage once (a tied weight, a view, a parameter that is also an optimizer's key): on the
simulated device the storages it counts (:meth:`SimulatedDevice.held`), on CUDA those on the current device. The
rest is what the allocator counts as allocated less the tally. It walks the trainer's model, its reference model and
its optimizer's state, nothing else, once, at the OOM: milliseconds for a model of billions of parameters.

>>> import torch
>>> from oomguard.child import simulate
>>> dev = simulate.start(256 << 20)
>>> model = torch.nn.Linear(1024, 1024)                         # 4 MiB of weights
>>> model.weight.grad = torch.zeros(1024, 1024)                # 4 MiB of gradients
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> opt.state[model.weight]["momentum_buffer"] = torch.zeros(1024, 1024)
>>> acts = torch.zeros(4 << 20)                                 # 16 MiB of something else
>>> live = tally(model, opt)
>>> [live[k] >> 20 for k in ("parameters", "gradients", "optimizer", "other")]
[4, 4, 4, 16]
>>> simulate.stop()
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any


def _sizer() -> tuple[Callable[[Any], tuple[Any, int] | None], int] | None:
    """A function tensor -> (its storage's key, bytes) where it lives on the device (None elsewhere), and what the
    allocator counts as allocated now; None without a device to count on."""
    from . import simulate

    dev = simulate.device()
    if dev is not None:
        def simulated(t: Any) -> tuple[Any, int] | None:
            st = t.untyped_storage()
            n = dev.held(st)
            return (id(st), n) if n else None

        return simulated, dev.model.allocated
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    here = torch.cuda.current_device()

    def cuda(t: Any) -> tuple[Any, int] | None:
        if not t.is_cuda or t.device.index != here:
            return None
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()

    return cuda, int(torch.cuda.memory_allocated())


def _tensors(obj: Any) -> Iterable[Any]:
    """The tensors in an optimizer state's values (dicts, lists and tuples of them, nested)."""
    torch = sys.modules["torch"]
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def tally(model: Any, optimizer: Any = None, *more_models: Any) -> dict[str, int] | None:
    """The bytes live on the device by what holds them: ``parameters`` (of ``model`` and ``more_models``, a
    reference model), ``gradients``, ``optimizer`` (its state) and ``other`` (allocated less those); None without a
    device to count on."""
    sizer = _sizer()
    if sizer is None:
        return None
    size, allocated = sizer
    seen: set[Any] = set()

    def count(tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            try:
                got = size(t)
            except (RuntimeError, NotImplementedError, TypeError):  # a meta tensor, a subclass without storage
                continue
            if got is not None and got[0] not in seen:
                seen.add(got[0])
                total += got[1]
        return total

    models = [m for m in (model, *more_models) if m is not None and hasattr(m, "parameters")]
    params = [p for m in models for p in m.parameters()]
    out = {"parameters": count(params),
           "gradients": count(p.grad for p in params if p.grad is not None)}
    state = getattr(optimizer, "state", None) if optimizer is not None else None
    out["optimizer"] = count(_tensors(list(state.values()))) if isinstance(state, dict) else 0
    out["other"] = max(0, allocated - sum(out.values()))
    return out


def of_trainer(trainer: Any) -> dict[str, int] | None:
    """:func:`tally` for a GRPOTrainer (its model, reference model and optimizer); None where it cannot be taken."""
    if trainer is None:
        return None
    try:
        return tally(getattr(trainer, "model", None), getattr(trainer, "optimizer", None),
                     getattr(trainer, "ref_model", None))
    except Exception:  # the crash record is written whatever the tally meets
        return None


__all__ = ["of_trainer", "tally"]
