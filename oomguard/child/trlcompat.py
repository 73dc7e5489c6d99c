"""What the installed TRL offers, read from its code: the one place that knows how TRL releases differ.

oomguard supports TRL 0.29 to 1.x (``oomguard.vocab.trlrange``). The releases differ in what the patches and the
memory model depend on, and each difference is read here from the code that is installed, never from a version
number:

- ``GRPOConfig``'s fields (own and inherited from transformers' ``TrainingArguments``): a knob whose field this TRL
  lacks cannot reach it (the field of its own name, or those the knob table names for it, ``KnobInfo.trl_fields``;
  what of the trainer takes a knob that reaches it: ``KnobInfo.trainer_args``). The training process reports those knobs (``RunFacts.trl_lacks``), and a rung that would
  change one is passed over with the reason, as a rung whose knobs the command never reads is.
- ``GRPOTrainer.__init__``'s arguments: ``quantization_config`` exists from TRL 1.10 on; before, a 4-bit load of a
  model given by name goes through ``GRPOConfig.model_init_kwargs`` (what TRL's own scripts do).
- The LM head: TRL 1.15 replaced the materialised logits (``[B, C+1, V]`` and their gradients) by a fused, chunked
  head (``trl.trainer.utils.add_fused_lm_head``), whose memory differs by up to 3x on the same config. The memory
  model counts the one this TRL has (``RunFacts.trl_head``: ``fused`` or ``logits``).

A TRL below the floor is refused here too, in the training process, when something imports ``trl`` (the supervisor
refuses it before launching when it can see the command's environment; this covers a command run by another
interpreter): one line naming the installed and the supported releases, exit 2, never a traceback from a patch.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from ..vocab.knobtable import REACH, TABLE
from ..vocab.trlrange import support


@dataclass(frozen=True)
class TrlFeatures:
    """The installed TRL as the patches and the memory model see it.

    ``config_fields``: GRPOConfig's dataclass fields; ``trainer_args``: GRPOTrainer.__init__'s parameters;
    ``head``: ``fused`` (the chunked LM head of TRL 1.15 on) or ``logits`` (materialised logits, TRL 0.29-1.14).

    >>> f = TrlFeatures("0.29.1", frozenset({"num_generations", "model_init_kwargs"}), frozenset({"peft_config"}),
    ...                 "logits")
    >>> f.takes("quantization_config"), f.quantization_via
    (False, 'model_init_kwargs')
    >>> "max_completion_length" in f.lacks(), "load_in_4bit" in f.lacks(), "lora_r" in f.lacks()
    (True, False, False)
    """

    version: str | None
    config_fields: frozenset[str]
    trainer_args: frozenset[str]
    head: str

    def takes(self, arg: str) -> bool:
        """Whether GRPOTrainer's constructor has the argument ``arg``."""
        return arg in self.trainer_args

    @property
    def quantization_via(self) -> str | None:
        """Where a 4-bit load's BitsAndBytesConfig goes for a model given by name: the trainer's own argument (TRL
        1.10 on), else ``model_init_kwargs`` (what TRL's scripts do on older releases), else nowhere."""
        if self.takes("quantization_config"):
            return "quantization_config"
        return "model_init_kwargs" if "model_init_kwargs" in self.config_fields else None

    def lacks(self) -> tuple[str, ...]:
        """The knobs that cannot reach this TRL: a GRPOConfig field or a trainer argument it does not have."""
        out = []
        for knob in sorted(REACH["config"]):  # the fields that take it (the knob table's trl_fields), any one
            if not any(f in self.config_fields for f in TABLE[knob].trl_fields or (knob,)):
                out.append(knob)
        for knob in sorted(n for n, i in TABLE.items() if i.trainer_args):  # a trainer argument, or a config field
            if not any(n in self.trainer_args or n in self.config_fields for n in TABLE[knob].trainer_args):
                out.append(knob)
        return tuple(out)

    def facts(self) -> dict[str, Any]:
        """What the training process reports to the supervisor (``RunFacts`` fields)."""
        return {"trl_version": self.version, "trl_head": self.head, "trl_lacks": list(self.lacks())}


def read(config_module: Any = None, trainer_module: Any = None) -> TrlFeatures:
    """Read the features of the installed TRL from its modules (``trl.trainer.grpo_config`` and
    ``trl.trainer.grpo_trainer``, imported here when not given)."""
    if config_module is None:
        from trl.trainer import grpo_config

        config_module = grpo_config
    if trainer_module is None:
        from trl.trainer import grpo_trainer

        trainer_module = grpo_trainer
    cfg_cls = config_module.GRPOConfig
    fields = frozenset(getattr(cfg_cls, "__dataclass_fields__", {}))
    try:  # oomguard's own patch keeps TRL's signature (functools.wraps), which inspect follows
        params = frozenset(inspect.signature(trainer_module.GRPOTrainer.__init__).parameters) - {"self"}
    except (TypeError, ValueError):
        params = frozenset()
    head = "fused" if getattr(trainer_module, "add_fused_lm_head", None) is not None else "logits"
    return TrlFeatures(version=_version(), config_fields=fields, trainer_args=params, head=head)


_FEATURES: TrlFeatures | None = None


def features() -> TrlFeatures:
    """The installed TRL's features, read once per process (the patches ask for them when GRPOTrainer's module has
    been imported, so this imports nothing new)."""
    global _FEATURES
    if _FEATURES is None:
        _FEATURES = read()
    return _FEATURES


def _version() -> str | None:
    trl = sys.modules.get("trl")
    version = getattr(trl, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("trl")
    except Exception:
        return None


def refuse_if_too_old(rt: Any, trl: Any) -> None:
    """When ``trl`` is imported: a TRL below the floor ends the process with one line and exit 2, before anything
    of it is patched or used (its GRPOTrainer lacks what the patches need; a traceback from inside one would say
    nothing useful)."""
    s = support(getattr(trl, "__version__", None))
    if not s.refused:
        return
    from ..vocab.protocol import END_ERROR

    line = f"oomguard: {s.message}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    rt.stopping_on_purpose()
    rt.end(END_ERROR, error=line[len("oomguard: "):])
    raise SystemExit(2)
