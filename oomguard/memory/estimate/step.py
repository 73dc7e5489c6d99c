"""One GRPO step, read from the knobs: the regime (byte widths and switches), the batch geometry, the persistent
state (sharded across ranks where ZeRO or FSDP shard it), the autocast copies and the activations, gathered in the
``Step`` that every phase function reads.

estimate() (``peak``) reads the knobs into a Step (the regime, the batch geometry, the persistent state and the terms
several phases share); each phase function (``phases``) returns what that phase adds on top of the persistent state,
by breakdown key; ``peak._composition()`` adds the persistent state and ``peak._assemble()`` turns the phases into the
Estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...vocab.distributed import buffer_elements
from ...vocab.knobs import TRL_DEFAULTS, Knobs
from .arch import DTYPE_ALIASES, DTYPE_BYTES, EstimateError
from .coefficients import Coefficients
from .model import ModelSpec, lora_targets
from .terms import (
    Regime,
    activation_bytes_per_token,
    head_bytes,
    logits_bytes,
    moe_bytes_per_token,
    optimizer_bytes,
    optimizer_order,
    rowchunk_bytes,
    weight_bytes,
)
from .vision import Images, merger_bytes_per_patch, pixel_bytes, prompt_patches, vision_bytes_per_patch
from .zero3 import prefetched_live

DEFAULT_PROMPT_TOKENS = 256
# DeepSpeed ZeRO-3's sub_group_size default (elements): the optimizer steps the partition one sub-group at a time
ZERO3_SUB_GROUP = 1_000_000_000


def with_trl_defaults(knobs: Knobs) -> Knobs:
    return TRL_DEFAULTS.merged(knobs)


def dtype_name(knobs: Knobs, spec: ModelSpec, keeps_dtype_4bit: bool = False) -> str:
    d = knobs.dtype or "float32"
    d = DTYPE_ALIASES.get(d, d)
    if d == "auto":  # transformers 5.x from_pretrained dtype="auto": the checkpoint's dtype
        d = spec.checkpoint_dtype or "bfloat16"
    if d not in DTYPE_BYTES:
        raise EstimateError(f"dtype must be one of {', '.join(DTYPE_BYTES)} or auto, not {knobs.dtype!r}")
    if knobs.load_in_4bit and d == "float32" and not keeps_dtype_4bit:
        # oomguard's 4-bit load forces a 16-bit dtype (child/patches.py, from_pretrained patch); a loader that keeps
        # the dtype asked (Unsloth's FastLanguageModel, RunFacts.load_takes_4bit) leaves its other modules in float32
        d = "bfloat16"
    return d


def regime_of(spec: ModelSpec, k: Knobs, simulated: bool, keeps_dtype_4bit: bool = False,
            target_parameters: tuple[str, ...] | None = None, lora_dropout: float = 0.0) -> Regime:
    """The byte widths and switches the knobs imply. A 4-bit load without LoRA has nothing to train: an error.
    ``target_parameters``: PEFT's ``target_parameters`` (expert parameters named by the user); ``lora_dropout``: the
    user's LoRA's dropout (oomguard's own LoRA has none)."""
    b_w = DTYPE_BYTES[dtype_name(k, spec, keeps_dtype_4bit)]
    quant4 = bool(k.load_in_4bit)
    r = int(k.lora_r or 0)
    lora = r > 0
    if quant4 and not lora:
        raise EstimateError("load_in_4bit needs LoRA (lora_r > 0): a purely quantised model cannot be trained")
    # Mixed precision is what the script asked for: TRL's bf16=True default autocasts matmuls to bf16, on a GPU and
    # on the CPU (accelerate's autocast on the simulated device too); fp16=True autocasts on a GPU only (accelerate
    # turns native AMP off for fp16 on the CPU: ms-swift's fp16 for a float32 checkpoint computes in float32 there);
    # bf16=False and fp16=False compute in the weights' dtype. PEFT upcasts adapters to fp32
    # (autocast_adapter_dtype=True); TRL casts them to bf16 under 4-bit (grpo_trainer.py:532-541).
    autocast = bool(k.bf16 or (k.fp16 and not simulated))
    rows = tuple(lora_targets(spec, r, k.lora_target_modules, target_parameters)) if lora else ()
    names = {t.name for t in rows if t.where in ("attention", "mlp", "moe") and t.kind == "linear"}
    names |= {"experts" for t in rows if t.where == "experts"} | {"vision" for t in rows if t.where == "vision"}
    return Regime(b_w=b_w, b_res=b_w, b_c=2 if autocast else b_w, autocast=autocast,
                   autocast_cast=autocast and b_w == 4, simulated=simulated, quant4=quant4, lora=lora, r=r,
                   targets=frozenset(names), b_a=2 if quant4 else 4, lora_targets=rows,
                   dropout=lora and lora_dropout > 0)


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


def geometry_of(k: Knobs, world_size: int, prompt_tokens: int | None, image_tokens: int = 0) -> _Geometry:
    """The batch geometry as TRL resolves it; P defaults to ``max_prompt_tokens`` or 256 and never exceeds it, then
    the images' tokens are added (``image_tokens`` per prompt)."""
    B, ga, spg = k.geometry(world_size)
    P = prompt_tokens if prompt_tokens is not None else (k.max_prompt_tokens or DEFAULT_PROMPT_TOKENS)
    if k.max_prompt_tokens:
        P = min(P, k.max_prompt_tokens)
    C = int(k.max_completion_length or 512)
    if B <= 0 or P <= 0 or C <= 0:
        raise EstimateError(f"batch, prompt and completion sizes must be positive (B={B}, P={P}, C={C})")
    return _Geometry(B=B, ga=ga, spg=spg, P=P + image_tokens, C=C)


@dataclass(frozen=True)
class _Persistent:
    """T1-T5: what lives on the device across the step (per device once :func:`sharded`), and the counts."""

    weights: int
    reference: int
    grads: int  # from the first backward to zero_grad
    opt_state: int
    opt_transient: int  # one optimizer step's temporaries
    gather: int  # ZeRO-3 / offloaded parameters: one gathered layer (and its gradient)
    # ZeRO-3 on several ranks, generating with the trainer's model: the parameters gathered on top of the rank's
    # partition while generate runs (in place of ``gather``): the whole model with ds3_gather_for_generation, else the
    # most that DeepSpeed's prefetcher holds at once (zero3.py)
    gen_gather: int
    buckets: int  # gradient buffers kept all the step: DDP's buckets (several ranks, no ZeRO), ZeRO-3's reduce bucket
    ds_bucket: int  # ZeRO-1/2's reduce bucket(s): allocated at a backward's first gradient, freed at its end
    trainable: int
    largest: int  # elements of the largest trainable tensor (ZeRO-2's partition boundaries)
    b_t: int  # bytes per trainable element (its gradient's dtype)
    total_params: int
    notes: tuple[str, ...]


def _trainable(spec: ModelSpec, g: Regime, freeze_vision: bool = False) -> tuple[int, list[int], int]:
    """T3: (trainable parameters, element counts of the trainable tensors, their bytes per element). A full
    fine-tune trains every parameter, the vision tower's too unless the script froze it (``freeze_vision``)."""
    if not g.lora:
        tensors = spec.param_tensors()
        if freeze_vision and spec.vision is not None:
            tensors = tensors[:len(tensors) - len(spec.vision.tensors())]
            return spec.params - spec.vision_params, tensors, g.b_w
        return spec.params, tensors, g.b_w
    tensors = [n for t in g.lora_targets for n in t.tensors for _ in range(t.count)]
    return sum(t.params for t in g.lora_targets), tensors, g.b_a


def persistent_of(spec: ModelSpec, k: Knobs, g: Regime, freeze_vision: bool = False,
                keep_mxfp4: bool = False) -> _Persistent:
    """T1 weights, T2 reference, T4 gradients and T5 optimizer on one device, before any sharding."""
    trainable, train_tensors, b_t = _trainable(spec, g, freeze_vision)
    n_lora = trainable if g.lora else 0
    n_emb = 0 if g.lora else 1  # param_tensors() lists embed_tokens first (an untied lm_head is an nn.Linear)
    opt_state, opt_transient, note = optimizer_bytes(str(k.optim or "adamw_torch_fused"), train_tensors, b_t,
                                                      g.simulated, embeddings=n_emb,
                                                      order=None if g.lora else optimizer_order(spec, freeze_vision))
    return _Persistent(
        weights=weight_bytes(spec, g.b_w, load_in_4bit=g.quant4, lora_params=n_lora, b_adapter=g.b_a,
                              keep_mxfp4=keep_mxfp4),
        reference=spec.params * g.b_w if float(k.beta or 0.0) > 0 and not g.lora else 0,
        grads=trainable * b_t, opt_state=opt_state, opt_transient=opt_transient, gather=0, gen_gather=0, buckets=0,
        ds_bucket=0,
        trainable=trainable, largest=max(train_tensors, default=0), b_t=b_t,
        total_params=spec.params + n_lora, notes=(note,) if note else ())


def sharded(p: _Persistent, spec: ModelSpec, k: Knobs, g: Regime, world_size: int) -> _Persistent:
    """DeepSpeed ZeRO stages and CPU offload: each stage divides one more term by the number of devices; offloaded
    parameters leave one gathered layer on the device.

    What DeepSpeed 0.19 adds (``runtime/zero/stage_1_and_2.py``, ``stage3.py``; measured per rank on the simulated
    device with two ranks, ``bench/zero_calibrate.py``): the optimizer runs on a flat **fp32 master copy** of the
    rank's partition (``single_partition_of_fp32_groups``), kept whatever the model's dtype, so its states are
    fp32 and its temporaries are those of one tensor the size of the partition; ZeRO-1/2 gather the partition's
    gradients into ``grads_in_partition`` sized by the parameters that *start* in the partition (one parameter
    beyond the even share) and flatten them again into fp32 for the step (``single_grad_partition``).

    DeepSpeed's own buffers, sized by the config or by DeepSpeed's defaults where it is silent (:func:`_ds_buffers`):
    ZeRO-1/2 allocate ``reduce_bucket_size`` elements of the gradients' dtype at a backward's first gradient
    (``setup_buckets``), two with ``overlap_comm``, and free them when the backward ends; ZeRO-3 allocates one such
    bucket with the optimizer and keeps it, and keeps whole on every rank each parameter smaller than
    ``stage3_param_persistence_threshold``.

    Generation under ZeRO-3 with ``ds3_gather_for_generation`` (TRL's default) gathers every parameter on every rank
    for the whole of ``generate`` (``unwrap_model_for_generation``, ``GatheredParameters`` over the model): a full
    copy of every parameter not kept whole comes on top of the rank's partition, which stays. Turned off, the
    forward's hooks gather per submodule, but DeepSpeed's prefetcher runs ahead of them in every decode step, so much
    of the model is gathered at once all the same (:mod:`.zero3`). With vLLM generating, the trainer's model is not
    gathered for it. Measured per rank and per phase on two CPU ranks: ``bench/zero_calibrate.py``."""
    zs = int(k.zero_stage or 0)
    n_dev = max(1, world_size)
    weights, reference, grads, opt_state, opt_transient = p.weights, p.reference, p.grads, p.opt_state, p.opt_transient
    notes = list(p.notes)
    if zs >= 1:
        flat = -(-p.trainable // n_dev)  # the rank's share of the flat parameter groups
        opt_state, opt_transient, _ = optimizer_bytes(str(k.optim or "adamw_torch_fused"), [flat], 4, g.simulated)
        opt_state += 4 * flat  # the fp32 master partition
        # the gradients flattened into fp32 for the step: ZeRO-1/2's single_grad_partition; ZeRO-3's
        # _prepare_fp32_grad_for_sub_group, one optimizer sub-group at a time (measured: the deep model's SGD step,
        # 20.4 MiB on top of its 61.4 MiB)
        opt_transient += 4 * (flat if zs < 3 else min(flat, ZERO3_SUB_GROUP))
    if zs >= 2:
        grads = p.b_t * min(p.trainable, flat + p.largest) if zs == 2 else grads // n_dev
    if zs >= 3:
        weights //= n_dev
        reference //= n_dev
    bucket, ipg, persistent = _ds_buffers(p, spec, k, g, zs)
    if zs >= 3 and n_dev > 1:  # parameters below the persistence threshold stay whole on every rank
        weights += persistent * g.b_w - persistent * g.b_w // n_dev
    # The simulated device is the CPU's memory: what a rung offloads to the CPU stays on it, counted as before.
    offload_opt = bool(k.offload_optimizer or k.fsdp_offload) and not g.simulated
    offload_params = bool(k.offload_params or k.fsdp_offload) and not g.simulated
    if (k.offload_optimizer or k.offload_params or k.fsdp_offload) and g.simulated:
        notes.append("the simulated device counts CPU memory: offloading to the CPU frees nothing on it")
    if offload_opt:
        opt_state, opt_transient = 0, 0
        notes.append("optimizer state offloaded to the CPU")
    if offload_params:
        weights = reference = 0
        notes.append("parameters offloaded to the CPU: only the gathered layer is on the device")
    if k.offload_optimizer or k.offload_params or k.fsdp_offload:
        notes.append("offload is modelled roughly")
    elif zs and not g.simulated:
        notes.append("ZeRO's buffers are fitted on CPU ranks; NCCL's buffers on a GPU are not counted")
    gather = 2 * g.b_w * spec.largest_layer_params() if zs >= 3 or offload_params else 0
    gen_gather = 0
    # one rank gathers nothing, unless its parameters wait on the CPU (DeepSpeed moves them to the device whole)
    if zs >= 3 and (n_dev > 1 or offload_params) and not k.use_vllm:
        if k.ds3_gather_for_generation is not False:
            gen_gather = max(0, p.weights - persistent * g.b_w)  # GatheredParameters: every partitioned one, in full
        else:
            h = spec.hidden_size
            gen_gather = prefetched_live(
                spec, tuple(sorted(g.targets)), g.r, g.b_w, g.b_a,
                buffer_elements("stage3_prefetch_bucket_size", k.stage3_prefetch_bucket_size, h),
                buffer_elements("stage3_param_persistence_threshold", k.stage3_param_persistence_threshold, h))
    # Several ranks without ZeRO: DistributedDataParallel allocates its gradient buckets when it wraps the model
    # (a flat copy of every trainable gradient) and keeps them; measured on the simulated device with two ranks
    # (the wide model: 121.7 MiB at train begin for 60.8 MiB of float32 weights).
    buckets = p.grads if n_dev > 1 and not zs and not k.fsdp_offload else ipg
    if bucket + ipg >= 64 * 2**20 and k.reduce_bucket_size is None:
        notes.append(f"DeepSpeed's reduce bucket: {(bucket or ipg) / 2**20:.0f} MiB per rank (reduce_bucket_size "
                     "left to DeepSpeed's default; \"auto\" sizes it to the model)")
    return replace(p, weights=weights, reference=reference, grads=grads, opt_state=opt_state,
                   opt_transient=opt_transient, gather=gather, gen_gather=gen_gather, buckets=buckets,
                   ds_bucket=bucket,
                   notes=tuple(notes))


def _ds_buffers(p: _Persistent, spec: ModelSpec, k: Knobs, g: Regime, zs: int) -> tuple[int, int, int]:
    """DeepSpeed's buffers under ZeRO stage ``zs``: (ZeRO-1/2's reduce bucket bytes, during a backward; ZeRO-3's
    reduce bucket bytes, kept; ZeRO-3's persistent parameter elements, kept whole on every rank)."""
    if not zs:
        return 0, 0, 0
    h = spec.hidden_size
    rb = buffer_elements("reduce_bucket_size", k.reduce_bucket_size, h) * p.b_t
    if zs < 3:
        overlap = bool(k.overlap_comm)  # DeepSpeed's default: off below ZeRO-3
        return rb * (2 if overlap else 1), 0, 0
    threshold = buffer_elements("stage3_param_persistence_threshold", k.stage3_param_persistence_threshold, h)
    persistent = sum(t for t in spec.param_tensors() if t < threshold)
    return 0, rb, persistent


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
    experts: int = 0  # one MoE layer's adapted experts, materialised by PEFT while the layer runs (no-grad passes)


def casts_of(spec: ModelSpec, g: Regime, gc: bool, gather: int) -> _Casts:
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
    linears = [a * b for a, b in spec.projections().values()] + [a * b for a, b in spec.moe_linears().values()]
    biggest = max(linears)
    cached = g.autocast_cast and not g.lora
    # the experts' grouped matmul is not cast by autocast (it runs in the weights' dtype): only Linear weights are
    cast_all = 2 * spec.linear_params() if g.autocast_cast else 0
    cast_one = 2 * biggest if g.autocast_cast else 0
    # 4-bit: bitsandbytes dequantises one weight at a time (forward and the input-gradient backward)
    dequant = 2 * max(linears) if g.quant4 else 0
    return _Casts(cached=cached, all=cast_all, layer=cast_all // max(1, L), one=cast_one,
                  head=2 * spec.vocab_size * spec.hidden_size if g.autocast_cast else 0,  # generate's lm_head
                  nograd=cast_all if cached else cast_one, fwd=cast_all if (cached or not gc) else cast_one,
                  transient_w=dequant + gather, experts=_expert_copy(spec, g))


def _expert_copy(spec: ModelSpec, g: Regime) -> int:
    """LoRA on experts (PEFT's ``ParamWrapper``): while a MoE block runs, PEFT registers a parametrization that
    returns ``W + scale·B·A`` (``torch.baddbmm``, ``_LoraFactorsProxy``, in the weight's dtype) for each adapted
    3-D parameter, a full-size copy of that layer's adapted experts, which the grouped matmul keeps for backward."""
    if spec.moe is None:
        return 0
    shapes = dict(spec.moe.expert_tensors(spec.hidden_size))
    return sum(math.prod(shapes[t.name]) * g.b_w for t in g.lora_targets if t.where == "experts")


@dataclass(frozen=True)
class _Activations:
    """T7 and the batch buffers: the activation terms the training phases share."""

    A: int  # one layer's saved activations (the largest layer's)
    stored: int  # every layer's (or, checkpointed, every layer input), the vision tower's included
    mask: int  # bool SDPA mask with padding (shared by the layers; one per attention type)
    final_norm: int  # the final norm's saved fp32 input and normalised copy (when it trains)
    final_out: int  # its output, until the head has copied the rows it scores
    batch_buf: int  # the buffered generation batch (with its images' pixel values)
    grad_tr: int  # one layer's backward gradient buffers
    vision_layer: int = 0  # one vision block's saved activations (recomputed in backward under checkpointing)
    vision_stored: int = 0  # the vision tower's part of ``stored`` (alive until the backward reaches the tower)


def activations_of(spec: ModelSpec, g: Regime, geo: _Geometry, co: Coefficients, gc: bool,
                 images: Images | None = None, freeze_vision: bool = False) -> _Activations:
    """T7 for one micro-batch, with checkpointing keeping only the layer inputs ``L·B·T·h·b_res``.

    A model with MoE layers stores each kind's own (:func:`terms._moe_bytes_per_token`); eager attention (gpt-oss)
    adds each layer's ``[B, heads, T, T+1]`` probabilities (softmax saves them); LoRA on experts adds each MoE layer's
    materialised expert weights (:func:`_expert_copy`); a vision tower its blocks' activations for the micro-batch's
    images (:func:`.vision.vision_bytes_per_patch`)."""
    h, L, tokens = spec.hidden_size, spec.num_layers, geo.tokens
    per_layer = _attention_matrix(spec, g, geo)
    A_dense = int(tokens * (co.c_act * activation_bytes_per_token(spec, g))) + per_layer if spec.dense_layers else 0
    A_moe = 0
    if spec.moe is not None:
        whole = activation_bytes_per_token(spec, g, moe=True)
        block = moe_bytes_per_token(spec, g, _no_consumers)  # itemised exactly (measured): not scaled by c_act
        A_moe = int(tokens * (co.c_act * (whole - block) + block)) + per_layer
        A_moe += _expert_copy(spec, g)
    A = max(A_dense, A_moe)
    ckpt = tokens * h * g.b_res  # one checkpointed layer input
    stored = L * ckpt if gc else spec.dense_layers * A_dense + spec.moe_layers * A_moe
    if spec.moe is not None and spec.moe.router_logits:  # the auxiliary loss: each MoE layer's logits and softmax
        stored += spec.moe_layers * tokens * spec.moe.num_experts * 2 * g.b_c
    v_layer = v_stored = 0
    v = spec.vision
    if v is not None and images is not None and images.per_prompt > 0:
        patches = geo.B * prompt_patches(v, images)
        trains = not g.lora and not freeze_vision
        per = vision_bytes_per_patch(v, b_c=g.b_c, b_res=g.b_res, trains=trains, adapted="vision" in g.targets)
        v_layer = patches * per  # itemised and measured for the tower itself: not scaled by c_act
        if per:
            merger = patches * merger_bytes_per_patch(v, b_c=g.b_c, b_res=g.b_res, trains=trains)
            v_stored = v.depth * (patches * v.hidden * g.b_res if gc else v_layer) + merger
            stored += v_stored
    masks = 2 if spec.sliding_layers and spec.sliding_layers < L else 1
    return _Activations(
        A=A, stored=stored, mask=masks * geo.B * geo.T * geo.T,
        final_norm=tokens * h * (4 + (g.b_res if not g.lora else 0)), final_out=tokens * h * g.b_res,
        # prompt/completion ids and masks (int64), old/ref log-probs and advantages, the images' pixel values
        batch_buf=geo.B_gen * (32 * geo.T + 8 * geo.C) + (
            geo.B_gen * pixel_bytes(v, images) if v is not None and images is not None else 0),
        # the gradient buffers of the MLP backward (grad of the product, silu and up) and of the residual stream, or
        # of an attention that keeps its probabilities: their gradient and the scores' (softmax's backward)
        grad_tr=max(int(co.c_act * tokens * (3 * _mlp_width(spec) * g.b_c + 2 * h * 4)), 2 * per_layer),
        vision_layer=v_layer,
        vision_stored=v_stored)


def _no_consumers(width: int, modules: tuple[str, ...], b_x: int) -> int:
    return 0


def _attention_matrix(spec: ModelSpec, g: Regime, geo: _Geometry) -> int:
    """The attention probabilities one layer keeps for backward, ``[B, heads, T, T]``, where attention materialises
    them: eager attention (gpt-oss has no SDPA path; its sink logit makes ``T + 1`` columns), or SDPA's math kernel,
    which torch picks on the CPU when the keys' head size differs from the values' (DeepSeek's latent attention:
    ``qk_nope + qk_rope`` against ``v_head_dim``; measured on the simulated device). 0 where SDPA's fused kernels run
    (on a GPU the memory-efficient kernel takes differing head sizes)."""
    if spec.eager_attention:
        return geo.B * spec.num_heads * geo.T * (geo.T + 1) * g.b_c
    if spec.mla is not None and spec.mla.qk_head_dim != spec.mla.v_head_dim and g.simulated:
        return geo.B * spec.num_heads * geo.T * geo.T * g.b_c
    return 0


def _mlp_width(spec: ModelSpec) -> int:
    """The widest MLP activation per token: the dense MLP's, or a MoE block's ``top_k`` experts and shared experts."""
    dense = spec.intermediate_size if spec.dense_layers else 0
    if spec.moe is None:
        return dense
    return max(dense, spec.moe.top_k * spec.moe.expert_intermediate + spec.moe.shared_intermediate)


@dataclass(frozen=True)
class Step:
    """Everything the phase functions read."""

    spec: ModelSpec
    k: Knobs
    co: Coefficients
    g: Regime
    geo: _Geometry
    p: _Persistent
    casts: _Casts
    acts: _Activations
    context: int | None = None  # the device's memory outside the allocator, when known (see estimate())
    lm_head: str = "fused"  # the LM head the run has (RunFacts.trl_head, vocab/trlrange.py HEADS)
    images: Images | None = None  # the images of each prompt (a vision-language model)
    freeze_vision: bool = False  # the script froze the vision tower (a full fine-tune trains it otherwise)

    def head(self) -> dict[str, int]:
        """T8 over the training micro-batch. TRL 1.15 on: the fused, chunked head (Triton on CUDA scores only the
        completion positions, the CPU fallback every one). TRL 0.29 to 1.14: materialised logits over the completion
        positions, or Liger's chunked GRPO loss with ``use_liger_kernel``. Unsloth's CPU backend: its row-chunked head
        over the completion positions."""
        geo, g = self.geo, self.g
        if self.lm_head == "rowchunk":
            return rowchunk_bytes(self.spec, geo.B * geo.C, geo.B * (geo.T - 1), b_c=g.b_c, b_res=g.b_res,
                                   b_w=g.b_w, head_trains=not g.lora)
        if self.lm_head == "logits" and self.k.use_liger_kernel:
            # Liger's LigerFusedLinearGRPOLoss (liger-kernel 0.8: sequence x vocabulary chunks, fp32 running
            # statistics, the hidden rows' and the weight's gradients computed chunk by chunk): bounded like TRL 1.15's
            # head on a GPU, over the completion positions. Not measured here: Liger needs Triton on a GPU.
            return head_bytes(self.spec, geo.B * geo.C, b_c=g.b_c, b_res=g.b_res, b_w=g.b_w, head_trains=not g.lora,
                               fallback=False, k_logits=self.co.k_logits)
        if self.lm_head == "logits":
            return logits_bytes(self.spec, geo.B, geo.C, b_c=g.b_c, b_w=g.b_w, head_trains=not g.lora,
                                 autocast=g.autocast, k_full=self.co.k_full_logits)
        N = geo.B * (geo.T - 1) if g.simulated else geo.B * geo.C
        return head_bytes(self.spec, N, b_c=g.b_c, b_res=g.b_res, b_w=g.b_w, head_trains=not g.lora,
                           fallback=g.simulated, k_logits=self.co.k_logits)

    @property
    def zero3_grads(self) -> int:
        """ZeRO-3's flat gradient partition: DeepSpeed allocates it with the optimizer and keeps it on the device in
        every phase (``grad_partitions_flat_buffer``, stage3.py; on the CPU with optimizer offload). Measured per rank
        on two CPU ranks: the scoring phase holds it (the tiny model: 7.6 MiB, the deep one 20.4 MiB)."""
        zero3 = int(self.k.zero_stage or 0) >= 3 and not (self.k.offload_optimizer and not self.g.simulated)
        return self.p.grads if zero3 else 0

    @property
    def grads_at_gen(self) -> int:
        """Gradients alive while generating: generation inside an accumulation window (steps_per_generation < GA), or
        ZeRO-3's flat gradient partition (:attr:`zero3_grads`)."""
        return self.p.grads if self.geo.ga > self.geo.spg else self.zero3_grads

    @property
    def head_gathered(self) -> int:
        """What ZeRO-3 holds gathered at the end of the forward and in the LM head's backward: the head's weight alone
        (the tied embedding or ``lm_head``); every decoder layer was released after its forward, and a checkpointed
        layer is gathered again only for its own backward (measured: the tiny and deep models' training peak is the
        head's backward, with the embedding gathered and no layer)."""
        if int(self.k.zero_stage or 0) < 3 or not self.p.gather:
            return self.p.gather
        return self.spec.vocab_size * self.spec.hidden_size * self.g.b_w
