"""The terms: the byte formulas of the model, each for one kind of memory (T1 weights, T5 optimizer states, T7
activations, T8 the chunked LM head, T9 the KV cache), with the lines of TRL, transformers, PEFT and bitsandbytes they
rest on. Each takes shapes and byte widths; which ones apply in which phase is ``step``'s and ``phases``' business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .model import MXFP4_BYTES_PER_PARAM, ModelSpec

# bitsandbytes NF4 with double quantisation: 4 bits + an 8-bit absmax per 64 weights + an fp32 absmax per 256 absmax
# blocks (QLoRA, arXiv:2305.14314 §3; research §3 T1).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# trl/kernels/chunked_logprob.py:31 and trl/trainer/utils.py:1506
TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768
# unsloth_zoo/cpu/ops.py cpu_chunked_log_probs: rows per LM-head chunk = this many logits / V
# (env UNSLOTH_CPU_CE_CHUNK_ELEMENTS)
ROWCHUNK_ELEMENTS = 16 * 1024 * 1024
# bitsandbytes/optim/optimizer.py: blockwise 8-bit states, min_8bit_size, paged threshold
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_PAGED_MIN_SIZE = 100_000


@dataclass(frozen=True)
class Regime:
    """Byte widths and switches that follow from the knobs (see :func:`regime_of`)."""

    b_w: int  # stored weight dtype (non-quantised tensors)
    b_res: int  # residual stream / norms / hidden states
    b_c: int  # matmul outputs and most saved activations
    autocast: bool  # mixed precision (bf16 or fp16 autocast), on a GPU or on the CPU
    autocast_cast: bool  # fp32 master weights under autocast: every Linear input/weight is cast
    simulated: bool
    quant4: bool
    lora: bool
    r: int
    targets: frozenset[str]  # the decoder layers' adapted Linears by name ("experts": adapted expert parameters)
    b_a: int  # LoRA adapter dtype
    lora_targets: tuple[Any, ...] = ()  # model.LoraTarget rows: what PEFT adapts, where, at which rank
    dropout: bool = False  # the user's LoRA drops its inputs in training (PEFT's lora_dropout > 0)


def activation_bytes_per_token(spec: ModelSpec, g: Regime, moe: bool = False) -> int:
    """Bytes autograd keeps per token for one decoder layer (T7), itemised from what each op saves; ``moe``: a layer
    with the mixture-of-experts block in place of the dense MLP.

    - RMSNorm (``norms_per_layer`` of them, ``LlamaRMSNorm.forward``): ``pow`` saves its fp32 input (4h: the residual
      itself when it is fp32, a copy otherwise); ``weight * x.to(dtype)`` saves the normalised x (``b_res·h``) only
      when the weight trains.
    - The normed output y feeds q/k/v (and gate/up). A trainable Linear saves its input: y once when no cast happens,
      one bf16 cast per consumer under autocast from fp32. A frozen base Linear saves nothing about its input; a LoRA
      ``lora_A`` saves it (a copy per module when PEFT's ``_cast_input_dtype`` or autocast must cast it).
    - Per-head q/k RMSNorm (Qwen3, Gemma 3): their fp32 input and, when they train, the normalised copy.
    - SDPA saves q, the repeated k and v (``repeat_kv``, padded mask), its output and the logsumexp; ``o_proj`` saves
      the transposed output copy when it trains or is adapted. DeepSeek's latent attention: also the latent's norm
      and ``kv_b_proj``'s input.
    - SwiGLU MLP: gate, silu(gate), up, and their product (saved by ``down_proj`` when it trains or is adapted).
      A MoE block instead: see :func:`moe_bytes_per_token`.
    - LoRA: ``lora_B`` saves the ``lora_A`` output, r per adapted module. With ``lora_dropout`` > 0 each adapted
      module drops its own copy of its input (PEFT's ``lora_dropout[adapter](x)``, after ``_cast_input_dtype``):
      ``lora_A`` saves that copy (its bf16 cast under autocast) and the dropout its mask, a bool per element where
      the fused kernel runs (CUDA's ``native_dropout``), the scaled noise in the adapter dtype on the CPU (ATen's
      ``_dropout``: ``input * noise``, which saves the noise); nothing is shared between the modules then.

    bf16 full fine-tune with ``heads·head_dim = h``: ``16h + 4h + 10h + 8i = 26h + 8i`` (research §3 T7).
    """
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    full = not g.lora
    b_res, b_c = g.b_res, g.b_c
    # norms
    norm = 4 * h + (b_res * h if full else 0)
    total = spec.norms_per_layer * norm

    autocast = g.autocast

    def consumers_of(width: int, modules: tuple[str, ...], b_x: int) -> int:
        """Bytes saved for one input of ``width`` elements and ``b_x`` bytes each, read by ``modules``."""
        if full:  # each trainable Linear saves its input; under autocast an fp32 input is cast per Linear
            return len(modules) * 2 * width if autocast and b_x == 4 else b_x * width
        adapted = sum(1 for m in modules if m in g.targets)
        if not adapted:
            return 0  # a frozen base Linear saves nothing about its input
        if g.dropout:  # each module's own dropped copy (or its autocast cast) and the dropout's mask or noise
            return adapted * (2 if autocast else g.b_a) * width + adapted * (g.b_a if g.simulated else 1) * width
        if autocast:
            # lora_A under autocast saves a bf16 copy per module when x is fp32, or when PEFT's _cast_input_dtype
            # first upcast it to the fp32 adapter dtype; with bf16 adapters (QLoRA) x is shared
            return adapted * 2 * width if (b_x == 4 or g.b_a == 4) else 2 * width
        return b_x * width if g.b_a == b_x else adapted * g.b_a * width

    attn = tuple(spec.attention_linears())
    readers = tuple(n for n in attn if n not in ("o_proj", "q_b_proj", "kv_b_proj"))
    total += consumers_of(h, readers, b_res)
    if moe:
        total += moe_bytes_per_token(spec, g, consumers_of)
    else:
        mlp = tuple(spec.mlp_linears())
        total += consumers_of(h, mlp[:-1], b_res)
    # attention: q, repeated k and v, output, logsumexp (fp32 per head)
    k_saved = q if spec.num_kv_heads < spec.num_heads else kv
    v_saved = spec.attn_out_dim if spec.mla is not None else k_saved
    total += b_c * (q + k_saved + v_saved + spec.attn_out_dim) + 4 * spec.num_heads
    total += consumers_of(spec.attn_out_dim, ("o_proj",), b_c)
    if spec.qk_norm:  # fp32 input of each per-head norm (a copy, or the projection's own output), normalised copy
        total += (4 + (b_c if full else 0)) * (q + spec.num_kv_heads * spec.head_dim)
    if spec.mla is not None:  # the latents: their norms' fp32 inputs, normalised copies, the b-projections' inputs
        m = spec.mla
        for width, reader in ((m.kv_lora_rank, "kv_b_proj"), (m.q_lora_rank or 0, "q_b_proj")):
            if width:
                total += (4 + (b_c if full else 0)) * width + consumers_of(width, (reader,), b_c)
    if not moe:  # MLP
        total += 3 * i * b_c + consumers_of(i, (tuple(spec.mlp_linears())[-1],), b_c)
    if g.lora:  # lora_B's input: r per adapted Linear of this layer
        here = set(attn) | set(spec.moe_linears() if moe else spec.mlp_linears())
        total += len(g.targets & here) * g.r * (2 if autocast else g.b_a)
    return total


def moe_bytes_per_token(spec: ModelSpec, g: Regime, consumers_of: Any) -> int:
    """Bytes a MoE block saves per token in training (transformers 5.24's ``grouped_mm_experts_forward``, the default
    experts implementation on CPU and GPU alike): the router's logits and fp32 probabilities; each token goes to
    ``top_k`` experts, so ``top_k`` rows of the sorted input (saved by the grouped matmul when the experts train), the
    ``gate_up`` output (``2·i_e``, kept by the activation), the activation's output, their product (saved when the
    experts train or are adapted) and the down projection's output (saved for the routing weights' gradient); gpt-oss's
    clamped GLU keeps three more ``i_e``-wide tensors. Shared experts: a dense MLP of their width, over every token."""
    m = spec.moe
    assert m is not None
    h, E, k, i_e, b_c = spec.hidden_size, m.num_experts, m.top_k, m.expert_intermediate, g.b_c
    b_e = g.b_w  # the experts compute in their weights' dtype: autocast does not cast the grouped matmul (measured on
    # CPU: fp32 experts under bf16 autocast made no bf16 copies), and _grouped_mm casts its input to the weights'
    experts_train = not g.lora or "experts" in g.targets
    total = E * (b_c + 4) + k * 8 * 3  # logits, fp32 softmax, sorted ids / permutation / weights
    gate = 2 * i_e + i_e + (3 * i_e if m.expert_bias else 0)  # gate_up output, activation (gpt-oss: clamp, GLU)
    total += k * b_e * (gate + h + (h + i_e if experts_train else 0))
    if m.shared_intermediate:
        mlp = tuple(spec.mlp_linears(m.shared_intermediate))
        total += consumers_of(h, mlp[:-1], g.b_res) + 3 * m.shared_intermediate * b_c
        total += consumers_of(m.shared_intermediate, (mlp[-1],), b_c)
    return total


def nograd_bytes_per_token(spec: ModelSpec, g: Regime) -> int:
    """Live bytes per token inside one decoder layer run without grad (prefill, scoring): the residual and its
    successor, the fp32 norm temporary, then the larger of attention (q, k, v, repeated k/v, output) and the MLP
    (silu(gate), up, product; a MoE block's ``top_k`` rows of input, gate_up output and product)."""
    h, i, q = spec.hidden_size, spec.intermediate_size, spec.q_dim
    attn = (3 * q + 2 * spec.kv_dim + q) * g.b_c
    mlp = 3 * i * g.b_c if spec.dense_layers else 0
    if spec.moe is not None:
        m = spec.moe
        mlp = max(mlp, m.top_k * (2 * h + 4 * m.expert_intermediate) * g.b_w + 3 * m.shared_intermediate * g.b_c)
    return 2 * g.b_res * h + 4 * h + max(attn, mlp)


def weight_bytes(spec: ModelSpec, b_w: int, *, load_in_4bit: bool = False, lora_params: int = 0,
                  b_adapter: int = 4, keep_mxfp4: bool = False) -> int:
    """T1: the stored weights. Under 4-bit NF4 with double quantisation each Linear weight but the LM head's costs
    ``NF4_BYTES_PER_PARAM`` and the embeddings, an untied ``lm_head``, norms, biases and the experts' 3-D parameters
    (not Linear layers: bitsandbytes leaves them) stay at ``b_w`` (16-bit); LoRA adapters are added at ``b_adapter``
    bytes. ``keep_mxfp4``: a gpt-oss checkpoint's experts kept in MXFP4 (``MXFP4_BYTES_PER_PARAM``; the
    inference load with transformers' MXFP4 kernels), not dequantised to ``b_w`` (``Mxfp4Config(dequantize=True)``,
    what training recipes do, and what a load without the kernels does anyway)."""
    if load_in_4bit:
        lin = spec.linear_params()
        base = math.ceil(lin * NF4_BYTES_PER_PARAM) + (spec.params - lin) * b_w
    else:
        base = spec.params * b_w
    if keep_mxfp4 and spec.moe is not None and spec.moe.mxfp4:
        m = spec.moe
        weights = spec.moe_layers * m.num_experts * 3 * m.expert_intermediate * spec.hidden_size
        base -= weights * b_w - math.ceil(weights * MXFP4_BYTES_PER_PARAM)
    return base + lora_params * b_adapter


def kv_cache_bytes(spec: ModelSpec, rows: int, tokens: int, b_k: int = 2, b_v: int = 2) -> int:
    """T9: HF ``generate``'s DynamicCache after ``tokens`` positions: ``L·n_kv·d·tokens·rows·(b_k + b_v)``
    (``2·L·n_kv·d·(P+C)·B_gen·b_kv`` of research §3 when ``b_k = b_v``); sliding-window layers keep at most the window,
    DeepSeek's latent attention the compressed latent (:meth:`ModelSpec.kv_elements`)."""
    k, v = spec.kv_elements(tokens)
    return rows * (k * b_k + v * b_v)


def head_bytes(spec: ModelSpec, N: int, *, b_c: int, b_res: int, b_w: int, head_trains: bool,
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


def rowchunk_bytes(spec: ModelSpec, N: int, rows_total: int, *, b_c: int, b_res: int, b_w: int,
                    head_trains: bool) -> dict[str, int]:
    """T8 under Unsloth's CPU backend, which routes TRL's fused head to ``cpu_chunked_log_probs``
    (``unsloth_zoo/cpu/ops.py``) over the ``N`` completion positions TRL labels (``hidden_states[mask]``, a copy).

    The rows go in chunks of ``min(N, ROWCHUNK_ELEMENTS // V)``, each an fp32 ``[rows, V]`` tile. Measured on the
    simulated device (unsloth 2026.10.9, the function alone, V 2048 to 40000, N 300 to 20000):

    - frozen head (LoRA): d log p / d hidden is computed eagerly into a saved ``grad_lp [N, h]``; the forward holds
      the logits and their softmax (two tiles), and while the second chunk is computed the first chunk's two are
      still bound (two more of the second chunk's size); the backward only rescales ``grad_lp`` (``dh`` and one
      product, ``2·N·h``), then the index's ``[B, T-1, h]`` gradient;
    - trainable head (a full fine-tune): the chunks run under activation checkpointing; three tiles in the
      forward, and in the backward 5.5 tiles of the first chunk recomputed plus 3.3 of the next, with the fp32
      weight gradient ``[V, h]``.

    Under autocast the hidden rows and the head's weight are cast to the autocast dtype first.
    """
    h, V = spec.hidden_size, spec.vocab_size
    rows = max(1, min(N, ROWCHUNK_ELEMENTS // max(1, V)))
    tile = rows * V * 4
    second = min(rows, max(0, N - rows)) * V * 4  # the next chunk, allocated while the first's tiles are bound
    gathered = N * h * b_res
    casts = (N * h * b_c + V * h * b_c) if b_c != b_res else 0
    outputs = 4 * 5 * N + 4 * 5 * rows_total  # log p, entropy and metrics per row, scattered back to [B, T-1]
    index_grad = rows_total * h * b_res  # hidden_states[mask]'s backward: a zero [B, T-1, h] filled in place
    saved = gathered + casts + outputs
    if head_trains:
        grad_weight = 4 * V * h
        backward = saved + N * h * 4 + grad_weight + int(5.5 * tile + 3.3 * second)
        end = saved + N * h * 4 + grad_weight + index_grad + (V * h * b_w if b_w != 4 else 0)
        return {"forward": saved + 3 * tile, "saved": saved, "backward": max(backward, end), "mm_buf": 0,
                "grad_weight": grad_weight}
    grad_lp = N * h * b_c
    fwd = saved + grad_lp + 2 * tile + max(2 * second, rows * h * 4)
    return {"forward": fwd, "saved": saved + grad_lp, "backward": saved + grad_lp + 2 * N * h * b_c + index_grad,
            "mm_buf": 0, "grad_weight": 0}


def logits_bytes(spec: ModelSpec, B: int, C: int, *, b_c: int, b_w: int, head_trains: bool, autocast: bool,
                  k_full: float) -> dict[str, int]:
    """T8 for TRL 0.29 to 1.14, which materialise the logits (``_get_per_token_logps_and_entropies``, TRL 1.10
    ``grpo_trainer.py``; ``selective_log_softmax``, ``trainer/utils.py:480-525``).

    Forward: the LM head runs on the last ``logits_to_keep + 1`` positions only, ``[B, C+1, V]`` in the compute dtype;
    ``logits[:, :-1] / temperature`` is a new ``[B, C, V]`` (the one autograd keeps for the log-softmax), and the
    log-softmax runs one row at a time (two fp32 ``[C, V]`` temporaries). The entropy is computed without grad in
    128-row chunks (small). Backward: ``k_full`` bytes per element of ``[B, C, V]`` in the log-softmax's dtype (fp32
    under autocast): the saved copy, the gathered and the per-row log-sum-exp gradients and their sum (measured on
    the simulated device: four such tensors at the peak), then the head's output gradient with the hidden rows' and,
    when ``lm_head`` trains, the weight's gradient.
    """
    h, V = spec.hidden_size, spec.vocab_size
    E = B * C * V
    b_sm = 4 if autocast else b_c  # autocast runs the log-softmax in fp32 (its fp32 op list), whatever b_c is
    out = B * (C + 1) * V * b_c
    scaled = E * b_c
    row = 2 * C * V * 4
    grad_hidden = B * (C + 1) * h * b_c
    grad_weight = V * h * b_w if head_trains else 0
    # the logits' gradients (measured: four [B, C, V] tensors at the peak, in fp32 under autocast), then, once they
    # are freed, the head's output gradient [B, C+1, V] with the hidden rows' and the weight's gradients
    backward = max(int(k_full * E * b_sm / 4), out + grad_hidden + grad_weight)
    return {"forward": out + scaled + row, "saved": scaled, "backward": backward, "mm_buf": 0,
            "grad_weight": grad_weight}


def optimizer_order(spec: ModelSpec, freeze_vision: bool = False) -> list[int]:
    """A full fine-tune's tensors (element counts) in the order the Trainer's optimizer steps through them: its
    weight-decay group first (the embedding, an untied head, every projection and expert weight layer by layer, the
    router, then the vision tower's weights unless frozen), then the norms and biases (transformers'
    ``get_decay_parameter_names``).

    >>> spec = ModelSpec(100, 8, 2, 2, 2, 4, 16, True)
    >>> optimizer_order(spec)[:8]
    [800, 64, 64, 64, 64, 128, 128, 128]
    """
    def lin(d: dict[str, tuple[int, int]]) -> list[int]:
        return [a * b for a, b in d.values()]

    decay = [spec.vocab_size * spec.hidden_size] * (1 if spec.tie_word_embeddings else 2)
    attn = lin(spec.attention_linears())
    decay += (attn + lin(spec.mlp_linears())) * spec.dense_layers
    m = spec.moe
    if m is not None:
        experts = [math.prod(s) for n, s in m.expert_tensors(spec.hidden_size) if "bias" not in n]
        decay += (attn + experts + [m.num_experts * spec.hidden_size] + lin(spec.moe_linears())) * spec.moe_layers
    rest = list(spec.param_tensors())
    vision = spec.vision.tensors() if spec.vision is not None else []
    del rest[len(rest) - len(vision):]
    for t in decay:  # what param_tensors() lists besides them: norms and biases
        rest.remove(t)
    if not freeze_vision:
        small = [n for n, _s, _l in vision if "bias" in n or "norm" in n or n == "ln_q"]
        decay += [math.prod(s) for n, s, _l in vision if n not in small]
        rest += [math.prod(s) for n, s, _l in vision if n in small]
    return decay + rest


def single_tensor_transient(order: list[int]) -> int:
    """Elements torch's single-tensor AdamW holds at once beyond its state (the CPU has no foreach kernels): for each
    tensor, ``exp_avg_sq.sqrt()`` and its quotient by the bias correction (the denominator), while the previous
    tensor's denominator is still bound to the loop's variable (measured on the simulated device: three times a
    tensor's size where two tensors of that size follow each other, twice where it follows a smaller one).

    >>> single_tensor_transient([16, 4, 4, 4]), single_tensor_transient([16, 16, 16, 4])
    (32, 48)
    """
    out, prev = 0, 0
    for t in order:
        out = max(out, prev + 2 * t)
        prev = t
    return out


def optimizer_bytes(optim: str, tensors: list[int], b_param: int, simulated: bool,
                     embeddings: int = 0, order: list[int] | None = None) -> tuple[int, int, str | None]:
    """T5: (state bytes, transient bytes of one step, note) for the trainable tensors (element counts).

    The first ``embeddings`` tensors are ``nn.Embedding`` weights: transformers gives them 32-bit bitsandbytes
    states (``transformers/trainer.py:1328-1339``). ``order``: the tensors in the order the optimizer steps through
    them (the Trainer's weight-decay group, then the rest; default ``tensors``), which sets torch's single-tensor
    AdamW temporaries on the CPU (``single_tensor_transient``).
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
        return state, b_param * single_tensor_transient(order or tensors), None
    # CUDA foreach path: _foreach_sqrt(exp_avg_sqs) materialises one state's worth (research §3 T5)
    return state, b_param * n, None
