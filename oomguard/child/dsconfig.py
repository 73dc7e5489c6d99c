"""The DeepSpeed config of a GRPO run as DeepSpeed will see it, read and rewritten in the training process.

A run's DeepSpeed config is ``GRPOConfig.deepspeed`` (a JSON file or a dict) or, when that is empty under
``accelerate launch --config_file`` with ``distributed_type: DEEPSPEED``, the one accelerate's ``DeepSpeedPlugin``
builds from the launcher's environment (the YAML's ``zero_stage``, offload devices and gradient accumulation, "auto"
batch sizes, no bucket sizes). :func:`user_deepspeed` reads either, so the knobs observed (and the memory model)
start from the config as it will run; :func:`apply` writes a generated config when a rung changes a DeepSpeed knob.

Two things accelerate does on its side are worked around here, each only where the run would otherwise fail:

- a generated config handed to ``GRPOConfig.deepspeed`` under an accelerate DeepSpeed YAML would be refused
  ("When using `deepspeed_config_file`, the following accelerate config variables will be ignored"), because
  the launcher lists the YAML's DeepSpeed fields in ``ACCELERATE_CONFIG_DS_FIELDS``. The generated config is built
  from those very fields, so the list is dropped in this process;
- on a machine whose only device is the CPU, accelerate counts each DeepSpeed rank alone unless the training
  arguments say ``use_cpu`` (its DeepSpeed launcher does not pass the YAML's ``use_cpu`` on, and ``PartialState``
  without ``cpu`` looks for a GPU backend, finds none and takes the process for a single one), so transformers fills
  ``train_batch_size`` for one rank and DeepSpeed, which sees them all, rejects it ("train_batch_size is not equal to
  micro_batch_per_gpu * gradient_acc_step * world_size 4 != 4 * 1 * 2"). Where DeepSpeed itself runs on the CPU,
  ``GRPOConfig.use_cpu`` is set: the run is on the CPU either way, and accelerate then starts gloo over every rank.
  (``ACCELERATE_USE_CPU`` would not do: accelerate then turns DeepSpeed off altogether.)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from ..vocab.distributed import deepspeed_config, ds_config_sizes, load_user_deepspeed, observe_deepspeed
from ..vocab.events import ConfigGenerated
from ..vocab.knobs import DS_SIZE_KNOBS
from .runtime import Runtime

_DS_KNOBS = ("zero_stage", "offload_optimizer", "offload_params", *DS_SIZE_KNOBS)


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def accelerate_deepspeed() -> dict[str, Any] | None:
    """The config accelerate's ``DeepSpeedPlugin`` builds from an ``accelerate launch`` with DeepSpeed (its
    ``deepspeed_config`` section, or the ``deepspeed_config_file`` it names), before the trainer fills "auto"; None
    when the process was not launched so, or the plugin refuses the environment (the run will say why itself)."""
    if not _flag("ACCELERATE_USE_DEEPSPEED"):
        return None
    try:
        from accelerate.utils import DeepSpeedPlugin

        return json.loads(json.dumps(DeepSpeedPlugin().deepspeed_config, default=str))
    except Exception:
        return None


def user_deepspeed(cfg: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The DeepSpeed config this GRPOConfig runs with, and where it comes from (``"GRPOConfig"``, ``"accelerate"``,
    or None without DeepSpeed)."""
    own = getattr(cfg, "deepspeed", None)
    if own:
        return load_user_deepspeed(own), "GRPOConfig"
    acc = accelerate_deepspeed()
    return (acc, "accelerate") if acc else (None, None)


def observe(cfg: Any) -> dict[str, Any]:
    """The DeepSpeed knobs the run's own config sets (stage, offloads, buffer sizes, overlap_comm)."""
    return observe_deepspeed(user_deepspeed(cfg)[0])


def with_rung(user: dict[str, Any] | None, ov: Any) -> dict[str, Any]:
    """The user's DeepSpeed config (None: transformers' "auto" template) with the ZeRO stage, offloads and buffer
    sizes oomguard's overrides ``ov`` set, every other key as the user wrote it."""
    return deepspeed_config(user, zero_stage=ov.zero_stage, offload_optimizer=ov.offload_optimizer,
                            offload_params=ov.offload_params, sizes=ds_config_sizes(ov))


def apply(rt: Runtime, cfg: Any) -> None:
    """A rung changed a DeepSpeed knob: write the run's config with the change (every other key as the user wrote
    it) next to the attempt's records and point ``GRPOConfig.deepspeed`` at it; then make sure a DeepSpeed run on CPU
    ranks counts all of them."""
    ov = rt.overrides
    if any(getattr(ov, name) is not None for name in _DS_KNOBS):
        user, source = user_deepspeed(cfg)
        generated = with_rung(user, ov)
        if source == "accelerate":
            for section in ("bf16", "fp16"):  # accelerate sets them from mixed_precision; transformers fills "auto"
                generated.setdefault(section, {"enabled": "auto"})
            os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)  # the generated config holds the YAML's fields
        own = getattr(cfg, "deepspeed", None)
        replaces = (str(own) if isinstance(own, str) else "your dict (GRPOConfig.deepspeed)" if own
                    else "accelerate's, from its --config_file" if source == "accelerate" else None)
        cfg.deepspeed = write_generated(rt, generated, replaces) or generated
    if (getattr(cfg, "deepspeed", None) or _flag("ACCELERATE_USE_DEEPSPEED")) and not getattr(cfg, "use_cpu", True) \
            and _deepspeed_on_cpu_ranks():
        cfg.use_cpu = True
        rt.adapt("use_cpu", True, "DeepSpeed runs on the CPU here: accelerate counts every rank only with use_cpu "
                                  "(its DeepSpeed launcher does not pass the YAML's use_cpu on)")
        if os.environ.get("RANK", "0") == "0" and (rt.plan.attempt or 1) <= 1:  # once a run
            sys.stderr.write("oomguard: DeepSpeed runs on the CPU here and the script does not set use_cpu: setting "
                             f"use_cpu=True so that accelerate counts all {os.environ.get('WORLD_SIZE')} ranks "
                             "(accelerate's DeepSpeed launcher does not pass the YAML's use_cpu on)\n")


def write_generated(rt: Runtime, generated: dict[str, Any], replaces: str | None) -> str | None:
    """Write the DeepSpeed config oomguard generated for this attempt next to its records (one file per attempt:
    written again with the same content where a stack's arguments and its GRPOConfig both take it) and tell the
    supervisor once (``replaces``: what the run would have used); its path, or None where it cannot be written."""
    target: str | None = os.path.join(rt.plan.crash_dir or tempfile.gettempdir(),
                                       f"deepspeed-attempt{rt.plan.attempt}.json")
    try:
        with open(str(target), "w", encoding="utf-8") as f:
            json.dump(generated, f, indent=2)
    except OSError:
        target = None
    if not getattr(rt, "_deepspeed_emitted", False):
        rt.emit(ConfigGenerated(kind="deepspeed", path=target, config=generated, replaces=replaces))
        rt._deepspeed_emitted = True  # type: ignore[attr-defined]
    return target


def _deepspeed_on_cpu_ranks() -> bool:
    """Several ranks, and DeepSpeed's accelerator is the CPU (no GPU or other device it could use)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or "LOCAL_RANK" not in os.environ:
        return False
    try:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().device_name() == "cpu"
    except Exception:
        return False
