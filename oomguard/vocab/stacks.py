"""The front-ends around TRL, as the user writes them: the flags (or the code) in which a diff and a lock are told
to a user who never wrote a GRPOConfig, or wrote only part of the run in one.

``swift rlhf`` (ms-swift) takes TRL's knobs under TRL's own names as flags, and its own for what it loads and adapts
(``--tuner_type lora --lora_rank``, ``--quant_method bnb --quant_bits 4``, ``--torch_dtype``, ``--deepspeed``,
``--vllm_max_model_len``, ``--sleep_level``, ``--offload_model``). oomguard changes them inside the training process
(``oomguard/child/stacks/swift.py``); these are the words it says them in.

>>> flags("swift", {"num_generations": 4, "lora_r": 16, "load_in_4bit": True, "expandable_segments": True})
['--num_generations 4', '--tuner_type lora --lora_rank 16', '--quant_method bnb --quant_bits 4']
"""

from __future__ import annotations

from typing import Any

# knob -> swift rlhf flag(s), for the knobs whose name differs from TRL's (the others are "--<knob> <value>")
_SWIFT = {
    "lora_r": lambda v: "--tuner_type full" if not v else f"--tuner_type lora --lora_rank {v}",
    "lora_alpha": lambda v: f"--lora_alpha {v}",
    "lora_target_modules": lambda v: "--target_modules " + (v if isinstance(v, str) else " ".join(v)),
    "load_in_4bit": lambda v: "--quant_method bnb --quant_bits 4" if v else "--quant_bits none",
    "dtype": lambda v: f"--torch_dtype {v}",
    "zero_stage": lambda v: f"--deepspeed zero{v}",
    "vllm_max_model_length": lambda v: f"--vllm_max_model_len {v}",
    "vllm_enable_sleep_mode": lambda v: f"--sleep_level {1 if v else 0}",
    "gradient_checkpointing": lambda v: f"--gradient_checkpointing {str(bool(v)).lower()}",
    "offload_during_generation": lambda v: f"--offload_model {str(bool(v)).lower()} --offload_optimizer "
                                           f"{str(bool(v)).lower()}",
}
# Unsloth's notebooks: what the loader and get_peft_model take is said there; the rest is GRPOConfig's
_UNSLOTH = {
    "load_in_4bit": lambda v: f"FastLanguageModel.from_pretrained(load_in_4bit={bool(v)})",
    "dtype": lambda v: f"FastLanguageModel.from_pretrained(dtype=torch.{v})",
    "vllm_gpu_memory_utilization": lambda v: f"FastLanguageModel.from_pretrained(gpu_memory_utilization={v})",
    "vllm_max_model_length": lambda v: f"FastLanguageModel.from_pretrained(max_seq_length={v})",
    "gradient_checkpointing": lambda v: "get_peft_model(use_gradient_checkpointing="
                                        + ('"unsloth")' if v else "False)"),
    "lora_r": lambda v: f"get_peft_model(r={v})" if v else "no get_peft_model (a full fine-tune)",
}
# how the end of a run introduces them, and what goes between two (flags on one command line; calls apart)
SAID_AS = {"swift": "as swift's flags", "unsloth": "in the notebook's code"}
_JOIN = {"swift": " "}
# knobs that are not flags: the allocator's settings, set in the environment
ENVIRONMENT = ("expandable_segments", "max_split_size_mb")


def flag(stack: str | None, knob: str, value: Any) -> str | None:
    """The flag(s) that set ``knob`` to ``value`` for ``stack``, or None (not a flag of it, or no stack).

    >>> flag("swift", "per_device_train_batch_size", 2), flag(None, "lora_r", 8), flag("swift", "max_split_size_mb", 1)
    ('--per_device_train_batch_size 2', None, None)
    >>> flag("unsloth", "load_in_4bit", True), flag("unsloth", "per_device_train_batch_size", 2)
    ('FastLanguageModel.from_pretrained(load_in_4bit=True)', 'GRPOConfig(per_device_train_batch_size=2)')
    """
    if stack not in SAID_AS or knob in ENVIRONMENT:
        return None
    if stack == "unsloth":
        if knob in _UNSLOTH:
            return _UNSLOTH[knob](value)
        return f"GRPOConfig({knob}={value!r})"
    if knob in _SWIFT:
        return _SWIFT[knob](value)
    if isinstance(value, bool):
        value = str(value).lower()
    return f"--{knob} {value}"


def told(stack: str | None, said: list[str]) -> str:
    """One line that gives the flags ``said`` to a user of ``stack``.

    >>> told("swift", ["--num_generations 4", "--lora_rank 16"])
    "as swift's flags: --num_generations 4 --lora_rank 16"
    >>> told("unsloth", ["get_peft_model(r=8)", "GRPOConfig(num_generations=4)"])
    "in the notebook's code: get_peft_model(r=8); GRPOConfig(num_generations=4)"
    """
    return f"{SAID_AS.get(stack or '', 'as the front-end takes them')}: {_JOIN.get(stack or '', '; ').join(said)}"


def flags(stack: str | None, changes: dict[str, Any]) -> list[str]:
    """``changes`` (knob -> new value) in ``stack``'s flags, in order, those that are flags."""
    return [f for k, v in changes.items() if (f := flag(stack, k, v)) is not None]


__all__ = ["ENVIRONMENT", "SAID_AS", "flag", "flags", "told"]
