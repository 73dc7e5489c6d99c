"""Unsloth (``FastLanguageModel`` and its GRPO notebooks): TRL's GRPOTrainer underneath, with its own loader, its
own LoRA set-up and, depending on the device, its own LM head or its own trainer class.

A notebook loads and adapts the model before any GRPOConfig exists, so this adapter patches Unsloth's loader, in the
training process (unsloth 2026.x, CPU backend and GPU path alike):

- ``FastLanguageModel.from_pretrained`` (and ``FastModel``'s): the loader's knobs. The notebook's own are read from
  its arguments and said before anything loads (``load_in_4bit`` as asked, ``dtype`` where it names one,
  ``fast_inference`` as a colocated vLLM with ``gpu_memory_utilization`` and ``max_seq_length``), so a pre-flight
  stop of the load keeps them; once loaded, what Unsloth built instead (its CPU backend falls back to 16-bit where
  bitsandbytes cannot run; ``dtype=None`` is the device's) is what the command runs (:func:`loaded`). oomguard's are
  set where Unsloth reads them: ``load_in_4bit`` (never with ``full_finetuning``), ``dtype``,
  ``gpu_memory_utilization`` and ``max_seq_length`` for its vLLM, ``max_lora_rank`` raised to a LoRA rank oomguard
  sets; an error the loader raises while one of them is in force is oomguard's (``patching.overrides_reported``: the
  rung is taken back). Where the loader cannot load 4-bit weights here (its CPU backend's own check, or oomguard's
  simulated device, where its CPU 4-bit load fails) or its CPU backend replaces an 8-bit optimizer with torch's AdamW,
  the adapter says so when Unsloth is imported (:func:`cannot_load_4bit`, :func:`cannot_optim_8bit`), and those rungs
  are not offered: each would launch the same run again, or one that breaks.
- ``FastLanguageModel.get_peft_model``: the notebook's LoRA (rank, alpha, targets) and checkpointing read where it
  passes them, and never replaced (a LoRA rung applies to a full fine-tune only); ``use_gradient_checkpointing`` set
  from oomguard's checkpointing knob.
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
from .. import ran
from ..runtime import Runtime

STACK = "unsloth"
# reported as soon as Unsloth is imported: its loader quantises and prepares a model for the LoRA added after it
LOADER_FACTS = {"stack": STACK, "load_takes_4bit": True}
CPU_NO_4BIT = ("Unsloth's CPU backend loads 16-bit weights instead, as bitsandbytes' 4-bit does not run on this CPU "
               "(Unsloth's own check)")
SIMULATED_NO_4BIT = ("Unsloth's CPU 4-bit load does not run on oomguard's simulated device (its quantised storages "
                     "fail inside the loader): a rehearsal on CPU offers no 4-bit load; a GPU does")
CPU_NO_8BIT = ("Unsloth's CPU backend replaces 8-bit and paged optimizers with torch's AdamW (bitsandbytes' have no CPU "
               "kernels)")
# who changed a value oomguard set (child/ran.py): the loader, and the notebook's own LoRA
FELL_BACK = "Unsloth's loader loaded 16-bit weights instead of the 4-bit load asked of it"
LORA_KNOBS = ("lora_r", "lora_alpha", "lora_target_modules")
# the modules whose import loads this adapter's patches (the bootstrap reads these tables)
TRIGGERS = {"unsloth": "patch_unsloth"}
SIMULATED_TRIGGERS: dict[str, str] = {}
# set in the training process under --simulate-gpu, before Unsloth is imported (it reads it at import)
SIMULATED_ENVIRONMENT = {"UNSLOTH_COMPILE_DISABLE": "1"}
# the classes a notebook loads with (GPU path: separate classes; CPU backend: one class under several names)
LOADERS = ("FastLanguageModel", "FastModel", "FastTextModel")


def observed_loader(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The notebook's own knobs in the arguments of ``from_pretrained`` (defaults filled): the 4-bit load it asks for,
    its dtype where it names one, and a colocated vLLM when ``fast_inference``. Read before anything loads, so that a
    pre-flight stop of the load keeps them.

    >>> observed_loader({"load_in_4bit": False, "dtype": None, "fast_inference": True, "gpu_memory_utilization": 0.6,
    ...                  "max_seq_length": 1024})
    {'use_vllm': True, 'vllm_mode': 'colocate', 'load_in_4bit': False, 'vllm_gpu_memory_utilization': 0.6, \
'vllm_max_model_length': 1024}
    >>> observed_loader({"load_in_4bit": True, "dtype": "torch.bfloat16", "fast_inference": False, "max_seq_length": 1024})
    {'load_in_4bit': True, 'dtype': 'bfloat16'}
    """
    vllm = {"use_vllm": True, "vllm_mode": "colocate"} if kwargs.get("fast_inference") else {}
    return {**vllm, **UNSLOTH.observe(kwargs, point=LOADER)}


def observed_peft(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The notebook's own LoRA and checkpointing in the arguments of ``get_peft_model`` (defaults filled).

    >>> observed_peft({"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"],
    ...                "use_gradient_checkpointing": "unsloth"})
    {'gradient_checkpointing': True, 'lora_r': 8, 'lora_alpha': 16, 'lora_target_modules': ('q_proj', 'v_proj')}
    """
    return UNSLOTH.observe(kwargs, point=PEFT)


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


def loaded(rt: Runtime, asked: dict[str, Any], model: Any) -> None:
    """After the loader returned: what it built where the notebook left it to the loader (dtype=None), and what it
    built instead of what the notebook asked (a 4-bit load Unsloth's CPU backend falls back from), as the values the
    command runs (``Runtime.resolve``); a 4-bit load oomguard set that the loader did not make, as a value the process
    runs instead (``child/ran.py``). Neither where oomguard set the knob: the model then says oomguard's, not the
    notebook's."""
    built = observed_model(model)
    ov = rt.overrides
    if ov.dtype is None and not ov.load_in_4bit and "dtype" in built:
        rt.observe({"dtype": built["dtype"]})
    if asked.get("load_in_4bit") and not built["load_in_4bit"]:
        rt.resolve({"load_in_4bit": False})
    if ov.load_in_4bit and not built["load_in_4bit"]:
        rt.runs_instead({"load_in_4bit": False}, FELL_BACK)


def apply_loader(rt: Runtime, kwargs: dict[str, Any]) -> list[str]:
    """oomguard's knobs, set in ``from_pretrained``'s arguments where Unsloth reads them (the notebook's spelling,
    ``oomguard/vocab/stacks/unsloth.py``): the 4-bit load (never with a full fine-tune), the dtype, and with
    ``fast_inference`` its vLLM's share of the GPU and context, with LoRA slots that hold the rank oomguard trains.
    Returns the knobs it set (those an error of the loader's is taken for: ``patching.overrides_reported``)."""
    ov = rt.overrides
    done = UNSLOTH.apply(ov, kwargs, point=LOADER)
    _resolve(kwargs, done)
    if kwargs.get("fast_inference") and ov.lora_r and int(kwargs.get("max_lora_rank") or 0) < int(ov.lora_r):
        kwargs["max_lora_rank"] = int(ov.lora_r)  # vLLM's LoRA slots must hold the rank oomguard trains
        done["max_lora_rank"] = ov.lora_r
    return _knobs_of(done)


def apply_peft(rt: Runtime, kwargs: dict[str, Any]) -> None:
    """oomguard's checkpointing knob, set in ``get_peft_model``'s arguments (``use_gradient_checkpointing``)."""
    _resolve(kwargs, UNSLOTH.apply(rt.overrides, kwargs, point=PEFT))


def _knobs_of(args: dict[str, Any]) -> list[str]:
    """The knobs whose spellings set ``args`` (``max_lora_rank`` is the LoRA rank's: vLLM's slots for it)."""
    out = {k for s in UNSLOTH.spellings if s.point == LOADER and set(s.args) & set(args) for k in s.knobs}
    return sorted(out | ({"lora_r"} if "max_lora_rank" in args else set()))


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
    rt.emit(CodeSeen(point="facts", facts=loader_facts()))
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
        from ..patching import overrides_reported

        asked = observed_loader(_with_defaults(sig, args, kwargs))
        rt.observe(asked)
        applied = apply_loader(rt, kwargs)
        # said before anything loads: a pre-flight stop of the load (or an OOM in it) keeps the notebook's own values
        rt.emit(CodeSeen(point="facts", facts=loader_facts(), observed=dict(rt.observed)))
        rt.loader = LOADER
        try:
            with overrides_reported(rt, f"Unsloth's {LOADER}", applied):
                out = orig(*args, **kwargs)
        finally:
            rt.loader = None
        loaded(rt, asked, out[0] if isinstance(out, tuple) else out)
        rt.emit(CodeSeen(point="facts", facts=loader_facts(), observed=dict(rt.observed), resolved=dict(rt.resolved)))
        ran.report(rt)  # a replayed lock's 4-bit load the loader did not make stops here
        return out

    from_pretrained._oomguard = True  # type: ignore[attr-defined]
    return from_pretrained


def _get_peft_model(rt: Runtime, orig: Any) -> Any:
    sig = _signature(orig)

    @functools.wraps(orig)
    def get_peft_model(*args: Any, **kwargs: Any) -> Any:
        from ..trainer import lora_dropout

        given = _with_defaults(sig, args, kwargs)
        own = observed_peft(given)
        rt.observe(own)
        apply_peft(rt, kwargs)
        # the notebook's own LoRA trains, never oomguard's (whose rung applies to a full fine-tune only)
        rt.runs_instead({k: v for k, v in own.items() if k in LORA_KNOBS}, ran.OWN_PEFT)
        out = orig(*args, **kwargs)
        rt.emit(CodeSeen(point="facts", observed=dict(rt.observed), facts={"lora_dropout": lora_dropout(given)}))
        return out

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


def loader_facts() -> dict[str, Any]:
    """What the loader itself tells the memory model and the ladder, known as soon as Unsloth is imported: it quantises
    and prepares a model for the LoRA added after it (``load_takes_4bit``), and what it cannot do on this machine, why
    (``cannot_load_4bit``, ``cannot_optim_8bit``: those rungs are then not offered)."""
    cannot = {"cannot_load_4bit": cannot_load_4bit(), "cannot_optim_8bit": cannot_optim_8bit()}
    return {**LOADER_FACTS, **{k: why for k, why in cannot.items() if why}}


def cannot_load_4bit() -> str | None:
    """Why Unsloth's loader loads no 4-bit weights here, or None: on a machine without CUDA its CPU backend loads 16-bit
    weights instead where bitsandbytes' CPU 4-bit does not run (Unsloth's own check, a 4-bit layer's forward and
    backward; ``UNSLOTH_CPU_LOAD_IN_4BIT=0`` turns it off)."""
    if not _without_cuda():
        return None
    try:
        from unsloth_zoo.cpu.runtime import cpu_bnb_4bit_supported

        if not cpu_bnb_4bit_supported():
            return CPU_NO_4BIT
    except Exception:  # another Unsloth: nothing known either way
        return None
    from .. import simulate

    return SIMULATED_NO_4BIT if simulate.device() is not None else None


def _without_cuda() -> bool:
    """torch is imported and sees no CUDA device: where Unsloth runs its CPU backend."""
    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available()


def cannot_optim_8bit() -> str | None:
    """Why an 8-bit optimizer never reaches the training here, or None: on a machine without CUDA, Unsloth's CPU
    backend turns every 8-bit or paged optimizer into torch's AdamW when the config is built
    (``unsloth_zoo.cpu.trainer.normalize_cpu_training_arguments``), so the rung would launch the same run again."""
    if not _without_cuda():
        return None
    try:
        from unsloth_zoo.cpu.trainer import normalize_cpu_training_arguments  # noqa: F401
    except Exception:  # another Unsloth, without a CPU backend: nothing known
        return None
    return CPU_NO_8BIT


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
    out: dict[str, Any] = loader_facts()
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


__all__ = ["LOADERS", "SIMULATED_ENVIRONMENT", "STACK", "apply_loader", "apply_peft", "cannot_load_4bit",
           "cannot_optim_8bit", "facts", "loaded", "loader_facts", "observed_loader", "observed_peft", "patch_unsloth"]
