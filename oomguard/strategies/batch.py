"""Batch remedies: fewer rows generated per device, or a smaller micro-batch with more accumulation steps.

GRPO's rules (TRL 1.16 GRPOConfig.__post_init__): rows per device = per_device_train_batch_size x steps_per_generation,
and the global generation batch must be a multiple of num_generations, which must be at least 2. Lowering
num_generations alone does not lower memory: the rows stay the same, only more prompts share them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobcost import cut, doubling
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, halve_request, register
from .params import Param

# TRL's loss types whose gradient does not depend on how a step's rows are split into micro-batches (TRL 1.16's
# GRPOTrainer._compute_loss): a mean per sequence, a constant (dr_grpo: rows x max_completion_length) or the tokens of
# the whole generation batch (dapo, cispo, vespo), each divided by the accumulation steps. ``bnpo`` divides each
# micro-batch by its own token count, so a split weighs tokens differently.
SPLIT_INVARIANT_LOSSES = frozenset({"grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo"})


def micro_steps_per_round(k: Knobs, world_size: int = 1) -> float:
    """The micro-steps one generation round serves (TRL's resolved ``steps_per_generation``): what a micro-batch split
    doubles, each micro-step reading the weights again.

    >>> micro_steps_per_round(Knobs(per_device_train_batch_size=4, gradient_accumulation_steps=8))
    8
    """
    return k.geometry(world_size)[2]


def rounds_per_step(k: Knobs, world_size: int = 1) -> float:
    """Generation rounds per optimizer step: the accumulation steps over the micro-steps a round serves (below 1
    where one round serves several steps). What ``generation_rounds`` doubles: decoding reads every weight once per
    token, however many rows a round has, so two rounds of half the rows take about twice as long.

    >>> rounds_per_step(Knobs(gradient_accumulation_steps=8, steps_per_generation=2))
    4.0
    """
    _, ga, spg = k.geometry(world_size)
    return ga / spg


def split_caveat(loss_type: str | None) -> str:
    """What a micro-batch split does to the gradients under ``loss_type`` beyond time: nothing for the loss types
    that normalise per sequence or per generation batch, a reweighting for those that normalise per micro-batch.

    >>> split_caveat("dapo"), split_caveat("bnpo")
    ('', '; bnpo normalises each micro-batch by its own tokens, so the gradients change slightly')
    """
    if loss_type is None or loss_type in SPLIT_INVARIANT_LOSSES:
        return ""
    if loss_type == "bnpo":
        return "; bnpo normalises each micro-batch by its own tokens, so the gradients change slightly"
    return f"; whether loss_type {loss_type} keeps the gradients under a split is not known"


# TRL's loss types that normalise a micro-batch's loss by the tokens of the whole generation batch, scaled to one
# accumulation window (TRL 1.16's GRPOTrainer._compute_loss: num_items_in_batch * GA / steps_per_generation): with
# smaller generation rounds each round's tokens stand in for the optimizer step's.
ROUND_NORMALISED_LOSSES = frozenset({"dapo", "cispo", "vespo"})


def rounds_caveat(loss_type: str | None) -> str:
    """What generating an optimizer step's completions in several rounds does to the gradients under ``loss_type``.

    >>> rounds_caveat("grpo"), rounds_caveat("dapo")
    ('', "; dapo normalises by a round's tokens scaled to the step, not the step's own, so the gradients change slightly")
    """
    if loss_type is not None and loss_type in ROUND_NORMALISED_LOSSES:
        return (f"; {loss_type} normalises by a round's tokens scaled to the step, not the step's own, so the "
                "gradients change slightly")
    return ""


def _rows(n: int) -> str:
    return f"{n} row{'' if n == 1 else 's'}"


@register
class FewerGenerations(Remedy):
    name = "fewer_generations"
    summary = "Generate fewer completions per device: halve num_generations and the rows per generation round."
    cost = "signal"
    trade_note = "fewer samples per prompt make group advantages noisier"
    resume = "continue-drift"
    graded = True
    changes = ("num_generations", "per_device_train_batch_size", "steps_per_generation", "generation_batch_size",
               "gradient_accumulation_steps")
    shrinks_shapes = True
    params = {"min_generations": Param(2, int, low=2, text="the fewest completions per prompt it goes down to")}

    # what GRPO learns from, read from several knobs: the prompts per optimizer step (the group's cut is
    # num_generations' own cost, in the knob table)
    signal_cost = cut(1.0, of=Knobs.prompts_per_step, what="of the prompts per optimizer step")

    ROWS_ONLY = "fewer_prompts_per_step"
    ROWS_ONLY_NOTE = ("fewer prompts per optimizer step (num_generations kept): each step averages over fewer "
                      "groups, and an epoch takes more steps")

    def name_for(self, changes: Mapping[str, Any]) -> str:
        """``fewer_prompts_per_step`` when the choice kept the user's num_generations and only the rows per device
        shrank (fewer prompts per step, every group whole).

        >>> FewerGenerations().name_for({"per_device_train_batch_size": 12})
        'fewer_prompts_per_step'
        >>> FewerGenerations().name_for({"num_generations": 8, "per_device_train_batch_size": 8})
        'fewer_generations'
        """
        if set(self.changes) & set(changes) and "num_generations" not in changes:
            return self.ROWS_ONLY
        return self.name

    def trade_for(self, changes: Mapping[str, Any]) -> str:
        if self.name_for(changes) == self.ROWS_ONLY:
            return self.ROWS_ONLY_NOTE
        return super().trade_for(changes)

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> user = TRL_DEFAULTS.replace(num_generations=8, per_device_train_batch_size=8)
        >>> FewerGenerations().describe_change(user, user.replace(num_generations=4, per_device_train_batch_size=4))
        '4 generations per prompt (yours: 8)'
        >>> FewerGenerations().describe_change(user, user.replace(per_device_train_batch_size=4))
        '0.5 prompts per step (yours: 1)'
        """
        parts = []
        g_user, g = user.num_generations or 8, final.num_generations or 8
        if g != g_user:
            parts.append(f"{g} generations per prompt (yours: {g_user})")
        p_user, p = user.prompts_per_step(world_size), final.prompts_per_step(world_size)
        if abs(p - p_user) > 1e-9:
            parts.append(f"{p:g} prompt{'' if p == 1 else 's'} per step (yours: {p_user:g})")
        return ", ".join(parts) or self.name

    def _candidate(self, ctx: Context) -> Knobs | None:
        k = ctx.knobs
        world = ctx.facts.world_size
        g = ctx.value("num_generations")
        bs, ga, spg = k.geometry(world)
        rows = bs * spg
        floor = int(self.p["min_generations"])
        new_g = max(floor, g // 2)
        derived_spg = k.steps_per_generation is None and k.generation_batch_size is None
        options = []
        for b in range(bs, 0, -1):
            for s in range(spg, 0, -1):
                r = b * s
                if r >= rows or (r * world) % new_g:
                    continue
                options.append((r <= rows // 2, r, s, b))
        if not options:
            return None
        # Prefer halving (or the nearest step below it), keep steps_per_generation, shrink the micro-batch first.
        options.sort(key=lambda o: (not o[0], -o[1] if o[0] else o[1], -o[2]))
        _, _, s, b = options[0]
        new_ga = s if derived_spg and s != spg else ga
        out = k.replace(num_generations=new_g) if new_g != g else k
        out = out.with_geometry(b, new_ga, s, world)
        return None if out.validate(world) else out

    def blocked(self, ctx: Context) -> str | None:
        if self._candidate(ctx) is None:
            return (f"at its floor: num_generations {ctx.value('num_generations')} and "
                    f"{ctx.knobs.rows_per_device(ctx.facts.world_size)} rows per device cannot shrink further")
        return None

    def apply(self, ctx: Context) -> Knobs:
        out = self._candidate(ctx)
        assert out is not None
        return out

    def with_values(self, knobs: Knobs, values: Mapping[str, Any], world_size: int = 1) -> Knobs:
        """The relaxed values as the rows generated per device (and the number of generations), laid over the batch
        split of ``knobs``: a micro-batch split before this rung stays a split of the rows kept, and goes when the
        split does (the values alone would keep the split they were read with).

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> values = {"num_generations": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
        ...           "steps_per_generation": 2}                       # 4 rows, read in 2 micro-steps of 2
        >>> k = FewerGenerations().with_values(TRL_DEFAULTS.replace(per_device_train_batch_size=8), values)
        >>> k.geometry(), k.rows_per_device()                           # without the split: 4 rows at once
        ((4, 1, 1), 4)
        """
        absolute = knobs.replace(**values)
        rows = absolute.rows_per_device(world_size)
        _, ga_in, spg_in = knobs.geometry(world_size)
        if rows % spg_in == 0:
            out = knobs.replace(num_generations=absolute.num_generations).with_geometry(
                rows // spg_in, ga_in, spg_in, world_size)
            if not out.validate(world_size):
                return out
        return absolute

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Generation counts and rows per device between the climbed and the user's: the most generations first, then
        the most rows, keeping the climbed steps_per_generation.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> now = TRL_DEFAULTS.replace(num_generations=4, per_device_train_batch_size=4)
        >>> [(k.num_generations, k.per_device_train_batch_size) for k in FewerGenerations().relax(TRL_DEFAULTS, now)]
        [(7, 7), (6, 6), (5, 5), (4, 8)]
        >>> user = TRL_DEFAULTS.replace(per_device_train_batch_size=16)      # 8 generations of 2 prompts
        >>> now = user.replace(num_generations=2, per_device_train_batch_size=2)
        >>> [(k.num_generations, k.per_device_train_batch_size) for k in FewerGenerations().relax(user, now)][:4]
        [(8, 8), (7, 14), (7, 7), (6, 12)]
        """
        g_user, g_now = user.num_generations or 8, current.num_generations or 8
        bs_user, _, spg_user = user.geometry(world_size)
        bs_now, ga_now, spg_now = current.geometry(world_size)
        rows_user, rows_now = bs_user * spg_user, bs_now * spg_now
        out = []
        for g in range(g_user, max(2, g_now) - 1, -1):
            for b in range(max(bs_user, bs_now), 0, -1):  # the most rows first, then fewer: the device decides
                rows = b * spg_now
                if not rows_now <= rows <= rows_user or (rows * world_size) % g:
                    continue
                if (g, rows) in ((g_user, rows_user), (g_now, rows_now)):
                    continue
                k = current.replace(num_generations=g).with_geometry(b, ga_now, spg_now, world_size)
                if not k.validate(world_size):
                    out.append(k)
        return out

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Halving the rows generated per device halves the KV cache and the scoring and "
                                 "training batches built from them.",
                      halve_request(d) if d.phase in ("generation", "scoring", "forward", "backward") else None)


@register
class MicroBatch(Remedy):
    name = "micro_batch"
    summary = "Halve per_device_train_batch_size and double gradient_accumulation_steps: same effective batch."
    cost = "speed"
    trade_note = "more, smaller micro-steps; the effective batch and the generation rows stay the same"
    resume = "continue-drift"
    graded = True
    changes = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")
    follows = ("steps_per_generation", "generation_batch_size")  # the rows generated per round stay
    shrinks_shapes = True
    params = {"min_batch": Param(1, int, low=1, text="the smallest per_device_train_batch_size it goes down to")}
    speed_cost = doubling(0.05, of=micro_steps_per_round, what="micro-steps per generation round: the weights read "
                                                                "again in each, in a step that generation dominates")

    def with_values(self, knobs: Knobs, values: Mapping[str, Any], world_size: int = 1) -> Knobs:
        """The micro-batch and accumulation steps of ``values``, with the rows generated per round of ``knobs``
        kept (a split never changes them; generation_rounds does).

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> k = TRL_DEFAULTS.replace(per_device_train_batch_size=16)
        >>> MicroBatch().with_values(k, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
        ...                               "steps_per_generation": 2}).geometry()
        (2, 8, 8)
        """
        bs_in, _, spg_in = knobs.geometry(world_size)
        bs = int(values.get("per_device_train_batch_size") or bs_in)
        ga = int(values.get("gradient_accumulation_steps") or knobs.geometry(world_size)[1])
        rows = bs_in * spg_in
        if rows % bs == 0:
            out = knobs.with_geometry(bs, ga, rows // bs, world_size)
            if not out.validate(world_size):
                return out
        return knobs.replace(**values)

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> user = TRL_DEFAULTS.replace(per_device_train_batch_size=8, gradient_accumulation_steps=2)
        >>> MicroBatch().describe_change(user, user.replace(per_device_train_batch_size=2, gradient_accumulation_steps=8))
        '8 micro-steps of 2 rows per step (yours: 2 of 8)'
        >>> user = user.replace(loss_type="bnpo")
        >>> MicroBatch().describe_change(user, user.replace(per_device_train_batch_size=4, gradient_accumulation_steps=4))
        '4 micro-steps of 4 rows per step (yours: 2 of 8); bnpo normalises each micro-batch by its own tokens, so the gradients change slightly'
        """
        bs_u, ga_u, _ = user.geometry(world_size)
        bs, ga, _ = final.geometry(world_size)
        return f"{ga} micro-steps of {_rows(bs)} per step (yours: {ga_u} of {bs_u}){split_caveat(final.loss_type)}"

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.phase == "generation":
            return "generation memory is set by the rows per device, which a micro-batch split keeps"
        return super().helps(d)

    def _split(self, ctx: Context) -> tuple[int, int] | None:
        bs, _, _ = ctx.knobs.geometry(ctx.facts.world_size)
        for d in range(2, bs + 1):
            if bs % d == 0 and bs // d >= int(self.p["min_batch"]):
                return bs // d, d
        return None

    def blocked(self, ctx: Context) -> str | None:
        if self._split(ctx) is None:
            return f"per_device_train_batch_size is at its floor ({ctx.knobs.geometry(ctx.facts.world_size)[0]})"
        return None

    def apply(self, ctx: Context) -> Knobs:
        split = self._split(ctx)
        assert split is not None
        new_bs, d = split
        k = ctx.knobs
        _, ga, spg = k.geometry(ctx.facts.world_size)
        return k.with_geometry(new_bs, ga * d, spg * d, ctx.facts.world_size)

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Micro-batches between the climbed and the user's (largest first), with the same effective batch.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> now = TRL_DEFAULTS.replace(per_device_train_batch_size=1, gradient_accumulation_steps=8)
        >>> [k.per_device_train_batch_size for k in MicroBatch().relax(TRL_DEFAULTS, now)]
        [4, 2]
        """
        bs_user, ga_user, _ = user.geometry(world_size)
        bs_now, _, spg_now = current.geometry(world_size)
        rows = bs_now * spg_now  # the rows generated per round in force: a split keeps them
        out = []
        for b in range(bs_user - 1, bs_now, -1):
            if bs_user % b or rows % b:
                continue
            d = bs_user // b
            k = current.with_geometry(b, ga_user * d, rows // b, world_size)
            if not k.validate(world_size):
                out.append(k)
        return out

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "A micro-batch half as large halves the activations and log-prob passes of each "
                                 "step, and gradient accumulation keeps the effective batch.",
                      halve_request(d) if d.phase in ("scoring", "forward", "backward") else None)


@register
class GenerationRounds(Remedy):
    """Fewer rows generated (and scored) at once: an optimizer step's completions in several rounds.

    TRL generates ``per_device_train_batch_size x steps_per_generation`` rows per device at once (the generation
    batch) and trains on them over ``steps_per_generation`` micro-steps; a micro-batch split keeps that product. This
    lowers ``steps_per_generation`` (or ``generation_batch_size``, where the user set that) to a divisor of the
    accumulation steps, so each round holds whole groups and ends with the optimizer step: the rows per optimizer
    step, the generations per prompt, the completion length and the weights each round generates with all stay. What
    it costs is time: more generate calls, each with fewer rows (and the gradients of the step's earlier micro-steps
    are held while a later round generates, which the memory model counts).
    """

    name = "generation_rounds"
    summary = ("Generate each optimizer step's completions in smaller rounds: lower steps_per_generation, so fewer "
               "rows are generated and scored at once; the rows per step, generations and completion length stay.")
    cost = "speed"
    trade_note = "more generate calls per optimizer step, each with fewer rows; what is generated and learned stays"
    resume = "continue-drift"
    graded = True
    changes = ("steps_per_generation", "generation_batch_size")
    shrinks_shapes = True
    # memory/steptime.py's roofline: the first halving of the rows per round adds 75% to 95% of a step on 1B-3B models
    speed_cost = doubling(0.8, of=rounds_per_step, what="generation rounds per optimizer step: decoding reads every "
                                                        "weight once per token whatever the rows, and generation is "
                                                        "most of a step")

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> user = TRL_DEFAULTS.replace(per_device_train_batch_size=4, gradient_accumulation_steps=8, num_generations=8,
        ...                             loss_type="grpo")
        >>> GenerationRounds().describe_change(user, user.replace(steps_per_generation=2))
        '4 generation rounds of 8 rows per optimizer step (yours: 1 of 32)'
        """
        bs_u, ga_u, spg_u = user.geometry(world_size)
        bs, ga, spg = final.geometry(world_size)
        return (f"{_rounds(ga, spg)} of {_rows(bs * spg)} per optimizer step (yours: {_rounds(ga_u, spg_u, short=True)} "
                f"of {bs_u * spg_u}){rounds_caveat(final.loss_type)}")

    def helps(self, d: Diagnosis | None) -> str | None:
        if d is not None and d.phase not in ("generation", "scoring", "unknown"):
            return (f"the OOM came in {d.phase}, which the micro-batch sets, not how many rows are generated at "
                    "once")
        return super().helps(d)

    def _options(self, k: Knobs, world: int) -> list[int]:
        """The smaller steps_per_generation values that keep whole groups and end each round with an optimizer step
        (a divisor of the accumulation steps, or a multiple of them below a generation that spans several steps),
        largest first."""
        bs, ga, spg = k.geometry(world)
        g = k.num_generations or 8
        out = []
        for s in range(spg - 1, 0, -1):
            if not (ga % s == 0 or s % ga == 0) or (bs * world * s) % g:
                continue
            cand = k.with_geometry(bs, ga, s, world)
            if not cand.validate(world):
                out.append(s)
        return out

    def blocked(self, ctx: Context) -> str | None:
        if not self._options(ctx.knobs, ctx.facts.world_size):
            bs, _, spg = ctx.knobs.geometry(ctx.facts.world_size)
            return (f"each round already generates as few rows as whole groups allow ({bs * spg} rows per device "
                    "at once)")
        return None

    def apply(self, ctx: Context) -> Knobs:
        k, world = ctx.knobs, ctx.facts.world_size
        bs, ga, spg = k.geometry(world)
        options = self._options(k, world)
        halved = [s for s in options if s <= spg // 2]
        return k.with_geometry(bs, ga, (halved or options)[0], world)

    ROWS = "rows_per_round"  # what a relaxed rung keeps: the rows generated per round, whatever the micro-batch

    def values_of(self, knobs: Knobs, world_size: int = 1) -> tuple[tuple[str, Any], ...]:
        """The rows generated per round, besides the knobs themselves: replayed before a micro-batch split, the rung
        keeps the rows, and the split keeps them too.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> GenerationRounds().values_of(TRL_DEFAULTS.with_geometry(2, 8, 4))[-1]
        ('rows_per_round', 8)
        """
        return (*super().values_of(knobs, world_size), (self.ROWS, knobs.rows_per_device(world_size)))

    def with_values(self, knobs: Knobs, values: Mapping[str, Any], world_size: int = 1) -> Knobs:
        """``knobs`` generating ``values``' rows per round, in micro-batches of the ``knobs``' own.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> k = TRL_DEFAULTS.replace(per_device_train_batch_size=8, gradient_accumulation_steps=2)
        >>> GenerationRounds().with_values(k, {"steps_per_generation": 8, "rows_per_round": 8}).geometry()
        (8, 2, 1)
        """
        bs, ga, _ = knobs.geometry(world_size)
        rows = values.get(self.ROWS)
        if isinstance(rows, int) and rows % bs == 0:
            out = knobs.with_geometry(bs, ga, rows // bs, world_size)
            if not out.validate(world_size):
                return out
        return knobs.replace(**{k: v for k, v in values.items() if k != self.ROWS})

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Rounds between the climbed and the user's rows per round (in micro-batches of the one in force: a split
        before keeps them), the most rows per round first.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> user = TRL_DEFAULTS.replace(per_device_train_batch_size=2, gradient_accumulation_steps=8, num_generations=2)
        >>> [k.steps_per_generation for k in GenerationRounds().relax(user, user.replace(steps_per_generation=1))]
        [4, 2]
        >>> user = TRL_DEFAULTS.replace(per_device_train_batch_size=16, num_generations=4)   # 16 rows at once
        >>> split = user.with_geometry(1, 16, 2)                                          # 1 row, rounds of 2
        >>> [k.steps_per_generation for k in GenerationRounds().relax(user, split)]
        [8, 4]
        """
        bs, ga, spg_now = current.geometry(world_size)
        bs_user, _, spg_user = user.geometry(world_size)
        rounds_user = bs_user * spg_user // bs  # the user's rows per round, in micro-batches of the one in force
        out = []
        for s in range(rounds_user - 1, spg_now, -1):
            if not (ga % s == 0 or s % ga == 0) or (bs * world_size * s) % (current.num_generations or 8):
                continue
            k = current.with_geometry(bs, ga, s, world_size)
            if not k.validate(world_size):
                out.append(k)
        return out

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Generating an optimizer step's completions in two rounds halves the KV cache and "
                                 "the rows scored at once; the rows per step stay.",
                      halve_request(d) if d.phase in ("generation", "scoring") else None)


def _rounds(ga: int, spg: int, short: bool = False) -> str:
    """How many generation rounds make one optimizer step (or how many steps one round serves)."""
    if spg >= ga:
        n = spg // max(1, ga)
        return "1" if short else (f"1 generation round per {n} optimizer steps" if n > 1 else "1 generation round")
    n = ga // spg
    return str(n) if short else f"{n} generation rounds"
