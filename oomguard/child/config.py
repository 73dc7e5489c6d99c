"""``GRPOConfig.__post_init__``: the script's own values observed (the diff starts from them), then oomguard's knobs
and the attempt's plan (a fresh run's output directory, the probe) applied before TRL validates them; a checkpoint
cadence leaves the config as the script wrote it (``child/saves.py``).
"""

from __future__ import annotations

from typing import Any

from ..vocab.events import CodeSeen
from ..vocab.knobtable import CONFIG_KNOBS  # GRPOConfig fields that are knobs of the same name
from . import engine, ran
from .patching import missing_packages, overrides_reported, plain, set_attr, world
from .probe import apply_probe
from .runtime import Runtime
from .saves import added_checkpoints


def observe_config(cfg: Any) -> dict[str, Any]:
    from ..vocab.distributed import fsdp_options
    from . import dsconfig

    out = {name: plain(getattr(cfg, name)) for name in CONFIG_KNOBS if hasattr(cfg, name)}
    act = getattr(cfg, "activation_checkpointing", None)
    out["gradient_checkpointing"] = act if act is not None else getattr(cfg, "gradient_checkpointing", None)
    out.update(dsconfig.observe(cfg))
    out["fsdp_offload"] = "offload" in fsdp_options(getattr(cfg, "fsdp", None))
    out.update(engine.observe(cfg))
    return out

def apply_distributed(rt: Runtime, cfg: Any) -> None:
    """ZeRO stage, offloads and buffers through a DeepSpeed config generated from the run's (child/dsconfig.py);
    FSDP offload through fsdp."""
    from ..vocab.distributed import fsdp_options
    from . import dsconfig

    ov = rt.overrides
    dsconfig.apply(rt, cfg)
    if ov.fsdp_offload is not None:
        opts = [o for o in fsdp_options(getattr(cfg, "fsdp", None)) if o != "offload"]
        if opts:
            cfg.fsdp = " ".join([*opts, "offload"] if ov.fsdp_offload else opts)

def apply_config(rt: Runtime, cfg: Any, can_defer: bool = True) -> None:
    """oomguard's knobs and the attempt's plan (a fresh run's output directory, checkpoints, the probe) on a config
    before its own ``__post_init__``. An attempt launched as a probe unless the memory model is sure of its config is
    decided where GRPOTrainer is built (``prepare_trainer_args``), when the model and the prompt lengths are known;
    a construction point after which nothing could still make it a probe (``can_defer`` False) decides it a probe."""
    ov = rt.overrides
    for name in CONFIG_KNOBS:
        v = getattr(ov, name)
        if v is not None and hasattr(cfg, name):
            setattr(cfg, name, v)
    apply_distributed(rt, cfg)
    engine.apply(rt, cfg)
    if ov.gradient_checkpointing is not None:
        # transformers 5.x: activation_checkpointing is the name; gradient_checkpointing is its deprecated mirror.
        if hasattr(cfg, "activation_checkpointing"):
            cfg.activation_checkpointing = ov.gradient_checkpointing
        cfg.gradient_checkpointing = ov.gradient_checkpointing
    plan = rt.plan
    if plan.resume and plan.resume.output_dir and plan.resume.mode in ("weights", "restart"):
        cfg.output_dir = plan.resume.output_dir  # a new run must not write over the checkpoints of the one before
    rt.added = added_checkpoints(rt, cfg)  # checkpoints a cadence adds to the user's own, taken away again
    if plan.probe and rt.probe_undecided() and not can_defer:
        rt.decide_probe("probe", "this launch form builds its trainer where the probe can no longer be decided")
    if plan.probe and rt.probing():
        apply_probe(rt, cfg, plan.probe)

def patch_grpo_config(rt: Runtime, module: Any) -> None:
    cls = module.GRPOConfig
    orig = cls.__dict__["__post_init__"]

    def __post_init__(self: Any) -> None:
        if not getattr(self, "_oomguard_seen", False):
            from ..vocab.distributed import fsdp_options
            from .dsconfig import user_deepspeed
            from .trlcompat import features

            rt.observe(observe_config(self))
            rt.emit(CodeSeen(point="config", observed=observe_config(self), world_size=world(),
                    facts={"fsdp": bool(fsdp_options(getattr(self, "fsdp", None))),
                           "deepspeed": user_deepspeed(self)[1], "missing_packages": missing_packages(),
                           **features().facts()}))
        object.__setattr__(self, "_oomguard_seen", True)
        with overrides_reported(rt, "GRPOConfig"):
            apply_config(rt, self)
            applied = ran.values(self)
            orig(self)
        ran.config_built(rt, self, applied)
        ran.report(rt)  # a replayed lock's value GRPOConfig changed stops here, before anything loads

    set_attr(cls, "__post_init__", __post_init__)
