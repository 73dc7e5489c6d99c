"""Unsloth's GRPO notebooks: how they spell the knobs, read both ways.

A notebook loads and adapts the model with Unsloth's own calls before any GRPOConfig exists:
``FastLanguageModel.from_pretrained`` takes the 4-bit load, the dtype and, with ``fast_inference``, its colocated
vLLM's share of the GPU and context; ``get_peft_model`` the LoRA and checkpointing. The rest is TRL's GRPOConfig. The
adapter in the training process (``oomguard/child/stacks/unsloth.py``) sets and observes the calls' keyword arguments
through :data:`UNSLOTH`; the end of a run says them in the notebook's code from the same table.

>>> UNSLOTH.said({"vllm_gpu_memory_utilization": 0.5, "lora_r": 8, "num_generations": 4})
{'vllm_gpu_memory_utilization': 'FastLanguageModel.from_pretrained(gpu_memory_utilization=0.5)', \
'lora_r': 'get_peft_model(r=8)', 'num_generations': 'GRPOConfig(num_generations=4)'}
"""

from __future__ import annotations

import json
from typing import Any

from .spelling import Code, Spelling, StackTable, arg, never, with_trl_names

LOADER = "FastLanguageModel.from_pretrained"
PEFT = "get_peft_model"
CONFIG = "GRPOConfig"
_VLLM = ("fast_inference",)  # the loader's vLLM settings mean something only with fast_inference
# Why a run in Unsloth's generated trainer is judged like an untested TRL (RunFacts.stack_untested): its loss is
# Unsloth's own, which no measurement covers (reported by child/stacks/unsloth.py, assumed by `oomguard plan --stack`)
GENERATED_TRAINER = "Unsloth's generated GRPO trainer, whose loss no measurement covers"


def _four_bit(a: Any) -> dict[str, Any]:
    """4-bit when asked for (Unsloth's default) and nothing overrules it (a full fine-tune, an 8- or 16-bit load)."""
    return {"load_in_4bit": bool(arg(a, "load_in_4bit", True) and not arg(a, "full_finetuning")
                                 and not arg(a, "load_in_8bit") and not arg(a, "load_in_16bit"))}


def _dtype(a: Any) -> dict[str, Any]:
    """The dtype the notebook asks for; None and "auto" leave it to the loader (read on the model it loads).

    >>> _dtype({"dtype": "torch.bfloat16"}), _dtype({"dtype": None}), _dtype({"dtype": "auto"})
    ({'dtype': 'bfloat16'}, {}, {})
    """
    d = arg(a, "dtype")
    name = str(d).replace("torch.", "") if d is not None else None
    return {"dtype": name} if name not in (None, "auto") else {}


def _targets(a: Any) -> dict[str, Any]:
    """The modules the notebook's LoRA adapts: a name (``all-linear``), or the names sorted, as PEFT keeps them."""
    tm = arg(a, "target_modules")
    if isinstance(tm, str):
        return {"lora_target_modules": tm}
    return {"lora_target_modules": tuple(sorted(map(str, tm)))} if tm else {}


def _number(name: str, knob: str, kind: type) -> Any:
    def read(a: Any) -> dict[str, Any]:
        v = arg(a, name)
        ok = isinstance(v, (int, float)) if kind is float else isinstance(v, int)
        return {knob: kind(v)} if ok and not isinstance(v, bool) else {}

    return read


_OWN = (
    # the loader's own arguments, read where the notebook passes them (before anything loads: a pre-flight stop of the
    # load keeps them); what the loader then builds instead (Unsloth's CPU backend falls back to 16-bit where
    # bitsandbytes' 4-bit does not run, dtype=None is the device's 16-bit dtype) is read on the model it returns
    Spelling(("load_in_4bit",), ("load_in_4bit", "load_in_8bit", "load_in_16bit", "full_finetuning"),
             lambda v: {"load_in_4bit": True, "load_in_8bit": False, "load_in_16bit": False, "full_finetuning": False}
             if v else {"load_in_4bit": False}, _four_bit, LOADER,
             sets=lambda ov: bool(ov.load_in_4bit)),  # only ever turned on, and never with a full fine-tune
    Spelling(("dtype",), ("dtype",), lambda v: {"dtype": Code(f"torch.{v}")}, _dtype, LOADER,
             sets=lambda ov: ov.dtype not in (None, "auto"), drops=("torch_dtype",)),
    Spelling(("vllm_gpu_memory_utilization",), ("gpu_memory_utilization",),
             lambda v: {"gpu_memory_utilization": float(v)},
             _number("gpu_memory_utilization", "vllm_gpu_memory_utilization", float), LOADER, needs=_VLLM),
    Spelling(("vllm_max_model_length",), ("max_seq_length",), lambda v: {"max_seq_length": int(v)},
             _number("max_seq_length", "vllm_max_model_length", int), LOADER, needs=_VLLM),
    # get_peft_model: the notebook's own LoRA and checkpointing, read where it adds them; oomguard never sets the
    # rank, alpha or targets there (a LoRA rung applies only to a full fine-tune: the script's LoRA is never replaced)
    Spelling(("gradient_checkpointing",), ("use_gradient_checkpointing",),
             lambda v: {"use_gradient_checkpointing": "unsloth" if v else False},
             lambda a: {"gradient_checkpointing": bool(arg(a, "use_gradient_checkpointing", "unsloth"))}, PEFT),
    Spelling(("lora_r",), ("r",), lambda v: {"r": int(v)} if v else {}, lambda a: {"lora_r": int(arg(a, "r") or 0)},
             PEFT, sets=never, otherwise=f"no {PEFT} (a full fine-tune)"),
    Spelling(("lora_alpha",), ("lora_alpha",), lambda v: {"lora_alpha": int(v)},
             _number("lora_alpha", "lora_alpha", int), PEFT, sets=never),
    Spelling(("lora_target_modules",), ("target_modules",),
             lambda v: {"target_modules": v if isinstance(v, str) else list(v)}, _targets, PEFT, sets=never),
)


def _python(v: Any) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_python, v)) + "]"
    return repr(v)



def _render(spelling: Spelling, args: dict[str, Any]) -> str:
    """The call with its keyword arguments, as a notebook writes it.

    >>> _render(_OWN[1], {"dtype": Code("torch.bfloat16")})
    'FastLanguageModel.from_pretrained(dtype=torch.bfloat16)'
    """
    return f"{spelling.point}(" + ", ".join(f"{k}={_python(v)}" for k, v in args.items()) + ")"


# the rest of what a notebook sets is TRL's GRPOConfig, under TRL's names
UNSLOTH = StackTable("unsloth", with_trl_names(_OWN, CONFIG), _render, said_as="in the notebook's code")

__all__ = ["CONFIG", "LOADER", "PEFT", "UNSLOTH"]
