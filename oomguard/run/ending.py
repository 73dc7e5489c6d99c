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
from ..vocab.records import Attempt, AttemptKind, Outcome, RunReport, ran_to_end
from ..vocab.stacks import flags
from .attempts import Launcher
from .command import EXIT_BUG
from .group import Group
from .options import Reporter, RunOptions
from .verdict import conclude


class Writer:
    """Ends a run: its status, report, lock and alternatives (see the module)."""

    def __init__(self, argv: list[str], options: RunOptions, ui: Reporter, conductor: Conductor, launcher: Launcher,
                 run_dir: Path, group: Group | None) -> None:
        self.argv, self.o, self.ui, self.conductor, self.launcher = argv, options, ui, conductor, launcher
        self.run_dir, self.group = run_dir, group

    def finish(self, last: Attempt | None, signum: int | None, error: str | None = None) -> int:
        """Conclude the run after ``last`` (``signum``: the signal that interrupted it; ``error``: the line of an
        error of oomguard's own that ended it), write what it found, and return the exit code. After such an error a
        stable attempt keeps its status and lock, anything else is ``failed``; the code is EXIT_BUG either way."""
        c, judge, run, p = self.conductor.climb, self.conductor.judge, self.launcher, self.conductor.policy
        status, code, message = conclude(last, c, signum=signum, replay=self.o.replay,
                                         reached=bool(self.conductor.reached), max_attempts=p.max_attempts,
                                         max_time=p.max_time, broken=run.broken,
                                         leaks=[a for a in c.attempts if a.index in self.conductor.leaks],
                                         held=run.leak_held)
        if error is not None:
            status, code, message = (status, EXIT_BUG, f"{message}; then an {error}") if status == "stable" else (
                "failed", EXIT_BUG, error)
        elif run.group_failure is not None and status == "failed":
            message = run.group_failure
        margin = self.conductor.stop_margin() if judge is not None and p.preflight else None
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
        lock_path = self._write_outputs(report, ran_to_end(status, code))
        if self.group is not None:
            lock = (self.lock(Knobs.from_dict(report.attempts[-1].knobs), report.original, report.stable,
                              report.diff, report.attempts[-1].files()).to_dict() if lock_path is not None else None)
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
            write_json_atomic(path, self.bare_lock(a.knobs).to_dict())
            alts[n - 1] = dataclasses.replace(a, lock=str(path))
        return alts

    def bare_lock(self, knobs: Knobs) -> Lock:
        """The lock of ``knobs`` from the climb alone (no run's report: an alternative, a salvaged lock)."""
        original = self.conductor.climb.original()
        diff = [{**r.to_dict(), "remedy": None} for r in original.diff(knobs)]
        return self.lock(knobs, original.to_dict(), knobs.to_dict(), diff)

    def lock(self, knobs: Knobs, original: dict[str, Any], stable: dict[str, Any] | None,
             diff: list[dict[str, Any]], files: dict[str, str] | None = None) -> Lock:
        """The lock that replays ``knobs``: what oomguard changed on top of the script's own values (``files``: the
        configs the attempt that ran them generated, named in the stack's flags)."""
        c = self.conductor.climb
        overrides = c.overrides(knobs)
        said = flags(c.facts.stack, overrides, files=files)
        return Lock(overrides=overrides, command=list(self.argv), ladder=self.o.ladder.name, original=original,
                    stable=stable, world_size=c.facts.world_size or 1, diff=diff,
                    stack=c.facts.stack if said else None, flags=said)

    def _write_outputs(self, report: RunReport, ran: bool) -> Path | None:
        """The report, the lock where the last attempt's config ran to the end (``ran``), then the HTML page (a
        help: its failure costs only the page, one line). Each run keeps its own copies; the top-level files are
        copies of the latest, and an older one that no run keeps is kept aside first."""
        kept = self.o.workdir / "kept"
        aside = publish(report.to_dict(), self.run_dir / "report.json", self.o.report_path, kept)
        lock_path: Path | None = None
        if ran:
            lock_path = self.o.lock_path
            final = Knobs.from_dict(report.attempts[-1].knobs)
            lock_aside = publish(self.lock(final, report.original, report.stable, report.diff,
                                           report.attempts[-1].files()).to_dict(),
                                 self.run_dir / "lock.json", lock_path, kept)
            aside = aside or lock_aside
        if aside is not None:
            self.ui.message(f"an older report or lock (not kept by any run) was kept aside in {kept}/ before the new "
                            "one replaced it")
        if self.o.html_path:
            try:
                self._write_html(report)
            except Exception as e:
                self.ui.message(f"warning: the HTML page {self.o.html_path} could not be written ({type(e).__name__}: "
                                f"{e}); the report and the lock are written")
        return lock_path

    def _write_html(self, report: RunReport) -> None:
        from ..display.html import write_run_html

        c, judge = self.conductor.climb, self.conductor.judge
        breakdown = None
        if judge is not None and report.attempts:
            est = judge.predict(c.facts, Knobs.from_dict(report.attempts[-1].knobs))
            breakdown = dict(est.breakdown) if est else None
        assert self.o.html_path is not None
        write_run_html(self.o.html_path, report.to_dict(), breakdown)

    def salvage_lock(self, last: Attempt | None) -> Path | None:
        """Where writing the report failed (an error of oomguard's own): the lock of a stable attempt all the same,
        from the climb alone, so that a long climb's result is never lost. None where ``last`` was not stable."""
        if last is None or last.outcome != Outcome.OK or last.kind != AttemptKind.RUN:
            return None
        try:
            publish(self.bare_lock(Knobs.from_dict(last.knobs)).to_dict(), self.run_dir / "lock.json",
                    self.o.lock_path, self.o.workdir / "kept")
        except Exception:
            return None
        return self.o.lock_path


__all__ = ["Writer"]
