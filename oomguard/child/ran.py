"""What the training process runs, knob by knob, and the stop of a replayed lock whose values it does not run.

oomguard's overrides reach the training process where its config, trainer and model are built (``config.py``,
``trainer.py``, ``load.py``). What runs can still differ from them: the script may set a value on its config after
building it, GRPOConfig's own rules, TRL's trainer or a stack around it may change one (a dataloader worker count an
iterable dataset cannot use, the accumulation steps of an ``accelerator_config``), or the script gives GRPOTrainer a
LoRA config of its own, which oomguard does not replace. At each construction point the process compares its config's
values with those oomguard left it with (``notice``): a change of a knob oomguard did not set is the user's own
(``Runtime.resolve``), one of a knob it set is a value the process runs instead (``Runtime.runs_instead``). Then it
reports what it runs (``report``: a ``ran`` event): TRL's defaults, the script's values, oomguard's overrides and
those changes. The supervisor records that as the attempt's config, so the report's stable config and the lock written
from it are what ran, not what the climb believes it set.

A replay pins its lock's values (``Plan.pinned``): where the process runs another value for one of them, it stops
before it trains, with one line naming the knob, both values and what changed it (``oomguard.vocab.lock.unmet``
decides, ``Unmet.line`` says it), as the pre-flight stop does: an ``end`` event ``unmet`` and ``EXIT_LOCK_UNMET``.
"""

from __future__ import annotations

from typing import Any

from ..vocab.events import Ran
from ..vocab.knobs import REACH, reachable
from ..vocab.knobtable import CONFIG_KNOBS
from ..vocab.lock import Unmet, unmet
from ..vocab.protocol import END_UNMET, EXIT_LOCK_UNMET
from .patching import plain
from .runtime import Runtime

# Who changed a value after oomguard set it, as the stop's line says it.
BY_CONFIG = "GRPOConfig's own rules changed it while the config was built"
BEFORE_TRAINER = "the script sets it on its config after building it, before GRPOTrainer"
IN_TRAINER = "it was changed while GRPOTrainer was built (by TRL, transformers or a stack around them)"
BEFORE_TRAIN = "it was set on the trainer's arguments after GRPOTrainer was built, before train()"
OWN_LORA = ("the script gives GRPOTrainer a LoRA config of its own (peft_config, or a model PEFT already wraps), "
            "which oomguard does not replace")
OWN_PEFT = "the script adds its own LoRA (a front-end's get_peft_model), which oomguard does not replace"
OWN_MODEL = "the script builds its model without from_pretrained, where oomguard sets the load's dtype"
MODEL_CHECKPOINTING = "the model has gradient checkpointing on before GRPOTrainer is built, which keeps it on"

_SEEN = "_oomguard_values"  # a config's values as oomguard left them
_ENV = REACH["env"]  # the allocator's knobs: the environment's, never a construction point's


def values(cfg: Any) -> dict[str, Any]:
    """A config's own knob fields, as plain values (the DeepSpeed and FSDP knobs are read where they are applied)."""
    out = {name: plain(getattr(cfg, name)) for name in CONFIG_KNOBS if hasattr(cfg, name)}
    act = getattr(cfg, "activation_checkpointing", None)
    gc = act if act is not None else getattr(cfg, "gradient_checkpointing", None)
    if gc is not None:
        out["gradient_checkpointing"] = gc
    return out


def mark(cfg: Any) -> None:
    """Remember ``cfg``'s values as oomguard leaves them (after its own changes), so that a later change shows."""
    if cfg is None:
        return
    try:
        object.__setattr__(cfg, _SEEN, values(cfg))
    except (AttributeError, TypeError):
        pass


def config_built(rt: Runtime, cfg: Any, applied: dict[str, Any]) -> None:
    """After GRPOConfig's own ``__post_init__``: a knob oomguard set (``applied``: the values before it) that its
    rules changed runs as they left it. Then the config is marked."""
    now = values(cfg)
    rt.runs_instead({k: v for k, v in now.items() if rt.override(k) is not None and v != applied.get(k)}, BY_CONFIG)
    mark(cfg)


def notice(rt: Runtime, cfg: Any, where: str) -> None:
    """The changes to ``cfg``'s knobs since it was marked: the user's own where oomguard did not set the knob
    (``Runtime.resolve``), else values the process runs instead of oomguard's; ``where`` says who made them."""
    before = getattr(cfg, _SEEN, None) if cfg is not None else None
    if before is None:  # not a config oomguard saw built
        return
    now = values(cfg)
    changed = {k: v for k, v in now.items() if k in before and v != before[k]}
    if not changed:
        return
    mark(cfg)
    ours = {k: v for k, v in changed.items() if rt.override(k) is not None}
    rt.runs_instead(ours, where)
    rt.resolve({k: v for k, v in changed.items() if k not in ours})


def report(rt: Runtime) -> None:
    """Report the knobs the process runs at this point, those its construction points reach (a ``ran`` event, when
    anything changed since the last); stop before training where a replayed lock's value is not among them."""
    reach = reachable(rt.reached) - _ENV
    ran = {k: v for k, v in rt.ran().to_dict().items() if k in reach}
    later = {k: where for k, (_v, where) in rt.later.items()}
    missed = unmet(rt.plan.pinned, ran, later)
    resolved = dict(rt.resolved)
    said = {"knobs": ran, "later": later, "resolved": resolved}
    if said != rt.ran_said or missed:
        rt.ran_said = said
        rt.emit(Ran(knobs=ran, later=later, resolved=resolved, unmet=missed[0].to_dict() if missed else {}))
    if missed:
        _stop(rt, missed[0])


def _stop(rt: Runtime, missed: Unmet) -> None:
    """End the process before it trains. Its line is the run's last (the supervisor ends with it): said once, not
    once per rank and again at the end."""
    rt.stopping_on_purpose()
    rt.end(END_UNMET, error=missed.line())
    raise SystemExit(EXIT_LOCK_UNMET)


__all__ = ["BEFORE_TRAIN", "BEFORE_TRAINER", "BY_CONFIG", "IN_TRAINER", "MODEL_CHECKPOINTING", "OWN_LORA", "OWN_MODEL",
           "OWN_PEFT", "config_built", "mark", "notice", "report", "values"]
