"""The analytical GPU-memory model of one TRL GRPO step (TRL 0.29 to 1.x): predict the peak before anything runs.

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
  :func:`activation_bytes_per_token` for the itemised sum. Scaled by ``c_act``. With gradient checkpointing only the
  layer inputs ``L·B·T·h·b_res`` are kept, plus one layer recomputed in backward. A layer in backward holds about the
  larger of its saved activations and its new gradients (autograd frees the one as it allocates the other), not
  their sum: counting both over-predicted a wide one-layer model by 31% (``tests/test_estimate.py``).
- **T8 chunked LM head** (``trl/kernels/chunked_logprob.py``, TRL 1.16 always patches it in, ``grpo_trainer.py:1068``):
  the forward allocates ``mm_buf = [min(N, 4096), 32768]`` in the compute dtype whatever the vocabulary size, plus
  fp32 per-token statistics; the backward allocates fp32 ``grad_hidden [N, h]``, ``mm_buf`` again, and fp32
  ``grad_weight [V, h]`` only when ``lm_head`` trains (full fine-tune). On CUDA with Triton, ``N = B·C`` (only
  completion positions, ``trl/trainer/utils.py:1642-1645``) and the tiles are folded in place; without Triton (CPU, the
  simulated device) every position is scored, ``N = B·(T-1)``, and the torch fallback makes fp32 tile temporaries
  (``k_logits`` bytes per tile element in backward, 12 B in forward). **TRL 0.29 to 1.14** have no fused head: they
  materialise the logits of the completion positions, ``[B, C+1, V]`` and a temperature-scaled ``[B, C, V]``, and
  their backward holds ``k_full_logits`` bytes per ``[B, C, V]`` element (:func:`terms._logits_bytes`). Which head the
  installed TRL has is read from its code (``oomguard.child.trlcompat``; ``estimate(head=...)``); the two differ by up
  to 3x on the same config (research notes of issue 24).
- **T9 generation** HF ``generate`` KV cache ``L·n_kv·d·(P+C)·B_gen·(b_k + b_v)`` (DynamicCache grows by
  ``torch.cat``, ``transformers/cache_utils.py:136``) plus the prefill or the sampling transient; vLLM colocate
  reserves ``vllm_gpu_memory_utilization × capacity`` outside torch's allocator, in every phase unless
  ``vllm_enable_sleep_mode`` (then only while generating); with ``offload_during_generation`` (ms-swift) the
  trainer's weights, reference and optimizer state leave the device while vLLM generates.
- **T10 context** ``M_ctx``: CUDA context and workspaces, not in torch's statistics (0 on the simulated device).
- **T11 fragmentation** ``peak_alloc·f_frag``, with the smaller ``f_frag_expandable`` under
  ``expandable_segments:True``.

The modules follow a prediction: ``model`` (the shapes and exact parameter counts), ``coefficients`` (the fitted
coefficients and the measured errors), ``terms`` (the byte formulas T1-T9), ``step`` (one step read from the knobs),
``phases`` (what each phase adds) and ``peak`` (:func:`estimate`, :func:`load_bytes`, :func:`describe`); then
``fitverdict`` (:func:`verdict`: the one answer to "will it fit" that `oomguard run` and `oomguard plan` act on).

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

from .coefficients import (
    DEVICE_OVERPREDICTION,
    SIMULATED_HEAD_ERROR,
    SIMULATED_OVERPREDICTION,
    SIMULATED_UNDERPREDICTION,
    STOP_ALLOWANCE,
    SURE_HEADROOM,
    UNTESTED_FACTOR,
    Coefficients,
    ModelError,
    measured_error,
)
from .fed import fed, images_of, load_fed
from .fitverdict import (
    PROBE,
    RUN,
    STOP,
    Doubts,
    FitVerdict,
    chooses,
    doubts_of,
    judge_spec,
    launch_as,
    verdict,
)
from .model import (
    MXFP4_BYTES_PER_PARAM,
    EstimateError,
    LoraTarget,
    MlaSpec,
    ModelSpec,
    MoeSpec,
    VisionSpec,
    load_model_spec,
    lora_targets,
    lora_trainable_params,
)
from .peak import BREAKDOWN_KEYS, Estimate, describe, estimate, load_bytes
from .phases import PHASES
from .terms import NF4_BYTES_PER_PARAM
from .unmodelled import NOT_MODELLED, not_modelled
from .vision import Images, image_tokens, load_pixel_budget, vision_patches

__all__ = [
    "BREAKDOWN_KEYS",
    "DEVICE_OVERPREDICTION",
    "MXFP4_BYTES_PER_PARAM",
    "NF4_BYTES_PER_PARAM",
    "NOT_MODELLED",
    "PHASES",
    "PROBE",
    "RUN",
    "SIMULATED_HEAD_ERROR",
    "SIMULATED_OVERPREDICTION",
    "SIMULATED_UNDERPREDICTION",
    "STOP",
    "STOP_ALLOWANCE",
    "SURE_HEADROOM",
    "UNTESTED_FACTOR",
    "Coefficients",
    "Doubts",
    "Estimate",
    "EstimateError",
    "FitVerdict",
    "Images",
    "LoraTarget",
    "MlaSpec",
    "ModelError",
    "ModelSpec",
    "MoeSpec",
    "VisionSpec",
    "chooses",
    "describe",
    "doubts_of",
    "estimate",
    "fed",
    "image_tokens",
    "images_of",
    "judge_spec",
    "launch_as",
    "load_bytes",
    "load_fed",
    "load_model_spec",
    "load_pixel_budget",
    "lora_targets",
    "lora_trainable_params",
    "measured_error",
    "not_modelled",
    "verdict",
    "vision_patches",
]
