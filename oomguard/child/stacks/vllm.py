"""vLLM beside the trainer (TRL's ``use_vllm=True``, ``vllm_mode="colocate"``), in the training process.

TRL builds one ``vllm.LLM`` inside ``GRPOTrainer.__init__`` (``trl/generation/vllm_generation.py``, the name ``LLM``
that module imported, in TRL 0.29 to 1.16 alike). vLLM then reserves ``vllm_gpu_memory_utilization`` of the device
for its weights, the activations of its profile run and its KV cache, beside the trainer. What oomguard does there:

- **The pre-flight judges the whole config before vLLM starts** (:func:`before_start`): the reservation and training
  must fit together, and a reservation that cannot hold vLLM's own weights, activations and one full-length sequence
  is refused before vLLM fails on it. The facts that decide the rungs are reported first: whether the platform has
  vLLM's sleep mode (CUDA and ROCm do, the CPU build does not) and which platform it is (the CPU build has no
  bitsandbytes quantisation, which TRL asks for a 4-bit model).
- **Under the simulated device, vLLM sizes its KV cache as a GPU of the device's size would** (:func:`size_like_a_gpu`):
  vLLM's CPU worker otherwise checks host RAM against the utilization and takes utilization x host RAM minus the
  process's RSS. Its start-up check and ``determine_available_memory`` follow vLLM's GPU worker instead, with the
  simulated device's figures: ``ceil(utilization x C)`` must be free at start-up, and the KV cache is that less what
  the engine itself took (weights, buffers) and the activation peak of one profile run. So
  ``vllm_gpu_memory_utilization``, ``vllm_max_model_length`` and the batch change the simulated footprint as they
  would on a card, and vLLM's own failures (no room for one sequence, the start-up check) appear as on a card.
- **Under the simulated device, vLLM keeps its linear layers' weights as a GPU does** (:func:`keep_weights_like_a_gpu`):
  on a CPU whose oneDNN builds its matmul (AVX-512 Xeons), vLLM's CPU build packs each weight into oneDNN's own
  buffer and replaces the layer's parameter with an empty one, which the simulated device cannot count and TRL's
  weight sync cannot load into (``'Parameter' object has no attribute 'weight_loader'``). Under the simulated device
  the layers use torch's linear on their own weights, vLLM's own fallback where oneDNN cannot build.
- **Under the simulated device, vLLM runs eager**, said in one line: inductor's compiled kernels allocate below the
  Python dispatcher, where the simulated device cannot count them, and on two CPU cores the compile costs 25-40 s per
  launch. A run on a GPU keeps vLLM's compilation.
"""

from __future__ import annotations

import gc
import math
import sys
from typing import Any

from ...vocab.events import CodeSeen, ModelSeen, VLLMMemory
from ..runtime import Runtime, rank

# the modules whose import loads this adapter's patches (the bootstrap reads these tables), and those under the
# simulated device only
TRIGGERS = {"trl.generation.vllm_generation": "patch_trl"}
SIMULATED_TRIGGERS = {"vllm.v1.worker.cpu_worker": "size_like_a_gpu",
                      "vllm.model_executor.layers.utils": "keep_weights_like_a_gpu"}
SIMULATED_ENVIRONMENT: dict[str, str] = {}

EAGER_LINE = ("oomguard: vLLM runs eager under the simulated device: its compiled kernels allocate below what the "
              "simulated device can count (a run on a GPU keeps vLLM's compilation)\n")


def platform_facts() -> dict[str, Any]:
    """What the platform vLLM runs on allows: ``vllm_sleep`` (sleep mode) and ``vllm_platform`` (``cuda``, ``cpu``,
    ...); empty where vLLM cannot say."""
    try:
        from vllm.platforms import current_platform

        return {"vllm_sleep": bool(current_platform.is_sleep_mode_available()),
                "vllm_platform": str(current_platform.device_type)}
    except Exception:
        return {}


def patch_trl(rt: Runtime, module: Any) -> None:
    """Wrap the ``LLM`` name of TRL's ``trl.generation.vllm_generation``: what runs before vLLM starts."""
    from ..patching import set_attr

    orig = module.__dict__.get("LLM")
    if orig is None:  # vLLM is not installed: TRL imports its LLM only where it is
        return

    def LLM(*args: Any, **kwargs: Any) -> Any:
        before_start(rt, kwargs)
        return orig(*args, **kwargs)

    set_attr(module, "LLM", LLM)


def before_start(rt: Runtime, kwargs: dict[str, Any]) -> None:
    """Report the platform's facts, run vLLM eager under the simulated device, and let the pre-flight judge the whole
    config (the trainer's model and vLLM's reservation together) before vLLM reserves anything."""
    from .. import simulate

    rt.emit(CodeSeen(point="facts", facts=platform_facts()))
    if simulate.device() is not None and "enforce_eager" not in kwargs:
        kwargs["enforce_eager"] = True
        if rank() in (None, 0):
            sys.stderr.write(EAGER_LINE)
    if rt.model_config is None and isinstance(kwargs.get("model"), str):
        from ..load import checkpoint_config

        config = checkpoint_config(kwargs["model"], {})
        if config is not None:
            rt.model_config = config
            rt.emit(ModelSeen(config=config, params=None, dtype=None))
    from .. import preflight

    preflight.check(rt, before="starts vLLM")


def size_like_a_gpu(rt: Runtime, module: Any) -> None:
    """Under the simulated device: vLLM's CPU worker (``vllm.v1.worker.cpu_worker``) checks and sizes its memory as
    vLLM's GPU worker does, against the simulated device (see the module's docstring). An explicit KV cache size
    (``kv_cache_memory_bytes``, ``VLLM_CPU_KVCACHE_SPACE``) is honoured, as on a GPU."""
    from .. import simulate

    dev = simulate.device()
    if dev is None:
        return
    from vllm.utils.cpu_resource_utils import MemoryNodeInfo

    from ..patching import set_attr

    def node_info(node_id: int = 0) -> MemoryNodeInfo:
        return MemoryNodeInfo(total_memory=dev.capacity, available_memory=max(0, dev.capacity - in_use(dev)))

    set_attr(module, "get_memory_node_info", node_info)
    worker = module.CPUWorker
    orig_init = worker.__dict__["__init__"]
    orig_determine = worker.__dict__["determine_available_memory"]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self._oomguard_reserved_at_start = dev.model.reserved

    def determine_available_memory(self: Any) -> int:
        if self.cache_config.kv_cache_memory_bytes is not None:
            return orig_determine(self)
        from vllm.config import CompilationMode

        gc.collect()
        dev.release_cached()
        dev.reset_peak()
        if self.compilation_config.mode != CompilationMode.NONE:
            self.model_runner.warming_up_model()  # compiles, and runs profile_run once
        else:
            self.model_runner.profile_run()
        peak = dev.peak
        gc.collect()
        dev.release_cached()  # the GPU worker's memory profiling empties the cache before it measures
        consumed = dev.model.reserved - self._oomguard_reserved_at_start
        headroom = max(0, peak - dev.model.allocated)
        requested = math.ceil(dev.capacity * self.cache_config.gpu_memory_utilization)
        kv = requested - consumed - headroom
        rt.emit(VLLMMemory(requested=requested, engine=consumed, activations=headroom, kv_cache=kv,
                capacity=dev.capacity, utilization=self.cache_config.gpu_memory_utilization))
        return kv

    set_attr(worker, "__init__", __init__)
    set_attr(worker, "determine_available_memory", determine_available_memory)


def keep_weights_like_a_gpu(rt: Runtime, module: Any) -> None:
    """Under the simulated device: vLLM's CPU GEMM dispatch (``vllm.model_executor.layers.utils``) leaves a linear
    layer's 2-D weight where it is, with torch's linear, as vLLM does where oneDNN cannot build its matmul (see the
    module's docstring); other weights (MoE experts, convolutions) go through vLLM's own dispatch."""
    from .. import simulate

    if simulate.device() is None or not hasattr(module, "dispatch_cpu_unquantized_gemm"):
        return
    import torch

    from ..patching import set_attr

    orig = module.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return orig(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    set_attr(module, "dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm)


def in_use(dev: Any) -> int:
    """What the simulated device holds now, as a GPU's free-memory query counts it: the allocator's reserved bytes
    plus the context outside it."""
    return int(dev.model.reserved + dev.context)
