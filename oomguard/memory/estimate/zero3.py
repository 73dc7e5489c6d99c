"""ZeRO-3's parameters while HF ``generate`` runs: what a rank gathers on top of its own partition.

With ``ds3_gather_for_generation=True`` (TRL's default), ``unwrap_model_for_generation`` (trl/models/utils.py) enters
``deepspeed.zero.GatheredParameters(model.parameters())`` and removes DeepSpeed's hooks: every parameter that is not
kept whole (``stage3_param_persistence_threshold``) is all-gathered into a new full-size tensor
(``_allgather_params_coalesced``, partition_parameters.py) while the rank's partition stays where it is, for the whole
of ``generate``. So a rank holds its partition *and* the full model (less what is kept whole anyway).

With ``ds3_gather_for_generation=False`` the forward's hooks gather per submodule, and DeepSpeed's prefetcher runs
ahead of them. Every decode step is one forward (``reset_step`` at its end, parameter_offload.py
``_end_of_forward_hook``), so after the first decode step the module trace is complete and each submodule call
(``PartitionedParameterCoordinator.fetch_sub_module``, partitioned_param_coordinator.py) pre-fetches at least one more
parameter from the queue, up to ``stage3_prefetch_bucket_size`` elements per call and ``stage3_max_live_parameters``
live in all. A Llama layer makes 13 submodule calls (the layer, two norms, the attention and the MLP, the seven
projections, the activation) for seven projection weights, so the prefetch front overtakes the forward: measured on
two CPU ranks (bench/zero_calibrate.py), the tests' tiny model (4 layers) holds 2.97M of its 3.99M gathered elements
at once while generating (this simulation: 3.04M), the wide one (1 layer) all of them. A parameter is released after
its module runs unless it is used again later in the forward (the tied embedding stays until ``lm_head``).
:func:`prefetched_live` replays that algorithm on the model's module order.
"""

from __future__ import annotations

import functools
import math
from collections import deque

from .model import ModelSpec

# DeepSpeed 0.19's default for stage3_max_live_parameters (the config's key is not read: oomguard does not set it)
MAX_LIVE_PARAMETERS = 1_000_000_000


def _trace(spec: ModelSpec, lora: tuple[str, ...], r: int, b_w: int, b_a: int) -> list[list[tuple[str, int, int]]]:
    """One decode forward's submodule calls in order (HF Llama/Qwen2/Mistral/Qwen3 under DeepSpeed's hooks; the
    experts of a MoE layer as one call, its shared experts as an MLP), each
    with its own parameters ``(name, elements, bytes per element)``; under PEFT each targeted projection is a LoRA
    layer that calls its base layer, its dropout, ``lora_A`` and ``lora_B``."""
    h, V = spec.hidden_size, spec.vocab_size
    embed = ("embed_tokens", V * h, b_w)
    calls: list[list[tuple[str, int, int]]] = ([[]] * (2 if lora else 0)  # PeftModel, LoraModel
                                               + [[], [], [embed], []])  # ForCausalLM, Model, embed_tokens, rotary
    attn = spec.attention_linears()
    qkv = ("q_proj", "k_proj", "v_proj", "qkv_proj")
    for layer in range(spec.num_layers):
        moe = spec.moe is not None and layer >= spec.dense_layers  # the MoE layers, after any dense ones
        shapes = {**attn, **(spec.moe_linears() if moe else spec.mlp_linears())}

        def proj(name: str, layer: int = layer, shapes: dict[str, tuple[int, int]] = shapes
                 ) -> list[list[tuple[str, int, int]]]:
            i, o = shapes[name]
            bias = ((name in qkv and spec.qkv_bias) or (name == "o_proj" and spec.o_bias)
                    or (name in spec.mlp_linears() and spec.mlp_bias))
            base = [(f"{layer}.{name}", i * o, b_w)] + ([(f"{layer}.{name}.bias", o, b_w)] if bias else [])
            if name not in lora:
                return [base]
            return [[], base, [], [(f"{layer}.{name}.lora_A", r * i, b_a)], [(f"{layer}.{name}.lora_B", r * o, b_a)]]

        norm = [(f"{layer}.input_layernorm", h, b_w)]
        calls += [[], norm, []]  # the layer, input_layernorm, self_attn
        for name in list(attn)[:-1]:
            calls += proj(name)
        if spec.qk_norm:
            calls += [[(f"{layer}.q_norm", spec.head_dim, b_w)], [(f"{layer}.k_norm", spec.head_dim, b_w)]]
        calls += proj("o_proj")
        calls += [[(f"{layer}.post_attention_layernorm", h, b_w)], []]  # the norm, mlp
        if moe:
            assert spec.moe is not None
            m = spec.moe
            calls += [[(f"{layer}.router", m.num_experts * h, b_w)]]
            calls += [[(f"{layer}.experts.{n}", math.prod(shape), b_w) for n, shape in m.expert_tensors(h)]]
            mlp = list(spec.moe_linears())
        else:
            mlp = list(spec.mlp_linears())
        if mlp:
            calls += [*proj(mlp[0]), []]  # act_fn after the first (gate) projection
            for name in mlp[1:]:
                calls += proj(name)
    lm_head = embed if spec.tie_word_embeddings else ("lm_head", V * h, b_w)
    return [*calls, [("norm", h, b_w)], [lm_head]]


@functools.lru_cache(maxsize=256)
def prefetched_live(spec: ModelSpec, lora: tuple[str, ...], r: int, b_w: int, b_a: int, bucket: int,
                    threshold: int, max_live: int = MAX_LIVE_PARAMETERS) -> int:
    """The most bytes of gathered parameters live at once during one decode forward under ZeRO-3's hooks (the
    prefetch front of ``fetch_sub_module`` plus what is fetched and not yet released), the trace complete.

    ``bucket``: ``stage3_prefetch_bucket_size`` (elements prefetched per submodule call at most), ``threshold``:
    ``stage3_param_persistence_threshold`` (parameters below it are never gathered nor released), ``max_live``:
    ``stage3_max_live_parameters``. ``lora``: the projections PEFT wraps (``r`` its rank, ``b_a`` its bytes).

    >>> tiny = ModelSpec(724, 256, 4, 8, 2, 32, 1024, True)
    >>> prefetched_live(tiny, (), 0, 4, 4, int(0.9 * 256 ** 2), 2560) / 2**20  # of 15.2 MiB gathered in full
    11.58203125
    >>> wide = ModelSpec(724, 1024, 1, 8, 2, 128, 4096, True)  # one layer: all of it at once
    >>> prefetched_live(wide, (), 0, 4, 4, int(0.9 * 1024 ** 2), 10240) == 4 * (wide.params - 3 * 1024)
    True
    """
    calls = _trace(spec, lora, r, b_w, b_a)
    size = {name: (n, b) for call in calls for name, n, b in call}
    persist = {name for name, (n, _b) in size.items() if n < threshold}
    queue = deque((name, step) for step, call in enumerate(calls) for name in sorted({p[0] for p in call}))
    # when each parameter is used again (within max_reuse_distance, 1e9 elements by default: the whole forward)
    uses: dict[str, list[int]] = {}
    for step, call in enumerate(calls):
        for name, _n, _b in call:
            uses.setdefault(name, []).append(step)
    state = dict.fromkeys(size, "absent")  # absent, inflight, available (persistent ones: always available)
    recent: dict[str, int] = {}
    n_avail = live = peak = 0

    def gather(name: str, status: str) -> None:
        nonlocal n_avail, live
        state[name] = status
        n_avail += size[name][0]
        live += size[name][0] * size[name][1]

    for step, call in enumerate(calls):
        mine = sorted({p[0] for p in call if p[0] not in persist})
        for name in mine:  # fetch what this module needs (prefetched ones only complete)
            if state[name] == "absent":
                gather(name, "available")
            state[name] = "available"
        fresh = {name for name in {p[0] for p in call} if recent.get(name, -1) < step}
        popped = 0
        while queue and popped < len(fresh):  # this module's own entries leave the prefetch queue
            name, used = queue.popleft()
            recent[name] = used
            popped += 1
        allowed, fetching, chosen = min(max_live - n_avail, bucket), 0, set()
        while queue and fetching < allowed:
            name, used = queue.popleft()
            recent[name] = max(recent.get(name, -1), used)
            if name not in persist and state[name] == "absent" and name not in chosen:
                chosen.add(name)
                fetching += size[name][0]
        for name in sorted(chosen):
            gather(name, "inflight")
        peak = max(peak, live)
        for name in mine:  # released after the module, unless prefetched for or used again later in the forward
            if recent.get(name, -1) > step + 1 or any(u > step for u in uses[name]):
                continue
            state[name] = "absent"
            n_avail -= size[name][0]
            live -= size[name][0] * size[name][1]
    return peak
