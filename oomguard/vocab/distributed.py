"""DeepSpeed and FSDP settings as knobs: read the user's, generate the one a rung asks for. Pure, no deepspeed import.

A DeepSpeed config reaches a GRPO run in one of three forms: a JSON file or a dict in ``GRPOConfig.deepspeed``, or
the config accelerate's ``DeepSpeedPlugin`` builds from an ``accelerate launch --config_file`` YAML
(``distributed_type: DEEPSPEED`` and ``zero_stage: 2``: the stage, the offload devices and "auto" batch sizes, no
bucket sizes). Whatever the config leaves out, DeepSpeed fills with its own defaults (:data:`DS_DEFAULTS`), and a
gradient bucket of 500,000,000 elements is 1.86 GiB in float32 on every rank, whatever the model's size. "auto" is
what transformers fills from the model's hidden size (:func:`auto_size`).

>>> deepspeed_config(None, zero_stage=3, offload_optimizer=True)["zero_optimization"]["offload_optimizer"]
{'device': 'cpu', 'pin_memory': True}
>>> buffer_elements("reduce_bucket_size", None, hidden_size=256), buffer_elements("reduce_bucket_size", "auto", 256)
(500000000, 65536)
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .knobs import DS_SIZE_KNOBS

# What transformers fills in from the training arguments ("auto"), so a generated config never contradicts them.
_AUTO: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}

# DeepSpeed 0.19's defaults for the sizes a config may leave out (deepspeed/runtime/zero/config.py,
# DeepSpeedZeroConfig), in elements. overlap_comm defaults to True for ZeRO-3 only.
DS_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
}

# The buffers that ``deepspeed_buffers`` sizes to the model, per ZeRO stage: ZeRO-1/2 allocate the reduce bucket in
# every backward; ZeRO-3 keeps one for the whole run, and prefetches and keeps whole parameters by the other two.
STAGE_BUFFERS: dict[int, tuple[str, ...]] = {1: ("reduce_bucket_size",), 2: ("reduce_bucket_size",),
                                             3: DS_SIZE_KNOBS}


def auto_size(key: str, hidden_size: int) -> int:
    """The value transformers gives a DeepSpeed size left at "auto" (``HfTrainerDeepSpeedConfig.trainer_config_finalize``):
    ``hidden_size²`` elements for the reduce bucket, 0.9 of that for ZeRO-3's prefetch bucket, ``10 × hidden_size``
    for ZeRO-3's persistence threshold.

    >>> auto_size("reduce_bucket_size", 2048), auto_size("stage3_param_persistence_threshold", 2048)
    (4194304, 20480)
    """
    if key == "reduce_bucket_size":
        return hidden_size * hidden_size
    if key == "stage3_prefetch_bucket_size":
        return int(0.9 * hidden_size * hidden_size)
    if key == "stage3_param_persistence_threshold":
        return 10 * hidden_size
    raise KeyError(f"transformers does not fill {key} from the model")


def buffer_elements(key: str, value: int | str | None, hidden_size: int) -> int:
    """The number of elements DeepSpeed will use for ``key`` given the config's ``value`` ("auto", a number, or
    ``None`` when the config leaves it to DeepSpeed)."""
    if value is None:
        return DS_DEFAULTS[key]
    if value == "auto":
        return auto_size(key, hidden_size)
    return int(value)


def load_user_deepspeed(value: Any) -> dict[str, Any] | None:
    """The user's DeepSpeed config as a dict (``GRPOConfig.deepspeed`` may be a dict or a JSON file path)."""
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        return copy.deepcopy(value)
    try:
        loaded: dict[str, Any] = json.loads(Path(str(value)).read_text(encoding="utf-8"))  # a config is an object
    except (OSError, ValueError):
        return None
    return loaded


def deepspeed_config(user: dict[str, Any] | None, *, zero_stage: int | None = None,
                     offload_optimizer: bool | None = None, offload_params: bool | None = None,
                     sizes: Mapping[str, int | str | None] | None = None) -> dict[str, Any]:
    """The user's DeepSpeed config (or transformers' "auto" template) with the ZeRO stage, the offloads and the
    buffer ``sizes`` (``{"reduce_bucket_size": "auto", ...}``; None leaves a key as it is) changed. Every other key
    of the user's stays as they wrote it.

    >>> deepspeed_config({"zero_optimization": {"stage": 2, "overlap_comm": True}},
    ...                  sizes={"reduce_bucket_size": "auto"})["zero_optimization"]
    {'stage': 2, 'overlap_comm': True, 'reduce_bucket_size': 'auto'}
    """
    cfg = copy.deepcopy(user) if user else copy.deepcopy(_AUTO)
    if cfg.get("steps_per_print") == float("inf"):  # accelerate's plugin adds it again; JSON has no infinity
        del cfg["steps_per_print"]
    zero = cfg.setdefault("zero_optimization", {})
    if zero_stage is not None:
        zero["stage"] = int(zero_stage)
    if offload_optimizer is not None:
        if offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        else:
            zero.pop("offload_optimizer", None)
    if offload_params is not None:
        if offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        else:
            zero.pop("offload_param", None)
    for key, value in (sizes or {}).items():
        if value is not None:
            zero[key] = value
    if zero.get("stage") == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    return cfg


def _offloaded(zero: Mapping[str, Any], key: str) -> bool:
    """An ``offload_*`` section whose device is cpu or nvme (accelerate writes ``{"device": "none"}`` for none)."""
    section = zero.get(key) or {}
    return isinstance(section, Mapping) and str(section.get("device") or "none").lower() not in ("none", "")


def observe_deepspeed(user: dict[str, Any] | None) -> dict[str, Any]:
    """The knobs a DeepSpeed config already sets (what the script chose): the stage, the offloads, and the buffer
    sizes and ``overlap_comm`` it sets itself (a size it leaves out stays ``None``: DeepSpeed's default).

    >>> observe_deepspeed({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8,
    ...                                          "offload_optimizer": {"device": "none"}}})
    {'zero_stage': 2, 'offload_optimizer': False, 'offload_params': False, 'reduce_bucket_size': 200000000}
    """
    if not user:
        return {}
    zero = user.get("zero_optimization") or {}
    out: dict[str, Any] = {}
    if "stage" in zero:
        out["zero_stage"] = int(zero["stage"])
    out["offload_optimizer"] = _offloaded(zero, "offload_optimizer")
    out["offload_params"] = _offloaded(zero, "offload_param")
    for key in DS_SIZE_KNOBS:
        v = zero.get(key)
        if v == "auto":
            out[key] = "auto"
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = int(v)
    if isinstance(zero.get("overlap_comm"), bool):
        out["overlap_comm"] = zero["overlap_comm"]
    return out


def ds_config_sizes(knobs: Any) -> dict[str, int | str | None]:
    """The buffer-size knobs of ``knobs`` (a Knobs), for :func:`deepspeed_config`."""
    return {key: getattr(knobs, key) for key in DS_SIZE_KNOBS}


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def deepspeed_buckets(knobs: Mapping[str, Any] | None, model_config: Mapping[str, Any] | None) -> dict[str, int]:
    """The reduce bucket DeepSpeed allocates in one piece under these knobs (a run's effective knobs, as a crash
    record keeps them) for this model: ``{description: bytes}``, empty without ZeRO or without the model's hidden
    size where the config says "auto". The bucket holds gradients in the trainable parameters' dtype (fp32 LoRA
    adapters, else the load dtype).

    >>> deepspeed_buckets({"zero_stage": 2, "dtype": "float32"}, {"hidden_size": 256})  # doctest: +NORMALIZE_WHITESPACE
    {"DeepSpeed's gradient reduce bucket (reduce_bucket_size: 500,000,000 elements, DeepSpeed's default where the
      config leaves it out, in float32)": 2000000000}
    """
    k = knobs or {}
    if not k.get("zero_stage"):
        return {}
    cfg = dict(model_config or {})
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = dict(cfg["text_config"])
    hidden = int(cfg.get("hidden_size") or 0)
    value = k.get("reduce_bucket_size")
    if value == "auto" and not hidden:
        return {}
    n = buffer_elements("reduce_bucket_size", value, hidden)
    dtype = str(k.get("dtype") or "float32")
    if dtype == "auto":
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    if k.get("lora_r"):
        dtype = "bfloat16" if k.get("load_in_4bit") else "float32"
    how = ("DeepSpeed's default where the config leaves it out" if value is None
           else "transformers' \"auto\": hidden_size²" if value == "auto" else "as the config sets it")
    return {f"DeepSpeed's gradient reduce bucket (reduce_bucket_size: {n:,} elements, {how}, in {dtype})":
            n * _DTYPE_BYTES.get(dtype, 4)}


def fsdp_options(value: Any) -> list[str]:
    """``GRPOConfig.fsdp`` as a list of options ("full_shard", "offload", ...); empty when FSDP is off."""
    if not value:
        return []
    if isinstance(value, str):
        return [o for o in value.replace(",", " ").split() if o]
    return [str(getattr(o, "value", o)) for o in value]
