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
from .serial import read_fields, to_fields

PLAN_ENV = "OOMGUARD_PLAN"
SIMULATE_ENV = "OOMGUARD_SIMULATE_GPU"
# Exit code of a training process that died of OOM after writing its CrashRecord.
EXIT_OOM = 86
# Exit code of a training process that the pre-flight check stopped: the memory model is sure it cannot fit. Only a
# courtesy to a reader of `echo $?`: the supervisor learns of the stop from the process's `end` event, since a launcher
# between them (torchrun, accelerate, `trl`, a shell script) replaces the code.
EXIT_PREDICTED = 87
# Exit code of a training process that does not run a value its replayed lock pins (``child/ran.py``), stopped before it
# trains: the usage code, which `oomguard run` exits with too (a lock this command cannot replay as it stands).
EXIT_LOCK_UNMET = 2
# A file a training process writes into its attempt's directory (the plan's ``crash_dir``) just before it stops itself on
# purpose (a pre-flight stop, a TRL oomguard refuses): what a launcher prints after that reads as a crash, so the
# supervisor keeps it out of the terminal (``run.proc.Aside``).
STOPPED_MARK = "stopped-on-purpose"
# How the line a training process prints as it dies of an uncaught OOM begins, after the traceback and naming its
# CrashRecord: what a launcher prints after that line (a ``ChildFailedError`` traceback, the other ranks' errors) is
# kept out of the terminal as after a stop (``run.proc.Aside``). In the output itself, so it is read in order with
# the traceback before it, which a file written alongside could not promise.
OOM_LINE = "oomguard: out of memory"


def oom_line(record: Any, shown: str = "") -> str:
    """The line (``OOM_LINE``) a training process prints after the traceback of its uncaught OOM, naming its record.

    >>> print(oom_line("crash-rank1.json", "the last 6 of 40 frames are above"), end="")
    oomguard: out of memory; the last 6 of 40 frames are above; crash-rank1.json keeps the full traceback
    >>> print(oom_line(None), end="")
    oomguard: out of memory; no crash record could be written
    """
    kept = f"{record} keeps the full traceback" if record is not None else "no crash record could be written"
    return f"{OOM_LINE}; {shown + '; ' if shown else ''}{kept}\n"
# How a process's `end` event says it ended (see Runtime.end).
END_EXIT, END_ERROR, END_OOM, END_PREDICTED, END_UNMET = "exit", "error", "oom", "predicted", "unmet"


@dataclass(frozen=True)
class JudgeSpec:
    """The memory model's judge of "will it fit", the one plan part the training process decides with (built by
    ``memory.estimate.judge_spec``; judged by ``memory.estimate.verdict``, which the supervisor's Judge, the climb and
    `oomguard plan` ask too): the device (``capacity``, ``simulated``, its ``context`` outside the allocator when
    measured), the model's ``coefficients``, its measured error for each LM head (``errors``: ``[over, under,
    source]``), the factor beyond which a TRL no measurement covers is stopped (``untested_factor``), the share of the
    device a sure config leaves free beyond the under-prediction (``headroom``), what the stop margin adds to the
    over-prediction (``allowance``), the climb's ``margin`` (and ``relax_margin`` for relaxing graded knobs; None: each
    head's under-prediction), and the stop margin the user set (``stop_margin``, ``--preflight-margin``)."""

    capacity: int = 0
    simulated: bool = False
    context: int | None = None
    coefficients: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, Any] = field(default_factory=dict)
    untested_factor: float = 0.0
    headroom: float = 0.0
    allowance: float = 0.0
    margin: float = 0.0
    relax_margin: float | None = None
    stop_margin: float | None = None


@dataclass(frozen=True)
class ProbePlan:
    """A short worst-case probe instead of the command's run (``child/probe.py``): ``steps`` optimizer steps on
    ``rows`` of the longest prompts, saving into oomguard's scratch ``output_dir``; with ``unless_sure``, the real run
    instead where the memory model (the plan's ``judge``) is sure of the config."""

    steps: int = 2
    rows: int = 64
    output_dir: str | None = None
    unless_sure: bool = False


@dataclass(frozen=True)
class ResumePlan:
    """How a real run continues from the newest checkpoint (``run/resume.resume_plan``): ``continue`` (TRL's
    resume_from_checkpoint), ``weights`` (a new run from its weights, saving into ``output_dir``) or ``restart``
    (from step 0 into ``output_dir``: the checkpoint holds only an adapter), and why."""

    mode: str = "continue"
    checkpoint: str = ""
    why: str = ""
    output_dir: str | None = field(default=None, metadata={"omit": True})


@dataclass
class Plan:
    """What the supervisor asks of one attempt (schema ``oomguard.plan/1``). Its parts may be given as their JSON
    objects: they are read as their records."""

    attempt: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)
    # a replayed lock's values: the process stops before it trains where it runs another (child/ran.py)
    pinned: dict[str, Any] = field(default_factory=dict)
    simulate_gpu: int | None = None
    simulate_context: int | None = None  # held outside the simulated allocator (memory/allocmodel.py, context_for)
    gpu_memory: int | None = None
    crash_dir: str | None = None
    events: str | None = None
    probe: ProbePlan | None = None
    resume: ResumePlan | None = None
    checkpoint_every: int | None = None
    remedies: list[str] = field(default_factory=list)
    log_to_trainer: bool = True
    judge: JudgeSpec | None = None  # the memory model's judge (None: no model judges this run)
    preflight: bool = False  # the training process stops a config the judge's verdict is "stop" on
    trace: bool = True  # a memory sample at each optimizer step's end (child/memwatch.py), and its trend
    host_limit: int | None = None  # the host memory the process may use (its cgroup's limit, else the RAM)
    census_after: int | None = None  # find where a leak is held after this many steps (a run known to leak)

    def __post_init__(self) -> None:
        for name, cls in (("probe", ProbePlan), ("resume", ResumePlan), ("judge", JudgeSpec)):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, read_fields(cls, value))

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        check_schema(data, PLAN_SCHEMA, path)
        return read_fields(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PLAN_SCHEMA, **to_fields(self)}


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
