"""The colocated split: how much of the card a colocated vLLM gets (``vllm_gpu_memory_utilization``), and how long
a context it holds at a given share (``vllm_max_model_length``), answered per card (``oomguard plan --fit``).

Too small a share and vLLM cannot hold its weights and a KV cache for its context and the generation batch; too large
and training runs out beside it. vLLM's side needs its 16-bit engine, its profile run's activations and a KV cache of
one sequence of ``vllm_max_model_length`` tokens (below that it refuses to start) and of every row of the generation
batch at once (the run's rows per device, each its prompt and completion; below that vLLM starts but generates the
batch in turns), with the Judge's margin kept free. Training's side is the Judge's own (``Judge.fits``: the predicted
device peak, the reservation included, with its margin kept free). The shares where both fit are one range: vLLM's
side only gains from a larger share, training's only loses.

>>> from oomguard.decide.judge import Judge
>>> from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
>>> cfg = {"vocab_size": 724, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
...        "num_key_value_heads": 2, "intermediate_size": 1024, "tie_word_embeddings": True}
>>> k = TRL_DEFAULTS.replace(use_vllm=True, vllm_max_model_length=256, num_generations=4, per_device_train_batch_size=4,
...                          max_completion_length=32)
>>> facts = RunFacts(model_config=cfg, prompt_tokens_max=20)
>>> s = share_split(Judge(150 * 2**20, simulated=True), facts, k)
>>> s.low, s.high, s.short
(0.46, 0.7, None)
>>> share_split(Judge(90 * 2**20, simulated=True), facts, k).short.side  # vLLM needs 0.76 of it
'training'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..memory.estimate.vllm import KV_BLOCK, vllm_memory
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.sizes import format_size
from .fit import SPLIT_KNOBS
from .judge import Judge

SHARE_KNOB, LENGTH_KNOB = SPLIT_KNOBS
SHARES = tuple(round(i / 100, 2) for i in range(1, 101))  # the shares searched: vLLM's utilisation in hundredths
LONGEST = 131072  # the longest context searched where the model's config names none


@dataclass(frozen=True)
class Short:
    """Where no value fits: which ``side`` is short (``vllm``: its share cannot hold what it needs; ``training``: the
    rest of the card cannot hold training beside it), by how many ``bytes``, at which value of the knob (``at``)."""

    side: str
    bytes: int
    at: float | int
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"side": self.side, "bytes": self.bytes, "at": self.at, "why": self.why}


@dataclass(frozen=True)
class Split:
    """The answer for one card: the values of ``knob`` where both sides fit (``low`` to ``high``; None: none),
    the least share with which vLLM starts at all (``starts_from``, shares only), and where none fits, which side is
    short (``short``)."""

    knob: str
    low: float | int | None
    high: float | int | None
    starts_from: float | None = None
    short: Short | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"fit_range": [self.low, self.high] if self.high is not None else None,
                "vllm_starts_from": self.starts_from,
                "fit_short": self.short.to_dict() if self.short else None}


def vllm_needs(judge: Judge, facts: RunFacts, knobs: Knobs, *, batch: bool = True) -> int | None:
    """The bytes a colocated vLLM's share must hold, with the Judge's margin kept free: its engine, its profile
    run's activations and a KV cache of one sequence of its context and (``batch``) of the whole generation batch at
    once; None without vLLM colocate or a model."""
    spec = judge.spec(facts)
    if spec is None:
        return None
    v = vllm_memory(spec, knobs, judge.capacity)
    if v is None:
        return None
    kv = v.one_sequence
    if batch:
        tokens = (facts.prompt_tokens_max or 256) + int(knobs.max_completion_length or 512)
        rows = knobs.rows_per_device(facts.world_size)
        kv = max(kv, rows * v.kv_per_token * KV_BLOCK * math.ceil(tokens / KV_BLOCK))
    return math.ceil((v.engine + v.activations + kv) * (1 + judge.margin))


def _training_over(judge: Judge, facts: RunFacts, knobs: Knobs) -> int:
    """How far training's predicted peak, with the Judge's margin kept free, is over the card (0 where it fits)."""
    est = judge.predict(facts, knobs)
    if est is None:
        return 0
    return max(0, math.ceil(est.peak_bytes * (1 + judge.margin)) - judge.capacity)


def share_split(judge: Judge, facts: RunFacts, knobs: Knobs) -> Split:
    """The shares of the card (``vllm_gpu_memory_utilization``, in hundredths) where vLLM and training both fit,
    at the other settings of ``knobs``; where none does, which side is short and by how much."""
    cap = judge.capacity
    fits = judge.fits(facts)
    need, start = vllm_needs(judge, facts, knobs), vllm_needs(judge, facts, knobs, batch=False)
    if fits is None or need is None or start is None:
        raise ValueError("--fit vllm_gpu_memory_utilization needs use_vllm=true in colocate mode (vllm_mode=colocate)")
    both = [s for s in SHARES if math.ceil(s * cap) >= need and fits(knobs.replace(**{SHARE_KNOB: s}))]
    starts = next((s for s in SHARES if math.ceil(s * cap) >= start), None)
    if both:
        return Split(SHARE_KNOB, both[0], both[-1], starts)
    least = next((s for s in SHARES if math.ceil(s * cap) >= need), None)
    if least is None:
        short = Short("vllm", need - cap, 1.0, f"even the whole {format_size(cap)} card cannot hold vLLM's weights, "
                                               "its profile's activations and a KV cache for its context and the "
                                               f"generation batch ({format_size(need)} with the model's margin)")
    else:
        over = _training_over(judge, facts, knobs.replace(**{SHARE_KNOB: least}))
        short = Short("training", over, least, f"at {least:.2f}, the least share that holds vLLM's weights and KV "
                                               f"cache, training is {format_size(over)} over the "
                                               f"{format_size(cap)} card (with the model's margin)")
    return Split(SHARE_KNOB, None, None, starts, short)


def length_split(judge: Judge, facts: RunFacts, knobs: Knobs, upper: int | None = None) -> Split:
    """The longest ``vllm_max_model_length`` vLLM holds beside training at the share ``knobs`` give (TRL's 0.3 where
    unset), at most ``upper`` (the model's ``max_position_embeddings``); where none, which side is short."""
    share = float(knobs.vllm_gpu_memory_utilization or 0.3)
    knobs = knobs.replace(**{SHARE_KNOB: share})
    fits = judge.fits(facts)
    if fits is None or vllm_needs(judge, facts, knobs) is None:
        raise ValueError("--fit vllm_max_model_length needs use_vllm=true in colocate mode (vllm_mode=colocate)")
    reservation = math.ceil(share * judge.capacity)
    hi = upper or LONGEST

    def holds(n: int) -> bool:
        k = knobs.replace(**{LENGTH_KNOB: n})
        need = vllm_needs(judge, facts, k)
        return need is not None and need <= reservation and fits(k)

    lo, top, best = 1, hi, None
    while lo <= top:  # vLLM's need grows with its context; training's peak does not depend on it
        mid = (lo + top) // 2
        if holds(mid):
            best, lo = mid, mid + 1
        else:
            top = mid - 1
    if best is not None:
        return Split(LENGTH_KNOB, 1, best)
    k1 = knobs.replace(**{LENGTH_KNOB: 1})
    over = _training_over(judge, facts, k1)
    if over:
        short = Short("training", over, share, f"at a share of {share:.2f}, training is {format_size(over)} over the "
                                               f"{format_size(judge.capacity)} card beside vLLM's reservation (with "
                                               "the model's margin), whatever vLLM's context")
    else:
        need = vllm_needs(judge, facts, k1) or 0
        short = Short("vllm", need - reservation, share, f"a share of {share:.2f} ({format_size(reservation)}) "
                                                         "cannot hold vLLM's weights, its profile's activations and "
                                                         f"the generation batch's KV cache ({format_size(need)} with "
                                                         "the model's margin), whatever its context")
    return Split(LENGTH_KNOB, None, None, None, short)


__all__ = ["LENGTH_KNOB", "SHARES", "SHARE_KNOB", "SPLIT_KNOBS", "Short", "Split", "length_split", "share_split",
           "vllm_needs"]
