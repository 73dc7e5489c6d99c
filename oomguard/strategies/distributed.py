"""Distributed remedies: shard what every rank holds (DeepSpeed ZeRO through the training arguments, or FSDP), then
move it to host RAM. They only apply to runs with several ranks.

The DeepSpeed configuration is generated from the user's own (``GRPOConfig.deepspeed``, a path or a dict, or the
one accelerate builds from its ``--config_file`` YAML) with the ZeRO stage, offload settings and buffer sizes
changed, and handed to transformers through ``GRPOConfig.deepspeed``; the report shows it. A config that leaves
DeepSpeed's buffers to DeepSpeed gets 500,000,000-element buckets on every rank (1.86 GiB in float32, whatever the
model's size): ``deepspeed_buffers`` sizes them to the model as transformers' "auto" does, and the ZeRO rungs do the
same for the stage they write.

>>> deepspeed_config(None, zero_stage=3, offload_optimizer=True)["zero_optimization"]["offload_optimizer"]
{'device': 'cpu', 'pin_memory': True}
"""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.distributed import STAGE_BUFFERS, deepspeed_config, load_user_deepspeed, observe_deepspeed  # noqa: F401
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register


class _Sharding(Remedy):
    cost = "speed"
    resume = "new-run"  # DeepSpeed and FSDP checkpoints are laid out per stage: a new run from the weights
    helps_optimizer = True

    def foreign(self, ctx: Context) -> str | None:
        if ctx.facts.world_size <= 1:
            return "the run has one rank; sharding needs several"
        if ctx.facts.fsdp:
            return "the run uses FSDP, not DeepSpeed"
        return None


def _sized(knobs: Knobs, stage: int) -> Knobs:
    """``knobs`` with every buffer size of ``stage`` that the config leaves to DeepSpeed set to "auto" (transformers
    sizes it from the model's hidden size); sizes the user set stay."""
    return knobs.replace(**{key: "auto" for key in STAGE_BUFFERS.get(stage, ()) if getattr(knobs, key) is None})


@register
class DeepSpeedBuffers(Remedy):
    name = "deepspeed_buffers"
    summary = ("Size DeepSpeed's buffers to the model (transformers' \"auto\": hidden_size² elements) where the config "
               "leaves them to DeepSpeed's defaults (500,000,000 elements, 1.86 GiB in float32 on every rank).")
    cost = "speed"
    trade_note = "smaller communication buckets: more, smaller collectives per step"
    resume = "continue"  # bucket sizes are not part of a checkpoint
    changes = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    sizes_buffers = True
    helps_optimizer = True  # ZeRO-3 keeps its bucket all the step

    def foreign(self, ctx: Context) -> str | None:
        return None if (ctx.knobs.zero_stage or 0) > 0 else "the run does not use DeepSpeed ZeRO"

    def blocked(self, ctx: Context) -> str | None:
        stage = ctx.knobs.zero_stage or 0
        keys = STAGE_BUFFERS.get(stage, ())
        if all(getattr(ctx.knobs, key) is not None for key in keys):
            return f"the DeepSpeed config already sizes its buffers ({', '.join(keys)})"
        return None

    def apply(self, ctx: Context) -> Knobs:
        return _sized(ctx.knobs, ctx.knobs.zero_stage or 0)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Set \"reduce_bucket_size\": \"auto\" (and under ZeRO-3 \"stage3_prefetch_bucket_size\" and "
                                 "\"stage3_param_persistence_threshold\") in the DeepSpeed config: transformers sizes "
                                 "them to the model; DeepSpeed's default bucket is 500,000,000 elements on every rank.",
                      d.report.requested if d.buffer else None)


@register
class Zero2(_Sharding):
    name = "zero2"
    summary = "DeepSpeed ZeRO stage 2: shard optimizer state and gradients across ranks."
    trade_note = "more communication per step"
    changes = ("zero_stage", "reduce_bucket_size")
    sizes_buffers = True

    def blocked(self, ctx: Context) -> str | None:
        if (ctx.knobs.zero_stage or 0) >= 2:
            return f"already in force (ZeRO stage {ctx.knobs.zero_stage})"
        return super().blocked(ctx)

    def apply(self, ctx: Context) -> Knobs:
        return _sized(ctx.knobs.replace(zero_stage=2), 2)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "With N ranks, ZeRO-2 keeps 1/N of the optimizer state and gradients on each GPU.")


@register
class Zero3(_Sharding):
    name = "zero3"
    summary = "DeepSpeed ZeRO stage 3: shard the parameters too."
    trade_note = "parameters are gathered for every forward and generation: slower, more communication"
    changes = ("zero_stage", "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    helps_at_load = True
    sizes_buffers = True

    def blocked(self, ctx: Context) -> str | None:
        if (ctx.knobs.zero_stage or 0) >= 3:
            return "already in force (ZeRO stage 3)"
        return super().blocked(ctx)

    def apply(self, ctx: Context) -> Knobs:
        return _sized(ctx.knobs.replace(zero_stage=3), 3)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "ZeRO-3 also keeps 1/N of the weights on each GPU (gathered layer by layer).")


@register
class Zero3Gather(Remedy):
    name = "zero3_gather"
    summary = ("ZeRO-3: generate with the parameters gathered layer by layer (ds3_gather_for_generation=False) "
               "instead of the whole model on every rank.")
    cost = "speed"
    trade_note = "generation gathers each layer as it runs it: slower generation, the same completions"
    resume = "continue"  # how generation gathers is not part of a checkpoint
    changes = ("ds3_gather_for_generation",)

    def foreign(self, ctx: Context) -> str | None:
        if (ctx.knobs.zero_stage or 0) < 3:
            return "the run does not use ZeRO-3"
        if ctx.value("use_vllm"):
            return "vLLM generates: the trainer's model is not gathered for generation"
        return None

    def blocked(self, ctx: Context) -> str | None:
        return "already layer by layer" if ctx.value("ds3_gather_for_generation") is False else None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(ds3_gather_for_generation=False)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Under ZeRO-3, TRL gathers the whole model on every rank to generate "
                                 "(ds3_gather_for_generation=True); False gathers it layer by layer: slower "
                                 "generation, and only what DeepSpeed's prefetch holds at once (at most "
                                 "stage3_max_live_parameters).", None)


@register
class OffloadOptimizer(_Sharding):
    name = "offload_optimizer"
    summary = "Keep the optimizer state in host RAM (DeepSpeed ZeRO offload_optimizer)."
    trade_note = "the optimizer step runs on the CPU; needs host RAM of about 12 bytes per parameter"
    changes = ("offload_optimizer", "zero_stage")

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("offload_optimizer"):
            return "already in force"
        if not ctx.knobs.zero_stage:
            return "needs DeepSpeed ZeRO (zero2 or zero3 first)"
        return super().blocked(ctx)

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(offload_optimizer=True)


@register
class OffloadParams(_Sharding):
    name = "offload_params"
    summary = "Keep the parameters in host RAM between uses (DeepSpeed ZeRO-3 offload_param)."
    trade_note = "every layer is fetched from host RAM: much slower"
    changes = ("offload_params",)
    helps_at_load = True

    def blocked(self, ctx: Context) -> str | None:
        if ctx.value("offload_params"):
            return "already in force"
        if (ctx.knobs.zero_stage or 0) < 3:
            return "needs ZeRO stage 3"
        return super().blocked(ctx)

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(offload_params=True)


@register
class FsdpOffload(Remedy):
    name = "fsdp_offload"
    summary = "FSDP with parameters and gradients offloaded to the CPU (fsdp='full_shard offload')."
    cost = "speed"
    trade_note = "every layer is fetched from host RAM: much slower"
    resume = "new-run"
    changes = ("fsdp_offload",)
    helps_optimizer = True
    helps_at_load = True

    def foreign(self, ctx: Context) -> str | None:
        return None if ctx.facts.fsdp else "the run does not use FSDP"

    def blocked(self, ctx: Context) -> str | None:
        return "already in force" if ctx.value("fsdp_offload") else None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(fsdp_offload=True)
