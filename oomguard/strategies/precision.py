"""Precision remedies: smaller weights, gradients and optimizer states."""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import EIGHT_BIT_OPTIMIZERS, Knobs

from .base import Advice, Context, Remedy, register

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


def _can_set_load(ctx: Context) -> str | None:
    if ctx.facts.model_source == "instance":
        return "the script builds the model without from_pretrained, so its load cannot be changed"
    return None


@register
class Bf16Load(Remedy):
    name = "bf16_load"
    summary = "Load the model in bfloat16 instead of float32 (TRL loads a model given by name in float32)."
    cost = "precision"
    trade_note = "bf16 master weights: half the weights, gradients and AdamW state; slightly less precise updates"
    resume = "new-run"
    changes = ("dtype",)
    helps_at_load = True
    helps_optimizer = True

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return f"bf16 weights (yours: {user.dtype or 'float32'})"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("dtype") in ("bfloat16", "float16") or ctx.value("load_in_4bit"):
            return f"already in force (dtype {ctx.value('dtype')})"
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
    requires = ("bitsandbytes",)

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return f"8-bit optimizer states ({final.optim})"

    def blocked(self, ctx: Context) -> str | None:
        optim = str(ctx.value("optim"))
        if optim in EIGHT_BIT_OPTIMIZERS:
            return f"already in force (optim {optim})"
        if optim not in EIGHT_BIT_TWIN:
            return f"optim {optim} has no 8-bit twin"
        return None

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
    requires = ("bitsandbytes", "peft")
    params = {"r": 16, "alpha": 32, "target_modules": "all-linear"}

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        lora = "" if user.lora_r else f" and LoRA r={final.lora_r} instead of a full fine-tune"
        return f"a 4-bit base model{lora}"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("load_in_4bit"):
            return "already in force"
        if ctx.facts.model_source == "instance":
            return "4-bit needs the model loaded through from_pretrained (or given to GRPOTrainer by name)"
        if ctx.facts.user_peft:
            return "the script passes its own PEFT model, which was loaded before oomguard could quantise it"
        return None

    def apply(self, ctx: Context) -> Knobs:
        changes: dict[str, object] = {"load_in_4bit": True}
        if not ctx.value("lora_r"):
            changes.update(lora_r=int(self.p["r"]), lora_alpha=int(self.p["alpha"]),
                           lora_target_modules=self.p["target_modules"])
        if ctx.value("dtype") == "float32":
            changes["dtype"] = "bfloat16"  # the QLoRA recipe: non-quantised modules and compute in bf16
        return ctx.knobs.replace(**changes)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "NF4 with double quantisation stores about 0.52 bytes per weight instead of 2 (bf16) "
                                 "or 4 (fp32); it needs LoRA to train.", None)
