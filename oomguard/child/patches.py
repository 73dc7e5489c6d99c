"""Patches at the construction points every TRL script passes through: GRPOConfig, GRPOTrainer, from_pretrained.

Each patch first records what the script set (so the diff starts from the user's own config), then applies the
knobs. The user's code is never edited; ``remove()`` restores the originals (the decorator uses this).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

from .runtime import Runtime

# GRPOConfig fields that are knobs of the same name.
CONFIG_KNOBS = (
    "max_completion_length", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
    "steps_per_generation", "generation_batch_size", "beta", "optim", "torch_empty_cache_steps", "use_vllm",
    "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_max_model_length",
    "dataloader_num_workers", "dataloader_prefetch_factor", "bf16", "fp16", "learning_rate", "loss_type",
    "ds3_gather_for_generation", "use_liger_kernel", "per_device_eval_batch_size", "num_generations_eval", "eval_strategy",
)
_PROMPT_STATS_ROWS = 20000
PROBE_STEPS = 2  # a plan's probe names its steps; this is the default of a plan that names none

_UNDO: list[Callable[[], None]] = []


def _set(owner: Any, name: str, value: Any) -> None:
    if name in owner.__dict__:
        old = owner.__dict__[name]
        _UNDO.append(lambda: setattr(owner, name, old))
    else:  # inherited: removing ours restores the base class's
        _UNDO.append(lambda: delattr(owner, name))
    setattr(owner, name, value)


def remove() -> None:
    """Restore every patched attribute (last patched first)."""
    while _UNDO:
        _UNDO.pop()()


def _plain(v: Any) -> Any:
    value = getattr(v, "value", v)  # enums such as OptimizerNames
    if value is not None and not isinstance(value, (bool, int, float, str, list, tuple)):
        return str(value)
    return value


def _dtype_name(d: Any) -> str | None:
    if d is None:
        return None
    s = str(d)
    return s.split(".", 1)[1] if s.startswith("torch.") else s


# ----------------------------------------------------------------------------------------------------------------
# GRPOConfig


def observe_config(cfg: Any) -> dict[str, Any]:
    from ..vocab.distributed import fsdp_options
    from . import dsconfig

    out = {name: _plain(getattr(cfg, name)) for name in CONFIG_KNOBS if hasattr(cfg, name)}
    act = getattr(cfg, "activation_checkpointing", None)
    out["gradient_checkpointing"] = act if act is not None else getattr(cfg, "gradient_checkpointing", None)
    out.update(dsconfig.observe(cfg))
    out["fsdp_offload"] = "offload" in fsdp_options(getattr(cfg, "fsdp", None))
    return out


def apply_distributed(rt: Runtime, cfg: Any) -> None:
    """ZeRO stage, offloads and buffers through a DeepSpeed config generated from the run's (child/dsconfig.py);
    FSDP offload through fsdp."""
    from ..vocab.distributed import fsdp_options
    from . import dsconfig

    ov = rt.overrides
    dsconfig.apply(rt, cfg)
    if ov.fsdp_offload is not None:
        opts = [o for o in fsdp_options(getattr(cfg, "fsdp", None)) if o != "offload"]
        if opts:
            cfg.fsdp = " ".join([*opts, "offload"] if ov.fsdp_offload else opts)


def apply_config(rt: Runtime, cfg: Any, can_defer: bool = True) -> None:
    """oomguard's knobs and the attempt's plan (a fresh run's output directory, checkpoints, the probe) on a config
    before its own ``__post_init__``. An attempt launched as a probe unless the memory model is sure of its config is
    decided where GRPOTrainer is built (``prepare_trainer_args``), when the model and the prompt lengths are known;
    a construction point after which nothing could still make it a probe (``can_defer`` False) decides it a probe."""
    ov = rt.overrides
    for name in CONFIG_KNOBS:
        v = getattr(ov, name)
        if v is not None and hasattr(cfg, name):
            setattr(cfg, name, v)
    apply_distributed(rt, cfg)
    if ov.gradient_checkpointing is not None:
        # transformers 5.x: activation_checkpointing is the name; gradient_checkpointing is its deprecated mirror.
        if hasattr(cfg, "activation_checkpointing"):
            cfg.activation_checkpointing = ov.gradient_checkpointing
        cfg.gradient_checkpointing = ov.gradient_checkpointing
    plan = rt.plan
    fresh = (plan.resume or {}).get("output_dir")
    if fresh and (plan.resume or {}).get("mode") in ("weights", "restart"):
        cfg.output_dir = fresh  # a new run must not write over the checkpoints of the one before
    if plan.checkpoint_every:
        cfg.save_strategy = "steps"
        cfg.save_steps = int(plan.checkpoint_every)
    if plan.probe and rt.probe_undecided() and not can_defer:
        rt.decide_probe("probe", "this launch form builds its trainer where the probe can no longer be decided")
    if plan.probe and rt.probing():
        apply_probe(rt, cfg, plan.probe)


def evaluates(cfg: Any) -> bool:
    """Whether a TrainingArguments (before or after its ``__post_init__``) asks for evaluation during training."""
    return str(_plain(getattr(cfg, "eval_strategy", None)) or "no").lower() not in ("no", "none")


def saves(cfg: Any) -> bool:
    """Whether a TrainingArguments asks for checkpoints during training."""
    return str(_plain(getattr(cfg, "save_strategy", None)) or "no").lower() not in ("no", "none")


def apply_probe(rt: Runtime, cfg: Any, probe: dict[str, Any]) -> None:
    """A short worst-case rehearsal: few steps, full-length completions, nothing reported. A config that evaluates
    runs one evaluation pass (of one batch, ``probe_eval_dataset``) and a config that saves writes one checkpoint,
    both after the last step, when the optimizer state exists: their peaks are measured with the steps'."""
    steps = int(probe.get("steps", PROBE_STEPS))
    cfg.max_steps = steps
    will_save = saves(cfg)
    _assign(cfg, "save_strategy", "steps" if will_save else "no")
    if will_save:
        cfg.save_steps = steps
        if hasattr(cfg, "save_total_limit"):
            cfg.save_total_limit = None
        if hasattr(cfg, "hub_strategy"):
            cfg.hub_strategy = "end"
    # The supervisor's scratch directory, deleted when the probe ends; never the user's own output_dir.
    cfg.output_dir = probe.get("output_dir") or os.path.join(rt.plan.crash_dir or tempfile.mkdtemp(), "probe-output")
    cfg.report_to = []
    cfg.push_to_hub = False
    if hasattr(cfg, "eval_strategy"):
        if evaluates(cfg):
            _assign(cfg, "eval_strategy", "steps")
            cfg.eval_steps = steps
            for name, value in (("eval_on_start", False), ("eval_delay", 0)):
                if hasattr(cfg, name):
                    setattr(cfg, name, value)
        else:
            _assign(cfg, "eval_strategy", "no")
    cfg.logging_steps = 1
    gk = dict(getattr(cfg, "generation_kwargs", None) or {})
    if getattr(cfg, "use_vllm", False):
        gk["min_tokens"] = cfg.max_completion_length
    else:
        gk["min_new_tokens"] = cfg.max_completion_length
    cfg.generation_kwargs = gk
    try:
        object.__setattr__(cfg, "_oomguard_probe", True)
    except (AttributeError, TypeError):
        pass


def _assign(cfg: Any, name: str, value: str) -> None:
    """Set a strategy field to ``value`` in the type it holds: after ``__post_init__`` an enum of transformers'
    (``IntervalStrategy``, ``SaveStrategy``), before it the string the script gave."""
    import enum

    current = getattr(cfg, name, None)
    if isinstance(current, enum.Enum):
        try:
            setattr(cfg, name, type(current)(value))
            return
        except ValueError:
            pass
    setattr(cfg, name, value)


def patch_grpo_config(rt: Runtime, module: Any) -> None:
    cls = module.GRPOConfig
    orig = cls.__dict__["__post_init__"]

    def __post_init__(self: Any) -> None:
        if not getattr(self, "_oomguard_seen", False):
            from ..vocab.distributed import fsdp_options
            from .dsconfig import user_deepspeed
            from .trlcompat import features

            rt.observe(observe_config(self))
            rt.emit("config", observed=observe_config(self), world_size=_world(),
                    facts={"fsdp": bool(fsdp_options(getattr(self, "fsdp", None))),
                           "deepspeed": user_deepspeed(self)[1], "missing_packages": missing_packages(),
                           **features().facts()})
        object.__setattr__(self, "_oomguard_seen", True)
        with overrides_reported(rt, "GRPOConfig"):
            apply_config(rt, self)
            orig(self)

    _set(cls, "__post_init__", __post_init__)


# Packages some rungs need (LoRA: peft; 8-bit and 4-bit: bitsandbytes; ZeRO: deepspeed; Liger's loss: liger_kernel),
# checked where they are used.
OPTIONAL_PACKAGES = ("peft", "bitsandbytes", "deepspeed", "liger_kernel")


def missing_packages() -> list[str]:
    """The optional packages this training environment lacks: installed (a distribution, as transformers checks for
    DeepSpeed) and findable, without importing them."""
    out = []
    for name in OPTIONAL_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None and bool(metadata.version(name))
        except (ImportError, ValueError, metadata.PackageNotFoundError):
            found = False
        if not found:
            out.append(name)
    return out


@contextlib.contextmanager
def overrides_reported(rt: Runtime, where: str) -> Iterator[None]:
    """An error raised while oomguard's overrides are applied is reported (event ``override_error``) before it
    propagates: the supervisor then takes back the rung that set them instead of passing the failure through."""
    try:
        yield
    except Exception as e:
        if rt.overrides.to_dict(only_set=True) and not rt.crashed:
            from ..oom.parse import is_oom

            if not is_oom(e):
                rt.emit("override_error", where=where, error=f"{type(e).__name__}: {e}"[:2000],
                        overrides=sorted(rt.overrides.to_dict(only_set=True)))
        raise


def _world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


# ----------------------------------------------------------------------------------------------------------------
# GRPOTrainer


def _bnb_config(torch: Any, rt: Runtime) -> Any:
    """QLoRA's NF4 config, computing in the 16-bit dtype the knobs chose (bfloat16, float16 on a card without it)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=_half(torch, rt),
                              bnb_4bit_use_double_quant=True)


def _half(torch: Any, rt: Runtime) -> Any:
    return torch.float16 if rt.overrides.dtype == "float16" else torch.bfloat16


def _lora_config(rt: Runtime) -> Any:
    from peft import LoraConfig

    k = rt.knobs()
    tm = k.lora_target_modules or "all-linear"
    return LoraConfig(r=int(k.lora_r), lora_alpha=int(k.lora_alpha or 2 * k.lora_r),
                      target_modules=list(tm) if isinstance(tm, tuple) else tm, lora_dropout=0.0,
                      task_type="CAUSAL_LM")


def patch_grpo_trainer(rt: Runtime, module: Any) -> None:
    """TRL's GRPOTrainer, and whatever class a stack binds to its name later (Unsloth's generated trainer is a
    rewritten copy, not a subclass: a patch on TRL's class would never run in it)."""
    patch_trainer_class(rt, module.GRPOTrainer, module)
    for name in ("trl", "trl.trainer", module.__name__):
        if name in sys.modules:
            watch_rebinding(rt, sys.modules[name], module)


def watch_rebinding(rt: Runtime, owner: Any, trainer_module: Any) -> None:
    """Patch any class bound to ``owner.GRPOTrainer`` from now on, when it is bound: the script builds whatever
    class that name holds when it runs ``GRPOTrainer(...)``. A module's class may be swapped for a subclass of it
    (Python allows that for modules); the swap is undone by ``remove()``."""
    cls = type(owner)
    if getattr(cls, "_oomguard_watch", False):
        return

    def __setattr__(self: Any, name: str, value: Any) -> None:
        cls.__setattr__(self, name, value)
        if name == "GRPOTrainer" and isinstance(value, type):
            try:
                patch_trainer_class(rt, value, trainer_module)
            except Exception as e:  # never break the stack's own import
                rt.emit("patch_failed", module=getattr(value, "__module__", "?"), patch="GRPOTrainer",
                        error=f"{type(e).__name__}: {e}"[:2000])

    watched = type(cls.__name__, (cls,), {"__setattr__": __setattr__, "_oomguard_watch": True})
    try:
        owner.__class__ = watched
    except TypeError:
        return
    _UNDO.append(lambda: setattr(owner, "__class__", cls))


def patch_trainer_class(rt: Runtime, cls: type, module: Any) -> None:
    """Wrap ``cls.__init__`` (its own or inherited) and ``train``: once per class, and not again in a subclass of a
    class already patched (the inherited wrapper runs)."""
    orig_init = cls.__init__
    if getattr(orig_init, "_oomguard", False):
        return
    orig_train = cls.__dict__.get("train") or getattr(cls, "train", None)
    sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)  # its signature stays TRL's (trlcompat reads the arguments this TRL takes)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)
        a = bound.arguments
        with overrides_reported(rt, "GRPOTrainer"):
            prepare_trainer_args(rt, a, module)
            orig_init(*bound.args, **bound.kwargs)
        rt.trainer = self
        _after_init(rt, self)

    __init__._oomguard = True  # type: ignore[attr-defined]
    _set(cls, "__init__", __init__)
    orig_save = getattr(cls, "_save_checkpoint", None)
    if orig_save is not None and not getattr(orig_save, "_oomguard", False):
        @functools.wraps(orig_save)
        def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
            # a save the kernel's OOM killer ends says nothing itself: this event tells the supervisor where it was
            rt.emit("saving", step=getattr(getattr(self, "state", None), "global_step", None))
            return orig_save(self, *args, **kwargs)

        _save_checkpoint._oomguard = True  # type: ignore[attr-defined]
        _set(cls, "_save_checkpoint", _save_checkpoint)
    if getattr(orig_train, "_oomguard", False):
        return
    if orig_train is None:
        from transformers import Trainer

        orig_train = Trainer.train

    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        rt.trainer = self
        plan_resume = rt.plan.resume or {}
        resume = plan_resume.get("checkpoint") if plan_resume.get("mode") == "continue" else None
        if resume and not kwargs.get("resume_from_checkpoint") and not args:
            kwargs["resume_from_checkpoint"] = resume
            rt.emit("resume", checkpoint=resume)
        try:
            return orig_train(self, *args, **kwargs)
        except BaseException as e:
            from ..oom.parse import is_oom

            if is_oom(e):
                rt.record_crash(e)
            raise

    train._oomguard = True  # type: ignore[attr-defined]
    _set(cls, "train", train)


def prepare_trainer_args(rt: Runtime, a: dict[str, Any], module: Any) -> None:
    """Observe and rewrite GRPOTrainer's arguments in place (``a`` is the bound-arguments mapping)."""
    import torch

    model = a.get("model")
    args = a.get("args")
    if args is None:
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        args = module.GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        a["args"] = args
    k_over = rt.overrides
    peft_config = a.get("peft_config")
    quant = a.get("quantization_config")
    is_peft_model = type(model).__name__.startswith("Peft") or hasattr(model, "peft_config")
    if isinstance(model, str):
        source = "string"
        mik = dict(args.model_init_kwargs or {})
        dtype = _dtype_name(mik.get("dtype", mik.get("torch_dtype", "float32")))
        q = quant or mik.get("quantization_config")
        in4 = bool(getattr(q, "load_in_4bit", False) or (isinstance(q, dict) and q.get("load_in_4bit")))
    else:
        source = "from_pretrained" if getattr(model, "_oomguard_from_pretrained", False) else "instance"
        dtype = _dtype_name(getattr(model, "dtype", None))
        # a 4-bit load oomguard made is not the script's own (its rung applies only to a model not loaded in 4-bit)
        in4 = not k_over.load_in_4bit and bool(getattr(model, "is_loaded_in_4bit", False))
    lora = peft_config
    if lora is None and is_peft_model:
        cfgs = getattr(model, "peft_config", {}) or {}
        lora = next(iter(cfgs.values()), None) if isinstance(cfgs, dict) else cfgs
    rt.observe({"dtype": dtype, "load_in_4bit": in4, **observed_lora(lora)})
    if (not isinstance(model, str) and getattr(model, "is_gradient_checkpointing", False)
            and not rt.knobs().gradient_checkpointing):
        # enabled on the model already (Unsloth's get_peft_model, a script's own call): the Trainer keeps it on
        # whatever args.gradient_checkpointing says
        rt.resolve({"gradient_checkpointing": True})

    # Apply what only the trainer can take.
    weights = _weights_checkpoint(rt)
    if isinstance(model, str) and weights:
        a["model"] = model = weights
    if isinstance(model, str):
        mik = dict(args.model_init_kwargs or {})
        if k_over.dtype is not None:
            mik.pop("torch_dtype", None)
            mik["dtype"] = k_over.dtype
        if k_over.load_in_4bit and quant is None and "quantization_config" not in mik:
            from .trlcompat import features

            if features().quantization_via == "quantization_config":
                a["quantization_config"] = _bnb_config(torch, rt)
            else:  # TRL before 1.10: no such trainer argument; TRL loads with model_init_kwargs
                mik["quantization_config"] = _bnb_config(torch, rt)
            if mik.get("dtype", "float32") == "float32":
                mik["dtype"] = "float16" if k_over.dtype == "float16" else "bfloat16"
        if mik != dict(args.model_init_kwargs or {}):
            args.model_init_kwargs = mik
    if k_over.lora_r and peft_config is None and not is_peft_model:
        a["peft_config"] = _lora_config(rt)
    dataset = a.get("train_dataset")
    tokenizer = a.get("processing_class")
    if dataset is not None:
        a["train_dataset"] = prepare_dataset(rt, dataset, tokenizer, model, args)
    if rt.probing() and a.get("eval_dataset") is not None and evaluates(args):
        a["eval_dataset"] = probe_eval_dataset(a["eval_dataset"], tokenizer, model, args)
    if evaluates(args) and a.get("eval_dataset") is None:
        # nothing to evaluate on: transformers refuses to evaluate, ms-swift turns evaluation off (its trainer mixin)
        rt.resolve({"eval_strategy": "no"})
    callbacks = list(a.get("callbacks") or [])
    from .callback import make_callback

    callbacks.append(make_callback(rt))
    a["callbacks"] = callbacks
    rt.emit("trainer", facts={"model_source": source, "user_peft": bool(is_peft_model), "world_size": _world(),
                              "missing_packages": missing_packages()},
            observed=dict(rt.observed), resolved=dict(rt.resolved))
    mik = dict(args.model_init_kwargs or {})
    if rt.probe_undecided():
        _decide_probe(rt, a, model, args, mik)
    elif rt.probing() and not getattr(args, "_oomguard_probe", False):  # a config built before the decision
        apply_probe(rt, args, rt.plan.probe or {})
    if isinstance(model, str) and rt.plan.preflight and not placed_elsewhere(mik):
        # TRL loads it inside GRPOTrainer: judge the whole config from the checkpoint's config, before it loads
        config = checkpoint_config(model, mik)
        if config is not None and rt.model_config is None and not placed_elsewhere(mik, config):
            rt.model_config = config
            rt.emit("model", config=config, params=None, dtype=None)
            from . import preflight

            preflight.check(rt, before="loads")


def _decide_probe(rt: Runtime, a: dict[str, Any], model: Any, args: Any, mik: dict[str, Any]) -> None:
    """Probe or run, for an attempt launched as a probe unless the memory model is sure of its config
    (``preflight.decide_probe``); a probe's changes go on the config and datasets before GRPOTrainer reads them."""
    from . import preflight

    if isinstance(model, str):
        config = None if placed_elsewhere(mik) else checkpoint_config(model, mik)
    else:
        config = rt.model_config or model_config_dict(getattr(model, "config", None) or {}) or None
    if config is not None and placed_elsewhere(mik, config):
        config = None
    preflight.decide_probe(rt, config)
    if not rt.probing():
        return
    apply_probe(rt, args, rt.plan.probe or {})
    tokenizer = a.get("processing_class")
    dataset = a.get("train_dataset")
    if dataset is not None and hasattr(dataset, "column_names") and "prompt" in (dataset.column_names or []):
        a["train_dataset"] = _longest(dataset, _tokenizer_for(tokenizer, model), rt, args)
    if a.get("eval_dataset") is not None and evaluates(args):
        a["eval_dataset"] = probe_eval_dataset(a["eval_dataset"], tokenizer, model, args)


def observed_lora(cfg: Any) -> dict[str, Any]:
    """A LoRA config's knobs (a ``peft_config`` argument, or the config of a model PEFT already wraps); no config:
    a full fine-tune. A rank PEFT leaves unset is its default, 8.

    >>> from types import SimpleNamespace
    >>> observed_lora(SimpleNamespace(r=16, lora_alpha=32, target_modules={"v_proj", "q_proj"}))
    {'lora_r': 16, 'lora_alpha': 32, 'lora_target_modules': ('q_proj', 'v_proj')}
    >>> observed_lora(None)
    {'lora_r': 0}
    """
    if cfg is None:
        return {"lora_r": 0}
    out: dict[str, Any] = {"lora_r": int(getattr(cfg, "r", 0) or 0) or 8}
    alpha = getattr(cfg, "lora_alpha", None)
    if isinstance(alpha, (int, float)) and alpha > 0:
        out["lora_alpha"] = int(alpha)
    tm = getattr(cfg, "target_modules", None)
    if isinstance(tm, str) and tm:
        out["lora_target_modules"] = tm
    elif isinstance(tm, (list, tuple, set, frozenset)) and tm:
        out["lora_target_modules"] = tuple(sorted(str(t) for t in tm))
    return out


# GRPOConfig fields a stack may resolve after the script set them (Unsloth turns bf16 off on a CPU without it)
RESOLVED = ("bf16", "fp16")


def resolved_precision(rt: Runtime, args: Any) -> dict[str, Any]:
    """The precision the trainer really trains in, where it differs from what the script's config said and
    oomguard did not set it: those values replace the observed ones (they are what the user's command runs)."""
    out: dict[str, Any] = {}
    knobs = rt.knobs()
    for name in RESOLVED:
        v = getattr(args, name, None)
        if isinstance(v, bool) and getattr(knobs, name) != v:
            out[name] = v
    return rt.resolve(out)


def _after_init(rt: Runtime, trainer: Any) -> None:
    from . import simulate

    dev = simulate.device()
    model = getattr(trainer, "model", None)
    if dev is not None and model is not None:
        dev.adopt(device_tensors(model))
    if rt.model_config is None and model is not None:
        record_model(rt, model)
    if model is not None:
        from . import precision

        facts = precision.facts(model, getattr(trainer, "args", None))
        for stack_facts in rt.stack_facts:  # what a stack around TRL changes (child/stacks/)
            facts.update(stack_facts(trainer))
        resolved_precision(rt, getattr(trainer, "args", None))
        targs = getattr(trainer, "args", None)
        if targs is not None and rt.knobs().evaluates() and not evaluates(targs):
            rt.resolve({"eval_strategy": "no"})  # a stack's trainer turned evaluation off after the config said it
        rt.emit("facts", facts=facts, resolved=dict(rt.resolved))
    if rt.overrides.torch_empty_cache_steps == 1 and hasattr(trainer, "_generate_and_score_completions"):
        inner = trainer._generate_and_score_completions

        def generate_then_empty(*a: Any, **kw: Any) -> Any:
            out = inner(*a, **kw)
            rt.empty_cache()
            return out

        trainer._generate_and_score_completions = generate_then_empty
    if rt.plan.log_to_trainer:
        from .callback import wrap_log

        wrap_log(rt, trainer)
    from . import preflight

    preflight.check(rt)  # last: the model, the knobs and the prompt lengths are all known now


# ----------------------------------------------------------------------------------------------------------------
# Datasets: prompt lengths, the max_prompt_tokens filter and the probe's worst case.


def _prompt_texts(rows: list[Any], tokenizer: Any) -> list[str]:
    texts = []
    for p in rows:
        if isinstance(p, list) and tokenizer is not None and getattr(tokenizer, "chat_template", None):
            texts.append(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True))
        elif isinstance(p, list):
            texts.append(" ".join(str(m.get("content", "")) for m in p if isinstance(m, dict)))
        else:
            texts.append(str(p))
    return texts


def prompt_lengths(rows: list[Any], tokenizer: Any) -> list[int]:
    texts = _prompt_texts(rows, tokenizer)
    if tokenizer is None:
        return [len(t.split()) for t in texts]
    enc = tokenizer(texts, add_special_tokens=False)
    return [len(ids) for ids in enc["input_ids"]]


def _tokenizer_for(tokenizer: Any, model: Any) -> Any:
    if tokenizer is not None and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer
    if tokenizer is not None and hasattr(tokenizer, "tokenizer"):
        return tokenizer.tokenizer  # a processor
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as e:
        global _TOKENIZER_WARNED
        if not _TOKENIZER_WARNED:
            _TOKENIZER_WARNED = True
            why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            sys.stderr.write(f"oomguard: warning: could not load the tokenizer of {name!r} ({type(e).__name__}"
                             f"{': ' + why if why else ''}), so prompt lengths are counted in words, not tokens: "
                             "max_prompt_tokens and the memory model's prompt lengths are approximate; pass "
                             "processing_class= to GRPOTrainer\n")
        return None


_TOKENIZER_WARNED = False


def prepare_dataset(rt: Runtime, dataset: Any, tokenizer: Any, model: Any, args: Any = None) -> Any:
    """Measure prompt lengths, apply max_prompt_tokens, and for a probe keep only the longest prompts."""
    if isinstance(dataset, dict) or not hasattr(dataset, "column_names") or "prompt" not in (dataset.column_names or []):
        return dataset
    tok = _tokenizer_for(tokenizer, model)
    limit = rt.overrides.max_prompt_tokens
    n = len(dataset) if hasattr(dataset, "__len__") else None
    if n is None:  # IterableDataset: filter lazily, no statistics
        if limit:
            rt.emit("dataset", rows=None, dropped=None, max_prompt_tokens=limit)
            return dataset.filter(lambda row: prompt_lengths([row["prompt"]], tok)[0] <= limit)
        return dataset
    if n == 0:
        return dataset
    step = max(1, math.ceil(n / _PROMPT_STATS_ROWS))
    sample_idx = list(range(0, n, step))
    lengths = prompt_lengths([dataset[i]["prompt"] for i in sample_idx], tok)
    ordered = sorted(lengths)
    stats = _stats(n, ordered, step > 1)
    out = dataset
    if limit:
        all_len = lengths if step == 1 else prompt_lengths(list(dataset["prompt"]), tok)
        keep = [i for i, length in enumerate(all_len) if length <= limit]
        dropped = n - len(keep)
        if keep:
            out = dataset.select(keep)
        stats.update(dropped=dropped, max_prompt_tokens=limit)
        sys.stderr.write(f"oomguard: max_prompt_tokens={limit} dropped {dropped} of {n} prompts "
                         f"(longest was {ordered[-1]} tokens)\n")
    rt.emit("dataset", **stats)
    if rt.probing():
        out = _longest(out, tok, rt, args)
    return out


def _stats(rows: int, ordered: list[int], sampled: bool) -> dict[str, Any]:
    return {"rows": rows, "prompt_tokens_max": ordered[-1],
            "prompt_tokens_p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "sampled": sampled}


def emit_prompt_stats(rt: Runtime, prompts: list[Any], tok: Any) -> None:
    """The ``dataset`` event for prompts a stack's trainer holds in its own format (the memory model's prompt
    length); nothing is filtered or reordered."""
    if not prompts:
        return
    rt.emit("dataset", **_stats(len(prompts), sorted(prompt_lengths(prompts, tok)), False))


def _probe_prompts(rt: Runtime, args: Any) -> int:
    """Distinct prompts the probe's steps consume: one generation batch of prompts per step (full groups)."""
    steps = int(rt.plan.probe.get("steps", PROBE_STEPS))
    try:
        per_round = int(args.generation_batch_size) // int(args.num_generations)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return int(rt.plan.probe.get("rows", 64))
    return max(1, per_round * steps)


def probe_eval_dataset(dataset: Any, tokenizer: Any, model: Any, args: Any) -> Any:
    """The probe's evaluation: one evaluation batch per device of the longest evaluation prompt (each of several
    evaluation datasets alike), so the probe's one evaluation pass is the worst an evaluation of the run holds."""
    if isinstance(dataset, dict):
        return {name: probe_eval_dataset(d, tokenizer, model, args) for name, d in dataset.items()}
    if not hasattr(dataset, "column_names") or "prompt" not in (dataset.column_names or []) or not len(dataset):
        return dataset
    lengths = prompt_lengths(list(dataset["prompt"]), _tokenizer_for(tokenizer, model))
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    rows = int(getattr(args, "per_device_eval_batch_size", 8) or 8) * _world()
    per_prompt = int(getattr(args, "num_generations_eval", None) or getattr(args, "num_generations", 8) or 8)
    return dataset.select([longest] * max(1, rows // max(1, per_prompt)))


def _longest(dataset: Any, tok: Any, rt: Runtime, args: Any = None) -> Any:
    """The probe trains only on the longest prompt, repeated, so every micro-batch of every step is the worst case.

    The worst case is a step after the first (the optimizer state exists from the first optimizer step on) whose
    micro-batch is padded to the longest prompt. The probe's first step has no optimizer state yet, so its later steps
    must hold the longest prompt too: with the several longest prompts instead, the sampler's shuffle gives a later
    step shorter ones, and a probe measured that way under-measures the run (by a third on a dataset whose prompts
    range from 18 to 56 tokens)."""
    lengths = prompt_lengths(list(dataset["prompt"]), tok)
    if not lengths:
        return dataset
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    rows = max(1, _probe_prompts(rt, args))
    rt.emit("probe_dataset", rows=rows, prompt_tokens=lengths[longest])
    return dataset.select([longest] * rows)


# ----------------------------------------------------------------------------------------------------------------
# from_pretrained


_MODEL_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
               "max_position_embeddings", "attention_bias", "mlp_bias", "torch_dtype", "dtype",
               "quantization_config",  # a checkpoint quantised already: the pre-flight does not judge its load
               # what the memory model reads beyond a dense decoder (memory/estimate/readconfig.py): biases, experts
               # and the layers that carry them, latent attention, sliding windows, a vision tower
               "qkv_bias", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
               "experts_per_token", "top_k", "moe_intermediate_size", "first_k_dense_replace", "decoder_sparse_step",
               "mlp_only_layers", "n_shared_experts", "shared_expert_intermediate_size", "output_router_logits",
               "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
               "layer_types", "use_sliding_window", "max_window_layers", "sliding_window_pattern",
               "mm_tokens_per_image", "text_config", "vision_config",
               "depth", "num_heads", "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
               "fullatt_block_indexes", "out_hidden_size", "in_channels", "in_chans", "num_channels", "image_size",
               "vision_use_head")
_NESTED = ("text_config", "vision_config")


def model_config_dict(cfg: Any) -> dict[str, Any]:
    """The fields of a transformers config that the memory model reads (a multimodal model's ``text_config`` and
    ``vision_config`` as nested dicts of the same fields; ``quantization_config`` as its ``quant_method``).

    >>> model_config_dict({"model_type": "gemma3", "rope_theta": 1e6, "vision_config": {"patch_size": 14, "x": 1},
    ...                    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}})
    {'model_type': 'gemma3', 'quantization_config': {'quant_method': 'mxfp4'}, 'vision_config': {'patch_size': 14}}
    """
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg) if isinstance(cfg, dict) else {}
    out: dict[str, Any] = {}
    for k in _MODEL_KEYS:
        if k not in d:
            continue
        v = d[k]
        if k in _NESTED and v is not None:
            out[k] = model_config_dict(v)
        elif k == "quantization_config" and isinstance(v, dict):
            out[k] = {"quant_method": _plain(v.get("quant_method"))}
        else:
            out[k] = _plain(v)
    return out


def checkpoint_config(name: Any, init_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's config (local, or already in the hub cache), read without loading a weight; None when it cannot
    be read (the pre-flight then waits until the model is built)."""
    if not isinstance(name, (str, os.PathLike)):
        return None
    try:
        from transformers import AutoConfig

        kw = {k: init_kwargs[k] for k in ("revision", "trust_remote_code", "cache_dir", "token", "subfolder",
                                          "local_files_only") if k in init_kwargs}
        return model_config_dict(AutoConfig.from_pretrained(name, **kw)) or None
    except Exception:  # no network, remote code refused, an unknown architecture: not ours to fail on
        return None


def record_model(rt: Runtime, model: Any) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    rt.model_config = model_config_dict(cfg)
    try:
        params = sum(p.numel() for p in model.parameters())
    except Exception:
        params = None
    rt.emit("model", config=rt.model_config, params=params, dtype=_dtype_name(getattr(model, "dtype", None)))


def _weights_checkpoint(rt: Runtime) -> str | None:
    """The checkpoint whose weights a new run starts from, after a rung that a checkpoint cannot continue."""
    r = rt.plan.resume or {}
    return r.get("checkpoint") if r.get("mode") == "weights" else None


def placed_elsewhere(kwargs: dict[str, Any], config: dict[str, Any] | None = None) -> bool:
    """A load the pre-flight cannot judge as "every weight on this device, in the load's dtype": spread by
    ``device_map``/``max_memory``, a checkpoint quantised already (AWQ, GPTQ, FP8: its ``quantization_config``), an
    8-bit load, or weights a ZeRO-3 or FSDP run shards over the ranks.

    >>> placed_elsewhere({"device_map": "auto"}), placed_elsewhere({}, {"quantization_config": {"quant_method": "awq"}})
    (True, True)
    >>> placed_elsewhere({"dtype": "bfloat16"})
    False
    """
    q = kwargs.get("quantization_config")
    eight = bool(getattr(q, "load_in_8bit", False) or (isinstance(q, dict) and q.get("load_in_8bit")))
    # `accelerate launch` with a DeepSpeed ZeRO-3 or FSDP config says so in the environment of every rank
    sharded = (os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
               or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true")
    return (kwargs.get("device_map") not in (None, "cpu") or "max_memory" in kwargs or eight or sharded
            or bool((config or {}).get("quantization_config")))


def _before_load(rt: Runtime, name: Any, kwargs: dict[str, Any], requested: Any) -> None:
    """Before ``from_pretrained`` places the weights: report the model's shape (so an OOM while loading can be
    answered by prediction, and the supervisor knows this command passes through a load), then let the pre-flight
    judge the load (``preflight.check_load``). Never fails the load: a config it cannot read is skipped."""
    try:
        _judge_load(rt, name, kwargs, requested)
    except SystemExit:
        raise
    except Exception as e:
        sys.stderr.write(f"oomguard: warning: could not judge this load before it ran ({type(e).__name__}: {e})\n")


def _judge_load(rt: Runtime, name: Any, kwargs: dict[str, Any], requested: Any) -> None:
    given = kwargs.get("config")
    config = model_config_dict(given) if given is not None and not isinstance(given, str) else \
        checkpoint_config(given or name, kwargs)
    if not config:
        return
    # a script that imported GRPOTrainer will build one: its knobs (LoRA) reach the next attempt
    reaches = ["trainer"] if "trl.trainer.grpo_trainer" in sys.modules else []
    rt.emit("model", config=config, params=None, dtype=None, reaches=reaches)
    if not rt.plan.preflight or placed_elsewhere(kwargs, config) or _sharded(rt):
        return
    dtype = _dtype_name(kwargs.get("dtype", kwargs.get("torch_dtype"))) or "auto"
    if dtype == "auto":  # transformers 5's default: the checkpoint's own dtype
        dtype = _dtype_name(config.get("dtype") or config.get("torch_dtype")) or "float32"
    q = kwargs.get("quantization_config")
    in4 = bool(getattr(q, "load_in_4bit", False) or (isinstance(q, dict) and q.get("load_in_4bit")))
    if requested not in (None, "auto"):
        rt.observe({"dtype": _dtype_name(requested)})
    elif not rt.overrides.dtype and not rt.overrides.load_in_4bit:
        rt.observe({"dtype": dtype})  # what the script loads when oomguard changes nothing
    try:
        knobs = rt.knobs().replace(dtype=dtype, load_in_4bit=in4)
    except (TypeError, ValueError):
        return
    from . import preflight

    preflight.check_load(rt, config, knobs)


def _zero3_comm() -> None:
    """ZeRO-3 partitions the weights while ``from_pretrained`` creates them, with DeepSpeed's own communication
    backend. On a GPU, accelerate starts it when the training arguments are built; on CPU (``use_cpu``) transformers
    takes another branch and never does, so DeepSpeed would see one rank and reject its batch sizes. Start it here
    (gloo) when that is the case: the ZeRO-3 rung must work wherever the run does."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            return
        import deepspeed
        import deepspeed.comm as ds_comm
        import torch

        if not ds_comm.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    except Exception as e:  # never the reason a load fails
        sys.stderr.write(f"oomguard: warning: could not start DeepSpeed's communication for ZeRO-3 ({e})\n")


def _sharded(rt: Runtime) -> bool:
    """This run shards its weights over the ranks (ZeRO-3, FSDP): a load's bytes on one device are not its size."""
    k = rt.knobs()
    return (k.zero_stage == 3) or bool(rt.facts().get("fsdp"))


def device_tensors(model: Any) -> list[Any]:
    """What a loaded model keeps on its device: parameters, buffers, and a 4-bit weight's quantisation state
    (bitsandbytes keeps the absmax and its own quantisation outside ``parameters()``)."""
    out = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        while qs is not None:
            out += [t for t in (getattr(qs, "absmax", None), getattr(qs, "code", None)) if t is not None]
            qs = getattr(qs, "state2", None)
    return out


def _is_policy(cls: type) -> bool:
    return cls.__name__.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel"))


def patch_from_pretrained(rt: Runtime, module: Any) -> None:
    base = module.PreTrainedModel
    orig = base.__dict__["from_pretrained"].__func__

    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not _is_policy(cls):
            return orig(cls, *args, **kwargs)
        import torch

        weights = _weights_checkpoint(rt)
        if weights:
            if args:
                args = (weights, *args[1:])
            else:
                kwargs["pretrained_model_name_or_path"] = weights
            rt.emit("weights_from", checkpoint=weights)
        requested = kwargs.get("dtype", kwargs.get("torch_dtype"))
        ov = rt.overrides
        if ov.dtype is not None and ov.dtype != "auto":
            kwargs.pop("torch_dtype", None)
            kwargs["dtype"] = getattr(torch, ov.dtype)
        if ov.load_in_4bit and "quantization_config" not in kwargs:
            kwargs["quantization_config"] = _bnb_config(torch, rt)
            if kwargs.get("dtype") in (None, "auto", torch.float32, "float32"):
                kwargs["dtype"] = _half(torch, rt)
        _before_load(rt, args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs, requested)
        _zero3_comm()
        model = orig(cls, *args, **kwargs)
        # What the script asked for; with "auto" (the default) that is the checkpoint's dtype, known once loaded
        # without an override (the first attempt always loads without one).
        if requested not in (None, "auto"):
            rt.observe({"dtype": _dtype_name(requested)})
        elif ov.dtype is None and not ov.load_in_4bit:
            rt.observe({"dtype": _dtype_name(getattr(model, "dtype", None))})
        try:
            model._oomguard_from_pretrained = True
        except Exception:
            pass
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            dev.adopt(device_tensors(model))
        record_model(rt, model)
        return model

    _set(base, "from_pretrained", classmethod(from_pretrained))
