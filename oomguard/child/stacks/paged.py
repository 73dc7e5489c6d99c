"""transformers' continuous batching (TRL's ``use_transformers_continuous_batching``, TRL 0.29's
``use_transformers_paged``), in the training process.

TRL hands the generation batch to ``model.generate_batch``; transformers then builds a ``PagedAttentionCache`` sized
to a share of the device memory free at that moment (``ContinuousBatchingConfig.max_memory_percent``, TRL's default
0.5: ``PagedAttentionMemoryHandler.get_available_memory``, after emptying the allocator's cache), runs the batch on a
thread of its own and frees the cache when the batch is done. What oomguard does there:

- **Under the simulated device, the cache is sized as on a GPU of the device's size** (:func:`size_like_the_device`):
  transformers' CPU path otherwise takes that share of the host's RAM less the process's resident set (a fixed
  allocation, whatever the device). Its memory query answers with the simulated device's figures, after giving the
  cached blocks back as ``torch.cuda.empty_cache`` does: so ``max_memory_percent`` and the device's size change the
  simulated footprint as they would on a card. Under ``--gpu-memory SIZE`` it answers for the card of SIZE (transformers
  asks CUDA for the whole card's free memory, which the rehearsal's cap does not change).
- **Under the simulated device, the generation thread is counted** (:func:`count_the_generation_thread`): the
  simulated device counts the tensors of the thread that entered it, and a GPU counts every thread's.
- **An out-of-memory error in the generation thread reaches the training process** (:func:`raise_from_the_thread`):
  transformers logs it, fails the batch's requests and returns what was generated, so the step trains on cut
  completions and nothing is seen to run out of memory; oomguard raises it from ``generate_batch`` instead, where the
  OOM handling of the training process meets it as it meets any other.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

from ..runtime import Runtime

# the modules whose import loads this adapter's patches (the bootstrap reads these tables); each function patches what
# the simulated device and --gpu-memory need itself
TRIGGERS = {"transformers.generation.continuous_batching.cache": "size_like_the_device",
            "transformers.generation.continuous_batching.continuous_api": "patch_manager"}
SIMULATED_TRIGGERS: dict[str, str] = {}
SIMULATED_ENVIRONMENT: dict[str, str] = {}


def size_like_the_device(rt: Runtime, module: Any) -> None:
    """The paged cache's memory query (``get_device_and_memory_breakdown``, as
    ``transformers.generation.continuous_batching.cache`` imported it) answers for the device the run rehearses: under
    the simulated device as CUDA's would on a device of its size (the total, the bytes the allocator reserves, and
    what is in use outside it: the context); under ``--gpu-memory`` for the card of that size (what the allocator may
    still take under its cap). Elsewhere transformers' own answer."""
    from .. import simulate

    if not hasattr(module, "get_device_and_memory_breakdown"):
        return
    from ..patching import set_attr

    dev = simulate.device()
    if dev is not None:
        def simulated() -> tuple[Any, int, int, int]:
            import torch

            gc.collect()
            dev.release_cached()  # torch.cuda.empty_cache(), as transformers' CUDA path calls it first
            reserved = int(dev.model.reserved)
            return torch.device("cpu"), int(dev.capacity), reserved, reserved + int(dev.context)

        set_attr(module, "get_device_and_memory_breakdown", simulated)
        return
    size = getattr(getattr(rt, "plan", None), "gpu_memory", None)
    if not size:
        return
    orig = module.get_device_and_memory_breakdown

    def capped() -> tuple[Any, int, int, int]:
        device, total, reserved, in_use = orig()
        try:
            import torch

            cap = int(torch.cuda.get_per_process_memory_fraction(device) * torch.cuda.mem_get_info(device)[1])
        except Exception:  # never break generation for a rehearsal
            return device, total, reserved, in_use
        # the card of SIZE: the allocator may reserve up to its cap, the rest is the context (child/capped.py)
        return device, int(size), int(reserved), int(size) - cap + int(reserved)

    set_attr(module, "get_device_and_memory_breakdown", capped)


def patch_manager(rt: Runtime, module: Any) -> None:
    """The generation thread's OOM raised in the training process (:func:`raise_from_the_thread`), and under the
    simulated device the thread's tensors counted (:func:`count_the_generation_thread`)."""
    raise_from_the_thread(rt, module)
    count_the_generation_thread(rt, module)


def count_the_generation_thread(rt: Runtime, module: Any) -> None:
    """Under the simulated device: the manager's generation loop (``ContinuousBatchingManager._run_generation_loop``,
    the body of its thread) counts its tensors on the simulated device."""
    from .. import simulate

    manager = getattr(module, "ContinuousBatchingManager", None)
    if simulate.device() is None or manager is None or "_run_generation_loop" not in manager.__dict__:
        return
    from ..patching import set_attr

    orig = manager.__dict__["_run_generation_loop"]

    @functools.wraps(orig)
    def _run_generation_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        dev = simulate.device()
        if dev is None:
            return orig(self, *args, **kwargs)
        with dev.counting():
            return orig(self, *args, **kwargs)

    set_attr(manager, "_run_generation_loop", _run_generation_loop)


def raise_from_the_thread(rt: Runtime, module: Any) -> None:
    """An OOM that ends the manager's generation thread (``_handle_critical_error``) is raised again from
    ``generate_batch`` in the training process's own thread, once the manager has stopped."""
    manager = getattr(module, "ContinuousBatchingManager", None)
    mixin = getattr(module, "ContinuousMixin", None)
    if manager is None or mixin is None or "_handle_critical_error" not in manager.__dict__ \
            or "generate_batch" not in mixin.__dict__:
        return
    from ...oom.parse import is_oom
    from ..patching import set_attr

    orig_handle = manager.__dict__["_handle_critical_error"]
    orig_generate = mixin.__dict__["generate_batch"]
    fatal: list[BaseException] = []

    @functools.wraps(orig_handle)
    def _handle_critical_error(self: Any, error: Exception, *args: Any, **kwargs: Any) -> Any:
        if is_oom(error):
            fatal.append(error)
        return orig_handle(self, error, *args, **kwargs)

    @functools.wraps(orig_generate)
    def generate_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        fatal.clear()
        out = orig_generate(self, *args, **kwargs)
        if fatal:
            error = fatal.pop()
            fatal.clear()
            raise error
        return out

    set_attr(manager, "_handle_critical_error", _handle_critical_error)
    set_attr(mixin, "generate_batch", generate_batch)
