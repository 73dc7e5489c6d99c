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

from ..vocab.files import publish
from ..vocab.knobs import Knobs
from ..vocab.records import REPORT_SCHEMA, AttemptKind, now_iso
from .attempts import Launcher
from .ending import Writer
from .group import GroupError, GroupTail
from .watch import PROBE_DIR_PREFIX, Watch

EXIT_GROUP = 1  # the group ended early (a node died, the leader vanished)


def follow(run: Launcher, writer: Writer) -> int:
    """Run the attempts the leader publishes until it ends the job; return the job's exit code. ``run`` launches
    them (the node's options, reporter, environment and tick), ``writer`` names this node's place in the report."""
    g = run.group
    assert g is not None
    index = 1
    with run.interrupts:
        while True:
            try:
                step = g.next_step(index)
            except GroupError as e:
                return _alone(run, writer, str(e))
            if step.get("kind") == "final":
                return _adopt(run, writer, step)
            plan: dict[str, Any] = dict(step["plan"])
            kind = AttemptKind(step["kind"])
            adir = g.attempt_dir(index)
            plan["events"], plan["crash_dir"] = str(g.events_path(index)), str(adir)
            scratch = None
            if plan.get("probe"):  # the leader's scratch directory is on its node: a probe writes into its own
                scratch = Path(tempfile.mkdtemp(prefix=PROBE_DIR_PREFIX))
                plan["probe"] = {**plan["probe"], "output_dir": str(scratch)}
            run.ui.attempt_start(index, int(step.get("max_attempts") or run.max_attempts),
                                 list(step.get("actions") or []), dict(plan.get("overrides") or {}), kind)
            watch = Watch(kind, Knobs(), GroupTail(adir), run.progress_state(index, kind, plan.get("remedies", [])))
            res = run.start(run.env_with(run.write_plan(adir, plan), step.get("alloc") or {}), watch, scratch)
            g.ended(index, {"returncode": res.returncode, "exit_code": res.exit_code, "interrupted": res.interrupted,
                            "host_oom": res.host_oom, "host_strong": res.host_strong, "survivors": res.survivors,
                            "seconds": round(res.seconds, 3)})
            if run.group_failure is not None:
                return _alone(run, writer, run.group_failure)
            run.ui.message(f"attempt {index}: this node's command ended (exit {res.exit_code}); node 0 decides for "
                           "the whole job")
            index += 1


def _adopt(run: Launcher, writer: Writer, final: dict[str, Any]) -> int:
    """The leader's report (and lock) as this node's own."""
    report = {**final["report"], "group": writer.group_info()}
    kept = run.o.workdir / "kept"
    publish(report, run.run_dir / "report.json", run.o.report_path, kept)
    lock = final.get("lock")
    if lock:
        publish(lock, run.run_dir / "lock.json", run.o.lock_path, kept)
    attempts = len(report.get("attempts") or [])
    run.ui.message(f"{report.get('status')} after {attempts} attempt(s), as node 0 decided: "
                   f"{report.get('message', '')}; report: {run.o.report_path}" + (f", lock: {run.o.lock_path}"
                                                                                  if lock else ""))
    return int(final.get("exit_code") or 0)


def _alone(run: Launcher, writer: Writer, why: str) -> int:
    """The group ended without the leader's word: say why, and keep a report that says so."""
    run.ui.message(why)
    report = {"schema": REPORT_SCHEMA, "status": "failed", "message": why, "exit_code": EXIT_GROUP,
              "command": run.argv, "finished": now_iso(), "attempts": [], "group": writer.group_info()}
    publish(report, run.run_dir / "report.json", run.o.report_path, run.o.workdir / "kept")
    return EXIT_GROUP


__all__ = ["EXIT_GROUP", "follow"]
