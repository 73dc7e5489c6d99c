"""The front-ends around TRL, as the user writes them: the flags (or the code) in which a diff and a lock are told
to a user who never wrote a GRPOConfig, or wrote only part of the run in one.

Each stack has one table of how it spells the knobs (``swift.py``: ms-swift's ``swift rlhf`` flags; ``unsloth.py``: an
Unsloth notebook's calls), read both ways: the stack's adapter in the training process (``oomguard/child/stacks/``)
sets and observes the knobs through it, and the words here are printed from it, so that what the end of a run says is
what oomguard applied, and a lock replays it (``spelling.py`` says how a table is built).

>>> flags("swift", {"num_generations": 4, "lora_r": 16, "load_in_4bit": True, "expandable_segments": True})
['--num_generations 4', '--tuner_type lora --lora_rank 16', '--quant_method bnb --quant_bits 4']
>>> flags("swift", {"zero_stage": 3, "offload_optimizer": True, "offload_params": True})
['--deepspeed zero3_offload']
>>> flags("swift", {"zero_stage": 3, "offload_optimizer": True}, files={"deepspeed": "attempt-2/ds.json"})
['--deepspeed attempt-2/ds.json']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..knobtable import REACH
from .spelling import StackTable
from .swift import SWIFT
from .unsloth import UNSLOTH

STACKS: Mapping[str, StackTable] = {t.name: t for t in (SWIFT, UNSLOTH)}
# how the end of a run introduces them
SAID_AS = {name: t.said_as for name, t in STACKS.items()}
# knobs that are not flags: the allocator's settings, set in the environment
ENVIRONMENT = tuple(sorted(REACH["env"]))


def flag(stack: str | None, knob: str, value: Any, among: Any = None) -> str | None:
    """The flag(s) that set ``knob`` to ``value`` for ``stack``, or None (not a flag of it, or no stack). A knob the
    stack spells together with others (ms-swift's ZeRO stage and offloads, one ``--deepspeed`` preset) reads them from
    ``among`` (the knobs in force: a Knobs or a mapping), else takes them as unset.

    >>> flag("swift", "per_device_train_batch_size", 2), flag(None, "lora_r", 8), flag("swift", "max_split_size_mb", 1)
    ('--per_device_train_batch_size 2', None, None)
    >>> flag("swift", "zero_stage", 3), flag("swift", "zero_stage", 2, among={"offload_optimizer": True})
    ('--deepspeed zero3', '--deepspeed zero2_offload')
    >>> flag("unsloth", "load_in_4bit", False), flag("unsloth", "per_device_train_batch_size", 2)
    ('FastLanguageModel.from_pretrained(load_in_4bit=False)', 'GRPOConfig(per_device_train_batch_size=2)')
    """
    table = STACKS.get(stack or "")
    if table is None:
        return None
    return table.said({knob: value}, among).get(knob)


def said_by_knob(stack: str | None, changes: Mapping[str, Any], among: Any = None,
                 files: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """``changes`` (knob -> new value) in ``stack``'s words, keyed by knob: each spelling once, under the first of its
    knobs among the changes (a diff's rows take their flag from here; the others of a spelling have none). ``files``:
    the configs the run generated for settings the stack has no word for, by kind (``Attempt.generated``).

    >>> said_by_knob("swift", {"offload_optimizer": True, "zero_stage": 2, "beta": 0.0})
    {'offload_optimizer': '--deepspeed zero2_offload', 'beta': '--beta 0.0'}
    """
    table = STACKS.get(stack or "")
    return table.said(changes, among, files) if table is not None else {}


def told(stack: str | None, said: list[str]) -> str:
    """One line that gives the flags ``said`` to a user of ``stack`` (each once).

    >>> told("swift", ["--num_generations 4", "--lora_rank 16"])
    "as swift's flags: --num_generations 4 --lora_rank 16"
    >>> told("unsloth", ["get_peft_model(r=8)", "GRPOConfig(num_generations=4)"])
    "in the notebook's code: get_peft_model(r=8); GRPOConfig(num_generations=4)"
    """
    table = STACKS.get(stack or "")
    join = table.join if table is not None else "; "
    return f"{SAID_AS.get(stack or '', 'as the front-end takes them')}: {join.join(dict.fromkeys(said))}"


def flags(stack: str | None, changes: dict[str, Any], among: Any = None,
          files: Mapping[str, str | None] | None = None) -> list[str]:
    """``changes`` (knob -> new value) in ``stack``'s flags, in order, those that are flags (a spelling of several
    knobs once; ``files`` as for :func:`said_by_knob`)."""
    return list(said_by_knob(stack, changes, among, files).values())


__all__ = ["ENVIRONMENT", "SAID_AS", "STACKS", "flag", "flags", "said_by_knob", "told"]
