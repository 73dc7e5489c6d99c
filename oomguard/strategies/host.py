"""Host-RAM remedies, for a process that the kernel's OOM killer ended: GPU remedies would not help it."""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, register


@register
class FewerWorkers(Remedy):
    name = "fewer_workers"
    summary = "Use fewer dataloader worker processes (each holds a copy of the dataset state)."
    cost = "speed"
    trade_note = "data loading moves back into the training process"
    changes = ("dataloader_num_workers",)
    addresses = "host"

    def blocked(self, ctx: Context) -> str | None:
        return "no worker processes to remove" if not ctx.value("dataloader_num_workers") else None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(dataloader_num_workers=int(ctx.value("dataloader_num_workers")) // 2)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Each dataloader worker is a process with its own memory; fewer workers, less RAM.")


@register
class SmallerPrefetch(Remedy):
    name = "smaller_prefetch"
    summary = "Prefetch fewer batches per dataloader worker (dataloader_prefetch_factor=1)."
    cost = "speed"
    trade_note = "less overlap between loading and training"
    changes = ("dataloader_prefetch_factor",)
    addresses = "host"

    def blocked(self, ctx: Context) -> str | None:
        if not ctx.value("dataloader_num_workers"):
            return "prefetching needs worker processes, and there are none"
        return "already in force" if ctx.knobs.dataloader_prefetch_factor == 1 else None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(dataloader_prefetch_factor=1)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Prefetched batches wait in host RAM; prefetch one at a time.")


@register
class NoCpuOffload(Remedy):
    name = "no_cpu_offload"
    summary = "Stop offloading optimizer state and parameters to host RAM (DeepSpeed/FSDP offload)."
    cost = "none"
    trade_note = "the offloaded state goes back to the GPU, which must then hold it"
    changes = ("offload_optimizer", "offload_params", "fsdp_offload")
    requires = ()  # turning an offload off needs no package
    addresses = "host"

    def blocked(self, ctx: Context) -> str | None:
        if not (ctx.value("offload_optimizer") or ctx.value("offload_params") or ctx.value("fsdp_offload")):
            return "nothing is offloaded to the CPU"
        return None

    def apply(self, ctx: Context) -> Knobs:
        return ctx.knobs.replace(offload_optimizer=False, offload_params=False, fsdp_offload=False)

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "CPU offload keeps optimizer state (12 bytes per parameter) in host RAM.")
