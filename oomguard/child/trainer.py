"""``GRPOTrainer``: its arguments observed and rewritten before TRL reads them (the script's model, LoRA and datasets;
oomguard's dtype, 4-bit load and LoRA; the prompts measured; the probe settled), then, once built, the model's shape,
the run's facts, the progress callback and the pre-flight. Whatever class a stack binds to TRL's name is patched too.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from ..vocab.events import CodeSeen, ModelSeen, PatchFailed, Resumed, Saving
from ..vocab.protocol import ProbePlan
from . import engine, ran
from .datasets import prepare_dataset
from .images import (
    image_facts,
    keeps_mxfp4,
    pixel_budget,
    set_pixel_budget,
    target_parameters,
    vision_frozen,
)
from .load import (
    bnb_config,
    checkpoint_config,
    device_tensors,
    placed_elsewhere,
    record_model,
    weights_checkpoint,
)
from .patching import UNDO, dtype_name, evaluates, missing_packages, overrides_reported, set_attr, world
from .probe import apply_probe, probe_datasets, settle_probe
from .prompts import check_built, construction_for
from .runtime import Runtime


def _lora_config(rt: Runtime) -> Any:
    from peft import LoraConfig

    k = rt.knobs()
    assert k.lora_r is not None  # asked for only where a rank is set
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
    cls: Any = type(owner)  # a module's class, or a subclass a stack swapped in
    if getattr(cls, "_oomguard_watch", False):
        return

    def __setattr__(self: Any, name: str, value: Any) -> None:
        cls.__setattr__(self, name, value)
        if name == "GRPOTrainer" and isinstance(value, type):
            try:
                patch_trainer_class(rt, value, trainer_module)
            except Exception as e:  # never break the stack's own import
                rt.emit(PatchFailed(module=getattr(value, "__module__", "?"), patch="GRPOTrainer",
                        error=f"{type(e).__name__}: {e}"[:2000]))

    watched = type(cls.__name__, (cls,), {"__setattr__": __setattr__, "_oomguard_watch": True})
    try:
        owner.__class__ = watched
    except TypeError:
        return
    UNDO.append(lambda: setattr(owner, "__class__", cls))

def patch_trainer_class(rt: Runtime, cls: type[Any], module: Any) -> None:
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
            ran.notice(rt, a.get("args"), ran.BEFORE_TRAINER)
            ran.report(rt)  # a locked value the script set again stops here, before anything loads
            prepare_trainer_args(rt, a, module)
            ran.mark(a.get("args"))  # as oomguard leaves it (a probe's own settings included)
            orig_init(*bound.args, **bound.kwargs)
        rt.trainer = self
        ran.notice(rt, getattr(self, "args", None), ran.IN_TRAINER)
        after_init(rt, self)

    __init__._oomguard = True  # type: ignore[attr-defined]
    set_attr(cls, "__init__", __init__)
    orig_save = getattr(cls, "_save_checkpoint", None)
    if orig_save is not None and not getattr(orig_save, "_oomguard", False):
        @functools.wraps(orig_save)
        def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
            # a save the kernel's OOM killer ends says nothing itself: this event tells the supervisor where it was
            rt.emit(Saving(step=getattr(getattr(self, "state", None), "global_step", None)))
            return orig_save(self, *args, **kwargs)

        _save_checkpoint._oomguard = True  # type: ignore[attr-defined]
        set_attr(cls, "_save_checkpoint", _save_checkpoint)
    if getattr(orig_train, "_oomguard", False):
        return
    if orig_train is None:
        from transformers import Trainer

        orig_train = Trainer.train

    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        rt.trainer = self
        ran.notice(rt, getattr(self, "args", None), ran.BEFORE_TRAIN)
        ran.report(rt)  # the last word before training: what it trains with
        plan_resume = rt.plan.resume
        resume = plan_resume.checkpoint if plan_resume is not None and plan_resume.mode == "continue" else None
        if resume and not kwargs.get("resume_from_checkpoint") and not args:
            kwargs["resume_from_checkpoint"] = resume
            rt.emit(Resumed(checkpoint=resume))
        try:
            return orig_train(self, *args, **kwargs)
        except BaseException as e:
            from ..oom.parse import is_oom

            if is_oom(e):
                rt.record_crash(e)
            raise

    train._oomguard = True  # type: ignore[attr-defined]
    set_attr(cls, "train", train)

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
        dtype = dtype_name(mik.get("dtype", mik.get("torch_dtype", "float32")))
        q = quant or mik.get("quantization_config")
        in4 = bool(getattr(q, "load_in_4bit", False) or (isinstance(q, dict) and q.get("load_in_4bit")))
    else:
        source = "from_pretrained" if getattr(model, "_oomguard_from_pretrained", False) else "instance"
        # the loaded model's dtype is the script's, unless oomguard's from_pretrained loaded it in its own dtype or in
        # 4-bit (the patch observed the script's then, where the checkpoint's config could be read)
        ours = source == "from_pretrained" and (k_over.dtype is not None or bool(k_over.load_in_4bit))
        dtype = None if ours else dtype_name(getattr(model, "dtype", None))
        # a 4-bit load oomguard made is not the script's own (its rung applies only to a model not loaded in 4-bit)
        in4 = not k_over.load_in_4bit and bool(getattr(model, "is_loaded_in_4bit", False))
    lora = peft_config
    if lora is None and is_peft_model:
        cfgs = getattr(model, "peft_config", {}) or {}
        lora = next(iter(cfgs.values()), None) if isinstance(cfgs, dict) else cfgs
    rt.observe({**({"dtype": dtype} if dtype is not None else {}), "load_in_4bit": in4, **observed_lora(lora)})
    if (not isinstance(model, str) and getattr(model, "is_gradient_checkpointing", False)
            and not rt.knobs().gradient_checkpointing):
        # enabled on the model already (Unsloth's get_peft_model, a script's own call): the Trainer keeps it on
        # whatever args.gradient_checkpointing says
        rt.resolve({"gradient_checkpointing": True})
        rt.runs_instead({"gradient_checkpointing": True}, ran.MODEL_CHECKPOINTING)
    if lora is not None:  # the script's own LoRA: a LoRA of oomguard's is never added to it
        rt.runs_instead(observed_lora(lora), ran.OWN_LORA)
    if source == "instance" and k_over.dtype is not None and not in4 and dtype is not None:
        rt.runs_instead({"dtype": dtype}, ran.OWN_MODEL)  # built without from_pretrained: oomguard's dtype missed it

    # Apply what only the trainer can take.
    weights = weights_checkpoint(rt)
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
                a["quantization_config"] = bnb_config(torch, rt)
            else:  # TRL before 1.10: no such trainer argument; TRL loads with model_init_kwargs
                mik["quantization_config"] = bnb_config(torch, rt)
            if mik.get("dtype", "float32") == "float32":
                mik["dtype"] = "float16" if k_over.dtype == "float16" else "bfloat16"
        if mik != dict(args.model_init_kwargs or {}):
            args.model_init_kwargs = mik
    if k_over.lora_r and peft_config is None and not is_peft_model:
        a["peft_config"] = _lora_config(rt)
    dataset = a.get("train_dataset")
    tokenizer = a.get("processing_class")
    facts = {**image_facts(dataset), **budget_facts(rt, tokenizer, model),
             **engine.report(rt, args, rollout_func=a.get("rollout_func"))}
    if lora is not None and (tp := target_parameters(lora)):
        facts["lora_target_parameters"] = tp
    if lora is not None:
        facts["lora_dropout"] = lora_dropout(lora)
    construction = construction_for(rt, a, args, model)
    if dataset is not None:
        a["train_dataset"] = prepare_dataset(rt, dataset, tokenizer or getattr(construction, "processing_class", None),
                                             model, args, construction)
    if rt.probing():  # a probe from the start (one launched unless the model is sure is settled below)
        probe_datasets(rt, a, model, args)
    if evaluates(args) and a.get("eval_dataset") is None:
        # nothing to evaluate on: transformers refuses to evaluate, ms-swift turns evaluation off (its trainer mixin)
        rt.resolve({"eval_strategy": "no"})
    callbacks = list(a.get("callbacks") or [])
    from .callback import make_callback

    callbacks.append(make_callback(rt))
    a["callbacks"] = callbacks
    rt.emit(CodeSeen(point="trainer", facts={"model_source": source, "user_peft": bool(is_peft_model), "world_size": world(),
                              "missing_packages": missing_packages(), **facts},
            observed=dict(rt.observed), resolved=dict(rt.resolved)))
    ran.report(rt)  # before TRL loads a model given by name
    mik = dict(args.model_init_kwargs or {})
    if rt.probe_undecided():
        settle_probe(rt, a, model, args, mik)
    elif rt.probing() and not getattr(args, "_oomguard_probe", False):  # a config built before the decision
        apply_probe(rt, args, rt.plan.probe or ProbePlan())
    if isinstance(model, str) and rt.plan.preflight and not placed_elsewhere(mik):
        # TRL loads it inside GRPOTrainer: judge the whole config from the checkpoint's config, before it loads
        config = checkpoint_config(model, mik)
        if config is not None and rt.model_config is None and not placed_elsewhere(mik, config):
            rt.model_config = config
            rt.emit(ModelSeen(config=config, params=None, dtype=None))
            from . import preflight

            preflight.check(rt, before="loads")

def budget_facts(rt: Runtime, processor: Any, model: Any = None) -> dict[str, Any]:
    """A vision-language model's pixel budget: the processor's own observed as the script's ``max_pixels`` (a model
    directory's ``preprocessor_config.json`` where TRL will load the processor itself), oomguard's set on it, and
    its floor and class as facts."""
    read = pixel_budget(processor)
    if not read and isinstance(model, str) and processor is None:  # TRL loads the processor inside GRPOTrainer
        from ..memory.estimate import load_pixel_budget

        try:
            high = load_pixel_budget(model)[1]
        except ValueError:
            high = None
        read = {"max_pixels": high} if high else {}
    if read.get("max_pixels"):
        rt.observe({"max_pixels": read["max_pixels"]})
    if rt.overrides.max_pixels and processor is not None:
        set_pixel_budget(processor, rt.overrides.max_pixels)
    return {k: v for k, v in read.items() if k != "max_pixels"}


def model_facts(model: Any) -> dict[str, Any]:
    """What the loaded model says beyond the knobs: a frozen vision tower, gpt-oss's experts kept in MXFP4."""
    out: dict[str, Any] = {}
    if vision_frozen(model):
        out["freeze_vision"] = True
    if keeps_mxfp4(model):
        out["keep_mxfp4"] = True
    return out


def lora_dropout(cfg: Any) -> float:
    """The dropout of a LoRA config (PEFT's ``lora_dropout``, a mapping's or an object's); 0 where it has none.

    >>> from types import SimpleNamespace
    >>> lora_dropout(SimpleNamespace(lora_dropout=0.05)), lora_dropout({"lora_dropout": "0.1"}), lora_dropout(None)
    (0.05, 0.1, 0.0)
    """
    v = cfg.get("lora_dropout") if isinstance(cfg, dict) else getattr(cfg, "lora_dropout", None)
    try:
        return max(0.0, float(v or 0.0))
    except (TypeError, ValueError):
        return 0.0


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

def after_init(rt: Runtime, trainer: Any) -> None:
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
        facts.update(model_facts(model))
        facts.update(budget_facts(rt, getattr(trainer, "processing_class", None)))
        for stack_facts in rt.stack_facts:  # what a stack around TRL changes (child/stacks/)
            facts.update(stack_facts(trainer))
        if facts.get("stack") == "unsloth" and rt.facts().get("generation_engine") == "vllm_colocate":
            facts["generation_engine"] = "unsloth_fast_inference"  # Unsloth's own vLLM, its fast_inference
        resolved_precision(rt, getattr(trainer, "args", None))
        targs = getattr(trainer, "args", None)
        if targs is not None and rt.knobs().evaluates() and not evaluates(targs):
            rt.resolve({"eval_strategy": "no"})  # a stack's trainer turned evaluation off after the config said it
        rt.emit(CodeSeen(point="facts", facts=facts, resolved=dict(rt.resolved), observed=dict(rt.observed)))
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
    ran.report(rt)  # the trainer as TRL (or a stack) built it
    check_built(rt, trainer)  # the prompts again, as the built trainer tokenizes them
    from . import preflight

    preflight.check(rt)  # last: the model, the knobs and the prompt lengths are all known now
