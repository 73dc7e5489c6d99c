"""ms-swift's ``swift rlhf --rlhf_type grpo``: how it spells the knobs, read both ways.

swift takes TRL's knobs under TRL's own names as flags (``--num_generations 4``), and its own for what it loads and
adapts. The adapter in the training process (``oomguard/child/stacks/swift.py``) sets and observes them through
:data:`SWIFT`, at two points: ``arguments`` (``RLHFArguments``, before swift derives the rest from them) and
``config`` (swift's ``GRPOConfig``, where the generic GRPOConfig patches read and set TRL's names). The diff, the lock
and the terminal print them from the same table.

>>> SWIFT.said({"zero_stage": 3, "offload_optimizer": True, "offload_params": True, "lora_r": 16})
{'zero_stage': '--deepspeed zero3_offload', 'lora_r': '--tuner_type lora --lora_rank 16'}
"""

from __future__ import annotations

import re
from typing import Any

from .spelling import Generated, Spelling, StackTable, arg, has_arg, never, with_trl_names

ARGUMENTS = "arguments"  # RLHFArguments.__post_init__: what the model is loaded and adapted with
CONFIG = "config"  # swift's GRPOConfig.__post_init__: TRL's knobs under TRL's names (the generic GRPOConfig patches)

# The arguments of ms-swift 4.x this table sets and reads beyond TRL's names: their type and swift's default
# (swift/arguments/, swift/rlhf_trainers/args_mixin.py, transformers' TrainingArguments for deepspeed).
SWIFT_ARGUMENTS: dict[str, tuple[type, Any]] = {
    "tuner_type": (str, "lora"), "lora_rank": (int, 8), "lora_alpha": (int, 32), "target_modules": (list, ["all-linear"]),
    "quant_method": (str, None), "quant_bits": (int, None), "torch_dtype": (str, None), "deepspeed": (str, None),
    "vllm_max_model_len": (int, None), "sleep_level": (int, 0), "offload_model": (bool, False),
    "offload_optimizer": (bool, False), "gradient_checkpointing": (bool, True),
}
# swift's DeepSpeed presets (swift/config/*.json): zero3_offload puts the optimizer state and the parameters in host
# RAM, zero2_offload the optimizer state (ZeRO-2 has no parameters to offload); each is zeroN.json with the offloads
_PRESET = re.compile(r"zero([0-3])(_offload)?")


def _lora(a: Any) -> bool:
    return str(arg(a, "tuner_type", "") or "").lower() == "lora"


def _target_modules(a: Any) -> dict[str, Any]:
    tm = arg(a, "target_modules")
    if not _lora(a) or not isinstance(tm, (list, tuple)):
        return {}
    return {"lora_target_modules": "all-linear" if list(tm) == ["all-linear"] else tuple(tm)}


def _deepspeed(stage: Any, optimizer: Any, params: Any) -> dict[str, Any]:
    """The preset for a ZeRO stage and its offloads (what swift's ``--deepspeed`` takes by name), where one says
    exactly that; else (ZeRO-3 with one offload, an offload below ZeRO-2) a DeepSpeed JSON the training process writes
    from swift's preset for the stage, given as ``--deepspeed PATH`` (:class:`~.spelling.Generated`): a preset that
    offloaded more than the rung chose would cost speed and host RAM the memory model and the diff never counted.

    >>> _deepspeed(3, True, True), _deepspeed(2, True, None)
    ({'deepspeed': 'zero3_offload'}, {'deepspeed': 'zero2_offload'})
    >>> print(_deepspeed(3, True, None)["deepspeed"])
    <swift's zero3 preset with offload_optimizer only, as a JSON file>
    """
    if stage is None:
        return {}
    stage, optimizer, params = int(stage), bool(optimizer), bool(params) and int(stage) == 3
    if optimizer == params and (stage == 3 or not optimizer):
        return {"deepspeed": f"zero{stage}" + ("_offload" if optimizer else "")}
    if stage == 2 and optimizer:
        return {"deepspeed": "zero2_offload"}
    only = "offload_optimizer" if optimizer else "offload_params"
    return {"deepspeed": Generated("deepspeed", f"swift's zero{stage} preset with {only} only, as a JSON file",
                                   (("preset", f"zero{stage}"), ("zero_stage", stage),
                                    ("offload_optimizer", optimizer), ("offload_params", params)))}


def is_preset(value: Any) -> bool:
    """Whether ``--deepspeed``'s value names one of swift's presets (else it is the user's own JSON, a path, a dict).

    >>> is_preset("zero2_offload"), is_preset("/home/me/ds.json")
    (True, False)
    """
    return _PRESET.fullmatch(str(value or "")) is not None


def _read_deepspeed(a: Any) -> dict[str, Any]:
    m = _PRESET.fullmatch(str(arg(a, "deepspeed") or ""))
    if m is None:  # a path, a JSON string or a dict: the DeepSpeed config itself says it (child/dsconfig.py)
        return {}
    stage, offload = int(m.group(1)), bool(m.group(2))
    return {"zero_stage": stage, "offload_optimizer": offload, "offload_params": offload and stage == 3}


def _offload(a: Any) -> dict[str, Any]:
    if not has_arg(a, "offload_model"):
        return {}
    return {"offload_during_generation": bool(arg(a, "offload_model") and arg(a, "offload_optimizer", False))}


_OWN = (
    Spelling(("lora_r",), ("tuner_type", "lora_rank"),
             lambda v: {"tuner_type": "lora", "lora_rank": int(v)} if v else {"tuner_type": "full"},
             lambda a: {"lora_r": int(arg(a, "lora_rank", 0) or 0) if _lora(a) else 0}, ARGUMENTS,
             sets=lambda ov: bool(ov.lora_r)),
    Spelling(("lora_alpha",), ("lora_alpha",), lambda v: {"lora_alpha": int(v)},
             lambda a: {"lora_alpha": int(arg(a, "lora_alpha", 0) or 0) or None} if _lora(a) else {}, ARGUMENTS,
             sets=lambda ov: bool(ov.lora_r and ov.lora_alpha)),
    Spelling(("lora_target_modules",), ("target_modules",),
             lambda v: {"target_modules": ["all-linear"] if v == "all-linear" else list(v)}, _target_modules,
             ARGUMENTS, sets=lambda ov: bool(ov.lora_r) and ov.lora_target_modules is not None),
    Spelling(("load_in_4bit",), ("quant_method", "quant_bits"),
             lambda v: {"quant_method": "bnb", "quant_bits": 4} if v else {"quant_bits": None},
             lambda a: {"load_in_4bit": arg(a, "quant_method") == "bnb" and arg(a, "quant_bits") == 4}, ARGUMENTS,
             sets=lambda ov: bool(ov.load_in_4bit)),  # only ever turned on
    Spelling(("dtype",), ("torch_dtype",), lambda v: {"torch_dtype": v},
             lambda a: {"dtype": str(arg(a, "torch_dtype")).replace("torch.", "")}
             if arg(a, "torch_dtype") is not None else {}, ARGUMENTS,
             sets=lambda ov: ov.dtype not in (None, "auto")),
    # the user's own DeepSpeed config is read from swift's GRPOConfig (its DeepSpeed dict, child/dsconfig.py)
    Spelling(("zero_stage", "offload_optimizer", "offload_params"), ("deepspeed",), _deepspeed, _read_deepspeed,
             ARGUMENTS, sets=lambda ov: bool(ov.zero_stage), observed=False),
    # the user's vLLM context and sleep are read from swift's GRPOConfig under TRL's names
    Spelling(("vllm_max_model_length",), ("vllm_max_model_len",), lambda v: {"vllm_max_model_len": int(v)},
             lambda a: {"vllm_max_model_length": arg(a, "vllm_max_model_len")}
             if arg(a, "vllm_max_model_len") is not None else {}, ARGUMENTS, observed=False),
    Spelling(("vllm_enable_sleep_mode",), ("sleep_level",), lambda v: {"sleep_level": 1 if v else 0},
             lambda a: {"vllm_enable_sleep_mode": int(arg(a, "sleep_level") or 0) >= 1}
             if has_arg(a, "sleep_level") else {}, ARGUMENTS,
             sets=lambda ov: bool(ov.vllm_enable_sleep_mode), observed=False),  # only ever turned on
    # swift's offload while vLLM generates: both flags, on RLHFArguments and again on its GRPOConfig
    Spelling(("offload_during_generation",), ("offload_model", "offload_optimizer"),
             lambda v: {"offload_model": bool(v), "offload_optimizer": bool(v)}, _offload, ARGUMENTS,
             sets=lambda ov: bool(ov.offload_during_generation)),  # only ever turned on
    Spelling(("gradient_checkpointing",), ("gradient_checkpointing",), lambda v: {"gradient_checkpointing": bool(v)},
             lambda a: {"gradient_checkpointing": arg(a, "gradient_checkpointing")}
             if has_arg(a, "gradient_checkpointing") else {}, CONFIG, sets=never),
)



def _render(spelling: Spelling, args: dict[str, Any]) -> str:
    """``--name value`` for each argument, as swift's command line takes it.

    >>> _render(_OWN[0], {"tuner_type": "lora", "lora_rank": 8}), _render(_OWN[3], {"quant_bits": None})
    ('--tuner_type lora --lora_rank 8', '--quant_bits none')
    """
    def word(v: Any) -> str:
        if isinstance(v, bool) or v is None:
            return str(v).lower()
        return " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    return " ".join(f"--{name} {word(v)}" for name, v in args.items())


# swift's own spellings, then TRL's knobs under TRL's names (the GRPOConfig fields it does not spell otherwise)
SWIFT = StackTable("swift", with_trl_names(_OWN, CONFIG), _render, said_as="as swift's flags", join=" ")

__all__ = ["ARGUMENTS", "CONFIG", "SWIFT", "SWIFT_ARGUMENTS", "is_preset"]
