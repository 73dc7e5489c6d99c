"""The model being trained, as the memory model sees it: the shapes of a decoder-only transformer (dense or
mixture-of-experts, with or without a vision tower), read from its ``config.json`` (:mod:`.readconfig`), and the exact
parameter counts (LoRA adapters included) that the terms multiply.

Every count here is the one transformers 5.24 builds for the same config (``tests/test_model_families.py`` compares
``ModelSpec.params`` with ``sum(p.numel())`` of the real class instantiated on the meta device, and the LoRA counts
with PEFT 0.21's ``get_peft_model`` on tiny models of each family).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .arch import (
    MXFP4_BYTES_PER_PARAM,
    PROJECTIONS,
    EstimateError,
    MlaSpec,
    MoeSpec,
    VisionSpec,
)

__all__ = [
    "MXFP4_BYTES_PER_PARAM",
    "PROJECTIONS",
    "EstimateError",
    "LoraTarget",
    "MlaSpec",
    "ModelSpec",
    "MoeSpec",
    "VisionSpec",
    "load_model_spec",
    "lora_targets",
    "lora_trainable_params",
]


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a decoder-only transformer, read from ``config.json`` (:meth:`from_config`).

    The positional fields are those of a dense Llama/Qwen2 decoder. ``qkv_bias``: q/k/v projections have biases
    (Qwen2 always; Llama with ``attention_bias``). ``o_bias`` (``attention_bias`` also biases ``o_proj``),
    ``mlp_bias`` and ``qk_norm`` (Qwen3's and Gemma 3's per-head q/k RMSNorm) default to off.

    Beyond the dense Llama shape: ``norms_per_layer`` (RMSNorm weights of width h per layer: Gemma 2/3's extra pre/post
    feed-forward norms make 4), ``fused_qkv`` / ``fused_gate_up`` (Phi-3 and Phi-4 store ``qkv_proj`` and
    ``gate_up_proj``: the same weights, other LoRA targets), ``attn_sinks`` (gpt-oss's learned per-head sink logit),
    ``eager_attention`` (the class has no SDPA path, so attention keeps its ``[B, heads, T, T]`` probabilities:
    gpt-oss), ``sliding_window`` and ``sliding_layers`` (layers that attend to the last ``sliding_window`` tokens only,
    whose KV cache holds no more), ``mla`` (DeepSeek's latent attention), ``moe`` (the mixture-of-experts blocks) and
    ``vision`` (a vision-language model's tower and projector).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    model_type: str = "llama"
    checkpoint_dtype: str | None = None
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_positions: int | None = None  # max_position_embeddings: the longest sequence a vLLM of it holds by default
    norms_per_layer: int = 2
    fused_qkv: bool = False
    fused_gate_up: bool = False
    attn_sinks: bool = False
    eager_attention: bool = False
    sliding_window: int | None = None
    sliding_layers: int = 0
    mla: MlaSpec | None = None
    moe: MoeSpec | None = None
    vision: VisionSpec | None = None

    # -- shapes ----------------------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection, ``num_heads · head_dim`` (equal to ``hidden_size`` in Llama/Qwen2; DeepSeek:
        ``heads · (nope + rope)``)."""
        if self.mla is not None:
            return self.num_heads * self.mla.qk_head_dim
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections, ``num_kv_heads · head_dim`` (DeepSeek: the keys the latent expands
        to, ``heads · (nope + rope)``)."""
        if self.mla is not None:
            return self.num_heads * self.mla.qk_head_dim
        return self.num_kv_heads * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        """Width of the attention output (``o_proj``'s input): ``heads · head_dim`` (DeepSeek: ``heads ·
        v_head_dim``)."""
        return self.num_heads * self.mla.v_head_dim if self.mla is not None else self.q_dim

    @property
    def dense_layers(self) -> int:
        """Decoder layers with the dense MLP (all of them without experts)."""
        return self.num_layers - (self.moe.moe_layers if self.moe is not None else 0)

    @property
    def moe_layers(self) -> int:
        """Decoder layers with the mixture-of-experts block."""
        return self.moe.moe_layers if self.moe is not None else 0

    def attention_linears(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of one layer's attention Linear layers."""
        h = self.hidden_size
        if self.mla is not None:
            m, a = self.mla, self.num_heads
            q = ({"q_proj": (h, a * m.qk_head_dim)} if m.q_lora_rank is None else
                 {"q_a_proj": (h, m.q_lora_rank), "q_b_proj": (m.q_lora_rank, a * m.qk_head_dim)})
            return {**q, "kv_a_proj_with_mqa": (h, m.kv_lora_rank + m.qk_rope_head_dim),
                    "kv_b_proj": (m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim)),
                    "o_proj": (a * m.v_head_dim, h)}
        if self.fused_qkv:
            return {"qkv_proj": (h, self.q_dim + 2 * self.kv_dim), "o_proj": (self.q_dim, h)}
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h)}

    def mlp_linears(self, width: int | None = None) -> dict[str, tuple[int, int]]:
        """``{name: (in, out)}`` of a SwiGLU MLP of ``width`` (default ``intermediate_size``)."""
        h, i = self.hidden_size, self.intermediate_size if width is None else width
        if self.fused_gate_up:
            return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def projections(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of the Linear layers of one dense decoder layer (attention and MLP;
        seven for Llama/Qwen2)."""
        return {**self.attention_linears(), **self.mlp_linears()}

    def moe_linears(self) -> dict[str, tuple[int, int]]:
        """The Linear layers of one MoE block (its shared experts and their gate; the experts and the router are
        parameters, not Linear layers)."""
        m = self.moe
        if m is None or not m.shared_intermediate:
            return {}
        out = self.mlp_linears(m.shared_intermediate)
        if m.shared_gate:
            out["shared_expert_gate"] = (self.hidden_size, 1)
        return out

    def linear_params_per_layer(self) -> int:
        """Weights of the Linear layers of one dense layer (what bitsandbytes quantises)."""
        return sum(a * b for a, b in self.projections().values())

    def linear_params(self) -> int:
        """Weights of every Linear layer but the LM head: the decoder's (attention, dense MLPs, shared experts) and the
        vision tower's. What bitsandbytes quantises under a 4-bit load; the experts (3-D parameters) and the
        embeddings stay in the load's dtype."""
        attn = sum(a * b for a, b in self.attention_linears().values())
        mlp = sum(a * b for a, b in self.mlp_linears().values())
        moe = sum(a * b for a, b in self.moe_linears().values())
        vis = sum(i * o for _n, i, o in self.vision.linears()) if self.vision is not None else 0
        return self.num_layers * attn + self.dense_layers * mlp + self.moe_layers * moe + vis

    def expert_params(self) -> int:
        """Every expert's weights and biases, over all MoE layers (the 3-D parameters)."""
        if self.moe is None:
            return 0
        return self.moe_layers * sum(math.prod(s) for _n, s in self.moe.expert_tensors(self.hidden_size))

    def small_params_per_layer(self) -> int:
        """Biases, norm weights and other small tensors of one layer (kept in 16-bit under 4-bit loading)."""
        return sum(n for n in self._attention_small() + self._dense_small())

    def _attention_small(self) -> list[int]:
        """The small attention tensors of a layer and the layer's norms: biases, q/k norms, sinks, MLA's norms."""
        h = self.hidden_size
        out = [h] * self.norms_per_layer
        if self.mla is not None:
            m = self.mla
            if m.q_lora_rank is not None:
                out.append(m.q_lora_rank)  # q_a_layernorm
                if self.o_bias:
                    out.append(m.q_lora_rank)  # q_a_proj bias
            out.append(m.kv_lora_rank)  # kv_a_layernorm
            if self.o_bias:
                out += [m.kv_lora_rank + m.qk_rope_head_dim, h]  # kv_a_proj, o_proj biases
            return out
        if self.qkv_bias:
            out += [self.q_dim + 2 * self.kv_dim] if self.fused_qkv else [self.q_dim, self.kv_dim, self.kv_dim]
        if self.o_bias:
            out.append(h)
        if self.qk_norm:
            out += [self.head_dim, self.head_dim]
        if self.attn_sinks:
            out.append(self.num_heads)
        return out

    def _dense_small(self) -> list[int]:
        if not self.mlp_bias:
            return []
        i = self.intermediate_size
        return [2 * i, self.hidden_size] if self.fused_gate_up else [i, i, self.hidden_size]

    def _moe_tensors(self) -> list[int]:
        """Element counts of one MoE block's tensors: experts, router, shared experts."""
        m = self.moe
        assert m is not None
        h = self.hidden_size
        out = [math.prod(s) for _n, s in m.expert_tensors(h)]
        out.append(m.num_experts * h)
        if m.router_bias:
            out.append(m.num_experts)
        out += [a * b for a, b in self.moe_linears().values()]
        return out

    def layer_tensors(self, moe: bool = False) -> list[int]:
        """Element counts of every parameter tensor of one decoder layer (dense, or with the MoE block)."""
        attn = [a * b for a, b in self.attention_linears().values()] + self._attention_small()
        if moe:
            return attn + self._moe_tensors()
        return attn + [a * b for a, b in self.mlp_linears().values()] + self._dense_small()

    @property
    def embedding_params(self) -> int:
        """``embed_tokens`` plus an untied ``lm_head``."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def vision_params(self) -> int:
        """The vision tower's and projector's parameters (0 for a language model)."""
        return self.vision.params if self.vision is not None else 0

    @property
    def params(self) -> int:
        """Exact parameter count: ``V·h·(1 if tied else 2) + L·(2h·q + 2h·kv + 3h·i + 2h [+ biases]) + h`` for a dense
        Llama/Qwen2 (research §1, with ``q = heads·head_dim``), plus the experts, routers and shared experts of MoE
        layers and the vision tower.

        >>> ModelSpec(128256, 2048, 16, 32, 8, 64, 8192, True).params  # Llama-3.2-1B
        1235814400
        """
        dense = sum(self.layer_tensors())
        moe = sum(self.layer_tensors(moe=True)) if self.moe is not None else 0
        return (self.embedding_params + self.dense_layers * dense + self.moe_layers * moe + self.hidden_size
                + self.vision_params)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: all of a dense model's, a MoE's routed ``top_k`` of its experts (the
        compute a step costs, not the memory it holds).

        >>> moe = ModelSpec(151936, 2048, 48, 32, 4, 128, 6144, False, moe=MoeSpec(128, 8, 768, 48))
        >>> round(moe.params / 1e9, 2), round(moe.active_params / 1e9, 2)   # Qwen3-30B-A3B
        (30.53, 3.35)
        """
        m = self.moe
        if m is None:
            return self.params
        idle = self.moe_layers * (m.num_experts - m.top_k) * sum(
            math.prod(s) for _n, s in m.expert_tensors(self.hidden_size)) // m.num_experts
        return self.params - idle

    def param_tensors(self) -> list[int]:
        """Element counts of every parameter tensor (what per-tensor optimizer rules need); ``embed_tokens`` first."""
        out = [self.vocab_size * self.hidden_size] * (1 if self.tie_word_embeddings else 2)
        out += self.layer_tensors() * self.dense_layers
        if self.moe is not None:
            out += self.layer_tensors(moe=True) * self.moe_layers
        out.append(self.hidden_size)
        if self.vision is not None:
            out += [math.prod(s) for _n, s, _lin in self.vision.tensors()]
        return out

    def largest_layer_params(self) -> int:
        """Parameters of the largest decoder layer (what ZeRO-3 or offloading gathers at once)."""
        dense = sum(self.layer_tensors()) if self.dense_layers else 0
        moe = sum(self.layer_tensors(moe=True)) if self.moe is not None else 0
        return max(dense, moe)

    # -- the KV cache ----------------------------------------------------------------------------------------------
    def kv_elements(self, tokens: int) -> tuple[int, int]:
        """Elements of keys and of values HF ``generate``'s DynamicCache holds per sequence after ``tokens``
        positions, over all layers: ``L·kv_dim·tokens`` each for full attention; a sliding-window layer keeps the
        last ``sliding_window - 1`` (``DynamicSlidingWindowLayer``); DeepSeek's cache keeps the compressed latent
        (``kv_lora_rank`` as keys, the shared rope key as values)."""
        if self.mla is not None:
            return (self.num_layers * self.mla.kv_lora_rank * tokens,
                    self.num_layers * self.mla.qk_rope_head_dim * tokens)
        full = self.num_layers - self.sliding_layers
        kept = min(tokens, self.sliding_window - 1) if self.sliding_window else tokens
        n = self.kv_dim * (full * tokens + self.sliding_layers * kept)
        return n, n

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, d: Mapping[str, Any], *, source: str = "config") -> ModelSpec:
        """Read a Hugging Face ``config.json`` dict (:func:`.readconfig.spec_from_config`).

        ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (also when it is null), ``num_key_value_heads``
        to ``num_attention_heads``; keys a published config leaves to its class take the class's default. A
        multimodal config whose language model sits under ``text_config`` is read from there, its ``vision_config``
        counted as the vision tower. Raises :class:`EstimateError` naming ``source`` and the key for missing keys,
        non-positive sizes, encoder architectures and anything declared that the model cannot count.

        >>> ModelSpec.from_config({"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048,
        ...     "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
        ...     "intermediate_size": 11008, "tie_word_embeddings": True}).params
        3085938688
        >>> moe = ModelSpec.from_config({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        ...     "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        ...     "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        ...     "tie_word_embeddings": False})
        >>> moe.params, moe.moe.top_k   # Qwen3-30B-A3B
        (30532122624, 8)
        """
        return spec_from_config(cls, d, source=source)


from .readconfig import spec_from_config  # noqa: E402  (it reads into ModelSpec, passed to it)


def load_model_spec(path: str | os.PathLike[str]) -> ModelSpec:
    """Read a :class:`ModelSpec` from a ``config.json`` file or a model directory that holds one.

    Every problem raises :class:`EstimateError` with one line that names the path: a missing path, a directory without
    ``config.json``, unreadable or garbled JSON, missing keys, non-positive sizes, a non-decoder architecture.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise EstimateError(f"{p}: no such file or directory")
    if os.path.isdir(p):
        cfg = os.path.join(p, "config.json")
        if not os.path.isfile(cfg):
            raise EstimateError(f"{p}: no config.json in this directory")
        p = cfg
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise EstimateError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}".splitlines()[0])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise EstimateError(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
    return ModelSpec.from_config(data, source=p)


# -- LoRA --------------------------------------------------------------------------------------------------------------

# PEFT 0.21 (utils/transformers_weight_conversion.py ``_MOE_TARGET_MODULE_MAPPING``): per conversion pattern, the
# transformers-v4 names of a fused MoE's modules and the parameter each became. ``all-linear`` resolves to every
# Linear's name plus these; the names are then no longer module targets.
_PEFT_MOE_NAMES = {"mixtral": {"gate": "router", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
                   "qwen2_moe": {"gate": "router", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                                 "down_proj": "down_proj"}}


@dataclass(frozen=True)
class LoraTarget:
    """One adapted weight, repeated over ``count`` places: ``kind`` is ``linear`` (a Linear of ``(in, out)``),
    ``param2`` (a 2-D parameter wrapped by PEFT's ParamWrapper, ``rank·(a + b)`` elements) or ``param3`` (an experts'
    3-D parameter ``[E, a, b]``: PEFT's ``lora_A``/``lora_B`` hold ``rank·E`` rows, ``rank·E·(a + b)`` elements).
    ``where`` is ``attention``, ``mlp``, ``moe``, ``experts`` or ``vision``."""

    name: str
    where: str
    kind: str
    dims: tuple[int, ...]
    rank: int
    count: int

    @property
    def tensors(self) -> tuple[int, int]:
        """Elements of ``lora_A`` and ``lora_B`` at one place."""
        if self.kind == "param3":
            E, a, b = self.dims
            return self.rank * E * b, self.rank * E * a
        i, o = self.dims
        return self.rank * i, self.rank * o

    @property
    def params(self) -> int:
        return self.count * sum(self.tensors)


def _names(target: str | Iterable[str] | None) -> tuple[bool, set[str]]:
    """(all-linear, the leaf names) of a ``target_modules`` value. ``None`` follows oomguard
    (``patches._lora_config``): all-linear. A string other than ``all-linear`` is one name or a comma-separated list."""
    if target is None or target == "all-linear":
        return True, set()
    names = target.split(",") if isinstance(target, str) else list(target)
    out = set()
    for n in names:
        n = n.strip().rsplit(".", 1)[-1]
        if n == "all-linear":
            return True, set()
        if n:
            out.add(n)
    return False, out


def lora_targets(spec: ModelSpec, r: int, target_modules: str | Iterable[str] | None = "all-linear",
                 target_parameters: Iterable[str] | None = None) -> list[LoraTarget]:
    """What PEFT 0.21 adapts on the model transformers 5.24 builds, as :class:`LoraTarget` rows.

    - ``all-linear``: every Linear but the LM head: the attention projections, the dense MLPs, shared experts and,
      in a vision-language model, the vision tower's Linears (its patch embedding is a convolution: not adapted).
    - A fused-expert model whose type transformers lists for PEFT's conversion (``MoeSpec.peft_pattern``): the names
      ``gate``, ``gate_proj``/``up_proj``, ``down_proj`` (``w1``/``w3``, ``w2`` for Mixtral's pattern; ``all-linear``
      includes them) become target parameters:
      the router's ``[E, h]`` weight, ``gate_up_proj`` at twice the rank and ``down_proj``; they are then no longer
      module targets, so the dense MLPs and shared experts are *not* adapted.
    - Other fused-expert models (gpt-oss): the experts and the router are parameters, so only the Linears; name them
      in ``target_parameters`` (``"mlp.experts.gate_up_proj"``, or ``"7.mlp.experts.down_proj"`` for one layer) to
      adapt them at rank ``r``.
    """
    if r <= 0:
        return []
    every, names = _names(target_modules)
    m = spec.moe
    out: list[LoraTarget] = []
    params: dict[str, tuple[int, int]] = {}  # expert/router parameter -> (rank, layers)
    mapping = _PEFT_MOE_NAMES.get(m.peft_pattern or "", {}) if m is not None else {}
    if mapping and (every or names & mapping.keys()):
        picked = {mapping[n] for n in (mapping if every else names & mapping.keys())}
        fused = [n for n, p in mapping.items() if p == "gate_up_proj"]
        if not every and 0 < len(names & set(fused)) < len(fused):
            raise EstimateError(f"LoRA: PEFT needs both {' and '.join(fused)} (fused into gate_up_proj) or neither")
        for p in picked:
            params[p] = (2 * r if p == "gate_up_proj" else r, spec.moe_layers)
    else:
        mapping = {}

    def wanted(name: str) -> bool:
        if name in mapping:
            return False
        return every or name in names

    L = spec.num_layers
    for name, (i, o) in spec.attention_linears().items():
        if wanted(name):
            out.append(LoraTarget(name, "attention", "linear", (i, o), r, L))
    if spec.dense_layers:
        for name, (i, o) in spec.mlp_linears().items():
            if wanted(name):
                out.append(LoraTarget(name, "mlp", "linear", (i, o), r, spec.dense_layers))
    if m is not None:
        for name, (i, o) in spec.moe_linears().items():
            if wanted(name):
                out.append(LoraTarget(name, "moe", "linear", (i, o), r, spec.moe_layers))
        for tp in target_parameters or ():
            leaf = tp.rsplit(".", 1)[-1]
            layer = re.match(r"^(?:.*\.)?(\d+)\.", tp)
            n_layers = 1 if layer and int(layer.group(1)) < L else spec.moe_layers if not layer else 0
            key = "router" if leaf in ("weight",) and ("gate" in tp or "router" in tp) else leaf
            if key in ("gate_up_proj", "down_proj", "router") and n_layers:
                rank, count = params.get(key, (r, 0))
                params[key] = (rank, min(spec.moe_layers, count + n_layers) if layer else spec.moe_layers)
        h, E, i_e = spec.hidden_size, m.num_experts, m.expert_intermediate
        shapes = {"gate_up_proj": (E, 2 * i_e, h), "down_proj": (E, h, i_e)}
        for p in sorted(params):
            rank, count = params[p]
            if p == "router":
                out.append(LoraTarget(m.router_name, "moe", "param2", (h, E), rank, count))
            else:
                out.append(LoraTarget(p, "experts", "param3", shapes[p], rank, count))
    if spec.vision is not None:
        seen: dict[tuple[str, int, int], int] = {}
        for name, i, o in spec.vision.linears():
            leaf = name.rsplit(".", 1)[-1] if not name.startswith("merger.") else name
            if every or leaf in names or name.split(".")[-1] in names:
                seen[(name, i, o)] = seen.get((name, i, o), 0) + 1
        for (name, i, o), count in seen.items():
            out.append(LoraTarget(name, "vision", "linear", (i, o), r, count))
    return out


def lora_trainable_params(spec: ModelSpec, r: int, target_modules: str | Iterable[str] | None = "all-linear",
                          target_parameters: Iterable[str] | None = None) -> int:
    """Exact LoRA adapter parameter count, as PEFT 0.21 creates it (:func:`lora_targets`): ``r·(in + out)`` per
    adapted Linear (``lora_A`` is r×in, ``lora_B`` out×r), ``rank·E·(a + b)`` per experts' parameter ``[E, a, b]``.

    ``"all-linear"`` on a dense Llama is the seven projections q, k, v, o, gate, up, down (research §3 T3).

    >>> qwen3b = ModelSpec(151936, 2048, 36, 16, 2, 128, 11008, True, qkv_bias=True, model_type="qwen2")
    >>> lora_trainable_params(qwen3b, 32), lora_trainable_params(qwen3b, 64, ("q_proj", "v_proj"))
    (59867136, 14745600)
    """
    return sum(t.params for t in lora_targets(spec, r, target_modules, target_parameters))
