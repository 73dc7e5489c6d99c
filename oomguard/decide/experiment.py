"""What a config keeps of the user's experiment and what it changes, in the words of the cost classes.

The end of a run says what was given up: "kept: 8 generations per prompt, 256-token completions, 1 prompt per step,
a full fine-tune; changed: bf16 weights (yours: float32) (precision), 4 micro-steps of 2 rows per step (yours: 1 of
8) (speed, about +3% time per step predicted)". Each change is the remedy's own words (``Remedy.describe_change``)
and its cost class (``Remedy.cost``); a speed change carries the predicted slowdown of a step
(``oomguard.memory.steptime``) when the caller can predict one.

>>> from oomguard.strategies import make_remedy
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> user = TRL_DEFAULTS.replace(max_completion_length=256, num_generations=8, per_device_train_batch_size=8,
...                             learning_rate=1e-4)
>>> final = user.replace(dtype="bfloat16")
>>> e = summarise(user, final, [make_remedy("bf16_load")], {"dtype": "bf16_load"})
>>> e.lines()
['kept: 8 generations per prompt, 256-token completions, 1 prompt per step, a full fine-tune', 'changed: bf16 weights (yours: float32) (precision)']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..strategies import Remedy, cost_rank
from ..strategies.precision import frozen, precision_warning
from ..vocab.knobs import Knobs, RunFacts

# What the end of a run says when the training process never reported a GRPO config: nothing is known to be kept.
UNSEEN = "nothing known: the command built no GRPOConfig that oomguard could read"


@dataclass(frozen=True)
class Change:
    """One rung's change of the user's run: its remedy, cost class, words, and for a speed change the predicted
    extra time per step (0.03 for 3%), when known."""

    remedy: str
    cost: str
    what: str
    slowdown: float | None = None

    def text(self) -> str:
        """``what (cost)``, with the time a speed change costs.

        >>> Change("micro_batch", "speed", "4 micro-steps of 2 rows per step", 0.031).text()
        '4 micro-steps of 2 rows per step (speed, about +3% time per step predicted)'
        """
        time = ""
        if self.slowdown is not None and self.cost == "speed":
            time = f", about {self.slowdown:+.0%} time per step predicted"
        return f"{self.what} ({self.cost}{time})"

    def to_dict(self) -> dict[str, Any]:
        return {"remedy": self.remedy, "cost": self.cost, "change": self.what, "slowdown": self.slowdown}


@dataclass(frozen=True)
class Experiment:
    """What a config keeps of the user's GRPO experiment and what it changes (costliest first)."""

    kept: list[str]
    changed: list[Change] = field(default_factory=list)
    seen: bool = True  # the user's config was observed; else nothing can be said to be kept

    @property
    def costs(self) -> set[str]:
        """The cost classes of the changes (``none`` included)."""
        return {c.cost for c in self.changed}

    def lines(self) -> list[str]:
        out = []
        if not self.seen:
            out.append(f"kept: {UNSEEN}")
        elif self.kept:
            out.append("kept: " + ", ".join(self.kept))
        if self.changed:
            out.append("changed: " + ", ".join(c.text() for c in self.changed))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kept": self.kept, "changed": [c.to_dict() for c in self.changed],
                **({} if self.seen else {"seen": False})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Experiment:
        """The report's ``experiment`` read back (missing fields empty).

        >>> Experiment.from_dict({"kept": [], "seen": False}).lines()
        ['kept: nothing known: the command built no GRPOConfig that oomguard could read']
        """
        return cls(list(data.get("kept") or []), [
            Change(c.get("remedy", ""), c.get("cost", ""), c.get("change", ""), c.get("slowdown"))
            for c in data.get("changed") or []], seen=data.get("seen", True) is not False)


def experiment_lines(experiment: Mapping[str, Any] | None) -> list[str]:
    """The lines that say what a run kept and changed, from the report's ``experiment`` (none without one).

    >>> experiment_lines({"kept": ["8 generations per prompt"], "changed": [{"remedy": "micro_batch", "cost":
    ...     "speed", "change": "2 micro-steps of 4 rows per step (yours: 1 of 8)", "slowdown": 0.031}]})
    ['kept: 8 generations per prompt', 'changed: 2 micro-steps of 4 rows per step (yours: 1 of 8) (speed, about +3% time per step predicted)']
    """
    return Experiment.from_dict(experiment).lines() if experiment else []


def cost_note(remedies: Sequence[Remedy], changes: Mapping[str, Any]) -> str:
    """What a climb costs, for its message: the cost classes of the rungs whose knobs changed (a rung the memory model
    then found not needed costs nothing), costliest last, and their notes.

    >>> from oomguard.strategies import make_remedy
    >>> cost_note([make_remedy("empty_cache"), make_remedy("shorter_sequences")], {"max_completion_length": 160})
    'costs signal: long reasoning is cut off'
    """
    acting = [r for r in remedies if not r.changes or set(r.changes) & set(changes)] or list(remedies)
    costs = sorted({r.cost for r in acting}, key=cost_rank)
    notes = "; ".join(dict.fromkeys(n for n in (r.trade_for(changes) for r in acting) if n))
    return f"costs {', '.join(costs)}{': ' + notes if notes else ''}"


def kept_of(user: Knobs, final: Knobs, world_size: int = 1, facts: RunFacts | None = None) -> list[str]:
    """The parts of the user's experiment that ``final`` keeps as they were: generations per prompt, completion length,
    prompts per optimizer step, and a full fine-tune (or the user's own LoRA). A full fine-tune whose weights cannot
    move (16-bit weights whose updates round away at this learning rate: ``strategies.precision.frozen``) is not one.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> kept_of(TRL_DEFAULTS, TRL_DEFAULTS.replace(lora_r=16, max_completion_length=128))
    ['8 generations per prompt', '1 prompt per step']
    >>> kept_of(TRL_DEFAULTS, TRL_DEFAULTS.replace(dtype="bfloat16"))[-1]
    '1 prompt per step'
    """
    out = []
    if (final.num_generations or 8) == (user.num_generations or 8):
        out.append(f"{user.num_generations or 8} generations per prompt")
    if final.max_completion_length == user.max_completion_length and user.max_completion_length:
        out.append(f"{user.max_completion_length}-token completions")
    p = user.prompts_per_step(world_size)
    if abs(final.prompts_per_step(world_size) - p) < 1e-9:
        out.append(f"{p:g} prompt{'' if p == 1 else 's'} per step")
    if not user.lora_r and not final.lora_r and not final.load_in_4bit:
        if frozen(final, facts or RunFacts()) is None:
            out.append("a full fine-tune")
    elif user.lora_r and final.lora_r == user.lora_r and final.load_in_4bit == user.load_in_4bit:
        out.append(f"your LoRA (r={user.lora_r})")
    return out


def summarise(user: Knobs, final: Knobs, remedies: Sequence[Remedy], who: Mapping[str, str], *, world_size: int = 1,
              slowdown: Callable[[Knobs, Knobs], float | None] | None = None, facts: RunFacts | None = None,
              seen: bool = True) -> Experiment:
    """What ``final`` keeps of ``user`` and what each remedy in force changed (``who``: knob -> the remedy that set
    it, as ``oomguard.decide.choose.replay`` gives it), costliest change first. ``slowdown(before, after)`` (optional)
    predicts how much longer a step takes; each speed change is measured against ``final`` without it. ``seen``: the
    user's config was observed (else nothing is said to be kept)."""
    changed = []
    diff = {r.knob: r.after for r in user.diff(final)}
    for remedy in sorted(remedies, key=lambda r: -cost_rank(r.cost)):
        mine = [k for k, name in who.items() if name == remedy.name and k in diff]
        if not mine:
            continue
        extra = None
        if slowdown is not None and remedy.cost == "speed":
            without = final.replace(**{k: getattr(user, k) for k in mine})
            if not without.validate(world_size):
                extra = slowdown(without, final)
        changed.append(Change(remedy.name_for({k: diff[k] for k in mine}), remedy.cost,
                              remedy.describe_change(user, final, world_size), extra))
    return Experiment(kept_of(user, final, world_size, facts) if seen else [], changed, seen=seen)


__all__ = ["Change", "Experiment", "cost_note", "experiment_lines", "kept_of", "precision_warning", "summarise"]
