"""``PreTrainedModel.from_pretrained``: the model's shape reported before its weights are placed (so the pre-flight
can judge the load), oomguard's dtype and 4-bit load applied, the script's own dtype observed, a new run started from
a checkpoint's weights, and the loaded tensors adopted by the simulated device.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..vocab.events import ModelSeen, WeightsFrom
from .patching import dtype_name, overrides_reported, plain, set_attr
from .runtime import Runtime

LOAD_KNOBS = ("dtype", "load_in_4bit")  # what oomguard sets in from_pretrained's arguments


def bnb_config(torch: Any, rt: Runtime) -> Any:
    """QLoRA's NF4 config, computing in the 16-bit dtype the knobs chose (bfloat16, float16 on a card without it)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=half_dtype(torch, rt),
                              bnb_4bit_use_double_quant=True)

def half_dtype(torch: Any, rt: Runtime) -> Any:
    return torch.float16 if rt.overrides.dtype == "float16" else torch.bfloat16

_MODEL_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
               "max_position_embeddings", "attention_bias", "mlp_bias", "torch_dtype", "dtype",
               "quantization_config",  # a checkpoint quantised already: the pre-flight does not judge its load
               # what the memory model reads beyond a dense decoder (memory/estimate/readconfig.py): biases, experts
               # and the layers that carry them, latent attention, sliding windows, a vision tower
               "qkv_bias", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
               "experts_per_token", "top_k", "moe_intermediate_size", "first_k_dense_replace", "decoder_sparse_step",
               "mlp_only_layers", "n_shared_experts", "shared_expert_intermediate_size", "output_router_logits",
               "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
               "layer_types", "use_sliding_window", "max_window_layers", "sliding_window_pattern",
               "mm_tokens_per_image", "text_config", "vision_config",
               "depth", "num_heads", "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
               "fullatt_block_indexes", "out_hidden_size", "in_channels", "in_chans", "num_channels", "image_size",
               "vision_use_head")
_NESTED = ("text_config", "vision_config")


def model_config_dict(cfg: Any) -> dict[str, Any]:
    """The fields of a transformers config that the memory model reads (a multimodal model's ``text_config`` and
    ``vision_config`` as nested dicts of the same fields; ``quantization_config`` as its ``quant_method``).

    >>> model_config_dict({"model_type": "gemma3", "rope_theta": 1e6, "vision_config": {"patch_size": 14, "x": 1},
    ...                    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}})
    {'model_type': 'gemma3', 'quantization_config': {'quant_method': 'mxfp4'}, 'vision_config': {'patch_size': 14}}
    """
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg) if isinstance(cfg, dict) else {}
    out: dict[str, Any] = {}
    for k in _MODEL_KEYS:
        if k not in d:
            continue
        v = d[k]
        if k in _NESTED and v is not None:
            out[k] = model_config_dict(v)
        elif k == "quantization_config" and isinstance(v, dict):
            out[k] = {"quant_method": plain(v.get("quant_method"))}
        else:
            out[k] = plain(v)
    return out


def checkpoint_config(name: Any, init_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's config (local, or already in the hub cache), read without loading a weight; None when it cannot
    be read (the pre-flight then waits until the model is built)."""
    if not isinstance(name, (str, os.PathLike)):
        return None
    try:
        from transformers import AutoConfig

        kw = {k: init_kwargs[k] for k in ("revision", "trust_remote_code", "cache_dir", "token", "subfolder",
                                          "local_files_only") if k in init_kwargs}
        return model_config_dict(AutoConfig.from_pretrained(name, **kw)) or None
    except Exception:  # no network, remote code refused, an unknown architecture: not ours to fail on
        return None

def record_model(rt: Runtime, model: Any) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    rt.model_config = model_config_dict(cfg)
    try:
        params = sum(p.numel() for p in model.parameters())
    except Exception:
        params = None
    rt.emit(ModelSeen(config=rt.model_config, params=params, dtype=dtype_name(getattr(model, "dtype", None))))

def weights_checkpoint(rt: Runtime) -> str | None:
    """The checkpoint whose weights a new run starts from, after a rung that a checkpoint cannot continue."""
    r = rt.plan.resume
    return r.checkpoint if r is not None and r.mode == "weights" else None

def placed_elsewhere(kwargs: dict[str, Any], config: dict[str, Any] | None = None) -> bool:
    """A load the pre-flight cannot judge as "every weight on this device, in the load's dtype": spread by
    ``device_map``/``max_memory``, a checkpoint quantised already (AWQ, GPTQ, FP8: its ``quantization_config``), an
    8-bit load, or weights a ZeRO-3 or FSDP run shards over the ranks.

    >>> placed_elsewhere({"device_map": "auto"}), placed_elsewhere({}, {"quantization_config": {"quant_method": "awq"}})
    (True, True)
    >>> placed_elsewhere({"dtype": "bfloat16"})
    False
    """
    q = kwargs.get("quantization_config")
    eight = bool(getattr(q, "load_in_8bit", False) or (isinstance(q, dict) and q.get("load_in_8bit")))
    # `accelerate launch` with a DeepSpeed ZeRO-3 or FSDP config says so in the environment of every rank
    sharded = (os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
               or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true")
    return (kwargs.get("device_map") not in (None, "cpu") or "max_memory" in kwargs or eight or sharded
            or bool((config or {}).get("quantization_config")))

def _before_load(rt: Runtime, name: Any, kwargs: dict[str, Any], requested: Any) -> None:
    """Before ``from_pretrained`` places the weights: report the model's shape (so an OOM while loading can be
    answered by prediction, and the supervisor knows this command passes through a load), then let the pre-flight
    judge the load (``preflight.check_load``). Never fails the load: a config it cannot read is skipped."""
    try:
        _judge_load(rt, name, kwargs, requested)
    except SystemExit:
        raise
    except Exception as e:
        sys.stderr.write(f"oomguard: warning: could not judge this load before it ran ({type(e).__name__}: {e})\n")

def _judge_load(rt: Runtime, name: Any, kwargs: dict[str, Any], requested: Any) -> None:
    given = kwargs.get("config")
    config = model_config_dict(given) if given is not None and not isinstance(given, str) else \
        checkpoint_config(given or name, kwargs)
    if not config:
        return
    # a script that imported GRPOTrainer will build one: its knobs (LoRA) reach the next attempt
    reaches = ("trainer",) if "trl.trainer.grpo_trainer" in sys.modules else ()
    rt.emit(ModelSeen(config=config, params=None, dtype=None, reaches=reaches))
    if not rt.plan.preflight or placed_elsewhere(kwargs, config) or _sharded(rt):
        return
    declared = dtype_name(config.get("dtype") or config.get("torch_dtype")) or "float32"
    dtype = dtype_name(kwargs.get("dtype", kwargs.get("torch_dtype"))) or "auto"
    if dtype == "auto":  # transformers 5's default: the checkpoint's own dtype
        dtype = declared
    q = kwargs.get("quantization_config")
    in4 = bool(getattr(q, "load_in_4bit", False) or (isinstance(q, dict) and q.get("load_in_4bit")))
    # What the script loads when oomguard changes nothing (``kwargs`` holds oomguard's overrides already): the dtype
    # it asked for, else the checkpoint's own. Observed whatever the overrides, so that a replayed lock's dtype is
    # never taken for the user's; but a front-end's loader (``rt.loader``) hands on oomguard's dtype as its own, and
    # its adapter observes the notebook's.
    if rt.loader is None or rt.overrides.dtype is None:
        rt.observe({"dtype": dtype_name(requested) if requested not in (None, "auto") else declared})
    try:
        knobs = rt.knobs().replace(dtype=dtype, load_in_4bit=in4)
    except (TypeError, ValueError):
        return
    from . import preflight

    preflight.check_load(rt, config, knobs)

def _zero3_comm() -> None:
    """ZeRO-3 partitions the weights while ``from_pretrained`` creates them, with DeepSpeed's own communication
    backend. On a GPU, accelerate starts it when the training arguments are built; on CPU (``use_cpu``) transformers
    takes another branch and never does, so DeepSpeed would see one rank and reject its batch sizes. Start it here
    (gloo) when that is the case: the ZeRO-3 rung must work wherever the run does."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            return
        import deepspeed
        import deepspeed.comm as ds_comm
        import torch

        if not ds_comm.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    except Exception as e:  # never the reason a load fails
        sys.stderr.write(f"oomguard: warning: could not start DeepSpeed's communication for ZeRO-3 ({e})\n")

def _sharded(rt: Runtime) -> bool:
    """This run shards its weights over the ranks (ZeRO-3, FSDP): a load's bytes on one device are not its size."""
    k = rt.knobs()
    return (k.zero_stage == 3) or bool(rt.facts().get("fsdp"))

def device_tensors(model: Any) -> list[Any]:
    """What a loaded model keeps on its device: parameters, buffers, and a 4-bit weight's quantisation state
    (bitsandbytes keeps the absmax and its own quantisation outside ``parameters()``)."""
    out = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        while qs is not None:
            out += [t for t in (getattr(qs, "absmax", None), getattr(qs, "code", None)) if t is not None]
            qs = getattr(qs, "state2", None)
    return out

def _is_policy(cls: type) -> bool:
    return cls.__name__.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel"))

def patch_from_pretrained(rt: Runtime, module: Any) -> None:
    base = module.PreTrainedModel
    orig = base.__dict__["from_pretrained"].__func__

    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not _is_policy(cls):
            return orig(cls, *args, **kwargs)
        import torch

        weights = weights_checkpoint(rt)
        if weights:
            if args:
                args = (weights, *args[1:])
            else:
                kwargs["pretrained_model_name_or_path"] = weights
            rt.emit(WeightsFrom(checkpoint=weights))
        requested = kwargs.get("dtype", kwargs.get("torch_dtype"))
        ov = rt.overrides
        if ov.dtype is not None and ov.dtype != "auto":
            kwargs.pop("torch_dtype", None)
            kwargs["dtype"] = getattr(torch, ov.dtype)
        if ov.load_in_4bit and "quantization_config" not in kwargs:
            kwargs["quantization_config"] = bnb_config(torch, rt)
            if kwargs.get("dtype") in (None, "auto", torch.float32, "float32"):
                kwargs["dtype"] = half_dtype(torch, rt)
        _before_load(rt, args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs, requested)
        _zero3_comm()
        # an error of the loader's while oomguard's dtype or 4-bit load is in force is reported as theirs, so the
        # supervisor takes the rung back instead of passing the failure through as the script's (inside a front-end's
        # loader, its adapter reports it, under the front-end's name)
        with overrides_reported(rt, "from_pretrained", () if rt.loader else LOAD_KNOBS):
            model = orig(cls, *args, **kwargs)
        # What the script asked for; with "auto" (the default) that is the checkpoint's dtype, known once loaded
        # without an override (the first attempt always loads without one).
        if requested not in (None, "auto"):
            rt.observe({"dtype": dtype_name(requested)})
        elif ov.dtype is None and not ov.load_in_4bit:
            rt.observe({"dtype": dtype_name(getattr(model, "dtype", None))})
        try:
            model._oomguard_from_pretrained = True
        except Exception:
            pass
        from . import simulate

        dev = simulate.device()
        if dev is not None:
            dev.adopt(device_tensors(model))
        record_model(rt, model)
        return model

    set_attr(base, "from_pretrained", classmethod(from_pretrained))
