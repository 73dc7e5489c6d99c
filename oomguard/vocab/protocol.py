"""The contract between the supervisor and the training process: the plan, the variables that carry it, the exit codes
and how a process says it ended.

The supervisor (:mod:`oomguard.run.supervisor`) writes a :class:`Plan` and names its file in ``OOMGUARD_PLAN``; every
Python process of the run reads it at start-up (:mod:`oomguard.child.bootstrap`) and answers through the events file
and crash records (:mod:`oomguard.vocab.records`). Both sides import this module, so neither imports the other.

>>> Plan(attempt=2, simulate_gpu=2**30).to_dict()["schema"]
'oomguard.plan/1'
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .schema import PLAN_SCHEMA, check_schema

PLAN_ENV = "OOMGUARD_PLAN"
SIMULATE_ENV = "OOMGUARD_SIMULATE_GPU"
# Exit code of a training process that died of OOM after writing its CrashRecord.
EXIT_OOM = 86
# Exit code of a training process that the pre-flight check stopped: the memory model is sure it cannot fit. Only a
# courtesy to a reader of `echo $?`: the supervisor learns of the stop from the process's `end` event, since a launcher
# between them (torchrun, accelerate, `trl`, a shell script) replaces the code.
EXIT_PREDICTED = 87
# A file a training process writes into its attempt's directory (the plan's ``crash_dir``) just before it stops itself on
# purpose (a pre-flight stop, a TRL oomguard refuses): what a launcher prints after that reads as a crash, so the
# supervisor keeps it out of the terminal (``run.proc.Aside``).
STOPPED_MARK = "stopped-on-purpose"
# How a process's `end` event says it ended (see Runtime.end).
END_EXIT, END_ERROR, END_OOM, END_PREDICTED = "exit", "error", "oom", "predicted"


@dataclass
class Plan:
    """What the supervisor asks of one attempt (schema ``oomguard.plan/1``)."""

    attempt: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)
    simulate_gpu: int | None = None
    simulate_context: int | None = None  # held outside the simulated allocator (memory/allocmodel.py, context_for)
    gpu_memory: int | None = None
    crash_dir: str | None = None
    events: str | None = None
    probe: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None
    checkpoint_every: int | None = None
    remedies: list[str] = field(default_factory=list)
    log_to_trainer: bool = True
    preflight: dict[str, Any] | None = None  # capacity, margin, coefficients, simulated: see child/preflight.py

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        check_schema(data, PLAN_SCHEMA, path)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PLAN_SCHEMA, **{k: getattr(self, k) for k in self.__dataclass_fields__}}


def whereabouts() -> str:
    """This process's host and PID namespace: a PID means the same process only where these match (another node of
    a job, or a container with its own PIDs, reuse the numbers).

    >>> whereabouts() == whereabouts() and ":" in whereabouts()
    True
    """
    import socket

    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "-"
    return f"{socket.gethostname()}:{ns}"
