"""LoRA: train low-rank adapters instead of every weight."""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register
from .params import lora_params


@register
class Lora(Remedy):
    name = "lora"
    summary = "Train LoRA adapters (r=16 on all linear layers) instead of the full model."
    cost = "capacity"
    trade_note = "far fewer trainable parameters; full-fine-tune learning rates are usually too low for LoRA"
    resume = "new-run"
    changes = ("lora_r", "lora_alpha", "lora_target_modules")
    helps_optimizer = True
    params = lora_params()

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        return f"LoRA r={final.lora_r} instead of a full fine-tune"

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("lora_r") or ctx.facts.user_peft:
            return "already in force"
        return None

    def apply(self, ctx: Context) -> Knobs:
        tm = self.p["target_modules"]
        return ctx.knobs.replace(lora_r=int(self.p["r"]), lora_alpha=int(self.p["alpha"]),
                                 lora_target_modules=tuple(tm) if isinstance(tm, list) else tm)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "With LoRA only the adapters have gradients and optimizer state, and the beta>0 "
                                 "reference model is the base with adapters off instead of a second copy.",
                      d.report.requested * 3 // 4 if d.report.requested and d.phase == "optimizer" else None)
