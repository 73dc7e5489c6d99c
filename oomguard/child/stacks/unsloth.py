"""Unsloth (``FastLanguageModel`` and its GRPO notebooks): TRL's GRPOTrainer underneath, with its own loader, its
own LoRA set-up and, depending on the device, its own LM head or its own trainer class.

A notebook loads and adapts the model before any GRPOConfig exists, so this adapter patches Unsloth's loader, in the
training process (unsloth 2026.x, CPU backend and GPU path alike):

- ``FastLanguageModel.from_pretrained`` (and ``FastModel``'s): the loader's knobs. Recorded as oomguard's once the
  model is loaded (``load_in_4bit`` from the model itself: Unsloth's CPU backend falls back to 16-bit where
  bitsandbytes cannot run; ``fast_inference`` as a colocated vLLM with ``gpu_memory_utilization`` and
  ``max_seq_length``), and set where Unsloth reads them: ``load_in_4bit`` (never with ``full_finetuning``),
  ``dtype``, ``gpu_memory_utilization`` and ``max_seq_length`` for its vLLM, ``max_lora_rank`` raised to a LoRA rank
  oomguard sets.
- ``FastLanguageModel.get_peft_model``: ``use_gradient_checkpointing`` set from oomguard's checkpointing knob. The
  rank, targets and checkpointing it applies are read from the model the trainer receives (``patches``).
- The trainer: the GRPOTrainer patch follows whatever class ``trl.GRPOTrainer`` names (``trainer.watch_rebinding``):
  on a GPU Unsloth binds a class it generates into ``unsloth_compiled_cache/``, a rewritten copy of TRL's.
- :func:`facts`, asked once the trainer is built: the LM head the memory model must count. On Unsloth's CPU backend
  TRL's fused head is routed to Unsloth's row-chunked torch code (``rowchunk``); Unsloth's generated trainer computes
  its loss its own way, which no measurement here covers (``stack_untested``: the pre-flight judges it with the margin
  of an untested release, and a probe verifies the first choice).

Under the simulated device Unsloth's ``torch.compile(fullgraph=True)`` regions cannot trace through the simulated
device's dispatch mode: :data:`SIMULATED_ENVIRONMENT` turns Unsloth's compilation off (set by the bootstrap).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from ...vocab.events import CodeSeen
from ...vocab.stacks.spelling import Code
from ...vocab.stacks.unsloth import GENERATED_TRAINER, LOADER, PEFT, UNSLOTH
from ..runtime import Runtime

STACK = "unsloth"
# reported as soon as Unsloth is imported: its loader quantises and prepares a model for the LoRA added after it
LOADER_FACTS = {"stack": STACK, "load_takes_4bit": True}
# the modules whose import loads this adapter's patches (the bootstrap reads these tables)
TRIGGERS = {"unsloth": "patch_unsloth"}
SIMULATED_TRIGGERS: dict[str, str] = {}
# set in the training process under --simulate-gpu, before Unsloth is imported (it reads it at import)
SIMULATED_ENVIRONMENT = {"UNSLOTH_COMPILE_DISABLE": "1"}
# the classes a notebook loads with (GPU path: separate classes; CPU backend: one class under several names)
LOADERS = ("FastLanguageModel", "FastModel", "FastTextModel")


def observed_loader(kwargs: dict[str, Any]) -> dict[str, Any]:
    """oomguard's knobs in the arguments of ``from_pretrained`` (defaults filled): a colocated vLLM when
    ``fast_inference``. ``load_in_4bit`` and ``dtype`` are read from the loaded model instead (:func:`observed_model`).

    >>> observed_loader({"fast_inference": True, "gpu_memory_utilization": 0.6, "max_seq_length": 1024})
    {'use_vllm': True, 'vllm_mode': 'colocate', 'vllm_gpu_memory_utilization': 0.6, 'vllm_max_model_length': 1024}
    >>> observed_loader({"fast_inference": False, "max_seq_length": 1024})
    {}
    """
    if not kwargs.get("fast_inference"):
        return {}
    return {"use_vllm": True, "vllm_mode": "colocate", **UNSLOTH.observe(kwargs, point=LOADER)}


def observed_model(model: Any) -> dict[str, Any]:
    """What Unsloth's loader really built: 4-bit or not, and the weights' dtype (under a 4-bit load, that of the
    modules it leaves unquantised: bfloat16 on a GPU by default, float32 on a CPU without bf16).

    >>> from types import SimpleNamespace
    >>> import torch
    >>> observed_model(SimpleNamespace(is_loaded_in_4bit=True, dtype=torch.bfloat16))
    {'load_in_4bit': True, 'dtype': 'bfloat16'}
    """
    from ..patching import dtype_name

    out: dict[str, Any] = {"load_in_4bit": bool(getattr(model, "is_loaded_in_4bit", False))}
    dtype = dtype_name(getattr(model, "dtype", None))
    if dtype:
        out["dtype"] = dtype
    return out


def apply_loader(rt: Runtime, kwargs: dict[str, Any]) -> None:
    """oomguard's knobs, set in ``from_pretrained``'s arguments where Unsloth reads them (the notebook's spelling,
    ``oomguard/vocab/stacks/unsloth.py``): the 4-bit load (never with a full fine-tune), the dtype, and with
    ``fast_inference`` its vLLM's share of the GPU and context, with LoRA slots that hold the rank oomguard trains."""
    ov = rt.overrides
    _resolve(kwargs, UNSLOTH.apply(ov, kwargs, point=LOADER))
    if kwargs.get("fast_inference") and ov.lora_r and int(kwargs.get("max_lora_rank") or 0) < int(ov.lora_r):
        kwargs["max_lora_rank"] = int(ov.lora_r)  # vLLM's LoRA slots must hold the rank oomguard trains


def apply_peft(rt: Runtime, kwargs: dict[str, Any]) -> None:
    """oomguard's checkpointing knob, set in ``get_peft_model``'s arguments (``use_gradient_checkpointing``)."""
    _resolve(kwargs, UNSLOTH.apply(rt.overrides, kwargs, point=PEFT))


def _resolve(kwargs: dict[str, Any], done: dict[str, Any]) -> None:
    """The names in the notebook's code that the table sets (``torch.bfloat16``) as the objects they name."""
    for name, value in done.items():
        if isinstance(value, Code):
            import importlib

            kwargs[name] = getattr(importlib.import_module(value.module), value.attr)


def patch_unsloth(rt: Runtime, module: Any) -> None:
    """When ``unsloth`` is imported: its loaders, and the facts the trainer patch asks for."""
    from ..patching import set_attr

    rt.stack_facts.append(facts)
    rt.emit(CodeSeen(point="facts", facts=dict(LOADER_FACTS)))
    seen: set[int] = set()
    for name in LOADERS:
        cls = getattr(module, name, None)
        if not isinstance(cls, type) or id(cls) in seen:
            continue
        seen.add(id(cls))
        for method, wrap in (("from_pretrained", _from_pretrained), ("get_peft_model", _get_peft_model)):
            orig = getattr(cls, method, None)
            if orig is not None and not getattr(orig, "_oomguard", False):
                set_attr(cls, method, staticmethod(wrap(rt, orig)))


def _from_pretrained(rt: Runtime, orig: Any) -> Any:
    sig = _signature(orig)

    @functools.wraps(orig)
    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        full = _with_defaults(sig, args, kwargs)
        rt.observe(observed_loader(full))
        apply_loader(rt, kwargs)
        out = orig(*args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if rt.overrides.load_in_4bit is None and rt.overrides.dtype is None:
            rt.observe(observed_model(model))
        rt.emit(CodeSeen(point="facts", facts=dict(LOADER_FACTS), observed=dict(rt.observed)))
        return out

    from_pretrained._oomguard = True  # type: ignore[attr-defined]
    return from_pretrained


def _get_peft_model(rt: Runtime, orig: Any) -> Any:
    @functools.wraps(orig)
    def get_peft_model(*args: Any, **kwargs: Any) -> Any:
        apply_peft(rt, kwargs)
        return orig(*args, **kwargs)

    get_peft_model._oomguard = True  # type: ignore[attr-defined]
    return get_peft_model


def _signature(f: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):
        return None


def _with_defaults(sig: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled (what Unsloth will use)."""
    if sig is None:
        return dict(kwargs)
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    out.update(out.pop("kwargs", None) or {})
    return out


def generated(trainer: Any) -> bool:
    """The trainer is a class Unsloth generated (``UnslothGRPOTrainer``), not TRL's GRPOTrainer or a subclass."""
    return not any(c.__module__.startswith("trl.") and c.__name__ == "GRPOTrainer" for c in type(trainer).__mro__)


def cpu_head() -> bool:
    """TRL's fused LM head is routed to Unsloth's torch code for tensors off CUDA/XPU (its CPU backend installs
    the routing)."""
    utils = sys.modules.get("trl.trainer.utils")
    return bool(getattr(getattr(utils, "_ChunkedLogProbFunction", None), "_unsloth_cpu_dispatch", False))


def facts(trainer: Any = None) -> dict[str, Any]:
    """What Unsloth changes that the memory model must know, once the trainer is built (``trainer``; None: the
    process's routing alone)."""
    out: dict[str, Any] = dict(LOADER_FACTS)
    if trainer is not None and generated(trainer):
        out["stack_untested"] = GENERATED_TRAINER
    elif cpu_head() and _on_cpu(trainer):
        out["trl_head"] = "rowchunk"
    return out


def _on_cpu(trainer: Any) -> bool:
    model = getattr(trainer, "model", None)
    if model is None:
        return True
    try:
        return next(model.parameters()).device.type not in ("cuda", "xpu")
    except (StopIteration, AttributeError, TypeError):
        return True


__all__ = ["LOADERS", "SIMULATED_ENVIRONMENT", "STACK", "apply_loader", "apply_peft", "facts", "observed_loader",
           "patch_unsloth"]
