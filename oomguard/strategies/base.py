"""The Remedy contract: a small, pure transform of Knobs that says when it applies and what it trades.

A remedy answers four questions, each a method:

- ``helps(diagnosis)``: can this remedy address this kind of OOM in this phase? (``None`` = yes, else why not)
- ``blocked(ctx)``: can it apply to this run now? Already in force, at its floor, missing a prerequisite.
- ``apply(ctx)``: the new Knobs. Pure: no I/O, no torch.
- ``advise(diagnosis)``: for ``oomguard analyze``, a reason and, where the figures allow, the bytes it frees.

Class attributes state what a remedy costs the experiment (``cost``, one of :data:`COST_CLASSES`, cheapest first;
within the classes the choice weighs, speed and signal, how much: declared on the knobs it writes, or on the remedy
where what it moves is read from several knobs, ``speed_cost``/``signal_cost``, see :meth:`Remedy.undeclared_cost`)
and whether a checkpoint can continue after it (``resume``: ``continue``, ``continue-drift`` with a warning that the
data position drifts, or ``new-run`` from the checkpoint's weights).

The cost classes, cheapest first (the default choice prefers a config whose costliest change is in a lower class):

- ``none``: how memory is handed out (allocator settings, emptying the cache); what is trained and how fast barely
  change.
- ``speed``: how the step is computed (a micro-batch split that keeps the generation batch and the effective batch,
  checkpointing, ZeRO sharding and offload): the same gradients, more time.
- ``precision``: the numbers the update is made of (bf16 master weights, 8-bit optimizer moments).
- ``capacity``: what is trained (LoRA adapters instead of the full model, then a 4-bit base).
- ``signal``: what GRPO learns from (fewer prompts per step, fewer generations per prompt, shorter completions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from oomguard.vocab.diagnosis import LEAK_KINDS, OVERFLOW_FACTOR, Diagnosis
from oomguard.vocab.knobcost import Cost
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.knobtable import TABLE

from .params import Param

REGISTRY: dict[str, type[Remedy]] = {}

# What a remedy costs the experiment, cheapest first (see the module's docstring).
COST_CLASSES = ("none", "speed", "precision", "capacity", "signal")
# The older, coarser words for the same (``Remedy.trades``): what reports and ladders listed before cost classes.
_TRADES = {"none": "nothing", "speed": "speed"}
# The classes whose changes the choice weighs by how far they go (``decide/cheapest.py``), and the attribute that
# declares it, on a knob's entry (``KnobInfo``) or on the remedy.
WEIGHED = {"speed": "speed_cost", "signal": "signal_cost"}


def cost_rank(cost: str) -> int:
    """A cost class's place, cheapest first (an unknown class counts as the costliest).

    >>> cost_rank("none") < cost_rank("speed") < cost_rank("precision") < cost_rank("capacity") < cost_rank("signal")
    True
    """
    return COST_CLASSES.index(cost) if cost in COST_CLASSES else len(COST_CLASSES)


@dataclass(frozen=True)
class Context:
    """What a remedy may look at: the effective knobs, facts about the run, the last diagnosis, and history."""

    knobs: Knobs
    facts: RunFacts = field(default_factory=RunFacts)
    diagnosis: Diagnosis | None = None
    used: Mapping[str, int] = field(default_factory=dict)
    read_fields: frozenset[str] | None = None  # the knobs that reach the training code; None = all
    subject: str = "the command"  # who reads the knobs, for messages ("the function" under guard())
    refused: Mapping[str, str] = field(default_factory=dict)  # rungs taken back after they broke a launch, with why

    def value(self, name: str) -> Any:
        v = getattr(self.knobs, name)
        return getattr(TRL_DEFAULTS, name) if v is None else v


@dataclass(frozen=True)
class Advice:
    name: str
    reason: str
    frees_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "reason": self.reason, "frees_bytes": self.frees_bytes}


def register(cls: type[Remedy]) -> type[Remedy]:
    REGISTRY[cls.name] = cls
    return cls


class Remedy:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    cost: ClassVar[str] = "none"  # one of COST_CLASSES: what it costs the experiment
    trade_note: ClassVar[str] = ""
    resume: ClassVar[str] = "continue"  # continue | continue-drift | new-run
    graded: ClassVar[bool] = False
    changes: ClassVar[tuple[str, ...]] = ()  # the knobs it writes
    # knobs it writes only to keep something else as it was (a micro-batch split's steps_per_generation keeps the rows
    # generated per round): the diff names it for them only where no other rung changed them
    follows: ClassVar[tuple[str, ...]] = ()
    # Which diagnoses it addresses: "gpu" (any GPU shortage), "fragmentation", "host", "vllm".
    addresses: ClassVar[str] = "gpu"
    shrinks_shapes: ClassVar[bool] = False  # acts on per-step tensors (helps an oversized request)
    helps_at_load: ClassVar[bool] = False  # reduces what model loading itself needs
    helps_optimizer: ClassVar[bool] = False  # reduces persistent state (weights, grads, optimizer states)
    sizes_buffers: ClassVar[bool] = False  # sizes a framework's own buffers (DeepSpeed's buckets)
    params: ClassVar[Mapping[str, Param]] = {}  # what a ladder file may set, typed (oomguard.strategies.params)
    # packages the training environment must import for this remedy: unless the class says, those of the knobs it
    # writes (the knob table's ``package``)
    requires: ClassVar[tuple[str, ...]] = ()
    # what the rung costs within its class where that is read from several knobs rather than from each knob it writes
    # (``Cost.of``): the micro-steps per generation round of a micro-batch split, say
    speed_cost: ClassVar[Cost | None] = None
    signal_cost: ClassVar[Cost | None] = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "requires" not in cls.__dict__:
            cls.requires = tuple(dict.fromkeys(TABLE[k].package for k in cls.changes if k in TABLE and TABLE[k].package))

    def __init__(self, **params: Any) -> None:
        unknown = set(params) - set(self.params)
        if unknown:
            raise ValueError(f"remedy {self.name!r} takes no parameter(s) {', '.join(sorted(unknown))}"
                             + (f"; it takes {', '.join(self.params)}" if self.params else "; it takes none"))
        for key, value in params.items():
            problem = self.params[key].check(key, value)
            if problem:
                raise ValueError(f"remedy {self.name!r}: {problem}")
        self.p = {**{k: v.default for k, v in self.params.items()}, **params}

    @property
    def trades(self) -> str:
        """The coarse word for ``cost``: ``nothing``, ``speed`` or ``quality`` (precision, capacity and signal).

        >>> from oomguard.strategies import make_remedy
        >>> make_remedy("bf16_load").trades, make_remedy("micro_batch").trades
        ('quality', 'speed')
        """
        return _TRADES.get(self.cost, "quality")

    def __repr__(self) -> str:
        extra = {k: v for k, v in self.p.items() if self.params[k].default != v}
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in extra.items())})"

    # -- the four questions ------------------------------------------------------------------------------------
    def helps(self, d: Diagnosis | None) -> str | None:
        if d is None:
            return None
        if d.kind in LEAK_KINDS:
            return "the run leaks memory step after step: no config change cures that, only a fix to the code"
        if self.addresses == "host":
            return None if d.kind == "host-ram" else "it addresses host RAM, and the GPU ran out"
        if d.kind == "host-ram":
            return "the host ran out of RAM; this remedy changes GPU memory"
        if self.addresses == "vllm":  # a run without vLLM colocate never gets here (``foreign``)
            if d.kind == "impossible":
                return "the single request exceeds the whole device, whatever vLLM reserves"
            return None  # vLLM's own OOM, or training beside its reservation: a smaller one gives training room
        if d.kind == "vllm-reservation" and d.report.origin != "vllm-startup":
            return "vLLM's own reservation ran out; vllm_gpu_memory_utilization decides it"
        if self.addresses == "fragmentation":
            if d.kind == "fragmentation":
                return None
            return f"no fragmentation (the diagnosis is {d.kind}), and allocator settings only help fragmentation"
        if d.kind == "impossible":
            r = d.report
            limit = r.allowed or r.capacity or 0
            if r.requested and limit and r.requested > OVERFLOW_FACTOR * limit:
                return "the request is an overflowed shape (far larger than the device); fix the shape"
            if d.buffer is not None:  # a framework's buffer, sized by its config, not by the step's shapes
                return None if self.sizes_buffers else f"the single request is {d.buffer}; only its size can change it"
            if d.phase == "load" and not self.helps_at_load:  # a weight tensor: only a smaller load shrinks it
                return "the single request exceeds the device while loading; only a smaller load can help"
            if not self.shrinks_shapes and d.phase != "load":
                return "the single request exceeds the device; only smaller shapes can help"
        if d.phase == "load" and not self.helps_at_load:
            return "the OOM came while loading the model, before any training memory exists"
        if d.phase == "optimizer" and not self.helps_optimizer:
            return "the OOM came in the optimizer step, whose state does not depend on this knob"
        return None

    @classmethod
    def undeclared_cost(cls) -> str | None:
        """Why what this rung costs within its class is not declared, or None. A rung of a class the choice weighs
        (``speed``, ``signal``) declares it on itself (``speed_cost``), or on every knob it writes (the knob table's
        ``speed_cost``), 0 included where it costs nothing: a cost left out would count as 0 and make the rung look
        free. Checked when a ladder is loaded.

        >>> from oomguard.strategies import make_remedy
        >>> make_remedy("checkpointing").undeclared_cost() is None
        True
        >>> class Faster(Remedy):
        ...     name, cost, changes = "faster", "speed", ("torch_empty_cache_steps",)
        >>> Faster.undeclared_cost()
        'rung faster (cost class speed) declares no speed_cost for torch_empty_cache_steps: declare it in the knob table (speed_cost=, 0 where it costs nothing) or on the remedy'
        """
        attr = WEIGHED.get(cls.cost)
        if attr is None or getattr(cls, attr) is not None:
            return None
        missing = [k for k in cls.changes if k not in cls.follows and getattr(TABLE[k], attr) is None]
        if not cls.changes or missing:
            return (f"rung {cls.name} (cost class {cls.cost}) declares no {attr} for {', '.join(missing) or 'itself'}: "
                    f"declare it in the knob table ({attr}=, 0 where it costs nothing) or on the remedy")
        return None

    def foreign(self, ctx: Context) -> str | None:
        """Why this rung has nothing to do with this kind of run (no vLLM, no DeepSpeed, one rank), or None. A ladder
        passes such a rung over without a word: it was never a candidate, unlike a rung ``blocked`` for a reason
        the user may want to read (already in force, at its floor).

        >>> from oomguard.strategies import make_remedy
        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> make_remedy("vllm_memory").foreign(Context(knobs=TRL_DEFAULTS))
        'the run does not use vLLM'
        """
        return None

    def blocked(self, ctx: Context) -> str | None:
        return None

    def apply(self, ctx: Context) -> Knobs:
        raise NotImplementedError

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, self.summary)

    def trade_for(self, changes: Mapping[str, Any]) -> str:
        """What this rung trades, given the knobs a climb really changed (``{knob: new value}``, possibly holding
        other rungs' knobs too): the class's ``trade_note``, or nothing when none of the knobs it writes changed (a
        rung the memory model found not needed). Overridden where the trade depends on which of its knobs changed.

        >>> from oomguard.strategies import make_remedy
        >>> make_remedy("checkpointing").trade_for({"gradient_checkpointing": True})
        "about 20-30% slower: each layer's forward runs twice"
        >>> make_remedy("checkpointing").trade_for({"max_completion_length": 64})
        ''
        """
        if self.changes and not set(self.changes) & set(changes):
            return ""
        return self.trade_note

    def name_for(self, changes: Mapping[str, Any]) -> str:
        """What this rung did, named by the knobs it really changed (``{knob: new value}``): its name, unless the
        choice left it doing something narrower that deserves its own name (see ``FewerGenerations``). Messages and
        the diff show it; reports keep ``name`` as the rung's identifier.

        >>> from oomguard.strategies import make_remedy
        >>> make_remedy("checkpointing").name_for({"gradient_checkpointing": True})
        'checkpointing'
        """
        return self.name

    def with_values(self, knobs: Knobs, values: Mapping[str, Any], world_size: int = 1) -> Knobs:
        """``knobs`` with this rung set to ``values``, the values a relaxed rung keeps (one of ``relax``'s
        candidates, read from the knobs it was relaxed on): as given, unless the rung means them relative to what it
        applies to (see ``FewerGenerations``), so that a rung before it that changes or leaves the same knobs keeps
        its own effect.

        >>> from oomguard.strategies import make_remedy
        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> make_remedy("shorter_sequences").with_values(TRL_DEFAULTS, {"max_completion_length": 96}).max_completion_length
        96
        """
        return knobs.replace(**values)

    def values_of(self, knobs: Knobs, world_size: int = 1) -> tuple[tuple[str, Any], ...]:
        """What a relaxed rung keeps of ``knobs`` (one of ``relax``'s candidates), for ``with_values`` to lay over the
        knobs it is replayed on: the values of the knobs it writes; a rung whose values mean something relative to
        other knobs keeps that too (see ``GenerationRounds``).

        >>> from oomguard.strategies import make_remedy
        >>> make_remedy("shorter_sequences").values_of(TRL_DEFAULTS)
        (('max_completion_length', 512), ('max_prompt_tokens', None))
        """
        return tuple((k, getattr(knobs, k)) for k in self.changes)

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """What this rung changed of the user's run, in words a user reads at the end ("bf16 weights (yours:
        float32)"); ``final`` is the whole config in force. Overridden by each remedy; this one names the knobs.

        >>> from oomguard.strategies import make_remedy
        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> Remedy.describe_change(make_remedy("vllm_memory"), TRL_DEFAULTS,
        ...                        TRL_DEFAULTS.replace(vllm_gpu_memory_utilization=0.2))
        'vllm_memory: vllm_gpu_memory_utilization=0.2'
        """
        changed = [f"{r.knob}={r.after}" for r in user.diff(final) if r.knob in self.changes]
        return f"{self.name}: {', '.join(changed)}" if changed else self.name

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Knobs between the user's values and ``current`` for this rung's knobs, closest to the user's first.

        Only graded rungs have such middle steps (a completion length between 256 and 512, say). The climb takes the
        first one the memory model predicts to fit, so a graded knob stays as close to the user's value as the memory
        allows instead of at the blind step the ladder took. Every returned Knobs passes ``validate(world_size)``.
        """
        return []

    # -- helpers -----------------------------------------------------------------------------------------------
    def missing(self, ctx: Context) -> str | None:
        """A package this remedy needs that the training environment cannot import (the training process reports
        which; the supervisor's own environment may differ)."""
        lacking = [p for p in self.requires if p in ctx.facts.missing_packages]
        if lacking:
            return (f"it needs {' and '.join(lacking)}, which the training environment cannot import "
                    f"(pip install {' '.join(lacking)} to let oomguard use it)")
        return None

    def lacking(self, ctx: Context, new: Knobs) -> str | None:
        """A knob this rung would change (``ctx.knobs`` -> ``new``) that the installed TRL has no way to take (no such
        GRPOConfig field or trainer argument; the training process reports which, ``RunFacts.trl_lacks``), so the
        change could not reach the training.

        >>> from oomguard.strategies import make_remedy
        >>> ctx = Context(knobs=TRL_DEFAULTS, facts=RunFacts(trl_version="9.0.0", trl_lacks=("max_completion_length",)))
        >>> r = make_remedy("shorter_sequences")
        >>> r.lacking(ctx, r.apply(ctx))
        'the installed TRL (9.0.0) has no way to take max_completion_length'
        """
        lacks = set(ctx.facts.trl_lacks)
        if not lacks:
            return None
        gone = [row.knob for row in ctx.knobs.diff(new) if row.knob in lacks]
        if not gone:
            return None
        if ctx.facts.stack:
            return f"{ctx.facts.stack} has no way to take {', '.join(gone)}"
        return f"the installed TRL ({ctx.facts.trl_version or 'version unknown'}) has no way to take {', '.join(gone)}"

    def unread(self, ctx: Context) -> str | None:
        """The knobs this remedy changes never reach the code that ran (a function that does not read them, or a
        command that built no GRPOConfig), so changing them cannot help."""
        if ctx.read_fields is None or not self.changes:
            return None
        if not (set(self.changes) & ctx.read_fields):
            return f"{ctx.subject} never reads {', '.join(self.changes)}"
        return None


def halve_request(d: Diagnosis) -> int | None:
    """Bytes freed by halving the shape of the failing request (it scales linearly with batch rows or length)."""
    return d.report.requested // 2 if d.report.requested else None
