"""The lock: a stable config, written when `oomguard run` ends stable, replayed with ``--config`` (schema
``oomguard.lock/1``).

What a replay applies is ``overrides``: the knobs oomguard changed, on top of the script's own values, each one sent to
the training process whatever TRL's default or the script's value is, and checked there: a training process that runs
another value for a locked knob stops before it trains (:func:`unmet` decides, :meth:`Unmet.line` says it). The rest says
where they came from: the command, the ladder, the user's config and the one that held, the diff with the rung
behind each change (a replay's own diff names the same rungs), the ranks it was checked for, and, for a stack with
its own arguments (ms-swift, Unsloth), the same changes in that stack's words. Read back, a lock of the same major
version is accepted with fields it does not know ignored, so that a newer oomguard can add some.

>>> lock = Lock(overrides={"optim": "adamw_bnb_8bit"}, command=["python", "train.py"], ladder="default",
...             diff=[{"knob": "optim", "from": "adamw_torch", "to": "adamw_bnb_8bit", "remedy": "optimizer_8bit"}])
>>> Lock.from_dict(lock.to_dict()) == lock, lock.pinned_by()
(True, {'optim': 'optimizer_8bit'})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .records import now_iso
from .schema import LOCK_SCHEMA, RecordError, check_schema
from .serial import read_fields, to_fields


@dataclass(frozen=True)
class Lock:
    """A stable config to replay (see the module)."""

    overrides: dict[str, Any]
    command: list[str] = field(default_factory=list)
    ladder: str | None = None
    original: dict[str, Any] | None = None  # the user's config, as in the report
    stable: dict[str, Any] | None = None  # the config that held
    world_size: int = 1  # the ranks the config was checked for
    diff: list[dict[str, Any]] = field(default_factory=list)  # as in the report: knob, from, to, remedy
    # a stack with its own arguments: how it takes the overrides
    stack: str | None = field(default=None, metadata={"omit": True})
    flags: list[str] = field(default_factory=list, metadata={"omit": True})
    created: str = field(default_factory=now_iso)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": LOCK_SCHEMA, **to_fields(self)}

    @classmethod
    def from_dict(cls, data: Any, source: str = "lock") -> Lock:
        """A lock read back; RecordError (one line: what is wrong, and how to get a good one) where it is not one."""
        if not isinstance(data, dict):
            raise RecordError(f"{source}: not a lock (a JSON object with \"schema\": \"{LOCK_SCHEMA}\")")
        check_schema(data, LOCK_SCHEMA, source)
        overrides = data.get("overrides")
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, dict):
            raise RecordError(f"{source}: \"overrides\" must be an object of knob values; re-create the lock with "
                              "`oomguard run` (without --config)")
        lock = read_fields(cls, {**data, "overrides": overrides})
        world = lock.world_size
        return replace(lock, diff=[r for r in lock.diff if isinstance(r, dict)],
                       world_size=world if isinstance(world, int) and world >= 1 else 1)

    def pinned_by(self) -> dict[str, str]:
        """The remedy the diff names for each knob the lock pins, so that a replay's diff still says which rung made
        each change (a row without one reads ``lock``)."""
        return {r["knob"]: r["remedy"] for r in self.diff if isinstance(r.get("knob"), str)
                and isinstance(r.get("remedy"), str) and r["remedy"]}


@dataclass(frozen=True)
class Unmet:
    """A value a replayed lock pins that the training process does not run: the knob, the lock's value, the value it
    runs, and what made it run that one (``child/ran.py`` names it)."""

    knob: str = ""
    locked: Any = None
    ran: Any = None
    where: str = "oomguard's override did not reach the training process"

    def line(self) -> str:
        """The one line the run stops with: the knob, both values, why, and the ways out.

        >>> print(Unmet("per_device_train_batch_size", 8, 16, "the script sets it on its config after building it").line())
        the lock pins per_device_train_batch_size=8, but the training process runs 16 (the script sets it on its config after building it); stopped before training: let the lock's value reach the trainer (drop the later change), or run without --config to choose again for the command as it is now
        """
        return (f"the lock pins {self.knob}={shown(self.locked)}, but the training process runs {shown(self.ran)} "
                f"({self.where}); stopped before training: let the lock's value reach the trainer (drop the later "
                "change), or run without --config to choose again for the command as it is now")

    def to_dict(self) -> dict[str, Any]:
        return to_fields(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Unmet:
        return read_fields(cls, data)


def unmet(pinned: Mapping[str, Any], ran: Mapping[str, Any], where: Mapping[str, str] | None = None) -> list[Unmet]:
    """The knobs of ``pinned`` (a lock's overrides) that the training process runs otherwise, among those it reports
    (``ran``: knob -> the value it runs); ``where`` says what changed each one. The one place this is decided.

    >>> unmet({"per_device_train_batch_size": 8, "lora_target_modules": ["q_proj"]},
    ...       {"per_device_train_batch_size": 16, "lora_target_modules": ("q_proj",)})
    [Unmet(knob='per_device_train_batch_size', locked=8, ran=16, where="oomguard's override did not reach the training process")]
    >>> unmet({"dtype": "bfloat16"}, {"per_device_train_batch_size": 16})  # not reported yet: nothing to say
    []
    """
    said = where or {}
    return [Unmet(k, v, ran[k], *([said[k]] if k in said else [])) for k, v in pinned.items()
            if v is not None and k in ran and _plain(v) != _plain(ran[k])]


def shown(value: Any) -> str:
    """A knob's value as the command line writes it (``KNOB=VALUE``).

    >>> shown(("q_proj", "v_proj")), shown(True), shown(None)
    ('q_proj,v_proj', 'True', 'unset')
    """
    if value is None:
        return "unset"
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


__all__ = ["Lock", "Unmet", "shown", "unmet"]
