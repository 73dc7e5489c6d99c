"""The four phases of a GRPO step (research §2): generation, scoring, the training forward and backward, and the
optimizer step; and, for a run that evaluates, the evaluation pass. Each function returns what its phase adds on top
of the persistent state, by breakdown key.
"""

from __future__ import annotations

from dataclasses import replace

from .step import Step, activations_of
from .terms import kv_cache_bytes, nograd_bytes_per_token

PHASES = ("generation", "scoring", "forward_backward", "optimizer")
EVAL_PHASE = "evaluation"


def _generation(s: Step) -> dict[str, int]:
    """HF ``generate`` (GC is off while generating, trl/models/utils.py:136-154): T9's KV cache and the larger of
    the prefill and the decode-step transients; nothing with vLLM, whose memory is outside torch's allocator, nor with
    transformers' continuous batching, whose paged cache is sized from the free memory (``peak._paged``)."""
    spec, g, geo, c = s.spec, s.g, s.geo, s.casts
    if s.k.use_vllm or s.k.use_transformers_continuous_batching:
        kv_cache = gen_transient = 0
    else:
        B_gen, P, V, L = geo.B_gen, geo.P, spec.vocab_size, spec.num_layers
        b_k, b_v = max(g.b_c, g.b_res), g.b_c  # RoPE with fp32 cos/sin promotes k to fp32 under autocast from fp32
        kv_cache = kv_cache_bytes(spec, B_gen, geo.T, b_k, b_v)
        kv_prefill = kv_cache_bytes(spec, B_gen, P, b_k, b_v)
        prefill = (B_gen * P * nograd_bytes_per_token(spec, g) + B_gen * P * P + kv_prefill
                   + B_gen * V * (g.b_c + 8) + _vision_nograd(s, B_gen))
        decode = kv_cache + kv_cache // max(1, L) + 16 * B_gen * V + B_gen * (spec.hidden_size * 8 + V * g.b_c)
        gen_transient = max(prefill, decode) - kv_cache  # kv_cache itself is reported apart
    # ZeRO-3 on several ranks: what generate gathers replaces the one gathered layer of the training forward
    gathered = c.transient_w - s.p.gather + s.p.gen_gather if s.p.gen_gather else c.transient_w
    return {"weights": (c.all + c.head if c.cached else max(c.head, c.one)) + gathered + c.experts,
            "gradients": s.grads_at_gen, "kv_cache": kv_cache + max(0, gen_transient),
            "activations": geo.B_gen * geo.T * 16 + _pixels(s)}


def _vision_nograd(s: Step, rows: int) -> int:
    """The vision tower run without grad over ``rows`` prompts' images (generate's prefill, scoring): the pixel
    values cast to the weights' dtype, the residual stream and one block's transient (its q, k, v in fp32 for the
    rotary embedding, or its MLP), and the merged image features handed to the decoder."""
    v, images = s.spec.vision, s.images
    if v is None or images is None or images.per_prompt <= 0:
        return 0
    from .vision import prompt_patches, prompt_tokens_of_images

    n = rows * prompt_patches(v, images)
    b = s.g.b_c
    block = max(3 * v.hidden * (b + 8), 3 * v.intermediate * b)
    tokens = rows * prompt_tokens_of_images(v, images)
    return n * (2 * v.hidden * s.g.b_res + 4 * v.hidden + block) + tokens * v.out_hidden * s.g.b_res


def _pixels(s: Step) -> int:
    """The generation batch's pixel values as the processor returned them (``_tokenize_prompts``), alive through
    generation and scoring beside the copy the buffered batch keeps."""
    v, images = s.spec.vision, s.images
    if v is None or images is None:
        return 0
    from .vision import pixel_bytes

    return s.geo.B_gen * pixel_bytes(v, images)


def _scoring(s: Step) -> dict[str, int]:
    """Old log-probs (GA not a multiple of steps_per_generation, or vLLM importance sampling) and/or reference
    log-probs (beta > 0): no grad, in chunks of per_device_train_batch_size (grpo_trainer.py:2642-2737). Without
    either, only the buffered batch."""
    geo = s.geo
    if not (float(s.k.beta or 0.0) > 0 or (geo.ga % geo.spg != 0) or bool(s.k.use_vllm)):
        return {"gradients": s.grads_at_gen, "activations": s.acts.batch_buf + _pixels(s)}
    out = {**_nograd_forward(s), "gradients": s.grads_at_gen}
    out["activations"] += _pixels(s)
    return out


def _nograd_forward(s: Step) -> dict[str, int]:
    """A forward without gradients over the micro-batch (log-probs for scoring, evaluation's loss): its transient
    activations, the mask, two residual copies and the head's forward."""
    geo, a = s.geo, s.acts
    score_act = (int(geo.tokens * nograd_bytes_per_token(s.spec, s.g)) + a.mask
                 + geo.tokens * s.spec.hidden_size * s.g.b_res * 2 + _vision_nograd(s, geo.B))
    return {"weights": s.casts.nograd + s.casts.transient_w + s.casts.experts, "activations": a.batch_buf + score_act,
            "logits": s.head()["forward"]}


def _forward_backward(s: Step) -> dict[str, int]:
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
        "backward_end": ({"activations": own_acts + a.grad_tr + a.mask + a.vision_stored,
                          "gradients": grads_new * grads, "weights": c.layer}),
        # the embedding's backward, after the first layer's has freed its activations: a tied embedding's dense
        # gradient [V, h] is a temporary that AccumulateGrad adds into the lm_head's in place
        "embedding_backward": ({"activations": 0,
                                "gradients": grads_new * grads + (V * h * g.b_w if not g.lora
                                                                  and spec.tie_word_embeddings else 0)}),
    }
    if a.vision_stored:  # the vision tower's backward, last: its blocks' activations (one recomputed), all gradients
        cands["vision_backward"] = {"activations": a.vision_stored + a.vision_layer * (2 if gc else 1),
                                    "gradients": grads_new * grads}
    for moment in ("layer_backward", "backward_end", "embedding_backward"):  # after the first gradient is ready
        cands[moment]["gradients"] = cands[moment].get("gradients", 0) + s.p.ds_bucket
    # ZeRO-3: before the layers' backward the flat gradient partition already exists (the later moments count it as
    # the gradients), and of the parameters only the head's is gathered
    head_w = c.transient_w - s.p.gather + s.head_gathered
    for moment in ("forward", "head_backward"):
        cands[moment]["gradients"] = cands[moment].get("gradients", 0) + (0 if grads_before else s.zero3_grads)
        cands[moment]["weights"] = cands[moment].get("weights", 0) + head_w
    for moment in ("layer_backward", "backward_end", "embedding_backward"):
        cands[moment]["weights"] = cands[moment].get("weights", 0) + c.transient_w
    for cand in cands.values():
        cand["activations"] += a.batch_buf
        cand["gradients"] = cand.get("gradients", 0) + grads_before
    return max(cands.values(), key=lambda cand: sum(cand.values()))


def _optimizer_step(s: Step) -> dict[str, int]:
    """``optimizer.step()``: every gradient, the step's temporaries and the buffered batch."""
    return {"gradients": s.p.grads, "optimizer": s.p.opt_transient, "activations": s.acts.batch_buf}


def evaluation_terms(s: Step) -> dict[str, int]:
    """One evaluation pass (``Trainer.evaluate``, GRPO's ``prediction_step``): ``per_device_eval_batch_size`` rows
    generated at once, then scored and their loss computed without gradients, in one batch (no buffering, no
    accumulation: grpo_trainer.py ``_prepare_inputs``). It runs between optimizer steps, after ``zero_grad`` has freed
    the gradients, with the optimizer state in place: the larger of its generation and its no-grad forward."""
    B_e = s.k.eval_geometry()[0]
    geo = replace(s.geo, B=B_e, ga=1, spg=1)
    e = replace(s, geo=geo, acts=activations_of(s.spec, s.g, geo, s.co, bool(s.k.gradient_checkpointing),
                                             s.images, s.freeze_vision))
    gen, fwd = _generation(e), _nograd_forward(e)
    # The layers' transients are gone by the time the head runs over the last hidden states: the pass holds the
    # larger of the two, not both (measured on the simulated device: the sum over-predicted a 16-row pass by 10%)
    layers = fwd["activations"] - e.acts.batch_buf
    fwd["activations"] = e.acts.batch_buf + max(0, layers - fwd["logits"])
    larger = max(gen, fwd, key=lambda parts: sum(parts.values()))
    out = dict(larger)
    out["activations"] = out.get("activations", 0) + s.acts.batch_buf  # the last training batch stays buffered
    return out


PHASE_TERMS = {"generation": _generation, "scoring": _scoring, "forward_backward": _forward_backward,
                "optimizer": _optimizer_step}
