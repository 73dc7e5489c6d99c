"""The end of ``oomguard run``: its status and exit code (``conclude``), what the stable config kept and changed,
the alternatives that trade differently (each with its lock), and the report, lock and HTML page, written so
that no earlier report or lock is lost. ``Writer`` reads the climb and the judge from the conductor and what only
the launches knew (warnings, a broken patch, the device's context, why a group ended) from the launcher."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..decide.conductor import Conductor
from ..decide.experiment import Experiment
from ..vocab.files import publish, write_json_atomic
from ..vocab.knobs import DS_SIZE_KNOBS, Knobs
from ..vocab.lock import Lock
from ..vocab.records import Attempt, RunReport
from ..vocab.stacks import flags
from .attempts import Launcher
from .group import Group
from .options import Reporter, RunOptions
from .verdict import conclude


class Writer:
    """Ends a run: its status, report, lock and alternatives (see the module)."""

    def __init__(self, argv: list[str], options: RunOptions, ui: Reporter, conductor: Conductor, launcher: Launcher,
                 run_dir: Path, group: Group | None) -> None:
        self.argv, self.o, self.ui, self.conductor, self.launcher = argv, options, ui, conductor, launcher
        self.run_dir, self.group = run_dir, group

    def finish(self, last: Attempt | None, signum: int | None) -> int:
        """Conclude the run after ``last`` (``signum``: the signal that interrupted it), write what it found, and
        return the exit code."""
        c, judge, run = self.conductor.climb, self.conductor.judge, self.launcher
        status, code, message = conclude(last, c, signum=signum, replay=self.o.replay,
                                         reached=bool(self.conductor.reached), max_attempts=self.o.max_attempts,
                                         max_time=self.o.max_time, broken=run.broken,
                                         leaks=[a for a in c.attempts if a.index in self.conductor.leaks],
                                         held=run.leak_held)
        if run.group_failure is not None and status == "failed":
            message = run.group_failure
        margin = self.conductor.stop_margin() if judge is not None and self.o.preflight else None
        report = c.report(status, message, code, command=self.argv,
                          device={"simulate_gpu": self.o.simulate_gpu, "simulate_context": run.sim_context,
                                  "gpu_memory": self.o.gpu_memory, "capacity": self.conductor.capacity,
                                  **({"context": run.device} if run.device else {}),
                                  **({"preflight_margin": margin[0], "preflight_margin_source": margin[1]}
                                     if margin is not None else {}),
                                  **({"calibration": judge.describe()} if judge is not None else {})})
        if last is not None and last.generated:
            who = {r["knob"]: r["remedy"] for r in report.diff}
            for kind, g in last.generated.items():
                report.diff.append({"knob": f"{kind} config", "from": g.get("replaces"), "to": g.get("path"),
                                    "remedy": next((who[k] for k in ("zero_stage", "offload_optimizer",
                                                                     "offload_params", *DS_SIZE_KNOBS) if who.get(k)),
                                                   None)})
        if status == "stable":
            final = Knobs.from_dict(report.attempts[-1].knobs)
            try:  # a help to the user: it must never cost the stable run its report and lock
                report.experiment = self._experiment(final).to_dict()
                report.alternatives = [a.to_dict() for a in self._alternatives(final)]
            except Exception as e:
                self.ui.message(f"could not work out alternatives to the stable config ({type(e).__name__}: {e})")
        if self.group is not None:
            report.group = self.group_info()
        report.warnings = list(run.warnings)
        lock_path = self._write_outputs(report, status)
        if self.group is not None:
            lock = (self.lock(Knobs.from_dict(report.attempts[-1].knobs), report.original, report.stable,
                              report.diff).to_dict() if lock_path is not None else None)
            self.group.finish({"status": status, "exit_code": code, "report": report.to_dict(), "lock": lock})
        self.ui.finish(report, self.o.report_path, lock_path)
        return code

    def group_info(self) -> dict[str, Any]:
        assert self.group is not None
        m = self.group.m
        return {"node": m.node, "nodes": m.nodes, "leader": 0, "session": str(self.group.session),
                "source": m.source}

    def _experiment(self, final: Knobs) -> Experiment:
        """What the stable config kept of the user's experiment and what it changed, in cost classes, with the
        predicted time of each speed change (oomguard.decide.experiment)."""
        c, judge = self.conductor.climb, self.conductor.judge
        return c.experiment(final, judge.slowdown(c.facts) if judge is not None else None)

    def _alternatives(self, final: Knobs) -> list[Any]:
        """Configs predicted to fit, with the model's error as headroom, that trade differently from ``final``
        (oomguard.decide.alternatives), each written as a lock in the run's directory so that one flag runs it."""
        c, judge = self.conductor.climb, self.conductor.judge
        if judge is None or self.conductor.policy.replay:
            return []
        alts = judge.alternatives(c, final)
        for n, a in enumerate(alts, 1):
            path = self.run_dir / f"alternative-{n}.lock.json"
            diff = [{**r.to_dict(), "remedy": None} for r in c.original().diff(a.knobs)]
            write_json_atomic(path, self.lock(a.knobs, c.original().to_dict(), a.knobs.to_dict(), diff).to_dict())
            alts[n - 1] = dataclasses.replace(a, lock=str(path))
        return alts

    def lock(self, knobs: Knobs, original: dict[str, Any], stable: dict[str, Any] | None,
             diff: list[dict[str, Any]]) -> Lock:
        """The lock that replays ``knobs``: what oomguard changed on top of the script's own values."""
        c = self.conductor.climb
        overrides = c.overrides(knobs)
        said = flags(c.facts.stack, overrides)
        return Lock(overrides=overrides, command=list(self.argv), ladder=self.o.ladder.name, original=original,
                    stable=stable, world_size=c.facts.world_size or 1, diff=diff,
                    stack=c.facts.stack if said else None, flags=said)

    def _write_outputs(self, report: RunReport, status: str) -> Path | None:
        """The report (and HTML), and the lock when stable. Each run keeps its own copies; the top-level files are
        copies of the latest, and an older one that no run keeps is kept aside first."""
        c, judge = self.conductor.climb, self.conductor.judge
        kept = self.o.workdir / "kept"
        aside = publish(report.to_dict(), self.run_dir / "report.json", self.o.report_path, kept)
        if self.o.html_path:
            from ..display.html import write_run_html

            breakdown = None
            if judge is not None and report.attempts:
                est = judge.predict(c.facts, Knobs.from_dict(report.attempts[-1].knobs))
                breakdown = dict(est.breakdown) if est else None
            write_run_html(self.o.html_path, report.to_dict(), breakdown)
        lock_path: Path | None = None
        if status == "stable":
            lock_path = self.o.lock_path
            final = Knobs.from_dict(report.attempts[-1].knobs)
            lock_aside = publish(self.lock(final, report.original, report.stable, report.diff).to_dict(),
                                 self.run_dir / "lock.json", lock_path, kept)
            aside = aside or lock_aside
        if aside is not None:
            self.ui.message(f"an older report or lock (not kept by any run) was kept aside in {kept}/ before the new "
                            "one replaced it")
        return lock_path


__all__ = ["Writer"]
