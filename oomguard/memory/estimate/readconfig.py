"""Reading a ``config.json`` into a :class:`~.model.ModelSpec`: by what the config declares (sizes, head dim, biases,
experts, sliding windows, a vision tower), with the few facts of an architecture that no key declares taken from
transformers 5.24's classes (cited per table below).

A published ``config.json`` may leave keys to its class's defaults (Gemma 3's ``text_config`` declares neither its
vocabulary nor its heads): :data:`CLASS_DEFAULTS` holds those defaults for the classes whose published configs rely
on them (``tests/test_model_families.py`` checks them against transformers' config classes). Anything a config
declares that the model cannot count is refused in one line naming the key.

>>> from oomguard.memory.estimate.model import ModelSpec
>>> gemma = spec_from_config(ModelSpec, {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
...     "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
...                     "num_hidden_layers": 34, "sliding_window": 1024},
...     "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
...                       "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
...                       "patch_size": 14, "vision_use_head": False}})
>>> gemma.params, gemma.vocab_size, gemma.sliding_layers, gemma.vision.tokens_per_image   # Gemma-3-4b-it
(4300079472, 262208, 29, 256)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .arch import DTYPE_ALIASES, DTYPE_BYTES, EstimateError, MlaSpec, MoeSpec, VisionSpec

Spec = TypeVar("Spec")  # model.ModelSpec, which passes itself (it imports this module)

_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_ALIASES = {"num_hidden_layers": ("n_layer", "num_layers"), "hidden_size": ("n_embd", "d_model"),
            "num_attention_heads": ("n_head",), "intermediate_size": ("ffn_dim", "n_inner")}

# Defaults of transformers 5.24's config classes for the keys their published configs leave out
# (configuration_gemma3.py Gemma3TextConfig, configuration_siglip.py SiglipVisionConfig,
# configuration_qwen2_5_vl.py Qwen2_5_VLVisionConfig, configuration_qwen2_moe.py Qwen2MoeConfig, ...).
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                    "tie_word_embeddings": True},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                            "vision_use_head": True},
    "qwen2_5_vl_vision": {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16,
                          "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]},
    "qwen2_moe": {"qkv_bias": True, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 5632,
                  "router_aux_loss_coef": 0.001},
    "qwen3_moe": {"decoder_sparse_step": 1, "router_aux_loss_coef": 0.001},
    "mixtral": {"router_aux_loss_coef": 0.001},
    "deepseek_v2": {"first_k_dense_replace": 0, "n_shared_experts": 2},
    "deepseek_v3": {"first_k_dense_replace": 3, "n_shared_experts": 1},
    "gpt_oss": {"num_experts_per_tok": 4, "router_aux_loss_coef": 0.001},
}

# Facts of an architecture that no config key declares, read from transformers 5.24's modeling code:
# q/k/v biases whatever the config says (Qwen2's attention), per-head q/k RMSNorm (q_norm, k_norm of head_dim),
# norms per decoder layer (Gemma 2/3: input, post-attention, pre- and post-feedforward), fused qkv_proj and
# gate_up_proj (Phi-3's Phi3Attention and Phi3MLP), gpt-oss's attention sinks, biased experts and router, and its
# lack of an SDPA path (GptOssPreTrainedModel._supports_sdpa = False).
QKV_BIAS_ALWAYS = frozenset({"qwen2", "qwen2_vl", "qwen2_5_vl", "qwen2_5_vl_text"})
NO_O_BIAS = frozenset({"qwen2", "qwen2_vl", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_moe"})
QK_NORM = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text"})
FUSED_PROJECTIONS = frozenset({"phi3"})
GPT_OSS = frozenset({"gpt_oss"})
# Untied unless the config says: PretrainedConfig's default is tied, these classes' is not.
UNTIED_BY_DEFAULT = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "phi3",
                               "gpt_oss", "deepseek_v2", "deepseek_v3"})
# transformers 5.24 conversion_mapping._MODEL_TO_CONVERSION_PATTERN (plus PEFT 0.21's own "mixtral" entry): the
# fused-MoE model types converted as Mixtral or as Qwen2-MoE, for which PEFT maps all-linear (and the v4 expert names
# of that pattern) onto the experts and the router. Qwen2-MoE itself is not in the table.
PEFT_MOE_PATTERN: dict[str, str] = {
    **dict.fromkeys(("mixtral", "minimax", "minimax_m2"), "mixtral"),
    **dict.fromkeys(("Dots3NoteTextModel", "afmoe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1",
                     "ernie4_5_moe", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "glm4v_moe", "longcat_flash",
                     "solar_open", "mellum", "qwen3_moe", "beam", "qwen3_omni_moe", "qwen3_omni_moe_thinker",
                     "qwen3_omni_moe_text", "qwen3_next", "hunyuan_v1_moe", "flex_olmo", "olmoe", "sarvam_mla",
                     "exaone_moe", "cohere2_moe"), "qwen2_moe")}
# What the MoE blocks and layer patterns of these families look like is modelled; others with experts are refused.
MOE_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"})
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


def _int(d: Mapping[str, Any], key: str, source: str, default: Any = None) -> Any:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise EstimateError(f"{source}: {key} must be a positive integer, not {v!r}")
    return v


def _with_defaults(d: Mapping[str, Any], model_type: str | None) -> dict[str, Any]:
    """``d`` over its class's defaults for the keys it leaves out."""
    return {**CLASS_DEFAULTS.get(str(model_type), {}), **d}


def spec_from_config(cls: Callable[..., Spec], top: Mapping[str, Any], *, source: str = "config") -> Spec:
    """The :class:`ModelSpec` of a ``config.json`` dict (see :meth:`ModelSpec.from_config`)."""
    if not isinstance(top, Mapping):
        raise EstimateError(f"{source}: expected a JSON object, found {type(top).__name__}")
    d: Mapping[str, Any] = top
    text = top.get("text_config")
    if "hidden_size" not in top and isinstance(text, Mapping):
        carried = {k: v for k, v in top.items() if k in ("tie_word_embeddings", "torch_dtype", "dtype")}
        d = {**carried, **text}
    archs = top.get("architectures") or []
    if isinstance(archs, list) and archs and not any(
            isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
            for a in archs):
        raise EstimateError(f"{source}: architecture {', '.join(map(str, archs))} is not a decoder-only language "
                            "model (expected *ForCausalLM)")
    model_type = str(d.get("model_type") or top.get("model_type") or "llama")
    d = _with_defaults(d, model_type)
    vals: dict[str, Any] = {}
    missing = []
    for k in _REQUIRED_KEYS:
        v = d.get(k)
        if v is None:
            v = next((d[a] for a in _ALIASES.get(k, ()) if d.get(a) is not None), None)
        if v is None:
            missing.append(k)
        vals[k] = v
    if missing:
        raise EstimateError(f"{source}: not a decoder config: missing {', '.join(missing)}")
    nkv = d.get("num_key_value_heads")
    vals["num_key_value_heads"] = vals["num_attention_heads"] if nkv is None else nkv
    for k, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise EstimateError(f"{source}: {k} must be a positive integer, not {v!r}")
    h, a, L = vals["hidden_size"], vals["num_attention_heads"], vals["num_hidden_layers"]
    hd = d.get("head_dim")
    if hd is None:
        if h % a:
            raise EstimateError(f"{source}: hidden_size {h} is not divisible by num_attention_heads {a} and "
                                "head_dim is not given")
        hd = h // a
    if isinstance(hd, bool) or not isinstance(hd, int) or hd <= 0:
        raise EstimateError(f"{source}: head_dim must be a positive integer, not {hd!r}")
    if a % vals["num_key_value_heads"]:
        raise EstimateError(f"{source}: num_attention_heads {a} is not a multiple of num_key_value_heads "
                            f"{vals['num_key_value_heads']}")
    attention_bias = bool(d.get("attention_bias", False))
    qkv_bias = model_type in QKV_BIAS_ALWAYS or attention_bias or bool(d.get("qkv_bias"))
    tie = d.get("tie_word_embeddings", top.get("tie_word_embeddings"))
    if tie is None:  # PretrainedConfig defaults to True; Llama-family configs to False
        tie = model_type not in UNTIED_BY_DEFAULT
    dtype = d.get("dtype") or d.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype")
    dtype = DTYPE_ALIASES.get(str(dtype), str(dtype)) if dtype else None
    window, sliding = _sliding(d, model_type, L, source)
    mla = _mla(d, source)
    return cls(
        vocab_size=vals["vocab_size"], hidden_size=h, num_layers=L, num_heads=a,
        num_kv_heads=vals["num_key_value_heads"], head_dim=hd, intermediate_size=vals["intermediate_size"],
        tie_word_embeddings=bool(tie), qkv_bias=qkv_bias and mla is None, model_type=model_type,
        checkpoint_dtype=dtype if dtype in DTYPE_BYTES else None,
        o_bias=attention_bias and model_type not in NO_O_BIAS,
        mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=model_type in QK_NORM,
        max_positions=_positive(d.get("max_position_embeddings")),
        norms_per_layer=4 if model_type in FOUR_NORMS else 2,
        fused_qkv=model_type in FUSED_PROJECTIONS, fused_gate_up=model_type in FUSED_PROJECTIONS,
        attn_sinks=model_type in GPT_OSS, eager_attention=model_type in GPT_OSS,
        sliding_window=window if sliding else None, sliding_layers=sliding, mla=mla,
        moe=_moe(d, top, model_type, L, source), vision=_vision(top, h, source),
    )


def _positive(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _sliding(d: Mapping[str, Any], model_type: str, L: int, source: str) -> tuple[int | None, int]:
    """(the window, how many layers attend through it), as transformers 5.24 builds the layer types: the declared
    ``layer_types``; Qwen2-family ``use_sliding_window`` (layers from ``max_window_layers`` on); Gemma 2/3's pattern
    (every ``sliding_window_pattern``-th layer global); otherwise a ``sliding_window`` applies to every layer
    (Mistral's cache infers the layer type from it)."""
    window = _positive(d.get("sliding_window"))
    types = d.get("layer_types")
    if isinstance(types, list) and types:
        odd = sorted({str(t) for t in types} - _ATTENTION_LAYERS)
        if odd:
            raise EstimateError(f"{source}: layer_types declares {', '.join(odd)} layers, which the memory model "
                                "cannot count (only full_attention and sliding_attention)")
        n = sum(1 for t in types[:L] if t == "sliding_attention")
        return (window, n) if window else (None, 0)
    if window is None:
        return None, 0
    if "use_sliding_window" in d:
        if not d.get("use_sliding_window"):
            return None, 0
        start = d.get("max_window_layers")
        start = start if isinstance(start, int) and not isinstance(start, bool) else 0
        return window, max(0, L - start)
    if model_type in FOUR_NORMS:
        pattern = d.get("sliding_window_pattern", 6)
        pattern = pattern if isinstance(pattern, int) and pattern > 0 else 6
        return window, sum(1 for i in range(L) if (i + 1) % pattern)
    return window, L


def _mla(d: Mapping[str, Any], source: str) -> MlaSpec | None:
    if d.get("kv_lora_rank") is None:
        return None
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    vals = {k: _int(d, k, source) for k in keys}
    missing = [k for k, v in vals.items() if v is None]
    if missing:
        raise EstimateError(f"{source}: latent attention (kv_lora_rank) without {', '.join(missing)}")
    return MlaSpec(kv_lora_rank=vals["kv_lora_rank"], q_lora_rank=_int(d, "q_lora_rank", source),
                   qk_nope_head_dim=vals["qk_nope_head_dim"], qk_rope_head_dim=vals["qk_rope_head_dim"],
                   v_head_dim=vals["v_head_dim"])


def _moe(d: Mapping[str, Any], top: Mapping[str, Any], model_type: str, L: int, source: str) -> MoeSpec | None:
    """The experts the config declares (``num_experts``, ``num_local_experts`` or ``n_routed_experts``; 0 or null:
    a dense model) and which layers carry them."""
    key = next((k for k in _EXPERT_KEYS if d.get(k)), None)
    if key is None:
        return None
    E = _int(d, key, source)
    if model_type not in MOE_FAMILIES:
        raise EstimateError(f"{source}: {key}: the mixture-of-experts blocks of model_type {model_type} are not "
                            f"modelled (modelled: {', '.join(sorted(MOE_FAMILIES))})")
    top_k = next((d[k] for k in ("num_experts_per_tok", "experts_per_token", "top_k") if d.get(k)), None)
    if top_k is None:
        raise EstimateError(f"{source}: {key} is set but num_experts_per_tok (experts per token) is not")
    top_k = _int({"num_experts_per_tok": top_k}, "num_experts_per_tok", source)
    width = _int(d, "moe_intermediate_size", source) or _int(d, "intermediate_size", source)
    if "first_k_dense_replace" in d:  # DeepSeek: the first k layers keep the dense MLP
        k = d.get("first_k_dense_replace") or 0
        moe_layers = max(0, L - int(k))
    else:  # Qwen2/3-MoE: every decoder_sparse_step-th layer not in mlp_only_layers
        step = d.get("decoder_sparse_step") or 1
        only = set(d.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(L) if i not in only and (i + 1) % int(step) == 0)
    shared, shared_gate = 0, False
    if d.get("n_shared_experts"):
        shared = int(d["n_shared_experts"]) * int(width)
    elif d.get("shared_expert_intermediate_size"):
        shared, shared_gate = int(d["shared_expert_intermediate_size"]), True
    q = top.get("quantization_config") or d.get("quantization_config") or {}
    gpt_oss = model_type in GPT_OSS
    return MoeSpec(num_experts=E, top_k=top_k, expert_intermediate=width, moe_layers=moe_layers,
                   shared_intermediate=shared, shared_gate=shared_gate, expert_bias=gpt_oss, router_bias=gpt_oss,
                   router_logits=bool(d.get("router_aux_loss_coef")), peft_pattern=PEFT_MOE_PATTERN.get(model_type),
                   mxfp4=isinstance(q, Mapping) and q.get("quant_method") == "mxfp4",
                   router_name="router" if gpt_oss else "gate")


def _vision(top: Mapping[str, Any], text_hidden: int, source: str) -> VisionSpec | None:
    v = top.get("vision_config")
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise EstimateError(f"{source}: vision_config must be a JSON object")
    kind = str(v.get("model_type") or "")
    parent = str(top.get("model_type") or "")
    if kind in ("qwen2_5_vl", "qwen2_5_vl_vision") or (not kind and parent == "qwen2_5_vl"):
        c = _with_defaults(v, "qwen2_5_vl_vision")
        if c.get("in_chans") is not None:  # the published configs' older name
            c["in_channels"] = c["in_chans"]

        def get(k: str) -> int:
            return int(_int(c, k, f"{source}: vision_config"))

        return VisionSpec(kind="merger", depth=get("depth"), hidden=get("hidden_size"),
                          intermediate=get("intermediate_size"), heads=get("num_heads"), patch=get("patch_size"),
                          out_hidden=int(c.get("out_hidden_size") or text_hidden), channels=get("in_channels"),
                          temporal_patch=get("temporal_patch_size"), merge=get("spatial_merge_size"),
                          full_blocks=len(c.get("fullatt_block_indexes") or ()), window=get("window_size"))
    if kind == "siglip_vision_model" and parent == "gemma3":
        c = _with_defaults(v, "siglip_vision_model")
        if c.get("vision_use_head"):
            raise EstimateError(f"{source}: vision_config.vision_use_head: SigLIP's pooling head is not modelled")

        def sget(k: str) -> int:
            return int(_int(c, k, f"{source}: vision_config"))

        tokens = top.get("mm_tokens_per_image", 256)
        return VisionSpec(kind="siglip", depth=sget("num_hidden_layers"), hidden=sget("hidden_size"),
                          intermediate=sget("intermediate_size"), heads=sget("num_attention_heads"),
                          patch=sget("patch_size"), out_hidden=text_hidden, channels=sget("num_channels"),
                          image_size=sget("image_size"), tokens_per_image=int(tokens or 256))
    raise EstimateError(f"{source}: vision_config (model_type {kind or parent or 'unknown'}): this vision tower is "
                        "not modelled (modelled: Qwen2.5-VL's, Gemma 3's SigLIP)")
