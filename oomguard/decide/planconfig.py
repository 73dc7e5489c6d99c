"""The config `oomguard plan` judges: the user's ``KNOB=VALUE`` on top of a TRL release's defaults, read in the
installed TRL's terms, and the facts the memory model needs beside it.

A config leaves most knobs out, and what they are depends on the TRL that runs it (gradient checkpointing was off
before 0.22, a second reference model on before 0.19, ...). ``oomguard plan`` fills them with the defaults of the
release it is told (``--trl-version``) or of the installed TRL (``oomguard.vocab.trlreleases``), models that release's
LM head (``trlrange.head_of``), and judges as ``oomguard run`` judges it: a TRL newer than the tested releases, or a
stack whose memory no measurement covers (Unsloth's generated trainer), is verified by a probe. What the run does that
no term counts (a vLLM server's own GPU, Unsloth's standby, offloaded checkpointing and chunked loss, packed batches)
is carried in ``RunFacts.unmodelled``: said in one line each, and never judged sure.

>>> a = planned({"max_completion_length": 1024}, trl_version="0.17.0")
>>> a.knobs.beta, a.knobs.gradient_checkpointing, a.knobs.max_completion_length, a.facts.trl_head
(0.04, False, 1024, 'logits')
>>> planned({"num_generations": 4, "per_device_train_batch_size": 2}, trl_version="0.14.0").knobs.per_device_train_batch_size
8
>>> planned({}, trl_version="1.16.0", stack="unsloth").facts.unmodelled
('unsloth_offloaded_checkpointing', 'unsloth_chunked_loss')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts, check_values
from ..vocab.stacks.unsloth import GENERATED_TRAINER
from ..vocab.trlrange import FLOOR, head_of, support
from ..vocab.trlreleases import defaults, in_current_terms, release

# The stacks plan knows: TRL itself, and Unsloth (its loader keeps the dtype under 4-bit; its generated trainer's
# memory is not measured, and it offloads the checkpointed inputs and chunks its loss its own way).
STACKS = ("trl", "unsloth")


@dataclass(frozen=True)
class Planned:
    """The knobs and facts plan judges, and the lines it says about them (the release whose defaults apply, how its
    config reads in the installed TRL's terms)."""

    knobs: Knobs
    facts: RunFacts
    lines: tuple[str, ...] = ()


def release_base(trl_version: str | None) -> Knobs:
    """TRL's defaults as ``trl_version``'s release has them (the newest known where it is None or unknown)."""
    r = release(trl_version)
    return TRL_DEFAULTS.merged(defaults(r.version)) if r is not None else TRL_DEFAULTS


def planned(values: Mapping[str, Any], *, trl_version: str | None, given: bool = True, world_size: int = 1,
            stack: str | None = None, padding_free: bool = False, **facts: Any) -> Planned:
    """The knobs of ``values`` over ``trl_version``'s defaults (``given``: named by the user rather than installed),
    the facts to judge them with (``facts``: further RunFacts fields, e.g. a vision model's images), and what to say.
    Raises ValueError (one line) for values GRPO's rules refuse."""
    r = release(trl_version)
    merged = {**release_base(trl_version).to_dict(only_set=True), **values}
    lines: list[str] = []
    if r is not None:
        merged, lines = in_current_terms(merged, r.version)
        head = head_of(trl_version)
        where = "--trl-version" if given else "installed"
        lines.insert(0, f"TRL {trl_version} ({where}): the defaults of {r.version} ({r.date}) fill what the config "
                        f"leaves out; its LM head {'is fused' if head == 'fused' else 'materialises the logits'}")
        if "max_prompt_tokens" not in values and merged.get("max_prompt_tokens"):
            lines.append(f"TRL {r.version} truncates prompts to max_prompt_length, {merged['max_prompt_tokens']} by "
                         "default: give your config's as max_prompt_tokens=N")
        if support(trl_version).refused:
            lines.append(f"TRL {trl_version} is below {FLOOR}: `oomguard run` refuses it, so this is a prediction "
                         "only")
    problems = check_values(merged, world_size)
    if problems:
        raise ValueError(f"these knobs break GRPO's rules: {'; '.join(problems)}")
    knobs = TRL_DEFAULTS.merged(merged)
    unmodelled = []
    if stack == "unsloth":
        facts.setdefault("load_takes_4bit", True)
        facts.setdefault("stack_untested", GENERATED_TRAINER)
        if knobs.use_vllm:
            unmodelled.append("unsloth_standby")
        if knobs.gradient_checkpointing:
            unmodelled.append("unsloth_offloaded_checkpointing")
        unmodelled.append("unsloth_chunked_loss")
    if padding_free:
        unmodelled.append("padding_free")
    run_facts = RunFacts(world_size=world_size, trl_version=trl_version, trl_head=head_of(trl_version),
                         stack=stack if stack != "trl" else None, unmodelled=tuple(unmodelled), **facts)
    return Planned(knobs=knobs, facts=run_facts, lines=tuple(lines))


__all__ = ["STACKS", "Planned", "planned", "release_base"]
