"""The parts of a model beyond a dense decoder's shapes, as transformers 5.24 builds them: the mixture-of-experts
blocks (:class:`MoeSpec`), DeepSeek's latent attention (:class:`MlaSpec`) and a vision-language model's tower
(:class:`VisionSpec`), with the error every reader of a model raises. :class:`~.model.ModelSpec` holds them;
:mod:`.readconfig` reads them from a ``config.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# MXFP4 (gpt-oss checkpoints; transformers' Mxfp4 quantizer keeps it on a GPU with triton kernels): 4-bit values and one
# 8-bit (E8M0) scale per block of 32, for the experts' gate_up_proj and down_proj only.
MXFP4_BYTES_PER_PARAM = 0.5 + 1 / 32


class EstimateError(ValueError):
    """A model description the memory model cannot use; the one-line message names the file and the problem."""


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts blocks of a decoder, as transformers 5.24 builds them: every expert's weights stored
    fused, ``gate_up_proj [E, 2·i_e, h]`` and ``down_proj [E, h, i_e]`` (``@use_experts_implementation``; so every
    expert has a gradient and optimizer state, zero rows for those no token reached: measured on CPU, see
    ``docs/concepts/memory-model.md``), a router ``[E, h]``, and optionally shared experts beside them.

    ``moe_layers``: how many decoder layers have the MoE block (the others keep the dense MLP of
    ``intermediate_size``). ``shared_intermediate``: width of the shared expert MLP (DeepSeek: ``n_shared_experts ·
    moe_intermediate_size``; Qwen2-MoE: ``shared_expert_intermediate_size``), 0 for none; ``shared_gate``: Qwen2-MoE's
    ``shared_expert_gate`` Linear(h, 1). ``expert_bias`` / ``router_bias``: gpt-oss. ``router_logits``: the model
    has a non-zero ``router_aux_loss_coef`` (declared, or its class's 0.001), so TRL 1.16 computes the auxiliary
    load-balancing loss whatever ``output_router_logits`` says (``grpo_trainer.py``: ``aux_loss_enabled``), and every
    MoE layer's router logits and their softmax stay alive until the loss. ``peft_pattern``: PEFT's transformers-v5 conversion applies (the model type is in transformers'
    ``conversion_mapping`` as a ``"mixtral"``- or ``"qwen2_moe"``-style model): ``all-linear``, or naming the
    pattern's v4 expert modules (``w1``/``w3``/``w2``, or ``gate_proj``/``up_proj``/``down_proj``) and ``gate``, adapts
    the fused experts (gate_up at twice the rank) and the router. ``mxfp4``: the
    checkpoint stores the experts as MXFP4 (gpt-oss), which a load dequantises unless it keeps the quantised kernels.
    """

    num_experts: int
    top_k: int
    expert_intermediate: int
    moe_layers: int
    shared_intermediate: int = 0
    shared_gate: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    router_logits: bool = False
    peft_pattern: str | None = None
    mxfp4: bool = False
    router_name: str = "gate"

    def expert_tensors(self, h: int) -> list[tuple[str, tuple[int, ...]]]:
        """The experts' parameters of one layer: ``(name, shape)``."""
        E, i = self.num_experts, self.expert_intermediate
        out: list[tuple[str, tuple[int, ...]]] = [("gate_up_proj", (E, 2 * i, h)), ("down_proj", (E, h, i))]
        if self.expert_bias:
            out += [("gate_up_proj_bias", (E, 2 * i)), ("down_proj_bias", (E, h))]
        return out



@dataclass(frozen=True)
class MlaSpec:
    """DeepSeek V2/V3 multi-head latent attention: ``q_proj`` (or ``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj`` when
    ``q_lora_rank`` is set), ``kv_a_proj_with_mqa`` (h → kv_lora_rank + rope), ``kv_a_layernorm``, ``kv_b_proj``
    (kv_lora_rank → heads·(nope + v)) and ``o_proj`` (heads·v → h). The KV cache keeps the compressed latent
    (``kv_lora_rank + qk_rope_head_dim`` per token per layer)."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's vision tower and projector, as transformers 5.24 builds them.

    ``kind``: ``"merger"`` (Qwen2.5-VL: patches of ``patch × patch`` pixels, ``temporal_patch`` frames, windowed
    attention with full attention in ``full_blocks`` blocks, a SwiGLU MLP, RMSNorm, and a patch merger that maps
    ``merge × merge`` patches to one token of ``out_hidden``) or ``"siglip"`` (Gemma 3: a SigLIP encoder at a fixed
    ``image_size``, LayerNorm and a GELU MLP, learned positions, and a projector that pools its patches to
    ``tokens_per_image`` tokens).
    """

    kind: str
    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch: int
    out_hidden: int
    channels: int = 3
    temporal_patch: int = 1
    merge: int = 1
    image_size: int = 0
    tokens_per_image: int = 0
    full_blocks: int = 0
    window: int = 0

    def tensors(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """Every parameter of the tower and projector: ``(name, shape, is an nn.Linear weight)``, repeated blocks
        listed ``depth`` times."""
        d, m = self.hidden, self.intermediate
        out: list[tuple[str, tuple[int, ...], bool]] = []
        if self.kind == "merger":
            out.append(("patch_embed", (d, self.channels * self.temporal_patch * self.patch * self.patch), False))
            block: list[tuple[str, tuple[int, ...], bool]] = [
                ("norm1", (d,), False), ("norm2", (d,), False),
                ("qkv", (3 * d, d), True), ("qkv.bias", (3 * d,), False), ("proj", (d, d), True),
                ("proj.bias", (d,), False),
                ("gate_proj", (m, d), True), ("gate_proj.bias", (m,), False), ("up_proj", (m, d), True),
                ("up_proj.bias", (m,), False), ("down_proj", (d, m), True), ("down_proj.bias", (d,), False)]
            out += block * self.depth
            wide = d * self.merge * self.merge
            out += [("ln_q", (d,), False), ("merger.mlp.0", (wide, wide), True), ("merger.mlp.0.bias", (wide,), False),
                    ("merger.mlp.2", (self.out_hidden, wide), True),
                    ("merger.mlp.2.bias", (self.out_hidden,), False)]
            return out
        # siglip
        grid = (self.image_size // self.patch) ** 2
        out += [("patch_embedding", (d, self.channels * self.patch * self.patch), False),
                ("patch_embedding.bias", (d,), False), ("position_embedding", (grid, d), False)]
        block = [("layer_norm1", (d,), False), ("layer_norm1.bias", (d,), False)]
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            block += [(name, (d, d), True), (name + ".bias", (d,), False)]
        block += [("layer_norm2", (d,), False), ("layer_norm2.bias", (d,), False), ("fc1", (m, d), True),
                  ("fc1.bias", (m,), False), ("fc2", (d, m), True), ("fc2.bias", (d,), False)]
        out += block * self.depth
        out += [("post_layernorm", (d,), False), ("post_layernorm.bias", (d,), False),
                ("mm_input_projection_weight", (d, self.out_hidden), False), ("mm_soft_emb_norm", (d,), False)]
        return out

    @property
    def params(self) -> int:
        """Parameters of the tower and projector."""
        return sum(math.prod(s) for _n, s, _lin in self.tensors())

    def linears(self) -> list[tuple[str, int, int]]:
        """Its nn.Linear layers ``(name, in, out)`` (what PEFT's all-linear and bitsandbytes reach), repeated blocks
        listed ``depth`` times."""
        return [(n, s[1], s[0]) for n, s, lin in self.tensors() if lin]

    @property
    def patches_per_image(self) -> int:
        """SigLIP: patches its encoder runs over per image (``(image_size / patch)²``, whatever the image)."""
        return (self.image_size // self.patch) ** 2 if self.kind == "siglip" else 0
