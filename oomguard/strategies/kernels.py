"""Kernel remedies: the same loss, computed by a kernel that never holds the whole of a large intermediate.

TRL 0.29 to 1.14 materialise the logits ``[batch, completion, vocab]`` for the GRPO loss (with a 150k vocabulary,
often the largest tensor of the step); ``use_liger_kernel=True`` computes the loss with Liger's
``LigerFusedLinearGRPOLoss`` instead, in sequence and vocabulary chunks (TRL issues 3678, 2756). From TRL 1.15 the
trainer's own fused LM head does the same by default and ``use_liger_kernel`` adds only Liger's layer kernels, so the
rung has nothing to do there. Liger runs on Triton, on a GPU: the rung is offered only where the training process
computes on a CUDA device with Triton and can import ``liger_kernel``.
"""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register


@register
class LigerKernel(Remedy):
    name = "liger_kernel"
    summary = ("Compute the GRPO loss with Liger's chunked kernel (use_liger_kernel=True) instead of materialising "
               "the logits: TRL 0.29 to 1.14 on a GPU.")
    cost = "speed"
    trade_note = ("the same loss computed in chunks by Liger's kernel (TRL 0.29-1.14); its speed against the "
                  "materialised logits is not measured by oomguard")
    resume = "continue"
    changes = ("use_liger_kernel",)
    shrinks_shapes = True

    def foreign(self, ctx: Context) -> str | None:
        head = ctx.facts.trl_head
        if head is not None and head != "logits":
            return (f"the installed TRL ({ctx.facts.trl_version or 'version unknown'}) computes the LM head in "
                    "chunks already; use_liger_kernel adds only Liger's layer kernels there")
        if head is None:
            return "which LM head the installed TRL has is not known yet"
        return None

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("use_liger_kernel"):
            return "use_liger_kernel is already on"
        if not ctx.facts.gpu_kernels:
            return ("Liger's kernels need Triton on a CUDA GPU, and the training process has none (the CPU, or the "
                    "simulated device)")
        return self.missing(ctx)

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.phase in ("generation", "optimizer", "evaluation"):
            return f"the OOM came in {d.phase}; Liger's loss changes only the training loss's logits"
        return super().helps(d)

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(use_liger_kernel=True)

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> LigerKernel().describe_change(TRL_DEFAULTS, TRL_DEFAULTS.replace(use_liger_kernel=True))
        "the GRPO loss computed by Liger's chunked kernel (yours: the materialised logits)"
        """
        return "the GRPO loss computed by Liger's chunked kernel (yours: the materialised logits)"

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "On TRL 0.29 to 1.14 the loss materialises [batch, completion, vocab] logits; "
                                 "use_liger_kernel=True (pip install liger-kernel, a GPU with Triton) computes it in "
                                 "chunks instead. TRL 1.15 and later do so by default.",
                      None)
