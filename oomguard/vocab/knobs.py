"""Knobs: every value oomguard may change, immutable, checked against GRPO's batch rules, with a diff.

A run has three layers of knobs. TRL's defaults, then what the user's script set (recorded by the training process
when it builds its ``GRPOConfig``), then oomguard's overrides. ``effective = defaults | observed | overrides``, and
the diff compares ``defaults | observed`` (the user's own config) with the effective knobs, so it shows exactly
what oomguard changed.

>>> k = TRL_DEFAULTS.replace(per_device_train_batch_size=4, gradient_accumulation_steps=2)
>>> k.rows_per_device(), k.validate()
(8, [])
>>> [r.knob for r in k.diff(k.replace(max_completion_length=256))]
['max_completion_length']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .facts import RunFacts
from .knobtable import (
    CONFIG_KNOBS,
    DS_SIZE_KNOBS,
    DTYPES,
    EIGHT_BIT_OPTIMIZERS,
    EVAL_STRATEGIES,
    KNOB_MEANINGS,
    KNOB_NAMES,
    OPTIMIZER_NAMES,
    REACH,
    STACK_ONLY,
    TABLE,
    VLLM_MODES,
    KnobFields,
)


@dataclass(frozen=True)
class Knobs(KnobFields):
    """Every value oomguard may change. ``None`` means "not set": TRL's default (or the user's value) applies.

    The fields, what each means, TRL's default, where it reaches the training process and the values it takes are
    declared once, in the knob table (``oomguard.vocab.knobtable``; ``oomguard knobs`` prints it). Field names follow
    ``GRPOConfig`` where one exists; the others are oomguard's own: the allocator config, the prompt-token limit, the
    load dtype, LoRA and 4-bit injected at the trainer, DeepSpeed and FSDP through accelerate, and ms-swift's offload
    while vLLM generates.
    """

    # -- construction ----------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> Knobs:
        unknown = set(changes) - KNOB_NAMES
        if unknown:
            raise KeyError(f"unknown knob(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def merged(self, top: Knobs | Mapping[str, Any]) -> Knobs:
        """This layer with ``top``'s set (non-None) values on top."""
        items = top.to_dict(only_set=True) if isinstance(top, Knobs) else dict(top)
        return self.replace(**{k: _normalise(k, v) for k, v in items.items() if v is not None})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Knobs:
        d = dict(d or {})
        unknown = set(d) - KNOB_NAMES
        if unknown:
            raise KeyError(f"unknown knob(s): {', '.join(sorted(unknown))}")
        return cls(**{k: _normalise(k, v) for k, v in d.items()})

    def to_dict(self, *, only_set: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if only_set and v is None:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    # -- GRPO batch geometry (GRPOConfig.__post_init__, TRL 1.16) ----------------------------------------------
    def geometry(self, world_size: int = 1) -> tuple[int, int, int]:
        """``(per_device_train_batch_size, gradient_accumulation_steps, steps_per_generation)`` as TRL resolves them."""
        bs = self.per_device_train_batch_size or 8
        ga = self.gradient_accumulation_steps or 1
        if self.steps_per_generation is not None:
            spg = self.steps_per_generation
        elif self.generation_batch_size is not None:
            spg = max(1, self.generation_batch_size // max(1, bs * world_size))
        else:
            spg = ga
        return bs, ga, spg

    def rows_per_device(self, world_size: int = 1) -> int:
        """Completions generated per device per generation round: what sets generation memory."""
        bs, _, spg = self.geometry(world_size)
        return bs * spg

    def prompts_per_step(self, world_size: int = 1) -> float:
        """Prompts per optimizer step, the effective batch GRPO learns from: the completions of one step
        (micro-batch x accumulation x ranks) over the completions per prompt. A micro-batch split keeps it.

        >>> k = Knobs(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=8)
        >>> k.prompts_per_step(), k.replace(per_device_train_batch_size=4, gradient_accumulation_steps=4).prompts_per_step()
        (2.0, 2.0)
        """
        bs, ga, _ = self.geometry(world_size)
        return bs * ga * world_size / max(1, self.num_generations or 8)

    def evaluates(self) -> bool:
        """Whether the run evaluates (``eval_strategy`` other than ``"no"``): TRL then generates and scores
        ``per_device_eval_batch_size`` rows per device at each evaluation.

        >>> Knobs().evaluates(), Knobs(eval_strategy="steps").evaluates()
        (False, True)
        """
        return (self.eval_strategy or "no") != "no"

    def eval_geometry(self) -> tuple[int, int]:
        """``(per_device_eval_batch_size, num_generations_eval)`` as TRL resolves them (8, and num_generations).

        >>> Knobs(num_generations=4).eval_geometry()
        (8, 4)
        """
        return self.per_device_eval_batch_size or 8, self.num_generations_eval or self.num_generations or 8

    def with_geometry(self, bs: int, ga: int, spg: int, world_size: int = 1) -> Knobs:
        """Set the batch geometry, written in the form the user used (generation_batch_size or steps_per_generation)."""
        changes: dict[str, Any] = {"per_device_train_batch_size": bs, "gradient_accumulation_steps": ga}
        if self.generation_batch_size is not None:
            changes["generation_batch_size"] = bs * world_size * spg
        elif self.steps_per_generation is not None or spg != ga:
            changes["steps_per_generation"] = spg
        return self.replace(**changes)

    def validate(self, world_size: int = 1) -> list[str]:
        """Problems with these knobs under TRL 1.16's rules: each set value's range (the knob table), then GRPO's batch
        rules; an empty list means GRPOConfig will accept them."""
        problems = [p for name, info in TABLE.items()
                    if (v := getattr(self, name)) is not None and (p := info.problem(v)) is not None]
        if problems:
            return problems
        g = self.num_generations if self.num_generations is not None else 8  # at least 2: its range says so
        bs = self.per_device_train_batch_size or 8
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            problems.append("generation_batch_size and steps_per_generation cannot both be set")
        if self.generation_batch_size is not None and self.generation_batch_size % (bs * world_size):
            problems.append(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch "
                            f"size ({bs} x {world_size})")
        gbs = self.rows_per_device(world_size) * world_size
        if g >= 2 and gbs % g:
            problems.append(f"generation_batch_size ({gbs}) must be divisible by num_generations ({g})")
        if self.evaluates():
            be, ge = self.eval_geometry()
            if (be * world_size) % ge:
                problems.append(f"the global eval batch size ({be} x {world_size}) must be divisible by "
                                f"num_generations_eval ({ge})")
        if self.load_in_4bit and not self.lora_r:
            problems.append("load_in_4bit needs LoRA (lora_r > 0): a purely quantised model cannot be trained")
        return problems

    # -- diff --------------------------------------------------------------------------------------------------
    def diff(self, other: Knobs) -> list[DiffRow]:
        """Rows for every knob whose value differs between ``self`` (before) and ``other`` (after)."""
        rows = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                rows.append(DiffRow(f.name, a, b))
        return rows


@dataclass(frozen=True)
class DiffRow:
    knob: str
    before: Any
    after: Any
    remedy: str | None = None

    def to_dict(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            return list(v) if isinstance(v, tuple) else v

        return {"knob": self.knob, "from": plain(self.before), "to": plain(self.after), "remedy": self.remedy}


def _normalise(name: str, value: Any) -> Any:
    if TABLE[name].kind is tuple and isinstance(value, list):
        return tuple(value)
    return value


def parse_knob(name: str, text: str) -> Any:
    """Read ``KNOB=VALUE`` text from the command line into the knob's type, with a one-line error if it cannot.

    >>> parse_knob("gradient_checkpointing", "off"), parse_knob("lora_target_modules", "q_proj,v_proj")
    (False, ('q_proj', 'v_proj'))
    >>> parse_knob("reduce_bucket_size", "5e7"), parse_knob("stage3_prefetch_bucket_size", "auto")
    (50000000, 'auto')
    """
    if name not in KNOB_NAMES:
        raise KeyError(f"unknown knob {name!r}; known knobs: {', '.join(sorted(KNOB_NAMES))}")
    return TABLE[name].parse(text)


def check_values(values: Mapping[str, Any], world_size: int = 1, base: Knobs | None = None) -> list[str]:
    """Problems with knob values read from outside (a lock file, ``plan``'s KNOB=VALUE): unknown names, wrong types,
    out-of-range values, unknown optimizer names, then GRPO's batch rules (``Knobs.validate``) for ``base`` (TRL's
    defaults unless given) with the values on top. An empty list means the values can be used.

    >>> check_values({"num_generations": 4, "optim": "adamw_bnb_8bit"})
    []
    >>> check_values({"num_generations": -5, "optim": "fast"})  # doctest: +NORMALIZE_WHITESPACE
    ['num_generations must be at least 2, not -5',
     "optim names no optimizer transformers knows: 'fast' (e.g. adamw_torch_fused, adamw_bnb_8bit)"]
    """
    unknown = sorted(set(values) - KNOB_NAMES)
    if unknown:
        return [f"unknown knob(s): {', '.join(unknown)}; `oomguard knobs` lists them"]
    given = {k: v for k, v in values.items() if v is not None}
    problems = [p for k, v in given.items() if (p := TABLE[k].type_problem(v)) is not None]
    if problems:
        return problems
    problems = [p for k, v in given.items() if (p := TABLE[k].problem(v, catalogue=True)) is not None]
    k = (base if base is not None else TRL_DEFAULTS).merged(values)
    return problems + [p for p in k.validate(world_size) if p not in problems]


# TRL 1.16's defaults for the knobs (research/trl-grpo-memory.md §1), plus the allocator and dtype facts: no allocator
# config, and fp32 when TRL loads the model from a string. From the knob table.
TRL_DEFAULTS = Knobs(**{name: info.trl for name, info in TABLE.items()})


def reachable(points: frozenset[str] | set[str]) -> frozenset[str]:
    """The knobs that reach a process which passed through ``points`` (``config``, ``trainer``, ``model``)."""
    out = set(REACH["env"])
    for p in points:
        out |= REACH.get(p, frozenset())
    return frozenset(out)


__all__ = ["CONFIG_KNOBS", "DS_SIZE_KNOBS", "DTYPES", "EIGHT_BIT_OPTIMIZERS", "EVAL_STRATEGIES", "KNOB_MEANINGS",
           "KNOB_NAMES", "OPTIMIZER_NAMES", "REACH", "STACK_ONLY", "TRL_DEFAULTS", "VLLM_MODES", "DiffRow", "Knobs",
           "RunFacts", "check_values", "parse_knob", "reachable"]
