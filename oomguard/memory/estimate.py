"""The analytical GPU-memory model of one TRL 1.16 GRPO step: predict the peak before anything runs.

Pure Python: no torch, transformers or trl import. The formulas come from ``research/memory-model.md`` (cited as
"research §N") and were checked against the installed TRL 1.16.0, transformers 5.23, PEFT 0.21 and bitsandbytes
0.50 code; each term below names the lines it rests on.

One GRPO step has four phases (research §2). Each has its own transient peak on top of the persistent state::

    peak_alloc = persistent + max(P_generation, P_scoring, P_forward_backward, P_optimizer)   # ≈ max_memory_allocated
    peak_bytes = M_ctx + max over phases of (alloc_phase * (1 + f_frag) + vLLM when awake)      # ≈ nvidia-smi

The terms (bytes; ``b_w`` weight dtype, ``b_res`` residual-stream dtype, ``b_c`` matmul/activation dtype):

- **T1 weights** ``Σ params·b_w``; 4-bit NF4 with double quantisation stores each quantised Linear parameter in
  ``0.5 + 1/64 + 4/(64·256)`` B (QLoRA paper, bnb blocksize 64, absmax re-quantised per 256 blocks); embeddings,
  ``lm_head``, norms and biases stay 16-bit. LoRA adapters are added (fp32, or bf16 under QLoRA).
- **T2 reference** ``beta > 0`` without LoRA: one more copy of T1 (``grpo_trainer.py:984-1003``); 0 otherwise.
- **T3 trainable** ``Ψ_t`` = all parameters (full) or the exact LoRA count :func:`lora_trainable_params`.
- **T4 gradients** ``Ψ_t·b_t``: from the first backward to ``zero_grad`` (``transformers/trainer.py:1946``), so
  present in the forward/backward and optimizer phases, and before them only when ``gradient_accumulation_steps > 1``.
- **T5 optimizer** AdamW (torch, fused): 2 states in the parameter dtype (plus one state's worth transient in the
  CUDA foreach step); bnb 8-bit: ``2·(n + 4·⌈n/256⌉)`` per tensor, 32-bit states for tensors under 4096 elements
  (``bitsandbytes/optim/optimizer.py:492-530``) and for ``nn.Embedding`` weights, which transformers registers as
  32-bit overrides (``transformers/trainer.py:1328-1339``); ``paged_*``: states
  of tensors ≥ 1e5 elements live in CUDA unified memory, invisible to torch (0 here; CPU falls back to plain
  buffers, ``optimizer.py:374-390``); Adafactor ≈ 4·(rows+cols) per matrix; SGD 0 (momentum 0 in transformers).
- **T6 autocast copies** fp32 master weights under bf16 autocast (TRL's default ``bf16=True`` with a fp32 load): every
  Linear weight is cast to bf16 and cached until the outermost autocast exits, so ``+2·Ψ_linear`` during a forward;
  without checkpointing the copies are saved for backward, with it only one layer's copies live in backward.
- **T7 activations** per token per layer, derived from what autograd saves in HF Llama/Qwen2 blocks with SDPA and
  ``repeat_kv`` (``transformers/integrations/sdpa_attention.py``): ``26h + 8i`` bytes in bf16 (research §3 T7),
  ``44h + 16i`` with fp32 activations, ``36h + 8i`` for fp32 master weights under bf16 autocast; see
  :func:`_activation_bytes_per_token` for the itemised sum. Scaled by ``c_act``. With gradient checkpointing only the
  layer inputs ``L·B·T·h·b_res`` are kept, plus one layer recomputed in backward. A layer in backward holds about the
  larger of its saved activations and its new gradients (autograd frees the one as it allocates the other), not
  their sum: counting both over-predicted a wide one-layer model by 31% (``tests/test_estimate.py``).
- **T8 chunked LM head** (``trl/kernels/chunked_logprob.py``, TRL 1.16 always patches it in, ``grpo_trainer.py:1068``):
  the forward allocates ``mm_buf = [min(N, 4096), 32768]`` in the compute dtype whatever the vocabulary size, plus
  fp32 per-token statistics; the backward allocates fp32 ``grad_hidden [N, h]``, ``mm_buf`` again, and fp32
  ``grad_weight [V, h]`` only when ``lm_head`` trains (full fine-tune). On CUDA with Triton, ``N = B·C`` (only
  completion positions, ``trl/trainer/utils.py:1642-1645``) and the tiles are folded in place; without Triton (CPU, the
  simulated device) every position is scored, ``N = B·(T-1)``, and the torch fallback makes fp32 tile temporaries
  (``k_logits`` bytes per tile element in backward, 12 B in forward).
- **T9 generation** HF ``generate`` KV cache ``L·n_kv·d·(P+C)·B_gen·(b_k + b_v)`` (DynamicCache grows by
  ``torch.cat``, ``transformers/cache_utils.py:136``) plus the prefill or the sampling transient; vLLM colocate
  reserves ``vllm_gpu_memory_utilization × capacity`` outside torch's allocator, in every phase unless
  ``vllm_enable_sleep_mode`` (then only while generating).
- **T10 context** ``M_ctx``: CUDA context and workspaces, not in torch's statistics (0 on the simulated device).
- **T11 fragmentation** ``peak_alloc·f_frag``, with the smaller ``f_frag_expandable`` under
  ``expandable_segments:True``.

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> qwen3b = ModelSpec(vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2,
...                    head_dim=128, intermediate_size=11008, tie_word_embeddings=True, qkv_bias=True, model_type="qwen2")
>>> qwen3b.params, lora_trainable_params(qwen3b, 32)
(3085938688, 59867136)
>>> e = estimate(qwen3b, TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=32, per_device_train_batch_size=8,
...                                           max_completion_length=1024), prompt_tokens=256)
>>> e.dominant_phase, e.fits(80 * 2**30), e.fits(8 * 2**30)
('forward_backward', True, False)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..vocab.knobs import TRL_DEFAULTS, Knobs
from ..vocab.sizes import MiB, format_size

__all__ = [
    "BREAKDOWN_KEYS",
    "PHASES",
    "Coefficients",
    "Estimate",
    "EstimateError",
    "ModelSpec",
    "describe",
    "estimate",
    "load_model_spec",
    "lora_trainable_params",
]

PHASES = ("generation", "scoring", "forward_backward", "optimizer")
BREAKDOWN_KEYS = ("weights", "reference", "gradients", "optimizer", "activations", "logits", "kv_cache", "vllm",
                  "overhead")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# bitsandbytes NF4 with double quantisation: 4 bits + an 8-bit absmax per 64 weights + an fp32 absmax per 256 absmax
# blocks (QLoRA, arXiv:2305.14314 §3; research §3 T1).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# trl/kernels/chunked_logprob.py:31 and trl/trainer/utils.py:1506
TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768
# bitsandbytes/optim/optimizer.py: blockwise 8-bit states, min_8bit_size, paged threshold
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_PAGED_MIN_SIZE = 100_000
DEFAULT_PROMPT_TOKENS = 256
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


class EstimateError(ValueError):
    """A model description the memory model cannot use; the one-line message names the file and the problem."""


# -------------------------------------------------------------------------------------------------------------------
# The model


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
        )


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


# -------------------------------------------------------------------------------------------------------------------
# Coefficients


# How far above the measured device use the built-in fit's device-level prediction reached on the 22 H100 rows
# (tests/fixtures/h100/calibration*.jsonl; `python bench/preflight_margin.py`): q3b-fp32-lora32 was predicted 6.3%
# over what it used. A config predicted up to this much over a card may still fit it.
DEVICE_OVERPREDICTION = 0.064
# The same on the simulated device: the allocated peak is within 1.0% (bench/cpu_calibrate.py), and the smallest
# budget each configuration fits in was 1.05 to 1.26 times its allocated peak (bench/min_budget.py) against the fitted
# 1 + f_frag = 1.14: up to 1.14 / 1.05 * 1.01 - 1 = 9.7% over.
SIMULATED_OVERPREDICTION = 0.097
# Added to the measured error to make the pre-flight's stop margin: errors on configurations not measured run a little
# beyond those on the measured ones.
STOP_ALLOWANCE = 0.02


@dataclass(frozen=True)
class Coefficients:
    """The uncertain coefficients of research §8. The defaults are fitted to real H100 measurements (2026-11-22:
    torch 2.11 + CUDA 13, TRL 1.16, 18 GRPO configurations of ``tests/fixtures/h100/calibration.jsonl`` and the run
    reports next to it) by ``python bench/gpu_calibrate.py --from-jsonl tests/fixtures/h100/calibration.jsonl``.
    With them the allocated peak is within 0.8% (median) and 4.7% (worst) of every row, the reserved peak within
    1.9% and 6.4% (``tests/test_gpu_rows.py``).

    - ``c_act``: scale of the derived activation bytes. Fitted 0.89 (smallest worst-case error of the allocated
      peak); the research prior was 0.9.
    - ``k_logits``: bytes per tile element of the chunked LM head's torch-fallback temporaries in backward. TRL 1.16
      only takes that path without Triton (CPU, the simulated device); on CUDA the Triton kernels work in place and
      the term is unused. The default 12 is the research prior for the old materialised-logits backward.
    - ``f_frag`` / ``f_frag_expandable``: reserved-but-unallocated margin, as a fraction of the allocated peak.
      Measured reserved/allocated: 1.02-1.17 over the 17 rows without expandable segments (least squares 1.061,
      median 1.086); 0.105 gives the smallest worst-case error of the reserved peak (the research prior 0.25 made
      every device prediction 11-20% high). With ``expandable_segments:True`` one calibration row (Qwen2.5-0.5B,
      1.079, against 1.115 without) and six Qwen2.5-3B run-report attempts (1.004-1.027) exist: 0.05 sits between.
    - ``m_ctx``: device memory outside the caching allocator (CUDA context, cuDNN, NCCL); 0 on the simulated device
      (``estimate(context=...)`` gives a measured context, or the one the simulated device models).
      The calibration rows' own context figures counted other processes sharing the GPU, so it comes from the real
      OOMs of the 24 GiB-capped Qwen2.5-3B runs: NVML's "this process has 24.74 GiB in use" against 23.96 GiB
      reserved (``memory_stats``), 0.785 GiB; and 24.25 against 23.48 GiB, 0.772 GiB. So 800 MiB.
    - ``m_workspace``: cuBLAS workspaces, which torch allocates through the caching allocator (so inside the
      allocated peak): 32 MiB per handle and stream on Hopper (``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:8``,
      ``aten/src/ATen/cuda/CublasHandlePool.cpp``), one handle for the forward's thread and one for autograd's
      backward thread. Every phase of every row was 63-100 MiB above the model without it.
    - ``scale``: online calibration, measured/predicted of the last attempt, applied to the allocated peak.
    """

    c_act: float = 0.89
    k_logits: float = 12.0
    f_frag: float = 0.105
    f_frag_expandable: float = 0.05
    m_ctx: int = 800 * 2**20
    scale: float = 1.0
    m_workspace: int = 64 * 2**20

    def calibrated(self, measured_peak: int, predicted_peak_alloc: int) -> Coefficients:
        """A copy whose ``scale`` makes the last prediction match the last measurement (clamped to [0.25, 4]).

        ``predicted_peak_alloc`` is what these coefficients predicted, so the new scale is
        ``scale · measured / predicted``.

        >>> Coefficients().calibrated(150, 100).scale, Coefficients(scale=2.0).calibrated(10**9, 1).scale
        (1.5, 4.0)
        """
        if measured_peak <= 0 or predicted_peak_alloc <= 0:
            return self
        s = self.scale * measured_peak / predicted_peak_alloc
        return replace(self, scale=min(4.0, max(0.25, s)))

    @classmethod
    def for_simulated(cls) -> Coefficients:
        """Coefficients fitted on the simulated device by ``bench/cpu_calibrate.py --fit`` (18 real TRL GRPO
        configurations, max |error| 1.0% of the allocated peak): ``c_act = 0.92`` of the itemised activation bytes and
        ``k_logits = 29`` bytes per tile element for the chunked head's torch fallback (counting its temporaries gives
        about 33). No CUDA context or cuBLAS workspace. Fragmentation from ``bench/min_budget.py`` (the smallest
        budget each config fits in, replayed through the allocator model): 106 MiB for a 93.5 MiB allocated peak and
        150 MiB for 132.7 MiB, so ``f_frag = 0.14`` (measured 0.13); with expandable segments 100 MiB for 93.5 MiB
        (0.07).
        """
        return cls(c_act=0.92, k_logits=29.0, f_frag=0.14, f_frag_expandable=0.07, m_ctx=0, m_workspace=0)


# -------------------------------------------------------------------------------------------------------------------
# The estimate


@dataclass(frozen=True)
class Estimate:
    """A predicted peak, split by term and by phase.

    ``breakdown`` has exactly the keys of ``BREAKDOWN_KEYS`` and sums to ``peak_bytes``: it is the composition of the
    dominant phase (a term that does not exist in that phase, such as the KV cache during training, is 0 there; see
    ``phases`` for the others). ``overhead`` is the CUDA context plus the fragmentation margin.
    """

    peak_bytes: int
    peak_alloc_bytes: int
    breakdown: dict[str, int]
    phases: dict[str, int]
    trainable_params: int
    total_params: int
    dominant_phase: str
    notes: tuple[str, ...] = field(default=())

    def fits(self, capacity: int) -> bool:
        """Whether the predicted device peak fits in ``capacity`` bytes."""
        return self.peak_bytes <= capacity

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (sizes in bytes, plus a readable ``peak`` string)."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["peak"] = format_size(self.peak_bytes)
        return d

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in self.breakdown.items() if v)
        return f"peak {format_size(self.peak_bytes)} in {self.dominant_phase} ({parts})"


@dataclass(frozen=True)
class _Regime:
    """Byte widths and switches that follow from the knobs (see :func:`_regime`)."""

    b_w: int  # stored weight dtype (non-quantised tensors)
    b_res: int  # residual stream / norms / hidden states
    b_c: int  # matmul outputs and most saved activations
    autocast_cast: bool  # fp32 master weights under bf16 autocast: every Linear input/weight is cast
    simulated: bool
    quant4: bool
    lora: bool
    r: int
    targets: frozenset[str]
    b_a: int  # LoRA adapter dtype


def _filled(knobs: Knobs) -> Knobs:
    return TRL_DEFAULTS.merged(knobs)


def _dtype_name(knobs: Knobs, spec: ModelSpec) -> str:
    d = knobs.dtype or "float32"
    d = _DTYPE_ALIASES.get(d, d)
    if d == "auto":  # transformers 5.x from_pretrained dtype="auto": the checkpoint's dtype
        d = spec.checkpoint_dtype or "bfloat16"
    if d not in _DTYPE_BYTES:
        raise EstimateError(f"dtype must be one of {', '.join(_DTYPE_BYTES)} or auto, not {knobs.dtype!r}")
    if knobs.load_in_4bit and d == "float32":
        d = "bfloat16"  # oomguard's 4-bit load forces a 16-bit dtype (child/patches.py, from_pretrained patch)
    return d


def _activation_bytes_per_token(spec: ModelSpec, g: _Regime) -> int:
    """Bytes autograd keeps per token for one decoder layer (T7), itemised from what each op saves.

    - RMSNorm (×2, ``LlamaRMSNorm.forward``): ``pow`` saves its fp32 input (4h: the residual itself when it is fp32,
      a copy otherwise); ``weight * x.to(dtype)`` saves the normalised x (``b_res·h``) only when the weight trains.
    - The normed output y feeds q/k/v (and gate/up). A trainable Linear saves its input: y once when no cast happens,
      one bf16 cast per consumer under autocast from fp32. A frozen base Linear saves nothing about its input; a LoRA
      ``lora_A`` saves it (a copy per module when PEFT's ``_cast_input_dtype`` or autocast must cast it).
    - SDPA saves q, the repeated k and v (``repeat_kv``, padded mask), its output and the logsumexp; ``o_proj`` saves
      the transposed output copy when it trains or is adapted.
    - SwiGLU MLP: gate, silu(gate), up, and their product (saved by ``down_proj`` when it trains or is adapted).
    - LoRA: ``lora_B`` saves the ``lora_A`` output, r per adapted module.

    bf16 full fine-tune with ``heads·head_dim = h``: ``16h + 4h + 10h + 8i = 26h + 8i`` (research §3 T7).
    """
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    full = not g.lora
    b_res, b_c = g.b_res, g.b_c
    # norms
    norm = 4 * h + (b_res * h if full else 0)
    total = 2 * norm

    autocast = not g.simulated  # on a GPU TRL trains under bf16 autocast (bf16=True by default)

    def consumers_of(width: int, modules: tuple[str, ...], b_x: int) -> int:
        """Bytes saved for one input of ``width`` elements and ``b_x`` bytes each, read by ``modules``."""
        if full:  # each trainable Linear saves its input; under autocast an fp32 input is cast per Linear
            return len(modules) * 2 * width if autocast and b_x == 4 else b_x * width
        adapted = sum(1 for m in modules if m in g.targets)
        if not adapted:
            return 0  # a frozen base Linear saves nothing about its input
        if autocast:
            # lora_A under autocast saves a bf16 copy per module when x is fp32, or when PEFT's _cast_input_dtype
            # first upcast it to the fp32 adapter dtype; with bf16 adapters (QLoRA) x is shared
            return adapted * 2 * width if (b_x == 4 or g.b_a == 4) else 2 * width
        return b_x * width if g.b_a == b_x else adapted * g.b_a * width

    total += consumers_of(h, ("q_proj", "k_proj", "v_proj"), b_res)
    total += consumers_of(h, ("gate_proj", "up_proj"), b_res)
    # attention: q, repeated k and v, output, logsumexp (fp32 per head)
    k_saved = q if spec.num_kv_heads < spec.num_heads else kv
    total += b_c * (q + 2 * k_saved + q) + 4 * spec.num_heads
    total += consumers_of(q, ("o_proj",), b_c)
    # MLP
    total += 3 * i * b_c + consumers_of(i, ("down_proj",), b_c)
    if g.lora:
        total += len(g.targets) * g.r * (2 if autocast else g.b_a)
    return total


def _nograd_bytes_per_token(spec: ModelSpec, g: _Regime) -> int:
    """Live bytes per token inside one decoder layer run without grad (prefill, scoring): the residual and its
    successor, the fp32 norm temporary, then the larger of attention (q, k, v, repeated k/v, output) and the MLP
    (silu(gate), up, product)."""
    h, i, q = spec.hidden_size, spec.intermediate_size, spec.q_dim
    attn = (3 * q + 2 * spec.kv_dim + q) * g.b_c
    mlp = 3 * i * g.b_c
    return 2 * g.b_res * h + 4 * h + max(attn, mlp)


def _weight_bytes(spec: ModelSpec, b_w: int, *, load_in_4bit: bool = False, lora_params: int = 0,
                  b_adapter: int = 4) -> int:
    """T1: the stored weights. Under 4-bit NF4 with double quantisation each projection weight costs
    ``NF4_BYTES_PER_PARAM`` and the embeddings, an untied ``lm_head``, norms and biases stay at ``b_w`` (16-bit);
    LoRA adapters are added at ``b_adapter`` bytes."""
    if load_in_4bit:
        lin = spec.num_layers * spec.linear_params_per_layer()
        base = math.ceil(lin * NF4_BYTES_PER_PARAM) + (spec.params - lin) * b_w
    else:
        base = spec.params * b_w
    return base + lora_params * b_adapter


def _kv_cache_bytes(spec: ModelSpec, rows: int, tokens: int, b_k: int = 2, b_v: int = 2) -> int:
    """T9: HF ``generate``'s DynamicCache after ``tokens`` positions: ``L·n_kv·d·tokens·rows·(b_k + b_v)``
    (``2·L·n_kv·d·(P+C)·B_gen·b_kv`` of research §3 when ``b_k = b_v``)."""
    return spec.num_layers * spec.kv_dim * tokens * rows * (b_k + b_v)


def _head_bytes(spec: ModelSpec, N: int, *, b_c: int, b_res: int, b_w: int, head_trains: bool,
                fallback: bool, k_logits: float) -> dict[str, int]:
    """T8: TRL 1.16's chunked LM head over ``N`` scored positions (``trl/kernels/chunked_logprob.py``).

    Forward (``ChunkedLogProbFunction.forward``): the hidden rows are gathered into a copy (``hidden_states[mask]`` on
    Triton devices, ``.reshape`` of the ``[:, :-1]`` slice otherwise, ``trainer/utils.py:1642-1650``), seven fp32
    running statistics per token, and ``mm_buf = [min(N, 4096), 32768]`` in the compute dtype, whatever ``V`` is.
    The torch fallback (no Triton) folds each ``[n, min(V, 32768)]`` tile with about three fp32 temporaries.

    Backward: fp32 ``grad_hidden [N, h]``, fp32 ``grad_weight [V, h]`` only when ``lm_head`` trains, ``mm_buf``
    again; the fallback's ``_backward_tile`` keeps y, z, log p, p, grad and the target mask (``k_logits`` bytes per
    tile element). The fp32 gradients are cast back to the hidden/weight dtype when those are 16-bit.
    """
    h, V = spec.hidden_size, spec.vocab_size
    n = min(N, TOKEN_CHUNK_SIZE)
    w = min(V, VOCAB_CHUNK_SIZE)
    mm_buf = n * VOCAB_CHUNK_SIZE * b_c
    hidden = N * h * b_res
    casts = (n * h * b_c if b_res != b_c else 0) + (w * h * b_c if b_w != b_c else 0)
    stats = 4 * 10 * N  # running max, sum_exp, x_sum_exp, sq_sum_exp, z_sum, max_before_target, target_logit, outputs
    tile_f = 12 * n * w if fallback else 0
    fwd = hidden + stats + mm_buf + casts + tile_f
    saved = hidden + 4 * 3 * N  # hidden, log_z, entropy (targets are int64 ids: 8 B)
    grad_hidden = 4 * N * h
    grad_weight = 4 * V * h if head_trains else 0
    tile_b = int(k_logits * n * w) if fallback else 0
    loop = saved + grad_hidden + grad_weight + mm_buf + casts + tile_b
    end = saved + grad_hidden + grad_weight + (N * h * b_res if b_res != 4 else 0) + (
        V * h * b_w if head_trains and b_w != 4 else 0)
    return {"forward": fwd, "saved": saved, "backward": max(loop, end), "mm_buf": mm_buf,
            "grad_weight": grad_weight}


def _optimizer_bytes(optim: str, tensors: list[int], b_param: int, simulated: bool,
                     embeddings: int = 0) -> tuple[int, int, str | None]:
    """T5: (state bytes, transient bytes of one step, note) for the trainable tensors (element counts).

    The first ``embeddings`` tensors are ``nn.Embedding`` weights: transformers gives them 32-bit bitsandbytes
    states (``transformers/trainer.py:1328-1339``).
    """
    o = optim.lower()
    n = sum(tensors)
    biggest = max(tensors, default=0)
    if o in ("sgd", "lomo", "adalomo"):
        return 0, 0, None
    if "adafactor" in o:
        # factored second moment: a row and a column vector per matrix (transformers Adafactor, no first moment)
        return 4 * 2 * int(math.sqrt(n) * 2), 4 * biggest, "Adafactor is estimated roughly"
    states = 1 if ("lion" in o or "rmsprop" in o) else 3 if "ademamix" in o else 2
    paged = o.startswith("paged") and not simulated  # bnb on CPU falls back to plain buffers (optimizer.py:375)
    note = ("paged optimizer states live in CUDA unified memory: not counted in torch's allocated bytes"
            if paged else None)
    bnb = ("bnb" in o or o.startswith("paged") or o in ("adamw_8bit", "lion_8bit", "ademamix_8bit"))
    if "8bit" in o or "4bit" in o:
        bits = 4 if "4bit" in o else 8
        state = 0
        for idx, t in enumerate(tensors):
            if paged and t >= BNB_PAGED_MIN_SIZE:
                continue  # F.get_paged: unified memory, outside torch's statistics (optimizer.py:383-390)
            if t < BNB_MIN_8BIT_SIZE or (bnb and idx < embeddings):
                state += states * 4 * t  # 32-bit states (optimizer.py:502; embeddings: trainer.py:1338)
            else:
                state += states * (t * bits // 8 + 4 * math.ceil(t / BNB_BLOCK))  # uint8 + fp32 absmax per block
        return state, 0, note
    if o.startswith("paged") or "32bit" in o:
        # bitsandbytes 32-bit states are fp32 whatever the parameter dtype
        return states * 4 * sum(t for t in tensors if not (paged and t >= BNB_PAGED_MIN_SIZE)), 0, note
    # torch AdamW (and fused): exp_avg and exp_avg_sq in the parameter dtype
    state = states * b_param * n
    if "fused" in o:
        return state, 0, None
    if simulated:
        # CPU has no foreach kernels: the single-tensor path makes sqrt(exp_avg_sq) and its quotient per tensor
        return state, 2 * b_param * biggest, None
    # CUDA foreach path: _foreach_sqrt(exp_avg_sqs) materialises one state's worth (research §3 T5)
    return state, b_param * n, None


# -------------------------------------------------------------------------------------------------------------------
# One GRPO step, phase by phase. estimate() reads the knobs into a _Step (the regime, the batch geometry, the
# persistent state and the terms several phases share); each phase function returns what that phase adds on top of
# the persistent state, by breakdown key; _composition() adds the persistent state and _assemble() turns the phases
# into the Estimate.


def _regime(spec: ModelSpec, k: Knobs, simulated: bool) -> _Regime:
    """The byte widths and switches the knobs imply. A 4-bit load without LoRA has nothing to train: an error."""
    b_w = _DTYPE_BYTES[_dtype_name(k, spec)]
    quant4 = bool(k.load_in_4bit)
    r = int(k.lora_r or 0)
    lora = r > 0
    if quant4 and not lora:
        raise EstimateError("load_in_4bit needs LoRA (lora_r > 0): a purely quantised model cannot be trained")
    # GPU: TRL's bf16=True default means bf16 autocast; on the simulated device the script trains without autocast.
    # PEFT upcasts adapters to fp32 (autocast_adapter_dtype=True); TRL casts them to bf16 under 4-bit
    # (grpo_trainer.py:532-541).
    return _Regime(b_w=b_w, b_res=b_w, b_c=b_w if simulated else 2, autocast_cast=(not simulated) and b_w == 4,
                   simulated=simulated, quant4=quant4, lora=lora, r=r,
                   targets=frozenset(_targets(k.lora_target_modules)) if lora else frozenset(),
                   b_a=2 if quant4 else 4)


@dataclass(frozen=True)
class _Geometry:
    """The shapes of one step: micro-batch ``B`` rows of ``T = P + C`` tokens, ``B_gen`` rows per generation."""

    B: int  # per_device_train_batch_size
    ga: int  # gradient_accumulation_steps
    spg: int  # steps_per_generation
    P: int  # padded prompt tokens
    C: int  # completion tokens (the worst case, max_completion_length)

    @property
    def B_gen(self) -> int:
        return self.B * self.spg

    @property
    def T(self) -> int:
        return self.P + self.C

    @property
    def tokens(self) -> int:
        return self.B * self.T


def _geometry(k: Knobs, world_size: int, prompt_tokens: int | None) -> _Geometry:
    """The batch geometry as TRL resolves it; P defaults to ``max_prompt_tokens`` or 256 and never exceeds it."""
    B, ga, spg = k.geometry(world_size)
    P = prompt_tokens if prompt_tokens is not None else (k.max_prompt_tokens or DEFAULT_PROMPT_TOKENS)
    if k.max_prompt_tokens:
        P = min(P, k.max_prompt_tokens)
    C = int(k.max_completion_length or 512)
    if B <= 0 or P <= 0 or C <= 0:
        raise EstimateError(f"batch, prompt and completion sizes must be positive (B={B}, P={P}, C={C})")
    return _Geometry(B=B, ga=ga, spg=spg, P=P, C=C)


@dataclass(frozen=True)
class _Persistent:
    """T1-T5: what lives on the device across the step (per device once :func:`_sharded`), and the counts."""

    weights: int
    reference: int
    grads: int  # from the first backward to zero_grad
    opt_state: int
    opt_transient: int  # one optimizer step's temporaries
    gather: int  # ZeRO-3 / offloaded parameters: one gathered layer (and its gradient)
    buckets: int  # DistributedDataParallel's gradient buckets (several ranks, no ZeRO): one more copy of the grads
    trainable: int
    total_params: int
    notes: tuple[str, ...]


def _trainable(spec: ModelSpec, g: _Regime) -> tuple[int, list[int], int]:
    """T3: (trainable parameters, element counts of the trainable tensors, their bytes per element)."""
    if not g.lora:
        return spec.params, spec.param_tensors(), g.b_w
    shapes = spec.projections()
    tensors = [t for m in sorted(g.targets) for t in (g.r * shapes[m][0], g.r * shapes[m][1])] * spec.num_layers
    return lora_trainable_params(spec, g.r, tuple(g.targets)), tensors, g.b_a


def _persistent(spec: ModelSpec, k: Knobs, g: _Regime) -> _Persistent:
    """T1 weights, T2 reference, T4 gradients and T5 optimizer on one device, before any sharding."""
    trainable, train_tensors, b_t = _trainable(spec, g)
    n_lora = trainable if g.lora else 0
    n_emb = 0 if g.lora else 1  # param_tensors() lists embed_tokens first (an untied lm_head is an nn.Linear)
    opt_state, opt_transient, note = _optimizer_bytes(str(k.optim or "adamw_torch_fused"), train_tensors, b_t,
                                                      g.simulated, embeddings=n_emb)
    return _Persistent(
        weights=_weight_bytes(spec, g.b_w, load_in_4bit=g.quant4, lora_params=n_lora, b_adapter=g.b_a),
        reference=spec.params * g.b_w if float(k.beta or 0.0) > 0 and not g.lora else 0,
        grads=trainable * b_t, opt_state=opt_state, opt_transient=opt_transient, gather=0, buckets=0,
        trainable=trainable,
        total_params=spec.params + n_lora, notes=(note,) if note else ())


def _sharded(p: _Persistent, spec: ModelSpec, k: Knobs, g: _Regime, world_size: int) -> _Persistent:
    """DeepSpeed ZeRO stages and CPU offload (research §3 T5, after DeepSpeed's estimator; rough, not validated
    here): each stage divides one more term by the number of devices; offloaded parameters leave one gathered
    layer on the device."""
    zs = int(k.zero_stage or 0)
    n_dev = max(1, world_size)
    weights, reference, grads, opt_state, opt_transient = p.weights, p.reference, p.grads, p.opt_state, p.opt_transient
    notes = list(p.notes)
    if zs >= 1:
        opt_state //= n_dev
        opt_transient //= n_dev
    if zs >= 2:
        grads //= n_dev
    if zs >= 3:
        weights //= n_dev
        reference //= n_dev
    if k.offload_optimizer or k.fsdp_offload:
        opt_state, opt_transient = 0, 0
        notes.append("optimizer state offloaded to the CPU")
    if k.offload_params or k.fsdp_offload:
        weights = reference = 0
        notes.append("parameters offloaded to the CPU: only the gathered layer is on the device")
    if zs or k.fsdp_offload:
        notes.append("sharding and offload are modelled roughly")
    gather = (2 * g.b_w * (spec.linear_params_per_layer() + spec.small_params_per_layer())
              if zs >= 3 or k.offload_params or k.fsdp_offload else 0)
    # Several ranks without ZeRO: DistributedDataParallel allocates its gradient buckets when it wraps the model
    # (a flat copy of every trainable gradient) and keeps them; measured on the simulated device with two ranks
    # (the wide model: 121.7 MiB at train begin for 60.8 MiB of float32 weights).
    buckets = p.grads if n_dev > 1 and not zs and not k.fsdp_offload else 0
    return replace(p, weights=weights, reference=reference, grads=grads, opt_state=opt_state,
                   opt_transient=opt_transient, gather=gather, buckets=buckets, notes=tuple(notes))


@dataclass(frozen=True)
class _Casts:
    """T6 autocast copies, and the one-weight transients (4-bit dequantisation, a gathered layer)."""

    cached: bool  # the copies stay in the autocast cache for the whole forward
    all: int  # every Linear weight's bf16 copy
    layer: int  # one layer's copies
    one: int  # one op's copy
    head: int  # lm_head's copy during generation
    nograd: int  # at the end of a generation or scoring forward
    fwd: int  # at the end of the training forward
    transient_w: int  # dequantised weight + gathered layer


def _casts(spec: ModelSpec, g: _Regime, gc: bool, gather: int) -> _Casts:
    """T6: the bf16 copies of fp32 master weights under autocast.

    torch keeps a bf16 cast in the autocast cache only for an fp32 leaf that requires grad
    (aten/src/ATen/autocast_mode.cpp, cached_cast: ``arg.requires_grad() && arg.is_leaf() && !arg.is_view()``),
    until the outermost autocast exits. Full fine-tune: every Linear weight trains, so all the copies stay for the
    whole forward (and in no-grad generation/scoring forwards too). LoRA: the base weights are frozen
    (requires_grad=False), so each use casts afresh and the copy dies with the op unless autograd saves it: the
    input of a frozen base Linear requires grad (the adapters upstream train), so mm saves the bf16 weight copy
    for the input gradient (derivatives.yaml, mm: ``self: mm_mat1_backward(grad, mat2, ...)``). Without
    checkpointing that is every layer's copy until its backward, as in the full case; with checkpointing the
    forward keeps nothing and only the recomputed layer holds its copies in backward. Measured on an H100:
    q3b-fp32-lora32 (GC) peaks at 13.87 GiB; counting the full 5.2 GiB of copies had predicted 18.5 GiB.
    """
    L = spec.num_layers
    biggest = max(a * b for a, b in spec.projections().values())
    cached = g.autocast_cast and not g.lora
    cast_all = 2 * L * spec.linear_params_per_layer() if g.autocast_cast else 0
    cast_one = 2 * biggest if g.autocast_cast else 0
    # 4-bit: bitsandbytes dequantises one weight at a time (forward and the input-gradient backward)
    dequant = 2 * biggest if g.quant4 else 0
    return _Casts(cached=cached, all=cast_all, layer=cast_all // max(1, L), one=cast_one,
                  head=2 * spec.vocab_size * spec.hidden_size if g.autocast_cast else 0,  # generate's lm_head
                  nograd=cast_all if cached else cast_one, fwd=cast_all if (cached or not gc) else cast_one,
                  transient_w=dequant + gather)


@dataclass(frozen=True)
class _Activations:
    """T7 and the batch buffers: the activation terms the training phases share."""

    A: int  # one layer's saved activations
    stored: int  # every layer's (or, checkpointed, every layer input)
    mask: int  # bool SDPA mask with padding (shared by the layers)
    final_norm: int  # the final norm's saved fp32 input and normalised copy (when it trains)
    final_out: int  # its output, until the head has copied the rows it scores
    batch_buf: int  # the buffered generation batch
    grad_tr: int  # one layer's backward gradient buffers


def _activations(spec: ModelSpec, g: _Regime, geo: _Geometry, co: Coefficients, gc: bool) -> _Activations:
    """T7 for one micro-batch, with checkpointing keeping only the layer inputs ``L·B·T·h·b_res``."""
    h, L, tokens = spec.hidden_size, spec.num_layers, geo.tokens
    a_tok = co.c_act * _activation_bytes_per_token(spec, g)
    A = int(tokens * a_tok)
    ckpt = tokens * h * g.b_res  # one checkpointed layer input
    return _Activations(
        A=A, stored=L * ckpt if gc else L * A, mask=geo.B * geo.T * geo.T,
        final_norm=tokens * h * (4 + (g.b_res if not g.lora else 0)), final_out=tokens * h * g.b_res,
        # prompt/completion ids and masks (int64), old/ref log-probs and advantages
        batch_buf=geo.B_gen * (32 * geo.T + 8 * geo.C),
        # the gradient buffers of the MLP backward (grad of the product, silu and up) and of the residual stream
        grad_tr=int(co.c_act * tokens * (3 * spec.intermediate_size * g.b_c + 2 * h * 4)))


@dataclass(frozen=True)
class _Step:
    """Everything the phase functions read."""

    spec: ModelSpec
    k: Knobs
    co: Coefficients
    g: _Regime
    geo: _Geometry
    p: _Persistent
    casts: _Casts
    acts: _Activations
    context: int | None = None  # the device's memory outside the allocator, when known (see estimate())

    def head(self) -> dict[str, int]:
        """T8 over the training micro-batch: Triton (CUDA) scores only completion positions, the fallback every one."""
        geo, g = self.geo, self.g
        N = geo.B * (geo.T - 1) if g.simulated else geo.B * geo.C
        return _head_bytes(self.spec, N, b_c=g.b_c, b_res=g.b_res, b_w=g.b_w, head_trains=not g.lora,
                           fallback=g.simulated, k_logits=self.co.k_logits)

    @property
    def grads_at_gen(self) -> int:
        """Gradients alive while generating: generation inside an accumulation window (steps_per_generation < GA)."""
        return self.p.grads if self.geo.ga > self.geo.spg else 0


def _generation(s: _Step) -> dict[str, int]:
    """HF ``generate`` (GC is off while generating, trl/models/utils.py:136-154): T9's KV cache and the larger of
    the prefill and the decode-step transients; nothing with vLLM, whose memory is outside torch's allocator."""
    spec, g, geo, c = s.spec, s.g, s.geo, s.casts
    if s.k.use_vllm:
        kv_cache = gen_transient = 0
    else:
        B_gen, P, V, L = geo.B_gen, geo.P, spec.vocab_size, spec.num_layers
        b_k, b_v = max(g.b_c, g.b_res), g.b_c  # RoPE with fp32 cos/sin promotes k to fp32 under autocast from fp32
        kv_cache = _kv_cache_bytes(spec, B_gen, geo.T, b_k, b_v)
        kv_prefill = _kv_cache_bytes(spec, B_gen, P, b_k, b_v)
        prefill = (B_gen * P * _nograd_bytes_per_token(spec, g) + B_gen * P * P + kv_prefill
                   + B_gen * V * (g.b_c + 8))
        decode = kv_cache + kv_cache // max(1, L) + 16 * B_gen * V + B_gen * (spec.hidden_size * 8 + V * g.b_c)
        gen_transient = max(prefill, decode) - kv_cache  # kv_cache itself is reported apart
    return {"weights": (c.all + c.head if c.cached else max(c.head, c.one)) + c.transient_w,
            "gradients": s.grads_at_gen, "kv_cache": kv_cache + max(0, gen_transient),
            "activations": geo.B_gen * geo.T * 16}


def _scoring(s: _Step) -> dict[str, int]:
    """Old log-probs (GA not a multiple of steps_per_generation, or vLLM importance sampling) and/or reference
    log-probs (beta > 0): no grad, in chunks of per_device_train_batch_size (grpo_trainer.py:2642-2737). Without
    either, only the buffered batch."""
    geo, a = s.geo, s.acts
    if not (float(s.k.beta or 0.0) > 0 or (geo.ga % geo.spg != 0) or bool(s.k.use_vllm)):
        return {"gradients": s.grads_at_gen, "activations": a.batch_buf}
    score_act = (int(geo.tokens * _nograd_bytes_per_token(s.spec, s.g)) + a.mask
                 + geo.tokens * s.spec.hidden_size * s.g.b_res * 2)
    return {"weights": s.casts.nograd + s.casts.transient_w, "gradients": s.grads_at_gen,
            "activations": a.batch_buf + score_act, "logits": s.head()["forward"]}


def _forward_backward(s: _Step) -> dict[str, int]:
    """One micro-batch's forward and backward: the largest of five moments (the end of the forward, the head's
    backward, the last layer's backward, the first layer's, the embedding's)."""
    spec, g, a, c, gc = s.spec, s.g, s.acts, s.casts, bool(s.k.gradient_checkpointing)
    hb = s.head()
    grads, ga = s.p.grads, s.geo.ga
    V, h = spec.vocab_size, spec.hidden_size
    g_head = 0 if g.lora else V * h * g.b_w  # lm_head/embedding gradient once the head's backward returned
    grads_new = 0 if ga > 1 else 1  # with GA > 1 the gradient buffers already exist (grads_before)
    grads_before = grads if ga > 1 else 0  # later micro-steps of an accumulation window start with gradients
    # Within one layer's backward its gradients are allocated while its saved activations are consumed and freed,
    # so the layer holds about the larger of the two, not both (a wide, one-layer model showed it: counting both
    # over-predicted its peak by 31%). With GA > 1 the gradients already exist and the activations come on top.
    g_layer = max(0, grads - g_head) // max(1, spec.num_layers)
    own = max(a.A, g_layer) if grads_new else a.A  # the layer in backward: activations and new gradients together
    own_acts = own - grads_new * g_layer
    others = a.stored if gc else a.stored - a.A  # the other layers' saved activations (checkpointed: their inputs)
    cands = {
        # end of forward: stored activations, the final norm, the head's forward, all autocast copies cached
        "forward": ({"activations": a.stored + a.final_norm + a.final_out + a.mask, "logits": hb["forward"],
                     "weights": c.fwd}),
        # the head's backward: grad_hidden, grad_weight (full), mm_buf and tile temporaries
        "head_backward": ({"activations": a.stored + a.final_norm + a.mask, "logits": hb["backward"],
                           "weights": 0 if gc else c.all}),
        # backward of the last layer: its (recomputed) activations and gradient buffers, the head's gradient
        "layer_backward": ({"activations": others + own_acts + a.grad_tr + a.mask,
                            "gradients": grads_new * (g_head + g_layer),
                            "weights": c.layer if gc else c.all}),
        # backward of the first layer and the embedding: every gradient exists. With checkpointing the layer's
        # 16-bit input (B·T·h·2, under 1% here) also lives; it is left out so that checkpointing stays monotone.
        "backward_end": ({"activations": own_acts + a.grad_tr + a.mask, "gradients": grads_new * grads,
                          "weights": c.layer}),
        # the embedding's backward, after the first layer's has freed its activations: a tied embedding's dense
        # gradient [V, h] is a temporary that AccumulateGrad adds into the lm_head's in place
        "embedding_backward": ({"activations": 0,
                                "gradients": grads_new * grads + (V * h * g.b_w if not g.lora
                                                                  and spec.tie_word_embeddings else 0)}),
    }
    for cand in cands.values():
        cand["weights"] = cand.get("weights", 0) + c.transient_w
        cand["activations"] += a.batch_buf
        cand["gradients"] = cand.get("gradients", 0) + grads_before
    return max(cands.values(), key=lambda cand: sum(cand.values()))


def _optimizer_step(s: _Step) -> dict[str, int]:
    """``optimizer.step()``: every gradient, the step's temporaries and the buffered batch."""
    return {"gradients": s.p.grads, "optimizer": s.p.opt_transient, "activations": s.acts.batch_buf}


_PHASE_TERMS = {"generation": _generation, "scoring": _scoring, "forward_backward": _forward_backward,
                "optimizer": _optimizer_step}


def _vllm_bytes(k: Knobs, capacity: int | None, notes: list[str]) -> int:
    """T9: a colocated vLLM reserves ``vllm_gpu_memory_utilization × capacity`` outside torch's allocator."""
    if not (k.use_vllm and (k.vllm_mode or "colocate") == "colocate"):
        return 0
    if capacity:
        return int(float(k.vllm_gpu_memory_utilization or 0.3) * capacity)
    notes.append("vLLM colocate reservation not counted: pass capacity")
    return 0


def _composition(s: _Step, phase_parts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each phase's allocated bytes by breakdown key: the persistent state plus what the phase adds (unscaled)."""
    p = s.p
    # cuBLAS workspaces come from the caching allocator, one per (handle, stream), and handles are per thread: the
    # forward (main thread) and the backward (autograd's device thread) each hold one (T10, ``m_workspace``)
    base = {"weights": p.weights, "reference": p.reference, "optimizer": p.opt_state, "gradients": p.buckets,
            "overhead": 0 if s.g.simulated else int(s.co.m_workspace)}
    comp: dict[str, dict[str, int]] = {}
    for ph, parts in phase_parts.items():
        d = dict.fromkeys(BREAKDOWN_KEYS, 0)
        for key, v in base.items():
            d[key] += v
        for key, v in parts.items():
            d[key] += int(v)
        comp[ph] = d
    return comp


def _assemble(s: _Step, comp: dict[str, dict[str, int]], capacity: int | None) -> Estimate:
    """Scale each phase, add T9 vLLM, T10 context and T11 fragmentation, and pick the dominant phase. The breakdown
    is that phase's composition, so that it sums to the peak."""
    co, k, simulated = s.co, s.k, s.g.simulated
    notes = list(s.p.notes)
    scale = co.scale
    phases = {ph: round(sum(d.values()) * scale) for ph, d in comp.items()}
    vllm = _vllm_bytes(k, capacity, notes)
    sleep = bool(k.vllm_enable_sleep_mode)
    frag = co.f_frag_expandable if k.expandable_segments else co.f_frag
    ctx = s.context if s.context is not None else 0 if simulated else int(co.m_ctx)

    def device_bytes(ph: str) -> int:
        awake = vllm if (not sleep or ph == "generation") else 0
        return ctx + int(phases[ph] * (1 + frag)) + awake

    dominant = max(PHASES, key=lambda ph: (device_bytes(ph), phases[ph]))
    peak_bytes = device_bytes(dominant)
    bd = {key: round(v * scale) for key, v in comp[dominant].items()}
    bd["activations"] += phases[dominant] - sum(bd.values())  # rounding of the scale
    bd["vllm"] = vllm if (not sleep or dominant == "generation") else 0
    bd["overhead"] = peak_bytes - sum(v for key, v in bd.items() if key != "overhead")
    return Estimate(peak_bytes=peak_bytes, peak_alloc_bytes=max(phases.values()), breakdown=bd, phases=phases,
                    trainable_params=s.p.trainable, total_params=s.p.total_params, dominant_phase=dominant,
                    notes=tuple(notes))


def estimate(spec: ModelSpec, knobs: Knobs, *, world_size: int = 1, prompt_tokens: int | None = None,
             coefficients: Coefficients | None = None, simulated: bool = False,
             capacity: int | None = None, context: int | None = None) -> Estimate:
    """Predict the peak memory of one steady-state TRL 1.16 GRPO step on one device.

    ``knobs`` may leave fields at None: TRL's defaults fill them (``oomguard.vocab.knobs.TRL_DEFAULTS``).
    ``prompt_tokens`` is the padded prompt length P (default ``max_prompt_tokens`` or 256); completions are taken at
    the worst case ``C = max_completion_length``. The training micro-batch is ``per_device_train_batch_size`` and
    generation runs ``rows_per_device()`` sequences at once. ``simulated=True`` models oomguard's simulated device on
    CPU: no CUDA context, no autocast, the chunked head's torch fallback. ``context`` is the device's memory outside
    the allocator when it is known (measured under ``--gpu-memory``, or the simulated device's
    ``--simulate-context``); by default ``m_ctx``, or 0 on the simulated device. ``capacity`` (device bytes) sizes a
    colocated vLLM.

    ``coefficients`` default to the research priors, or to :meth:`Coefficients.for_simulated` when ``simulated``.
    The optimizer state is assumed to exist in every phase (the steady state after step 1).

    >>> tiny = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True)
    >>> e = estimate(tiny, Knobs(per_device_train_batch_size=4, max_completion_length=128), prompt_tokens=32,
    ...              simulated=True)
    >>> e.dominant_phase, sorted(e.phases) == sorted(PHASES), sum(e.breakdown.values()) == e.peak_bytes
    ('forward_backward', True, True)
    """
    co = coefficients or (Coefficients.for_simulated() if simulated else Coefficients())
    k = _filled(knobs)
    g = _regime(spec, k, simulated)
    geo = _geometry(k, world_size, prompt_tokens)
    gc = bool(k.gradient_checkpointing)
    p = _sharded(_persistent(spec, k, g), spec, k, g, world_size)
    s = _Step(spec=spec, k=k, co=co, g=g, geo=geo, p=p, casts=_casts(spec, g, gc, p.gather),
              acts=_activations(spec, g, geo, co, gc), context=context)
    return _assemble(s, _composition(s, {ph: terms(s) for ph, terms in _PHASE_TERMS.items()}), capacity)


def load_bytes(spec: ModelSpec, knobs: Knobs, *, coefficients: Coefficients | None = None,
               simulated: bool = False, context: int | None = None) -> int:
    """Device bytes once ``from_pretrained`` has placed the weights: the context outside the allocator plus the
    stored weights in the load's dtype (NF4 projections under a 4-bit load), before any training memory exists.

    Every phase of the step holds at least this, so it is the floor a pre-flight can judge before anything loads,
    from the checkpoint's config alone. (LoRA adapters are created after the load and are not counted.)

    >>> tiny = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True)
    >>> load_bytes(tiny, Knobs(dtype="float32"), simulated=True) == 4 * tiny.params
    True
    >>> load_bytes(tiny, Knobs(dtype="float32", load_in_4bit=True, lora_r=8), simulated=True) < 2 * tiny.params
    True
    """
    co = coefficients or (Coefficients.for_simulated() if simulated else Coefficients())
    k = _filled(knobs)
    b_w = _DTYPE_BYTES[_dtype_name(k, spec)]
    ctx = context if context is not None else 0 if simulated else int(co.m_ctx)
    return ctx + _weight_bytes(spec, b_w, load_in_4bit=bool(k.load_in_4bit))


def describe(e: Estimate) -> str:
    """A few lines for people: the peak, its phase and the terms above 1 MiB."""
    lines = [f"predicted peak {format_size(e.peak_bytes)} ({e.dominant_phase}); allocated "
             f"{format_size(e.peak_alloc_bytes)}"]
    for key in BREAKDOWN_KEYS:
        v = e.breakdown[key]
        if v >= MiB:
            lines.append(f"  {key:<12} {format_size(v):>12}  {100 * v / max(1, e.peak_bytes):5.1f}%")
    lines.append("  phases: " + ", ".join(f"{ph} {format_size(v)}" for ph, v in e.phases.items()))
    lines += [f"  note: {n}" for n in e.notes]
    return "\n".join(lines)

