"""The prediction: :func:`estimate` reads the knobs into a step, runs the phases, adds the persistent state, vLLM,
the context and the fragmentation margin, and picks the dominant phase. Also :func:`load_bytes` (the floor once the
weights are placed) and :func:`describe`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...vocab.knobs import Knobs
from ...vocab.sizes import MiB, format_size
from ...vocab.trlrange import HEADS
from .arch import DTYPE_BYTES, EstimateError
from .coefficients import Coefficients
from .model import ModelSpec
from .paged import paged_cache
from .phases import EVAL_PHASE, PHASE_TERMS, PHASES, evaluation_terms
from .step import (
    Step,
    activations_of,
    casts_of,
    dtype_name,
    geometry_of,
    persistent_of,
    regime_of,
    sharded,
    with_trl_defaults,
)
from .terms import weight_bytes
from .unmodelled import from_model
from .unmodelled import unmodelled as _unmodelled
from .vision import Images, prompt_image_tokens
from .vllm import VllmMemory, vllm_memory

BREAKDOWN_KEYS = ("weights", "reference", "gradients", "optimizer", "activations", "logits", "kv_cache", "vllm",
                  "overhead")


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
    vllm_lacks: int = 0  # how far a colocated vLLM's reservation is short of what it needs to start (0: it starts)
    # what the run does that no term counts (``unmodelled.NOT_MODELLED``'s keys): never judged sure
    unmodelled: tuple[str, ...] = field(default=())
    # the long-lived state every phase holds (the weights, a reference model, the optimizer's state), scaled
    state: int = 0

    def own(self, phase: str) -> int:
        """What ``phase`` allocates beyond the long-lived state: the step's own memory there (activations, the KV
        cache, generation's buffers, gradients), where the model's error lies when the state is the same.

        >>> Estimate(30, 30, {}, {"generation": 20}, 0, 0, "generation", state=12).own("generation")
        8
        """
        return max(0, self.phases.get(phase, 0) - self.state)

    def fits(self, capacity: int) -> bool:
        """Whether the predicted device peak fits in ``capacity`` bytes (and a colocated vLLM can start)."""
        return self.peak_bytes <= capacity and not self.vllm_lacks

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (sizes in bytes, plus a readable ``peak`` string)."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["unmodelled"] = list(self.unmodelled)
        d["peak"] = format_size(self.peak_bytes)
        return d

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in self.breakdown.items() if v)
        return f"peak {format_size(self.peak_bytes)} in {self.dominant_phase} ({parts})"


def _vllm(s: Step, capacity: int | None, notes: list[str]) -> VllmMemory | None:
    """T9b: a colocated vLLM's reservation, ``vllm_gpu_memory_utilization × capacity`` (``estimate.vllm``)."""
    k = s.k
    v = vllm_memory(s.spec, k, capacity, prefill_tokens=s.geo.B_gen * s.geo.P)
    if v is None and k.use_vllm and (k.vllm_mode or "colocate") == "colocate":
        notes.append("vLLM colocate reservation not counted: pass capacity")
    if k.use_vllm and k.vllm_mode == "server":
        notes.append("vLLM server mode: generation runs in the server, on its own device; this device holds none of "
                     "it (the server's memory is its --gpu_memory_utilization)")
    if v is not None and v.lacks:
        notes.append(f"vLLM's reservation ({format_size(v.reservation)}) cannot hold its engine "
                     f"({format_size(v.engine)}), its profile's activations ({format_size(v.activations)}) and one "
                     f"sequence of {v.max_model_len:,} tokens ({format_size(v.one_sequence)}): vLLM would refuse to "
                     "start")
    return v


def _paged(s: Step, capacity: int | None, ctx: int, phases: dict[str, int], notes: list[str]) -> dict[str, int]:
    """transformers' continuous batching: the paged cache each generating phase allocates, a share of what the device
    has free when the round starts (``estimate.paged``); nothing without it, or under vLLM (which TRL uses first)."""
    k = s.k
    if not k.use_transformers_continuous_batching or k.use_vllm:
        return {}
    if not capacity:
        notes.append("transformers' paged cache not counted: pass capacity")
        return {}
    share = float(k.cb_max_memory_percent or 0.5)
    rows = {"generation": s.geo.B_gen, EVAL_PHASE: s.k.eval_geometry()[0]}
    return {ph: paged_cache(s.spec, available=int(share * max(0, capacity - ctx - phases[ph])), dtype_bytes=s.g.b_w,
                            requests=rows[ph], sequence=s.geo.T, max_batch_tokens=k.cb_max_batch_tokens)
            for ph in ("generation", EVAL_PHASE) if ph in phases}


def _composition(s: Step, phase_parts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each phase's allocated bytes by breakdown key: the persistent state plus what the phase adds (unscaled)."""
    p = s.p
    # cuBLAS workspaces come from the caching allocator, one per (handle, stream), and handles are per thread: the
    # forward (main thread) and the backward (autograd's device thread) each hold one (T10, ``m_workspace``)
    base = {"weights": p.weights, "reference": p.reference, "optimizer": p.opt_state, "gradients": p.buckets,
            "overhead": 0 if s.g.simulated else int(s.co.m_workspace)}
    k = s.k
    # ms-swift's offload context: while a colocated vLLM generates, the trainer's weights (and the reference model's)
    # and its optimizer state wait in host RAM
    away = (("weights", "reference", "optimizer") if k.offload_during_generation and k.use_vllm
            and (k.vllm_mode or "colocate") == "colocate" else ())
    comp: dict[str, dict[str, int]] = {}
    for ph, parts in phase_parts.items():
        d = dict.fromkeys(BREAKDOWN_KEYS, 0)
        for key, v in base.items():
            d[key] += 0 if ph == "generation" and key in away else v
        for key, v in parts.items():
            d[key] += int(v)
        comp[ph] = d
    return comp


def _assemble(s: Step, comp: dict[str, dict[str, int]], capacity: int | None,
              reported: tuple[str, ...] = ()) -> Estimate:
    """Scale each phase, add T9 vLLM, T10 context and T11 fragmentation, and pick the dominant phase. The breakdown
    is that phase's composition, so that it sums to the peak."""
    co, k, simulated = s.co, s.k, s.g.simulated
    notes = list(s.p.notes)
    scale = co.scale
    phases = {ph: round(sum(d.values()) * scale) for ph, d in comp.items()}
    v = _vllm(s, capacity, notes)
    sleep = bool(k.vllm_enable_sleep_mode)

    def vllm_bytes(ph: str) -> int:
        """vLLM's part of the device in a phase (``VllmMemory.generating``, ``.training``); asleep, nothing."""
        generates = ph in ("generation", EVAL_PHASE)  # an evaluation pass generates with vLLM too
        if v is None or (sleep and not generates):
            return 0
        return v.generating if generates else v.training

    frag = co.f_frag_expandable if k.expandable_segments else co.f_frag
    ctx = s.context if s.context is not None else 0 if simulated else int(co.m_ctx)
    paged = _paged(s, capacity, ctx, phases, notes)  # one block, outside the fragmentation margin

    def device_bytes(ph: str) -> int:
        return ctx + int(phases[ph] * (1 + frag)) + vllm_bytes(ph) + paged.get(ph, 0)

    # ties go to the earlier phase of a step; the evaluation pass (when the run evaluates) comes last
    dominant = max((ph for ph in (*PHASES, EVAL_PHASE) if ph in phases), key=lambda ph: (device_bytes(ph), phases[ph]))
    peak_bytes = device_bytes(dominant)
    bd = {key: round(v * scale) for key, v in comp[dominant].items()}
    bd["activations"] += phases[dominant] - sum(bd.values())  # rounding of the scale
    bd["vllm"] = vllm_bytes(dominant)
    bd["kv_cache"] += paged.get(dominant, 0)
    bd["overhead"] = peak_bytes - sum(v for key, v in bd.items() if key != "overhead")
    # what torch's allocator counts includes what vLLM keeps allocated (engine and KV cache) while it is awake
    held = v.held if v is not None and not sleep else 0
    allocated = max(phases[ph] + paged.get(ph, 0) for ph in phases)
    return Estimate(peak_bytes=peak_bytes, peak_alloc_bytes=allocated + held, breakdown=bd, phases=phases,
                    state=round((s.p.weights + s.p.reference + s.p.opt_state) * scale),
                    trainable_params=s.p.trainable, total_params=s.p.total_params, dominant_phase=dominant,
                    notes=tuple(notes), vllm_lacks=v.lacks if v is not None else 0,
                    unmodelled=_unmodelled(k, reported, from_model(s.spec, simulated=simulated, images=bool(
                        s.images is not None and s.images.per_prompt > 0))))


def estimate(spec: ModelSpec, knobs: Knobs, *, world_size: int = 1, prompt_tokens: int | None = None,
             coefficients: Coefficients | None = None, simulated: bool = False,
             capacity: int | None = None, context: int | None = None, head: str | None = None,
             keeps_dtype_4bit: bool = False, images: Images | None = None,
             lora_target_parameters: tuple[str, ...] | None = None, freeze_vision: bool = False,
             keep_mxfp4: bool = False, unmodelled: tuple[str, ...] = (), lora_dropout: float = 0.0) -> Estimate:
    """Predict the peak memory of one steady-state TRL GRPO step on one device.

    ``knobs`` may leave fields at None: TRL's defaults fill them (``oomguard.vocab.knobs.TRL_DEFAULTS``).
    ``prompt_tokens`` is the padded prompt length P (default ``max_prompt_tokens`` or 256); completions are taken at
    the worst case ``C = max_completion_length``. The training micro-batch is ``per_device_train_batch_size`` and
    generation runs ``rows_per_device()`` sequences at once. ``simulated=True`` models oomguard's simulated device on
    CPU: no CUDA context, no autocast, the chunked head's torch fallback. ``context`` is the device's memory outside
    the allocator when it is known (measured under ``--gpu-memory``, or the simulated device's
    ``--simulate-context``); by default ``m_ctx``, or 0 on the simulated device. ``capacity`` (device bytes) sizes a
    colocated vLLM. ``head`` is the installed TRL's LM head (``RunFacts.trl_head``): ``fused`` (TRL 1.15 on, the
    default) or ``logits`` (TRL 0.29 to 1.14, materialised logits); see ``oomguard.child.trlcompat``.
    ``keeps_dtype_4bit``: the run's own loader takes ``load_in_4bit`` and keeps the dtype asked for the modules it
    does not quantise (Unsloth's, ``RunFacts.load_takes_4bit``); oomguard's 4-bit load makes them 16-bit.

    What the run feeds a model beyond the knobs: ``images`` (a vision-language model's images per prompt, the largest
    image's size and the processor's pixel budget, :class:`.vision.Images`): their tokens are added to the prompt
    (unless ``Images.in_prompt_tokens``), the vision tower's activations to every forward and their pixel values to
    the buffered batch; None or a text model: none. ``lora_target_parameters``: PEFT's ``target_parameters`` (experts
    named by the user, e.g. ``("mlp.experts.gate_up_proj", "mlp.experts.down_proj")``). ``freeze_vision``: a full
    fine-tune whose script froze the vision tower. ``keep_mxfp4``: gpt-oss's experts kept in MXFP4 (the inference load
    with the kernels; training recipes dequantise, the default). ``unmodelled``: what the run does that no term
    counts (``RunFacts.unmodelled``, keys of :data:`.unmodelled.NOT_MODELLED`), kept in ``Estimate.unmodelled`` with
    what the knobs imply (vLLM in server mode). ``lora_dropout``: the user's own LoRA's dropout (``RunFacts``; TRL's
    ``ModelConfig`` and ms-swift default to 0.05): each adapted module then keeps its own dropped input and mask.

    ``coefficients`` default to the research priors, or to :meth:`Coefficients.for_simulated` when ``simulated``.
    The optimizer state is assumed to exist in every phase (the steady state after step 1).

    >>> tiny = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True)
    >>> e = estimate(tiny, Knobs(per_device_train_batch_size=4, max_completion_length=128), prompt_tokens=32,
    ...              simulated=True)
    >>> e.dominant_phase, sorted(e.phases) == sorted(PHASES), sum(e.breakdown.values()) == e.peak_bytes
    ('forward_backward', True, True)
    """
    co = coefficients or (Coefficients.for_simulated() if simulated else Coefficients())
    k = with_trl_defaults(knobs)
    g = regime_of(spec, k, simulated, keeps_dtype_4bit, lora_target_parameters, lora_dropout)
    if keep_mxfp4 and not g.lora:
        raise EstimateError("keep_mxfp4: MXFP4 experts cannot train; a full fine-tune dequantises them (LoRA only)")
    geo = geometry_of(k, world_size, prompt_tokens, prompt_image_tokens(spec, images))
    gc = bool(k.gradient_checkpointing)
    p = sharded(persistent_of(spec, k, g, freeze_vision, keep_mxfp4), spec, k, g, world_size)
    if head not in (None, *HEADS):
        raise EstimateError(f"head must be one of {', '.join(HEADS)}, not {head!r}")
    s = Step(spec=spec, k=k, co=co, g=g, geo=geo, p=p, casts=casts_of(spec, g, gc, p.gather),
              acts=activations_of(spec, g, geo, co, gc, images, freeze_vision), context=context,
              lm_head=head or "fused", images=images, freeze_vision=freeze_vision)
    parts = {ph: terms(s) for ph, terms in PHASE_TERMS.items()}
    if k.evaluates():
        parts[EVAL_PHASE] = evaluation_terms(s)
    return _assemble(s, _composition(s, parts), capacity, tuple(unmodelled))


def load_bytes(spec: ModelSpec, knobs: Knobs, *, coefficients: Coefficients | None = None,
               simulated: bool = False, context: int | None = None, keeps_dtype_4bit: bool = False,
               keep_mxfp4: bool = False) -> int:
    """Device bytes once ``from_pretrained`` has placed the weights: the context outside the allocator plus the
    stored weights in the load's dtype (NF4 projections under a 4-bit load), before any training memory exists; on the
    simulated device, as its caching allocator reserves them (:func:`placed_bytes`: whole segments, rounded blocks).

    Every phase of the step holds at least this, so it is the floor a pre-flight can judge before anything loads,
    from the checkpoint's config alone. (LoRA adapters are created after the load and are not counted.)

    >>> tiny = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True)
    >>> load_bytes(tiny, Knobs(dtype="float32")) - int(Coefficients().m_ctx) == 4 * tiny.params
    True
    >>> load_bytes(tiny, Knobs(dtype="float32"), simulated=True) // MiB  # 16.5 MiB of weights in 20 MiB segments
    36
    >>> load_bytes(tiny, Knobs(dtype="float32", load_in_4bit=True, lora_r=8), simulated=True) < 2 * tiny.params
    True
    """
    co = coefficients or (Coefficients.for_simulated() if simulated else Coefficients())
    k = with_trl_defaults(knobs)
    b_w = DTYPE_BYTES[dtype_name(k, spec, keeps_dtype_4bit)]
    ctx = context if context is not None else 0 if simulated else int(co.m_ctx)
    weights = weight_bytes(spec, b_w, load_in_4bit=bool(k.load_in_4bit), keep_mxfp4=keep_mxfp4)
    if simulated and not k.load_in_4bit and not keep_mxfp4:
        # the simulated device places each weight as the caching allocator does: a model of tens of MiB holds whole
        # 20 MiB segments and 2 MiB blocks it only partly fills
        weights = max(weights, placed_bytes([n * b_w for n in spec.param_tensors()],
                                            expandable=bool(k.expandable_segments)))
    return ctx + weights


def placed_bytes(sizes: list[int], expandable: bool = False) -> int:
    """What the CUDA caching allocator (``memory.allocmodel``) reserves to place tensors of ``sizes`` bytes one after
    another, none freed: a load's weights as the device holds them.

    >>> placed_bytes([3 * MiB] * 6) // MiB, placed_bytes([3 * MiB] * 7) // MiB   # 20 MiB segments for 1-10 MiB
    (20, 40)
    """
    from ..allocmodel import AllocatorModel

    m = AllocatorModel(1 << 62, expandable=expandable)
    for n in sizes:
        m.malloc(n)
    return m.reserved


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
