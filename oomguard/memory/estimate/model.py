"""The model being trained, as the memory model sees it: the shapes of a dense decoder-only transformer, read from
its ``config.json``, and the exact parameter counts (LoRA adapters included) that the terms multiply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


class EstimateError(ValueError):
    """A model description the memory model cannot use; the one-line message names the file and the problem."""


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a dense decoder-only transformer (Llama/Qwen2/Mistral/Qwen3 family), read from ``config.json``.

    ``qkv_bias``: q/k/v projections have biases (Qwen2 always; Llama with ``attention_bias``). The extra fields
    ``o_bias`` (Llama ``attention_bias`` also biases ``o_proj``), ``mlp_bias`` and ``qk_norm`` (Qwen3's per-head
    q/k RMSNorm) default to off.
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

    # -- shapes ----------------------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection, ``num_heads · head_dim`` (equal to ``hidden_size`` in Llama/Qwen2)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections, ``num_kv_heads · head_dim``."""
        return self.num_kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of the seven Linear layers of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_params_per_layer(self) -> int:
        """Weights of the seven projections of one layer (what bitsandbytes quantises)."""
        return sum(a * b for a, b in self.projections().values())

    def small_params_per_layer(self) -> int:
        """Biases and norm weights of one layer (kept in 16-bit under 4-bit loading)."""
        h = self.hidden_size
        n = 2 * h  # input_layernorm, post_attention_layernorm
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            n += h
        if self.mlp_bias:
            n += 2 * self.intermediate_size + h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def embedding_params(self) -> int:
        """``embed_tokens`` plus an untied ``lm_head``."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def params(self) -> int:
        """Exact parameter count: ``V·h·(1 if tied else 2) + L·(2h·q + 2h·kv + 3h·i + 2h [+ biases]) + h``.

        research §1 (with ``q = heads·head_dim``, which equals ``h`` for Llama and Qwen2).

        >>> ModelSpec(128256, 2048, 16, 32, 8, 64, 8192, True).params  # Llama-3.2-1B
        1235814400
        """
        per_layer = self.linear_params_per_layer() + self.small_params_per_layer()
        return self.embedding_params + self.num_layers * per_layer + self.hidden_size

    def param_tensors(self) -> list[int]:
        """Element counts of every parameter tensor (what per-tensor optimizer rules need)."""
        out = [self.vocab_size * self.hidden_size] * (1 if self.tie_word_embeddings else 2)
        layer = [a * b for a, b in self.projections().values()] + [self.hidden_size] * 2
        if self.qkv_bias:
            layer += [self.q_dim, self.kv_dim, self.kv_dim]
        if self.o_bias:
            layer.append(self.hidden_size)
        if self.mlp_bias:
            layer += [self.intermediate_size, self.intermediate_size, self.hidden_size]
        if self.qk_norm:
            layer += [self.head_dim, self.head_dim]
        return out + layer * self.num_layers + [self.hidden_size]

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, d: Mapping[str, Any], *, source: str = "config") -> ModelSpec:
        """Read a Hugging Face ``config.json`` dict.

        ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (also when it is null), ``num_key_value_heads``
        to ``num_attention_heads``. Qwen2 always has q/k/v biases; Llama's ``attention_bias`` biases q, k, v and o.
        A multimodal config whose language model sits under ``text_config`` is read from there. Raises
        :class:`EstimateError` naming ``source`` for missing keys, non-positive sizes and mixture-of-experts or
        encoder architectures.

        >>> ModelSpec.from_config({"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048,
        ...     "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
        ...     "intermediate_size": 11008, "tie_word_embeddings": True}).params
        3085938688
        """
        if not isinstance(d, Mapping):
            raise EstimateError(f"{source}: expected a JSON object, found {type(d).__name__}")
        top = d
        if "hidden_size" not in d and isinstance(d.get("text_config"), Mapping):
            d = {**{k: v for k, v in top.items() if k in ("tie_word_embeddings", "torch_dtype", "dtype")},
                 **d["text_config"]}
        archs = top.get("architectures") or []
        if isinstance(archs, list) and archs and not any(
                isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
                for a in archs):
            raise EstimateError(f"{source}: architecture {', '.join(map(str, archs))} is not a decoder-only language "
                                "model (expected *ForCausalLM)")
        moe = [k for k in _MOE_KEYS if d.get(k)]
        if moe:
            raise EstimateError(f"{source}: a mixture-of-experts model ({', '.join(moe)}); only dense decoders are "
                                "modelled")
        aliases = {"num_hidden_layers": ("n_layer", "num_layers"), "hidden_size": ("n_embd", "d_model"),
                   "num_attention_heads": ("n_head",), "intermediate_size": ("ffn_dim", "n_inner")}
        vals: dict[str, Any] = {}
        missing = []
        for k in _REQUIRED_KEYS:
            v = d.get(k)
            if v is None:
                v = next((d[a] for a in aliases.get(k, ()) if d.get(a) is not None), None)
            if v is None:
                missing.append(k)
            vals[k] = v
        if missing:
            raise EstimateError(f"{source}: not a dense decoder config: missing {', '.join(missing)}")
        nkv = d.get("num_key_value_heads")
        vals["num_key_value_heads"] = vals["num_attention_heads"] if nkv is None else nkv
        for k, v in vals.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise EstimateError(f"{source}: {k} must be a positive integer, not {v!r}")
        h, a = vals["hidden_size"], vals["num_attention_heads"]
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
        model_type = str(d.get("model_type") or top.get("model_type") or "llama")
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias = model_type in ("qwen2", "qwen2_vl", "qwen2_5_vl") or attention_bias or bool(d.get("qkv_bias"))
        tie = d.get("tie_word_embeddings", top.get("tie_word_embeddings"))
        if tie is None:  # PretrainedConfig defaults to True; Llama-family configs to False
            tie = model_type not in ("llama", "mistral", "qwen2", "qwen3")
        dtype = d.get("dtype") or d.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype")
        dtype = _DTYPE_ALIASES.get(str(dtype), str(dtype)) if dtype else None
        return cls(
            vocab_size=vals["vocab_size"], hidden_size=h, num_layers=vals["num_hidden_layers"], num_heads=a,
            num_kv_heads=vals["num_key_value_heads"], head_dim=hd, intermediate_size=vals["intermediate_size"],
            tie_word_embeddings=bool(tie), qkv_bias=qkv_bias, model_type=model_type,
            checkpoint_dtype=dtype if dtype in _DTYPE_BYTES else None,
            o_bias=attention_bias and model_type not in ("qwen2", "qwen3"),
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=model_type.startswith("qwen3"),
            max_positions=_positive(d.get("max_position_embeddings")),
        )


def _positive(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


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


def _targets(target_modules: str | Iterable[str] | None) -> set[str]:
    """The projections a LoRA ``target_modules`` value adapts. ``None`` follows oomguard (``patches._lora_config``):
    all-linear. A string other than ``all-linear`` is one name or a comma-separated list; ``lm_head`` is never
    adapted (PEFT excludes the output layer from all-linear, and TRL 1.16 rejects it, ``grpo_trainer.py:835``)."""
    if target_modules is None or target_modules == "all-linear":
        return set(PROJECTIONS)
    names = target_modules.split(",") if isinstance(target_modules, str) else list(target_modules)
    out = set()
    for n in names:
        n = n.strip().rsplit(".", 1)[-1]
        if n == "all-linear":
            return set(PROJECTIONS)
        if n in PROJECTIONS:
            out.add(n)
    return out


def lora_trainable_params(spec: ModelSpec, r: int, target_modules: str | tuple[str, ...] | None = "all-linear") -> int:
    """Exact LoRA adapter parameter count: ``L · Σ_targets r·(in + out)`` (``lora_A`` is r×in, ``lora_B`` out×r).

    ``"all-linear"`` is the seven projections q, k, v, o, gate, up, down (research §3 T3).

    >>> qwen3b = ModelSpec(151936, 2048, 36, 16, 2, 128, 11008, True, qkv_bias=True, model_type="qwen2")
    >>> lora_trainable_params(qwen3b, 32), lora_trainable_params(qwen3b, 64, ("q_proj", "v_proj"))
    (59867136, 14745600)
    """
    if r <= 0:
        return 0
    shapes = spec.projections()
    return spec.num_layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in _targets(target_modules))
