"""DeepSpeed and FSDP settings as knobs: read the user's, generate the one a rung asks for. Pure, no deepspeed import.

>>> deepspeed_config(None, zero_stage=3, offload_optimizer=True)["zero_optimization"]["offload_optimizer"]
{'device': 'cpu', 'pin_memory': True}
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

# What transformers fills in from the training arguments ("auto"), so a generated config never contradicts them.
_AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}


def load_user_deepspeed(value: Any) -> dict[str, Any] | None:
    """The user's DeepSpeed config as a dict (``GRPOConfig.deepspeed`` may be a dict or a JSON file path)."""
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        return copy.deepcopy(value)
    try:
        return json.loads(Path(str(value)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def deepspeed_config(user: dict[str, Any] | None, *, zero_stage: int | None = None,
                     offload_optimizer: bool | None = None, offload_params: bool | None = None) -> dict[str, Any]:
    """The user's DeepSpeed config (or transformers' "auto" template) with the ZeRO stage and offloads changed."""
    cfg = copy.deepcopy(user) if user else copy.deepcopy(_AUTO)
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
    # buffer sizes transformers derives from the model ("auto": hidden_size^2 and the like); DeepSpeed's own defaults
    # (5e8 elements) would allocate a 1.9 GiB float32 bucket on every rank. A value the user set stays.
    if zero.get("stage", 0) >= 2:
        zero.setdefault("reduce_bucket_size", "auto")
    if zero.get("stage") == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
        zero.setdefault("stage3_prefetch_bucket_size", "auto")
        zero.setdefault("stage3_param_persistence_threshold", "auto")
    return cfg


def observe_deepspeed(user: dict[str, Any] | None) -> dict[str, Any]:
    """The knobs a DeepSpeed config already sets (what the script chose)."""
    if not user:
        return {}
    zero = user.get("zero_optimization") or {}
    out: dict[str, Any] = {}
    if "stage" in zero:
        out["zero_stage"] = int(zero["stage"])
    out["offload_optimizer"] = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    out["offload_params"] = (zero.get("offload_param") or {}).get("device", "none") not in ("none", None)
    return out




def fsdp_options(value: Any) -> list[str]:
    """``GRPOConfig.fsdp`` as a list of options ("full_shard", "offload", ...); empty when FSDP is off."""
    if not value:
        return []
    if isinstance(value, str):
        return [o for o in value.replace(",", " ").split() if o]
    return [str(getattr(o, "value", o)) for o in value]
