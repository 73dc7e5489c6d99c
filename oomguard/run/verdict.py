"""How a run ended, in one place: its status, its exit code and the one-line message the user reads.

>>> from oomguard.decide.climb import Climb
>>> from oomguard.decide.ladder import load_ladder
>>> conclude(None, Climb(load_ladder("default")), signum=2)
('interrupted', 130, 'interrupted; no retry')
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from ..decide.climb import Climb
from ..vocab.lock import Lock
from ..vocab.protocol import EXIT_LOCK_UNMET
from ..vocab.records import Attempt, AttemptKind, Outcome
from .command import EXIT_EXHAUSTED, EXIT_LEAKED

# The reasons a climb gives for ending that are its own diagnosis, said as the run's message (decide/repeat.py, the
# climb's ``predicted``).
ENDS = ("fixed-allocation", "predicted")


def conclude(last: Attempt | None, climb: Climb, *, signum: int | None = None, replay: Lock | None = None,
             reached: bool = True, max_attempts: int = 8, max_time: float | None = None,
             broken: str | None = None, leaks: Sequence[Attempt] = (),
             held: str | None = None) -> tuple[str, int, str]:
    """``(status, exit code, message)`` after the last attempt; ``reached``: the command passed through a
    construction point (GRPOConfig, GRPOTrainer or from_pretrained), so rungs could reach it; ``broken``: the line of
    a patch of oomguard's that failed (``PatchFailed.line``), the reason rungs could not reach it; ``leaks``: the
    attempts that ran out of memory through a leak and were resumed with the same config; ``held``: where the leak's
    memory is held, as the training process found it.

    A run that leaks ends ``leaked``: with exit code 0 where it finished every step through restarts from its
    checkpoints, EXIT_LEAKED where it stopped at a leak (--no-leak-restart, or a leak too fast to get past a
    checkpoint)."""
    if signum or last is None or last.outcome == Outcome.INTERRUPTED:
        return "interrupted", 128 + (signum or 2), "interrupted; no retry"
    if climb.exhausted is not None and climb.exhausted.skipped[:1] and climb.exhausted.skipped[0][0] == "leak":
        return "leaked", EXIT_LEAKED, f"the run leaks memory and stopped: {climb.exhausted.skipped[0][1]}. " + \
            _leak_said(last, held)
    if climb.exhausted is not None and climb.exhausted.skipped[:1] and climb.exhausted.skipped[0][0] in ENDS:
        # the climb ended on a diagnosis of its own: a fixed allocation, or every config predicted to be stopped
        return "exhausted", EXIT_EXHAUSTED, climb.exhausted.skipped[0][1]
    if leaks and last.outcome == Outcome.OK and last.kind == AttemptKind.RUN:
        return "leaked", last.exit_code or 0, (f"finished every step after {len(leaks)} restart(s) from its "
                                               "checkpoints with the same config (no knob changed for the leak): "
                                               + _leak_said(leaks[-1], held))
    if last.outcome == Outcome.OK and last.kind == AttemptKind.RUN:
        status, message = "stable", _stable_message(climb, replay)
        if last.miss:  # the config held, but far from what the memory model said of it (decide/miss.py)
            message += (f"; its peak was {last.miss['factor']:.2f}x the memory model's prediction, beyond twice its "
                        "measured error (the attempt's miss in the report)")
        if last.exit_code:  # the training processes all finished; a launcher's own code is passed through untouched
            message += (f"; every training process finished, but the command exited with code {last.exit_code}, "
                        "passed through")
        return status, last.exit_code or 0, message
    budget = (f"--max-time {max_time:g}s" if max_time and time.time() - climb.started >= max_time
              else f"--max-attempts {max_attempts}")
    if last.outcome == Outcome.OK or (last.outcome != Outcome.FAILED and climb.verified and climb.exhausted is None):
        return "exhausted", EXIT_EXHAUSTED, (f"a config fits (its probe passed), but the budget ({budget}) ran out "
                                             "before the run (no lock written): raise it to train")
    if last.outcome == Outcome.FAILED and last.override_error is not None and climb.exhausted is not None:
        # oomguard's own override broke it, and taking that rung back left none that can help: not the script's failure
        return "exhausted", EXIT_EXHAUSTED, f"the ladder is used up: no rung left that can help ({last.note})"
    if last.outcome == Outcome.FAILED and last.unmet:  # a replay stopped before training: the lock is not what runs
        return "failed", EXIT_LOCK_UNMET, last.note or "the training process does not run the lock's config"
    if last.outcome == Outcome.FAILED:
        code = last.exit_code or 1  # 0 only from a launcher that hides a failed rank: still a failure
        why = f": {last.note}" if last.note else ""
        said = (f"the command failed with exit code {last.exit_code}" if last.exit_code
                else "the command exited with code 0 but its training did not finish")
        return "failed", code, f"{said} (not an OOM){why}; passed through without retrying"
    if climb.exhausted is not None:
        if replay:
            return "exhausted", EXIT_EXHAUSTED, f"the locked config {_fell_short(last)}; run without --config to climb again"
        if not reached and broken:
            return "exhausted", EXIT_EXHAUSTED, f"no rung can reach this command: {broken}"
        if not reached:
            return "exhausted", EXIT_EXHAUSTED, (
                "no rung can reach this command: it built no GRPOConfig or GRPOTrainer and loaded no model with "
                "from_pretrained before running out of memory, so only allocator settings apply")
        return "exhausted", EXIT_EXHAUSTED, "the ladder is used up: no rung left that can help"
    if last.outcome == Outcome.OOM:
        return "exhausted", EXIT_EXHAUSTED, f"stopped by the budget ({budget}) while the run still ran out of memory"
    ooms = sum(1 for a in climb.attempts if a.outcome == Outcome.OOM)
    return "exhausted", EXIT_EXHAUSTED, (
        f"stopped by the budget ({budget}) while the last config tried was still predicted not to fit (stopped by the "
        "pre-flight check before it loaded or generated)" + ("" if ooms else "; no attempt ran out of memory"))


def _fell_short(last: Attempt) -> str:
    """How the last attempt fell short: it ran out of memory, or the pre-flight check stopped it first."""
    if last.outcome == Outcome.PREDICTED:
        return "was predicted not to fit (stopped by the pre-flight check before it loaded or generated)"
    return "ran out of memory"


def _leak_said(a: Attempt, held: str | None) -> str:
    """The leak's own sentence, from the attempt's diagnosis, where it is held, and the way out."""
    evidence = (a.oom or {}).get("evidence") or []
    said = str(evidence[0]) if evidence else "The run leaks memory (the report's evidence says how fast)."
    if held and "It is held here" not in said:
        said = said.replace(" Only a fix", f" {held} Only a fix", 1) if " Only a fix" in said else f"{said} {held}"
    return said


def _stable_message(climb: Climb, replay: Lock | None) -> str:
    ooms = sum(1 for a in climb.attempts if a.outcome == Outcome.OOM and a.kind != AttemptKind.MINIMIZE)
    stops = sum(1 for a in climb.attempts if a.outcome == Outcome.PREDICTED and a.kind != AttemptKind.MINIMIZE)
    trials = sum(1 for a in climb.attempts if a.outcome == Outcome.OOM and a.kind == AttemptKind.MINIMIZE)
    proof = (f"; {trials} probe(s) without a change ran out of memory, showing it needed" if trials else "")
    if ooms or stops:
        return f"stable after {ooms} out-of-memory attempt(s)" + (
            f" and {stops} pre-flight stop(s) (predicted not to fit, stopped before loading or generating)" if stops
            else "") + proof
    if replay:
        return (f"the locked config fit: replayed the lock's {len(replay.overrides)} override(s), no "
                "rung climbed")
    how = "on the first attempt" if len(climb.attempts) <= 1 else f"in {_launches(climb.attempts)}"
    if climb.adapted:
        return (f"the command fit {how}; nothing changed for memory, only what lets it run here: "
                + ", ".join(f"{k}={v}" for k, (v, _why) in climb.adapted.items()))
    return f"the command fit {how}; nothing changed"


def _launches(attempts: Sequence[Attempt]) -> str:
    """The launches of a run that changed nothing, in words: what came before its run.

    >>> from oomguard.vocab.records import Attempt
    >>> _launches([Attempt(1, {}, [], "ok", 0, 1.0, kind="probe"), Attempt(2, {}, [], "ok", 0, 1.0)])
    '2 launches (a probe, then the run)'
    """
    kinds = Counter(str(a.kind) for a in attempts[:-1])
    names = {"probe": ("a probe", "probes"), "minimize": ("a probe without a change", "probes without a change"),
             "run": ("a run", "runs")}
    before = [names.get(k, (f"a {k}", f"{k}s"))[0] if n == 1 else f"{n} {names.get(k, (k, k + 's'))[1]}"
              for k, n in kinds.items()]
    return f"{len(attempts)} launches ({', '.join(before)}, then the run)"


__all__ = ["conclude"]
