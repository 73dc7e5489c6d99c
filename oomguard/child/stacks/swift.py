"""ms-swift's ``swift rlhf --rlhf_type grpo``: TRL underneath, with its own arguments, config class and trainer.

``swift rlhf`` is a launcher that runs ``python swift/cli/rlhf.py ARGS`` (under torchrun when ``NPROC_PER_NODE`` is
set), with the flags, a positional YAML/JSON config file or ``RAY_SWIFT_ARGS`` parsed into ``RLHFArguments``. Swift's
``GRPOConfig`` subclasses TRL's but skips TRL's ``__post_init__``, and its ``GRPOTrainer`` deletes
``trl.GRPOTrainer.__init__`` when it is imported, so the patches on TRL's classes never run. This adapter patches
swift's own construction points instead, in the training process (ms-swift 4.x):

- ``swift.arguments.rlhf_args.RLHFArguments.__post_init__``: what the model is loaded and adapted with. The user's
  own values are recorded (``tuner_type``/``lora_rank`` as ``lora_r``, ``quant_method``/``quant_bits`` as
  ``load_in_4bit``, ``torch_dtype`` as ``dtype``) and oomguard's knobs are set where swift reads them, before swift
  derives the rest: ``lora_r`` as ``tuner_type lora --lora_rank``, ``load_in_4bit`` as ``--quant_method bnb
  --quant_bits 4``, ``dtype`` as ``--torch_dtype``, ZeRO as ``--deepspeed zero2|zero3|zero2_offload|zero3_offload``
  (or ``--deepspeed PATH``, swift's preset for the stage with exactly the offloads chosen, where none says them),
  ``vllm_max_model_length`` as ``--vllm_max_model_len``, vLLM's sleep as ``--sleep_level 1``. A probe writes into a
  scratch directory, not the user's ``output_dir``.
- ``swift.rlhf_trainers.arguments.GRPOConfig.__post_init__``: TRL's knobs, which swift names as TRL does
  (``num_generations``, ``max_completion_length``, ``per_device_train_batch_size``, ...): recorded and set before
  swift derives ``steps_per_generation`` and ``generation_batch_size`` from them (the same as TRL's GRPOConfig).
- ``swift.rlhf_trainers.grpo_trainer.GRPOTrainer.__init__``: once built, what TRL's trainer patch does after its
  init (the model's shape, the prompts' lengths, the progress callback, the pre-flight).

How swift spells each knob is one table, ``oomguard/vocab/stacks/swift.py`` (``SWIFT``), read both ways: this adapter
sets and observes the arguments through it, and the diff and the lock print swift's flags from it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ...vocab.events import CodeSeen
from ...vocab.knobs import STACK_ONLY
from ...vocab.stacks.spelling import Generated
from ...vocab.stacks.swift import ARGUMENTS, SWIFT, is_preset
from ..datasets import PROMPT_STATS_ROWS
from ..runtime import Runtime

STACK = "swift"
# the modules whose import loads this adapter's patches (the bootstrap reads these tables)
TRIGGERS = {"swift.arguments.rlhf_args": "patch_arguments", "swift.rlhf_trainers.arguments": "patch_config",
            "swift.rlhf_trainers.grpo_trainer": "patch_trainer"}
SIMULATED_TRIGGERS: dict[str, str] = {}
SIMULATED_ENVIRONMENT: dict[str, str] = {}
# knobs swift has no way to take: oomguard drops long prompts from a TRL dataset; swift encodes its own
CANNOT_TAKE = ("max_prompt_tokens",)
# knobs swift takes that TRL lacks: the trainer's weights and optimizer wait in host RAM while vLLM generates
TAKES = tuple(sorted(STACK_ONLY))
# the knob swift reads on RLHFArguments and again on its GRPOConfig: offload while vLLM generates
OFFLOAD = ("offload_during_generation",)


def unmodelled(args: Any) -> list[str]:
    """What swift's arguments do that the memory model does not count (``RunFacts.unmodelled``): packed or
    padding-free batches (``--padding_free``, ``--packing``), whose rows are not padded to the longest.

    >>> from types import SimpleNamespace
    >>> unmodelled(SimpleNamespace(padding_free=True, packing=False)), unmodelled(object())
    (['padding_free'], [])
    """
    return ["padding_free"] if getattr(args, "padding_free", False) or getattr(args, "packing", False) else []


def observed_offload(args: Any) -> dict[str, Any]:
    """``--offload_model`` and ``--offload_optimizer`` as the knob ``offload_during_generation`` (both, or not).

    >>> from types import SimpleNamespace
    >>> observed_offload(SimpleNamespace(offload_model=True, offload_optimizer=False)), observed_offload(object())
    ({'offload_during_generation': False}, {})
    """
    return SWIFT.observe(args, knobs=OFFLOAD)


def apply_offload(rt: Runtime, args: Any) -> None:
    """oomguard's ``offload_during_generation`` as swift's two flags (only ever turned on)."""
    SWIFT.apply(rt.overrides, args, knobs=OFFLOAD)


def lacks(trl_lacks: Any) -> list[str]:
    """What swift cannot take: TRL's lacks, less what swift adds, plus what swift drops.

    >>> lacks(["offload_during_generation", "vllm_max_model_length"])
    ['max_prompt_tokens', 'vllm_max_model_length']
    """
    return sorted({*trl_lacks, *CANNOT_TAKE} - set(TAKES))


def observed_model_args(args: Any) -> dict[str, Any]:
    """The user's model-level settings (and offload while vLLM generates) in oomguard's knobs.

    >>> from types import SimpleNamespace
    >>> observed_model_args(SimpleNamespace(tuner_type="lora", lora_rank=8, lora_alpha=32.0, quant_method=None,
    ...                                     quant_bits=None, torch_dtype=None, target_modules=["all-linear"]))
    {'lora_r': 8, 'lora_alpha': 32, 'lora_target_modules': 'all-linear', 'load_in_4bit': False}
    """
    return SWIFT.observe(args, point=ARGUMENTS)


def lora_facts(args: Any) -> dict[str, Any]:
    """The dropout of swift's own LoRA (``--lora_dropout``, 0.05 by default), for the memory model; nothing for a
    full fine-tune.

    >>> from types import SimpleNamespace
    >>> lora_facts(SimpleNamespace(tuner_type="lora", lora_dropout=0.05))
    {'lora_dropout': 0.05}
    >>> lora_facts(SimpleNamespace(tuner_type="full"))
    {}
    """
    from ..trainer import lora_dropout

    return {"lora_dropout": lora_dropout(args)} if str(getattr(args, "tuner_type", "") or "").lower() == "lora" else {}


def apply_model_args(rt: Runtime, args: Any) -> None:
    """oomguard's model-level knobs, set where swift reads them (before ``RLHFArguments.__post_init__``): LoRA, 4-bit,
    the dtype, ZeRO as one of swift's DeepSpeed presets (or, where none says exactly what the rung chose, a JSON
    written from swift's preset for the stage), vLLM's context and sleep, the offload while vLLM generates."""
    ov = rt.overrides
    own = getattr(args, "deepspeed", None)
    SWIFT.apply(ov, args, point=ARGUMENTS)
    if own and not is_preset(own) and getattr(args, "deepspeed", None) is not own:
        args.deepspeed = own_deepspeed_file(rt, own)  # the user's own JSON, not one of swift's presets
    elif isinstance(getattr(args, "deepspeed", None), Generated):
        args.deepspeed = deepspeed_file(rt, args.deepspeed, own)
    if ov.dtype is not None and ov.dtype not in ("auto", "float32") and not _cuda():
        # swift turns 16-bit mixed precision on with a 16-bit dtype, which needs use_cpu here
        args.use_cpu = True
        rt.adapt("use_cpu", True, "ms-swift turns 16-bit mixed precision on with a 16-bit dtype, which needs "
                                  "use_cpu where there is no GPU")
    probe = rt.plan.probe
    if probe and rt.probe_undecided():  # swift builds its trainer itself: nothing later could make it a probe
        rt.decide_probe("probe", "ms-swift's arguments are read before the model, so the probe is decided first")
    if probe and rt.probing() and probe.output_dir:  # a probe's files go to oomguard's scratch directory
        args.output_dir = probe.output_dir
        args.save_strategy = "no"
        args.add_version = False


def deepspeed_file(rt: Runtime, wanted: Generated, own: Any) -> str | dict[str, Any]:
    """The DeepSpeed JSON for a ZeRO stage and offloads no preset of swift's says (ZeRO-3 with the optimizer offloaded
    but not the parameters): swift's own preset for the stage with exactly those offloads, written next to the
    attempt's records; its path (swift reads a path to a JSON file as it reads a preset), else the config itself.
    ``own``: the user's ``--deepspeed``, named in the report as what it replaces."""
    from ...vocab.distributed import deepspeed_config
    from ..dsconfig import write_generated

    how = dict(wanted.settings)
    cfg = deepspeed_config(swift_preset(str(how.pop("preset"))), **how)
    return write_generated(rt, cfg, str(own) if own else None) or cfg


def own_deepspeed_file(rt: Runtime, own: Any) -> str | dict[str, Any]:
    """The user's own ``--deepspeed`` (a JSON file or string, not a preset's name) with the rung's ZeRO stage,
    offloads and buffer sizes written into it, every other key as they wrote it: a preset in its place would lose
    their settings. Its path, else the config itself."""
    from ...vocab.distributed import load_user_deepspeed
    from ..dsconfig import with_rung, write_generated

    cfg = with_rung(load_user_deepspeed(own), rt.overrides)
    return write_generated(rt, cfg, str(own)) or cfg


def swift_preset(name: str) -> dict[str, Any] | None:
    """swift's DeepSpeed preset ``name`` (``zero3``: swift/config/zero3.json) as swift reads it, or None where this
    swift has none (the generated config then starts from transformers' "auto" template)."""
    import importlib.util
    import json
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("swift")
        if spec is None or spec.origin is None:
            return None
        return json.loads((Path(spec.origin).parent / "config" / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, ImportError):
        return None


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def patch_arguments(rt: Runtime, module: Any) -> None:
    """``RLHFArguments.__post_init__``: record the user's model-level settings, then set oomguard's."""
    from ..patching import missing_packages, overrides_reported, set_attr

    cls = module.RLHFArguments
    orig = cls.__dict__["__post_init__"]

    @functools.wraps(orig)
    def __post_init__(self: Any) -> None:
        if getattr(self, "_oomguard_seen", False):
            return orig(self)
        object.__setattr__(self, "_oomguard_seen", True)
        user = {**observed_model_args(self), **observed_offload(self)}
        with overrides_reported(rt, "swift RLHFArguments"):
            apply_model_args(rt, self)
            orig(self)
        if "dtype" not in user and getattr(self, "torch_dtype", None) is not None and rt.overrides.dtype is None:
            user["dtype"] = str(self.torch_dtype).replace("torch.", "")  # swift's default: the model's own dtype
        rt.observe(user)
        rt.emit(CodeSeen(point="trainer", observed=user, facts={"model_source": "from_pretrained", "user_peft": False,
                                                 "stack": STACK, "trl_lacks": lacks(()),
                                                 "missing_packages": missing_packages(),
                                                 "unmodelled": unmodelled(self), **lora_facts(self)}))

    set_attr(cls, "__post_init__", __post_init__)


def patch_config(rt: Runtime, module: Any) -> None:
    """Swift's ``GRPOConfig.__post_init__``: TRL's knobs, recorded and set before swift derives the batch geometry."""
    from ..config import apply_config, observe_config
    from ..patching import missing_packages, overrides_reported, set_attr, world
    from ..trlcompat import features

    cls = module.GRPOConfig
    orig = cls.__dict__["__post_init__"]

    @functools.wraps(orig)
    def __post_init__(self: Any) -> None:
        if not getattr(self, "_oomguard_seen", False):
            seen = {**observe_config(self), **observed_offload(self)}
            rt.observe(seen)
            rt.emit(CodeSeen(point="config", observed=seen, world_size=world(),
                    facts={"stack": STACK, "missing_packages": missing_packages(), **features().facts(),
                           "trl_lacks": lacks(features().lacks())}))
        object.__setattr__(self, "_oomguard_seen", True)
        with overrides_reported(rt, "swift GRPOConfig"):
            apply_config(rt, self, can_defer=False)
            apply_offload(rt, self)
            orig(self)

    set_attr(cls, "__post_init__", __post_init__)


def patch_trainer(rt: Runtime, module: Any) -> None:
    """Swift's ``GRPOTrainer.__init__``: once built, the model's shape, the prompts' lengths, the progress callback
    and the pre-flight, as after TRL's own trainer."""
    from ..callback import make_callback
    from ..datasets import emit_prompt_stats, tokenizer_for
    from ..patching import set_attr
    from ..prompts import error_line
    from ..trainer import after_init

    cls = module.GRPOTrainer
    orig = cls.__dict__["__init__"]

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        rt.trainer = self
        rows = prompt_rows(getattr(self, "train_dataset", None))
        try:
            lengths = template_lengths(self.template, rows)
        except Exception as e:  # swift's template API changes between releases: measure with the tokenizer instead
            rt.cannot_observe(f"the prompts as swift's template encodes them ({error_line(e)}): their length is "
                              "measured with the tokenizer's chat template alone, without swift's default system "
                              "prompt and tools")
            lengths = None
        tok = tokenizer_for(getattr(self, "processing_class", None) or getattr(self, "tokenizer", None),
                             getattr(self, "model", None))
        emit_prompt_stats(rt, [r.get("messages") or r.get("prompt") for r in rows], tok, lengths)
        self.add_callback(make_callback(rt))
        after_init(rt, self)

    __init__.__signature__ = inspect.signature(orig)  # type: ignore[attr-defined]
    set_attr(cls, "__init__", __init__)


def prompt_rows(dataset: Any, limit: int = PROMPT_STATS_ROWS) -> list[dict[str, Any]]:
    """Swift's rows without their response (the last assistant turn of ``messages``), at most ``limit`` of them
    spread over the dataset: what its template encodes for generation (with the row's ``tools``, ``system``, images).

    >>> prompt_rows([{"messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}],
    ...               "solution": "3"}])
    [{'messages': [{'role': 'user', 'content': '1+2?'}], 'solution': '3'}]
    """
    out: list[dict[str, Any]] = []
    try:
        n = len(dataset)
    except TypeError:
        return out
    step = max(1, n // limit)
    for i in range(0, n, step):
        row = dataset[i]
        if not isinstance(row, dict):
            continue
        msgs = row.get("messages")
        if isinstance(msgs, list):
            if msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
                row = {**row, "messages": msgs[:-1]}
            out.append(row)
        elif row.get("prompt") is not None:
            out.append(row)
    return out


def template_lengths(template: Any, rows: list[dict[str, Any]]) -> list[int] | None:
    """Each prompt's tokens as swift generates from it: its template in ``transformers`` mode (its inference
    encoding, the generation prompt added), with the template's default system prompt and the row's tools, which
    the tokenizer's chat template alone does not add (a ``qwen`` template's "You are a helpful assistant." is 26
    more tokens for each prompt of the tests' tiny model). None for rows with no ``messages``."""
    if not rows or not all(isinstance(r.get("messages"), list) for r in rows):
        return None
    mode = template.mode
    template.set_mode("transformers")
    try:
        return [len(template.encode(r)["input_ids"]) for r in rows]
    finally:
        template.set_mode(mode)
