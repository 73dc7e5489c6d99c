"""Precision remedies: smaller weights, gradients and optimizer states, offered only where training still learns.

A remedy's cost is what it does to training. bf16 weights trained with AdamW and no float32 master copy round every
update into the weight: AdamW moves a weight by about the learning rate per step, and bfloat16 keeps 8 significant
bits, so at GRPO's learning rates (TRL's default is 1e-6) almost no weight of a model with weights around 0.02
moves (measured with torch 2.13: 1.9% of a 4096x256 weight of std 0.02 in 10 steps at 1e-6, against 99.99% in
float32). ``moving_share`` says how many weights still move for a config (the training process's measurement on the
loaded weights where there is one, else the normal-weights estimate below), and ``bf16_load`` is offered only where
they do, or where something keeps the updates whole: LoRA (the adapters are float32), DeepSpeed ZeRO (it keeps a
float32 master copy of the weights), an optimizer that compensates the rounding (Kahan summation).

>>> from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
>>> round(moving_share(TRL_DEFAULTS.replace(dtype="bfloat16"), RunFacts()), 3)   # lr 1e-6, weights of std 0.02
0.014
>>> moving_share(TRL_DEFAULTS, RunFacts()) is None                               # float32 weights keep every update
True
"""

from __future__ import annotations

import math

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import EIGHT_BIT_OPTIMIZERS, TRL_DEFAULTS, Knobs, RunFacts

from .base import Advice, Context, Remedy, register
from .params import lora_params

# 32-bit optimizer -> its 8-bit bitsandbytes twin (transformers OptimizerNames).
EIGHT_BIT_TWIN = {
    "adamw_torch": "adamw_bnb_8bit",
    "adamw_torch_fused": "adamw_bnb_8bit",
    "adamw_hf": "adamw_bnb_8bit",
    "adamw_apex_fused": "adamw_bnb_8bit",
    "adamw_torch_npu_fused": "adamw_bnb_8bit",
    "adamw_torch_xla": "adamw_bnb_8bit",
    "adamw_anyprecision": "adamw_bnb_8bit",
    "paged_adamw_32bit": "paged_adamw_8bit",
    "lion_32bit": "lion_8bit",
    "paged_lion_32bit": "paged_lion_8bit",
    "ademamix": "ademamix_8bit",
    "paged_ademamix_32bit": "paged_ademamix_8bit",
    "rmsprop": "rmsprop_bnb_8bit",
    "rmsprop_bnb": "rmsprop_bnb_8bit",
}


# Below this share of weights that a step of the learning rate moves, low-precision weights count as frozen: the run
# would say it keeps a full fine-tune while most of the model cannot learn.
MOVING_FLOOR = 0.5
# Significant bits of the 16-bit weight dtypes (the implicit bit included): an update below half of a weight's last
# bit, |w| * 2**-bits, is rounded away.
SIGNIFICANT_BITS = {"bfloat16": 8, "float16": 11}
# Optimizers that keep updates smaller than a 16-bit weight's resolution: torch-optimi's StableAdamW (transformers'
# ``stable_adamw``) sums them with Kahan compensation for bf16 weights by default.
COMPENSATING_OPTIMIZERS = frozenset({"stable_adamw"})
# The weights' spread when nothing was measured: transformers' default initializer_range, and about what the linear
# weights of released LLMs have.
WEIGHT_STD = 0.02


def estimated_share(lr: float, dtype: str = "bfloat16", std: float = WEIGHT_STD) -> float:
    """The share of normal weights of spread ``std`` that a step of ``lr`` moves once stored in ``dtype``: those
    below about ``lr * 2**(bits + 0.5)`` in magnitude (half a last bit, taken in the middle of a binade).

    >>> round(estimated_share(1e-6), 3), round(estimated_share(1e-4), 2), round(estimated_share(1e-6, "float16"), 2)
    (0.014, 0.93, 0.12)
    """
    bits = SIGNIFICANT_BITS[dtype]
    return math.erf(lr * 2 ** (bits + 0.5) / (std * math.sqrt(2)))


def weights_dtype(k: Knobs) -> str | None:
    """The dtype the trained weights are stored in, when it is a 16-bit one (None for float32 or unknown)."""
    d = k.dtype if k.dtype is not None else TRL_DEFAULTS.dtype
    return d if d in SIGNIFICANT_BITS else None


def moving_share(k: Knobs, facts: RunFacts) -> float | None:
    """The share of weights that one step of the learning rate moves under ``k``, or None where every update is
    kept: float32 weights, LoRA (the adapters train in float32; the base is frozen anyway), DeepSpeed ZeRO (a float32
    master copy of the weights), an optimizer that compensates the rounding. The training process's measurement on
    the loaded weights (``RunFacts.bf16_moving``, at the run's learning rate) where there is one, else
    ``estimated_share`` from the learning rate and the model config's ``initializer_range``."""
    dtype = weights_dtype(k)
    if dtype is None or k.lora_r or k.load_in_4bit or (k.zero_stage or 0) >= 1:
        return None
    if (k.optim or TRL_DEFAULTS.optim) in COMPENSATING_OPTIMIZERS:
        return None
    if dtype == "bfloat16" and facts.bf16_moving is not None:
        return float(facts.bf16_moving)
    lr = k.learning_rate if k.learning_rate is not None else TRL_DEFAULTS.learning_rate
    std = (facts.model_config or {}).get("initializer_range") or WEIGHT_STD
    return estimated_share(float(lr or 0.0), dtype, float(std))


def frozen(k: Knobs, facts: RunFacts) -> float | None:
    """The share of weights that cannot learn under ``k`` when it is most of them (at least ``1 - MOVING_FLOOR``),
    else None: a config whose full fine-tune is one in name only.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> round(frozen(TRL_DEFAULTS.replace(dtype="bfloat16"), RunFacts()), 2)
    0.99
    >>> frozen(TRL_DEFAULTS.replace(dtype="bfloat16", learning_rate=1e-4), RunFacts()) is None
    True
    """
    share = moving_share(k, facts)
    return None if share is None or share >= MOVING_FLOOR else 1.0 - share


def precision_warning(k: Knobs, facts: RunFacts) -> str | None:
    """The line that tells a user their own config trains weights that cannot move (no peer says so), or None.

    >>> print(precision_warning(TRL_DEFAULTS.replace(dtype="bfloat16"), RunFacts()))  # doctest: +NORMALIZE_WHITESPACE
    99% of the weights' updates are below bfloat16's resolution at learning rate 1e-06 (bfloat16 weights, adamw_torch_fused,
    no float32 master copy): most weights will not move; load the model in float32, train LoRA, or raise the learning rate
    """
    share = frozen(k, facts)
    if share is None:
        return None
    dtype = weights_dtype(k)
    return (f"{share:.0%} of the weights' updates are below {dtype}'s resolution at learning rate "
            f"{k.learning_rate if k.learning_rate is not None else TRL_DEFAULTS.learning_rate:g} ({dtype} weights, "
            f"{k.optim or TRL_DEFAULTS.optim}, no float32 master copy): most weights will not move; load the model "
            "in float32, train LoRA, or raise the learning rate")


def half_dtype(facts: RunFacts) -> str:
    """The 16-bit dtype to compute in: bfloat16, unless the device is known to lack it (V100, T4: float16)."""
    return "float16" if facts.bf16_supported is False else "bfloat16"


def _can_set_load(ctx: Context) -> str | None:
    if ctx.facts.model_source == "instance":
        return "the script builds the model without from_pretrained, so its load cannot be changed"
    return None


@register
class Bf16Load(Remedy):
    name = "bf16_load"
    summary = ("Load the model in bfloat16 instead of float32 (TRL loads a model given by name in float32), where "
               "updates survive bf16's rounding: LoRA, DeepSpeed ZeRO's float32 master copy, or a learning rate large "
               "enough for the weights' scale.")
    cost = "precision"
    trade_note = "bf16 weights: half the weights, gradients and AdamW state; updates rounded to bf16's 8 bits"
    resume = "new-run"
    changes = ("dtype",)
    helps_at_load = True
    helps_optimizer = True

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return f"bf16 weights (yours: {user.dtype or 'float32'})"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("dtype") in ("bfloat16", "float16") or ctx.value("load_in_4bit"):
            return f"already in force (dtype {ctx.value('dtype')})"
        if ctx.facts.bf16_supported is False:
            return "the device has no bfloat16 (it predates NVIDIA's Ampere)"
        share = frozen(self.apply(ctx), ctx.facts)
        if share is not None:
            lr = ctx.value("learning_rate")
            # before the command has built its config, its learning rate (and its LoRA) are TRL's defaults: say so
            unseen = ctx.read_fields is not None and "learning_rate" not in ctx.read_fields
            which = f"TRL's default learning rate {lr:g} (the command's own is not known yet)" if unseen else \
                f"learning rate {lr:g}"
            return (f"it would freeze the model: at {which}, {share:.0%} of the weights' AdamW updates are below "
                    "bfloat16's resolution and no float32 master copy keeps them (LoRA, DeepSpeed ZeRO or a larger "
                    "learning rate would)")
        return _can_set_load(ctx)

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(dtype="bfloat16")

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "A float32 load doubles weights, gradients and AdamW state; bfloat16 halves them.",
                      d.report.requested // 2 if d.report.requested and d.phase in ("load", "optimizer") else None)


@register
class Optimizer8bit(Remedy):
    name = "optimizer_8bit"
    summary = "Keep optimizer state in 8 bits (bitsandbytes, e.g. optim=adamw_bnb_8bit)."
    cost = "precision"
    trade_note = "8-bit moments: about 2 bytes per parameter instead of 8, with a small effect on updates"
    resume = "new-run"
    changes = ("optim",)
    helps_optimizer = True
    requires = ("bitsandbytes",)  # the 8-bit optimizer it picks (optim itself needs no package)

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return f"8-bit optimizer states ({final.optim})"

    def blocked(self, ctx: Context) -> str | None:
        optim = str(ctx.value("optim"))
        if optim in EIGHT_BIT_OPTIMIZERS:
            return f"already in force (optim {optim})"
        if optim not in EIGHT_BIT_TWIN:
            return f"optim {optim} has no 8-bit twin"
        return ctx.facts.cannot_optim_8bit

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(optim=EIGHT_BIT_TWIN[str(ctx.value("optim"))])

    def advise(self, d: Diagnosis) -> Advice:
        frees = d.report.requested * 3 // 4 if d.report.requested and d.phase == "optimizer" else None
        return Advice(self.name, "AdamW keeps two 32-bit moments per parameter; 8-bit moments take a quarter of that.",
                      frees)


@register
class Load4bit(Remedy):
    name = "load_4bit"
    summary = "Load the base model in 4-bit NF4 with LoRA adapters (QLoRA)."
    cost = "capacity"
    trade_note = "4-bit base weights (about 0.52 bytes per parameter) and adapters only"
    resume = "new-run"
    changes = ("load_in_4bit", "lora_r", "dtype")
    helps_at_load = True
    helps_optimizer = True
    params = lora_params()

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        lora = "" if user.lora_r or not final.lora_r else f" and LoRA r={final.lora_r} instead of a full fine-tune"
        return f"a 4-bit base model{lora}"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("load_in_4bit"):
            return "already in force"
        if ctx.facts.cannot_load_4bit:
            return ctx.facts.cannot_load_4bit
        if ctx.value("use_vllm") and ctx.value("vllm_mode") == "colocate" and ctx.facts.vllm_platform == "cpu":
            return "vLLM's CPU build has no bitsandbytes quantisation, which TRL asks of vLLM for a 4-bit model"
        if ctx.facts.model_source == "instance":
            return "4-bit needs the model loaded through from_pretrained (or given to GRPOTrainer by name)"
        if ctx.facts.user_peft and not ctx.facts.load_takes_4bit:
            return "the script passes its own PEFT model, which was loaded before oomguard could quantise it"
        return None

    def apply(self, ctx: Context) -> Knobs:
        changes: dict[str, object] = {"load_in_4bit": True}
        # LoRA comes with it only for a full fine-tune: never over the script's own LoRA, nor, where the script's
        # loader prepares the model for a LoRA it adds after it (Unsloth's), before that LoRA could be seen (the run
        # stopped before its trainer was built)
        unseen = ctx.facts.load_takes_4bit and ctx.facts.model_source is None
        if not ctx.value("lora_r") and not unseen:
            changes.update(lora_r=int(self.p["r"]), lora_alpha=int(self.p["alpha"]),
                           lora_target_modules=self.p["target_modules"])
        if ctx.value("dtype") == "float32":
            changes["dtype"] = half_dtype(ctx.facts)  # the QLoRA recipe: non-quantised modules and compute in bf16
        return ctx.knobs.replace(**changes)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "NF4 with double quantisation stores about 0.52 bytes per weight instead of 2 (bf16) "
                                 "or 4 (fp32); it needs LoRA to train.", None)
