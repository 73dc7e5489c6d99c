"""The end of ``oomguard run``: its status and exit code (``conclude``), what the stable config kept and changed,
the alternatives that trade differently (each with its lock), and the report, lock and HTML page, written so
that no earlier report or lock is lost."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..decide.climb import Climb
from ..decide.experiment import Experiment
from ..vocab.knobs import DS_SIZE_KNOBS, Knobs
from ..vocab.records import (
    Attempt,
    RunReport,
    now_iso,
    publish,
    write_json_atomic,
)
from ..vocab.schema import LOCK_SCHEMA
from ..vocab.stacks import flags
from .group import Group
from .options import Reporter, RunOptions
from .verdict import conclude


class Ending:
    """The Supervisor's part that ends a run and writes what it found (a mixin of ``Supervisor``)."""

    # the Supervisor's state these methods read and write (set in Supervisor.__init__)
    argv: list[str]
    o: RunOptions
    ui: Reporter
    climb: Climb
    guide: Any
    group: Group | None

    def _finish(self, last: Attempt | None) -> int:
        c = self.climb
        status, code, message = conclude(last, c, signum=self.interrupts.signum, replay=self.o.replay,
                                         reached=bool(self.reached), max_attempts=self.o.max_attempts,
                                         max_time=self.o.max_time, broken=self.broken)
        if self.group_failure is not None and status == "failed":
            message = self.group_failure
        report = c.report(status, message, code, command=self.argv,
                          device={"simulate_gpu": self.o.simulate_gpu, "simulate_context": self.sim_context,
                                  "gpu_memory": self.o.gpu_memory, "capacity": self.capacity,
                                  **({"context": self.device} if self.device else {}),
                                  **({"preflight_margin": self._stop_margin()[0],
                                      "preflight_margin_source": self._stop_margin()[1]}
                                     if self.guide is not None and self.o.preflight else {}),
                                  **({"calibration": self.guide.describe()} if self.guide is not None else {})})
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
            report.group = self._group_info()
        report.warnings = list(self.warnings)
        lock_path = self._write_outputs(report, status)
        if self.group is not None:
            lock = (self._lock_data(Knobs.from_dict(report.attempts[-1].knobs), report.original, report.stable,
                                    report.diff) if lock_path is not None else None)
            self.group.finish({"status": status, "exit_code": code, "report": report.to_dict(), "lock": lock})
        self.ui.finish(report, self.o.report_path, lock_path)
        return code

    def _group_info(self) -> dict[str, Any]:
        assert self.group is not None
        m = self.group.m
        return {"node": m.node, "nodes": m.nodes, "leader": 0, "session": str(self.group.session),
                "source": m.source}

    def _experiment(self, final: Knobs) -> Experiment:
        """What the stable config kept of the user's experiment and what it changed, in cost classes, with the
        predicted time of each speed change (oomguard.decide.experiment)."""
        c = self.climb
        return c.experiment(final, self.guide.slowdown(c.facts) if self.guide is not None else None)

    def _alternatives(self, final: Knobs) -> list[Any]:
        """Configs predicted to fit, with the model's error as headroom, that trade differently from ``final``
        (oomguard.decide.alternatives), each written as a lock in the run's directory so that one flag runs it."""
        c = self.climb
        if self.guide is None or self.o.replay:
            return []
        alts = self.guide.alternatives(c, final)
        for n, a in enumerate(alts, 1):
            path = self.run_dir / f"alternative-{n}.lock.json"
            write_json_atomic(path, self._lock_data(a.knobs, c.original().to_dict(), a.knobs.to_dict(),
                                                    [{**r.to_dict(), "remedy": None} for r in c.original().diff(
                                                        a.knobs)]))
            alts[n - 1] = dataclasses.replace(a, lock=str(path))
        return alts

    def _lock_data(self, knobs: Knobs, original: dict[str, Any], stable: dict[str, Any] | None,
                   diff: list[dict[str, Any]]) -> dict[str, Any]:
        overrides = self.climb.overrides(knobs)
        said = flags(self.climb.facts.stack, overrides)
        return {"schema": LOCK_SCHEMA, "created": now_iso(), "command": self.argv, "ladder": self.o.ladder.name,
                "overrides": overrides, "original": original, "stable": stable,
                "world_size": self.climb.facts.world_size, "diff": diff,
                **({"stack": self.climb.facts.stack, "flags": said} if said else {})}

    def _write_outputs(self, report: RunReport, status: str) -> Path | None:
        """The report (and HTML), and the lock when stable. Each run keeps its own copies; the top-level files are
        copies of the latest, and an older one that no run keeps is kept aside first."""
        c = self.climb
        kept = self.o.workdir / "kept"
        aside = publish(report.to_dict(), self.run_dir / "report.json", self.o.report_path, kept)
        if self.o.html_path:
            from ..display.html import write_run_html

            breakdown = None
            if self.guide is not None and report.attempts:
                est = self.guide.predict(c.facts, Knobs.from_dict(report.attempts[-1].knobs))
                breakdown = dict(est.breakdown) if est else None
            write_run_html(self.o.html_path, report.to_dict(), breakdown)
        lock_path: Path | None = None
        if status == "stable":
            lock_path = self.o.lock_path
            final = Knobs.from_dict(report.attempts[-1].knobs)
            lock_aside = publish(self._lock_data(final, report.original, report.stable, report.diff),
                                 self.run_dir / "lock.json", lock_path, kept)
            aside = aside or lock_aside
        if aside is not None:
            self.ui.message(f"an older report or lock (not kept by any run) was kept aside in {kept}/ before the new "
                            "one replaced it")
        return lock_path
