"""A node that follows: it launches what the group's leader (node 0) publishes and reports how its part ended.

A follower decides nothing. For attempt K it waits for the leader's plan (oomguard.group), launches the user's command
with it (the same overrides, allocator options and simulated device as every node), stops its command when the group
says so (a rank on another node ran out of memory and its own ranks wait at a collective; a node died; the leader ended
the job), and writes how its command ended for the leader to weigh. When the leader ends the job, the follower writes
the leader's report, and lock, as its own (with its place in the group), and exits with the leader's code, so every
node names the same stable config and the same attempts.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..vocab.knobs import Knobs
from ..vocab.records import REPORT_SCHEMA, AttemptKind, now_iso, publish
from .group import GroupError, GroupTail
from .watch import PROBE_DIR_PREFIX, Watch

EXIT_GROUP = 1  # the group ended early (a node died, the leader vanished)


def follow(sup: Any) -> int:
    """Run the attempts the leader publishes until it ends the job; return the job's exit code. ``sup`` is the
    node's Supervisor (its options, reporter, environment and tick), which calls this for a follower."""
    g = sup.group
    assert g is not None
    index = 1
    with sup.interrupts:
        while True:
            try:
                step = g.next_step(index)
            except GroupError as e:
                return _alone(sup, str(e))
            if step.get("kind") == "final":
                return _adopt(sup, step)
            plan: dict[str, Any] = dict(step["plan"])
            kind = AttemptKind(step["kind"])
            adir = g.attempt_dir(index)
            plan["events"], plan["crash_dir"] = str(g.events_path(index)), str(adir)
            scratch = None
            if plan.get("probe"):  # the leader's scratch directory is on its node: a probe writes into its own
                scratch = Path(tempfile.mkdtemp(prefix=PROBE_DIR_PREFIX))
                plan["probe"] = {**plan["probe"], "output_dir": str(scratch)}
            sup.ui.attempt_start(index, int(step.get("max_attempts") or sup.o.max_attempts),
                                 list(step.get("actions") or []), dict(plan.get("overrides") or {}), kind)
            watch = Watch(kind, Knobs(), GroupTail(adir), sup._progress_state(index, kind, plan.get("remedies", [])))
            res = sup._start(sup._env_with(sup._write_plan(adir, plan), step.get("alloc") or {}), watch, scratch)
            g.ended(index, {"returncode": res.returncode, "exit_code": res.exit_code, "interrupted": res.interrupted,
                            "host_oom": res.host_oom, "host_strong": res.host_strong, "survivors": res.survivors,
                            "seconds": round(res.seconds, 3)})
            if sup.group_failure is not None:
                return _alone(sup, sup.group_failure)
            sup.ui.message(f"attempt {index}: this node's command ended (exit {res.exit_code}); node 0 decides for "
                           "the whole job")
            index += 1


def _adopt(sup: Any, final: dict[str, Any]) -> int:
    """The leader's report (and lock) as this node's own."""
    report = {**final["report"], "group": sup._group_info()}
    kept = sup.o.workdir / "kept"
    publish(report, sup.run_dir / "report.json", sup.o.report_path, kept)
    lock = final.get("lock")
    if lock:
        publish(lock, sup.run_dir / "lock.json", sup.o.lock_path, kept)
    attempts = len(report.get("attempts") or [])
    sup.ui.message(f"{report.get('status')} after {attempts} attempt(s), as node 0 decided: "
                   f"{report.get('message', '')}; report: {sup.o.report_path}" + (f", lock: {sup.o.lock_path}"
                                                                                  if lock else ""))
    return int(final.get("exit_code") or 0)


def _alone(sup: Any, why: str) -> int:
    """The group ended without the leader's word: say why, and keep a report that says so."""
    sup.ui.message(why)
    report = {"schema": REPORT_SCHEMA, "status": "failed", "message": why, "exit_code": EXIT_GROUP,
              "command": sup.argv, "finished": now_iso(), "attempts": [], "group": sup._group_info()}
    publish(report, sup.run_dir / "report.json", sup.o.report_path, sup.o.workdir / "kept")
    return EXIT_GROUP


__all__ = ["EXIT_GROUP", "follow"]
