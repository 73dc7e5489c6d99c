"""Leak restarts: after an OOM the memory trace shows is a leak (memory kept step after step), no rung is climbed; the
run resumes from its last checkpoint with the same config, saving at the leak's pace, while each restart gets further
and the budget leaves room. The conductor (``oomguard.decide.conductor``) asks these after such an OOM; the state they
keep is the conductor's (``leaks``, ``leak_confirmed``, ``checkpoint_every``).

>>> resumed_step({"mode": "continue", "checkpoint": "/out/checkpoint-12"}), resumed_step(None)
(12, 0)
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any, Protocol

from ..vocab.diagnosis import Diagnosis
from ..vocab.records import Attempt, AttemptKind
from .climb import Climb
from .said import Next


class Conductor(Protocol):
    """What of the conductor (``decide/conductor.py``) a leak restart reads and keeps."""

    climb: Climb
    policy: Any  # the conductor's Policy
    leaks: list[int]  # the attempts that ran out of memory through a leak and were resumed as they were
    leak_confirmed: bool  # a leak the trace showed over enough steps, or a young one a restart reproduced
    checkpoint_every: int | None  # the checkpoint cadence a leak's restarts need
    last_diag: Diagnosis | None

    def choose(self, attempt: Attempt | None, diag: Diagnosis | None) -> Next: ...
    def room_for(self, attempts: int, counted: bool = True) -> bool: ...


def after_leak(con: Conductor, attempt: Attempt, diag: Diagnosis) -> Next:
    """The OOM was a leak (the memory trace shows memory kept step after step): no rung is climbed for it. The
    run resumes from its last checkpoint with the same config, saving often enough to move on at the leak's
    pace (half the steps it made before running out), as long as each restart gets further and the budget
    (--max-attempts, --max-time: restarts count) leaves room; with --no-leak-restart it stops.

    A young leak (``Facts.young_leak``: foretold by a few steps only) is provisional: the restart confirms it by
    getting further and growing again. One that gets no further, or runs out without the growth, is the
    shortfall its figures show (a warm-up that settles late looks the same over a few steps), and a rung is
    climbed."""
    c = con.climb
    made = (attempt.step or 0) - resumed_step(attempt.resume)
    where = "the host's memory" if diag.kind == "host-leak" else "the device"
    young = diag.facts.young_leak
    # a restart confirms a young leak by getting past the step the last leak ran out at: one from step 0 (no
    # checkpoint yet) that runs out where it did is the warm-up it looked like
    before = next((a.step or 0 for a in c.attempts if con.leaks and a.index == con.leaks[-1]), 0)
    further = made > 0 and (attempt.step or 0) > before
    if young and not con.leak_confirmed and (not con.policy.leak_restart or (con.leaks and not further)):
        unconfirmed(con, attempt, "the restart got no further before it ran out" if con.policy.leak_restart else
                    "--no-leak-restart leaves no restart to reproduce the few steps it grew over")
        con.last_diag = figures = replace(diag, kind=diag.facts.by_figures or "shortfall")
        return con.choose(attempt, figures)
    if not young or (con.leaks and further):
        con.leak_confirmed = True
    budget = None if con.room_for(1) else (
        f"--max-time {con.policy.max_time:g}s" if con.policy.max_time is not None and
        time.time() - c.started >= con.policy.max_time else f"--max-attempts {con.policy.max_attempts}")
    if not con.policy.leak_restart or (con.leaks and made <= 0) or budget:
        why = ("--no-leak-restart: stopped at the first leak" if not con.policy.leak_restart else
               f"the leak fills {where} before the run gets past its last checkpoint" if made <= 0 else
               f"the budget ({budget}) is spent after {len(con.leaks)} restart(s); raise it to restart again")
        c.give_up("leak", why)
        attempt.note = f"a leak, not a shortfall: no config change cures it; {why}"
        return Next(None).line(f"  {attempt.note}; fix the code that keeps the memory (the evidence says where)")
    cadence = max(1, made // 2)
    con.checkpoint_every = min(con.checkpoint_every or cadence, cadence)
    con.leaks.append(attempt.index)
    what = "a leak, not a shortfall" if con.leak_confirmed else "a leak, it seems (too few steps to be sure)"
    attempt.note = (f"{what}: resumed with the same config from the last checkpoint, saving every "
                    f"{con.checkpoint_every} step(s)")
    line = (f"  {what}: no config change cures it, so the run resumes from its last checkpoint with the same "
            f"config, with a checkpoint at least every {con.checkpoint_every} step(s) (it made {made} step(s) "
            f"before {where} was full)")
    if not con.leak_confirmed:
        line += "; a restart that gets further and grows again confirms it, else a rung is climbed"
    return Next(AttemptKind.RUN, checkpoint_every=con.checkpoint_every).line(
        line + "; --no-leak-restart stops instead")


def unconfirmed(con: Conductor, attempt: Attempt, why: str) -> None:
    """A young leak the restart did not reproduce: what it was taken for is the shortfall its figures show; the
    attempts restarted for it are no longer counted as a leak's (the ending does not call the run leaked)."""
    attempt.note = (f"not a leak after all: {why}, so the OOM is the shortfall its figures show (a warm-up that "
                    "settles late grows for a few steps too)")
    con.leaks.clear()


def resumed_step(resume: dict[str, Any] | None) -> int:
    """The step an attempt resumed from (its resume plan's checkpoint, ``checkpoint-N``), 0 where it started afresh."""
    if not resume or resume.get("mode") != "continue":
        return 0
    m = re.search(r"checkpoint-(\d+)/?$", str(resume.get("checkpoint") or ""))
    return int(m.group(1)) if m else 0


__all__ = ["after_leak", "resumed_step", "unconfirmed"]
