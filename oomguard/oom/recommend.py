"""Rank the remedies that address a diagnosis, for `oomguard analyze`, each with a line to paste.

The ranking differs from a ladder's fixed order on purpose: a post-mortem can point at the most direct fix for this
OOM (8-bit optimizer for an optimizer-step OOM), where a ladder climbs the same order for every run. The remedy
names are the ladder's, so advice and `oomguard run` speak the same language.

Remedies come in tiers of relevance: first what the kind of OOM calls for (allocator settings for fragmentation, the
neighbour for a shared GPU), then what shrinks the phase that ran out (shapes during generation and training, state
at the optimizer step), then the rest. Within a tier, the remedy that frees more bytes (where the figures tell)
comes first. The terminal shows the top three, and up to five while the next ones are as relevant as the third;
``--all`` and the JSON give every remedy with its rank.

>>> from oomguard.oom.parse import parse_oom
>>> from oomguard.oom.diagnose import diagnose
>>> d = diagnose(parse_oom("CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total capacity of 15.73 GiB "
...     "of which 1.28 GiB is free. Of the allocated memory 11.82 GiB is allocated by PyTorch, and 2.41 GiB is "
...     "reserved by PyTorch but unallocated."))
>>> [a.name for a in recommend(d)][:2]
['expandable_segments', 'empty_cache']
>>> ranked(d)[0].paste
('PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True',)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..strategies import REGISTRY, Advice
from ..strategies.base import Context
from ..vocab.diagnosis import OVERFLOW_FACTOR, Diagnosis
from ..vocab.knobs import DS_SIZE_KNOBS, KNOB_NAMES, REACH, TRL_DEFAULTS, Knobs
from ..vocab.sizes import format_size

TOP_MIN = 3  # remedies the terminal always shows (when there are that many)
TOP_MAX = 5  # and at most, while the next ones are in the third one's tier

_SHAPES = ["shorter_sequences", "fewer_generations", "micro_batch"]
_STATE = ["optimizer_8bit", "lora", "bf16_load", "load_4bit"]
# Per phase: tiers of remedies, the most direct first.
_BY_PHASE: dict[str, list[list[str]]] = {
    "generation": [["shorter_sequences", "fewer_generations", "vllm_memory"], _STATE],
    "scoring": [["micro_batch", "shorter_sequences", "fewer_generations"], _STATE],
    "forward": [["checkpointing", "micro_batch", "shorter_sequences", "fewer_generations"], _STATE],
    "backward": [["checkpointing", "micro_batch", "shorter_sequences", "fewer_generations"],
                 ["lora", "optimizer_8bit", "bf16_load", "load_4bit"]],
    "optimizer": [_STATE],
    "load": [["bf16_load", "load_4bit"]],
    "unknown": [["checkpointing", *_SHAPES], [*_STATE, "vllm_memory"]],
}


@dataclass(frozen=True)
class Recommendation:
    """One remedy for one OOM: the advice, its rank (1 = most relevant), the tier it was ranked in, the lines to
    paste (an environment variable, a ``GRPOConfig(...)`` argument, a ``LoraConfig``), and whether the terminal
    shows it without ``--all``."""

    advice: Advice
    rank: int
    tier: int
    paste: tuple[str, ...] = ()
    top: bool = True

    @property
    def name(self) -> str:
        return self.advice.name

    def to_dict(self) -> dict[str, Any]:
        return {**self.advice.to_dict(), "rank": self.rank, "paste": list(self.paste), "top": self.top}


def recommend(d: Diagnosis) -> list[Advice]:
    """Remedies that address this diagnosis, most relevant first, each with its reason and bytes freed if known."""
    return [r.advice for r in ranked(d)]


def ranked(d: Diagnosis, knobs: Mapping[str, Any] | Knobs | None = None) -> list[Recommendation]:
    """Every remedy for this diagnosis, ranked, with paste lines computed from ``knobs`` (the run's effective knobs,
    as a crash record or run report holds them) or TRL's defaults when the run's config is not known.

    >>> from oomguard.vocab.oomreport import OOMReport
    >>> from oomguard.oom.diagnose import diagnose
    >>> d = diagnose(OOMReport("cuda", "allocator", "x", requested=4 << 30, capacity=16 << 30, free=1 << 30),
    ...              phase="generation")
    >>> [(r.rank, r.name, r.top) for r in ranked(d)][:4]
    [(1, 'shorter_sequences', True), (2, 'fewer_generations', True), (3, 'vllm_memory', True), (4, 'optimizer_8bit', False)]
    >>> ranked(d)[0].paste
    ('GRPOConfig(max_completion_length=256)',)
    """
    tiers = _tiers(d)
    base = _base_knobs(knobs)
    if knobs is not None:
        tiers = _demote_blocked(tiers, Context(knobs=base, diagnosis=d))
    out: list[Recommendation] = []
    seen: set[str] = set()
    for t, tier in enumerate(tiers):
        advice = [a for a in tier if a.name not in seen]
        seen.update(a.name for a in advice)
        advice.sort(key=lambda a: -(a.frees_bytes or 0))  # stable: ties keep the tier's order
        for a in advice:
            out.append(Recommendation(a, len(out) + 1, t, paste_lines(a.name, d, base)))
    return _mark_top(out)


def _demote_blocked(tiers: list[list[Advice]], ctx: Context) -> list[list[Advice]]:
    """With the run's knobs known, a remedy that cannot apply to it (already in force, at its floor, vLLM remedies
    for a run without vLLM) goes last, its reason saying why."""
    kept: list[list[Advice]] = []
    blocked: list[Advice] = []
    for tier in tiers:
        keep = []
        for a in tier:
            cls = REGISTRY.get(a.name)
            why = (cls().foreign(ctx) or cls().blocked(ctx)) if cls is not None else None
            if why:
                blocked.append(Advice(a.name, f"{a.reason} Not for this run: {why}.", None))
            else:
                keep.append(a)
        if keep:
            kept.append(keep)
    return [*kept, blocked] if blocked else kept


def _mark_top(recs: list[Recommendation]) -> list[Recommendation]:
    if len(recs) <= TOP_MIN:
        return recs
    cut_tier = recs[TOP_MIN - 1].tier
    return [r if r.rank <= TOP_MIN or (r.rank <= TOP_MAX and r.tier == cut_tier) else
            Recommendation(r.advice, r.rank, r.tier, r.paste, top=False) for r in recs]


def _tiers(d: Diagnosis) -> list[list[Advice]]:
    """The remedies for ``d`` in tiers of relevance (each tier in its own order of directness)."""
    r = d.report
    if d.kind == "host-ram":
        return [[REGISTRY[n]().advise(d) for n in ("fewer_workers", "smaller_prefetch", "no_cpu_offload")]]
    if d.kind == "vllm-reservation":
        return [[REGISTRY["vllm_memory"]().advise(d)]]
    if d.kind == "impossible":
        limit = r.allowed or r.capacity or 0
        if r.requested and limit and r.requested > OVERFLOW_FACTOR * limit:
            return [[Advice("fix_shapes", f"A {format_size(r.requested)} request on a {format_size(limit)} device is "
                                          "an overflowed or mistaken tensor shape; no memory setting can hold it.",
                            None)]]
    first: list[Advice] = []
    if d.buffer is not None:  # a framework buffer: its size is set by a config (DeepSpeed's reduce bucket)
        first.append(REGISTRY["deepspeed_buffers"]().advise(d))
    if d.kind == "neighbour":
        first.append(Advice("free_gpu", f"Other processes hold {format_size(r.others_total)}: stop them or choose an "
                                        "idle GPU (CUDA_VISIBLE_DEVICES).", r.others_total or None))
    if d.kind == "driver":
        first.append(Advice("fresh_process", "Restart the process: a CUDA context that failed this way can stay "
                                             "unusable (`oomguard run` relaunches each attempt in a fresh process).",
                            None))
    names: list[str] = []
    if d.kind == "fragmentation":
        names = ["expandable_segments", "empty_cache"]
    elif d.kind in ("driver", "non-pytorch"):
        names = ["empty_cache", *(["vllm_memory"] if d.kind == "non-pytorch" else [])]
    first += [REGISTRY[n]().advise(d) for n in names]

    phase_tiers = [list(t) for t in _BY_PHASE.get(d.phase, _BY_PHASE["unknown"])]
    if _state_bound(d) or (d.kind == "small-allocations" and d.facts.short_of is None):
        # Memory filled with many small blocks, or the failing request is a sliver of what is live: the long-lived
        # state (weights, gradients, optimizer moments) is what to shrink, before the shapes.
        flat = [n for t in phase_tiers for n in t]
        state = [n for n in flat if n in _STATE] or _STATE
        phase_tiers = [state, [n for n in flat if n not in _STATE]]
    if d.kind == "impossible":
        phase_tiers = [[n for t in phase_tiers for n in t if n in _SHAPES]]
    tiers = [first] if first else []
    for t in phase_tiers:
        tier = [REGISTRY[n]().advise(d) for n in t if REGISTRY[n]().helps(d) is None]
        if tier:
            tiers.append(tier)
    near = _near_fragmentation(d)
    if near is not None:
        tiers.append([near])
    return tiers


STATE_BOUND = 0.02  # a request below this share of the live tensors: the state, not the step's shapes, fills memory


def _state_bound(d: Diagnosis) -> bool:
    """Whether the long-lived state is what filled memory: what was live says so where the training process counted
    it (``Facts.short_of``); else a request that is a sliver of what is live."""
    if d.facts.short_of is not None:
        return d.facts.short_of == "long-lived state"
    r = d.report
    if d.kind != "shortfall" or d.phase == "load" or not r.requested or not r.allocated:
        return False
    return r.requested < STATE_BOUND * r.allocated


def _near_fragmentation(d: Diagnosis) -> Advice | None:
    """A shortfall whose cache still held more than the request: expandable segments may get this one request
    through, though the next one would fail; worth a try only after the remedies that make the step smaller."""
    r = d.report
    if d.kind not in ("shortfall", "small-allocations") or not r.requested or r.reserved_unallocated is None:
        return None
    if r.reserved_unallocated < r.requested:
        return None
    return Advice("expandable_segments", f"{format_size(r.reserved_unallocated)} is reserved but unallocated: "
                                         "expandable segments may get this request through, but too little room is "
                                         "left for the rest of the step to fit.", None)


# --------------------------------------------------------------------------------------------------------------
# Lines to paste.

_NOT_GRPO = {"zero_stage", "offload_optimizer", "offload_params", "fsdp_offload", "overlap_comm",
             *DS_SIZE_KNOBS}  # accelerate / DeepSpeed configs


def _base_knobs(knobs: Mapping[str, Any] | Knobs | None) -> Knobs:
    if knobs is None:
        return TRL_DEFAULTS
    if isinstance(knobs, Knobs):
        return TRL_DEFAULTS.merged(knobs)
    try:
        return TRL_DEFAULTS.merged({k: v for k, v in knobs.items() if k in KNOB_NAMES})
    except (KeyError, TypeError, ValueError):
        return TRL_DEFAULTS


def paste_lines(name: str, d: Diagnosis, base: Knobs = TRL_DEFAULTS) -> tuple[str, ...]:
    """Ready-to-paste lines for one remedy: what it would change in ``base`` (TRL's defaults unless the run's knobs
    are known), as the environment variable and the ``GRPOConfig``/trainer arguments that carry it.

    >>> from oomguard.vocab.oomreport import OOMReport
    >>> from oomguard.oom.diagnose import diagnose
    >>> d = diagnose(OOMReport("cuda", "allocator", "x", requested=1 << 30, capacity=16 << 30, free=0))
    >>> paste_lines("optimizer_8bit", d)
    ('GRPOConfig(optim="adamw_bnb_8bit")',)
    >>> paste_lines("lora", d)
    ('GRPOTrainer(..., peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))',)
    """
    if name == "free_gpu":
        return ("nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv",)
    if name == "fresh_process":
        return ("oomguard run -- python train.py",)
    cls = REGISTRY.get(name)
    if cls is None:
        return ()
    remedy = cls()
    try:
        after = remedy.apply(Context(knobs=base, diagnosis=d))
    except Exception:  # a remedy that cannot apply to these knobs has no line to paste
        return ()
    changed = {k: v for k, v in after.to_dict().items() if v != base.to_dict().get(k)}
    if not changed:  # already the default (gradient checkpointing): say it anyway, the script may have changed it
        changed = {k: getattr(after, k) for k in remedy.changes if getattr(after, k) is not None}
    if not changed and name == "deepspeed_buffers":  # a plain log: the stage is not known, the bucket is
        changed = {"reduce_bucket_size": "auto"}
    lines = list(_lines(changed, d.report.backend))
    if name == "vllm_memory" and d.report.kv_cache_tokens:
        lines.append(f"GRPOConfig(vllm_max_model_length={d.report.kv_cache_tokens})")
    return tuple(lines)


def _lines(changed: Mapping[str, Any], backend: str) -> list[str]:
    out: list[str] = []
    env = []
    if changed.get("expandable_segments") is not None:
        env.append(f"expandable_segments:{bool(changed['expandable_segments'])}")
    if changed.get("max_split_size_mb") is not None:
        env.append(f"max_split_size_mb:{int(changed['max_split_size_mb'])}")
    if env:
        var = "PYTORCH_HIP_ALLOC_CONF" if backend == "hip" else "PYTORCH_CUDA_ALLOC_CONF"
        out.append(f"{var}={','.join(env)}")
    args = [f"{k}={_py(v)}" for k, v in changed.items()
            if k in REACH["config"] and k not in _NOT_GRPO and v is not None]
    init: dict[str, str] = {}
    if changed.get("dtype"):
        init["dtype"] = _py(changed["dtype"])
    if changed.get("load_in_4bit"):
        init["quantization_config"] = ('BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", '
                                       'bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="bfloat16")')
    if init:
        args.append("model_init_kwargs={" + ", ".join(f'"{k}": {v}' for k, v in init.items()) + "}")
    if args:
        out.append(f"GRPOConfig({', '.join(args)})")
    if changed.get("lora_r"):
        r = int(changed["lora_r"])
        alpha = int(changed.get("lora_alpha") or 2 * r)
        tm = changed.get("lora_target_modules") or "all-linear"
        out.append(f"GRPOTrainer(..., peft_config=LoraConfig(r={r}, lora_alpha={alpha}, target_modules={_py(tm)}, "
                   'task_type="CAUSAL_LM"))')
    sizes = {k: v for k, v in changed.items() if k in DS_SIZE_KNOBS and v is not None}
    if sizes:
        out.append('DeepSpeed config: "zero_optimization": {'
                   + ", ".join(f'"{k}": {json.dumps(v)}' for k, v in sizes.items()) + "}")
    if changed.get("max_prompt_tokens"):
        n = int(changed["max_prompt_tokens"])
        out.append(f'dataset = dataset.filter(lambda x: len(tokenizer(x["prompt"])["input_ids"]) <= {n})')
    return out


def _py(v: Any) -> str:
    """A Python literal with double-quoted strings, as people write config code."""
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_py(x) for x in v) + "]"
    return repr(v)


def top(recs: Sequence[Recommendation]) -> list[Recommendation]:
    """The remedies shown without ``--all``."""
    return [r for r in recs if r.top]
