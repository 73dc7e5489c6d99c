"""What the supervisor tells the user while it works: plain lines on stderr (the training log owns stdout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .diagnose import Diagnosis
from .ladder import Exhausted, Step
from .records import Attempt, RunReport
from .sizes import format_size


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return "unset" if v is None else str(v)


def _changes(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in changes.items())


class ConsoleReporter:
    """Human-readable progress, one block per attempt, and the diff table at the end."""

    def __init__(self, quiet: bool = False) -> None:
        from rich.console import Console

        self.quiet = quiet
        self.out = Console(stderr=True, highlight=False, soft_wrap=True)

    def _say(self, text: str) -> None:
        self.out.print(f"[bold magenta]oomguard[/] {text}")

    def message(self, text: str) -> None:
        self._say(text)

    def attempt_start(self, index: int, max_attempts: int, remedies: list[str], changes: dict[str, Any],
                      kind: str) -> None:
        if self.quiet:
            return
        what = "probe" if kind == "probe" else "attempt"
        extra = f" with {', '.join(remedies)}" if remedies else " with your config as it is"
        self._say(f"[bold]{what} {index}/{max_attempts}[/]{extra}")
        if changes:
            self._say(f"  overrides: {_changes(changes)}")

    def attempt_end(self, attempt: Attempt, diagnosis: Diagnosis | None) -> None:
        peak = f", peak {format_size(attempt.peak_bytes)}" if attempt.peak_bytes else ""
        step = f" at step {attempt.step}" if attempt.step is not None else ""
        if attempt.outcome == "ok":
            if not self.quiet:
                self._say(f"attempt {attempt.index}: [green]finished[/] in {attempt.seconds:.1f}s{peak}")
            return
        if attempt.outcome == "oom" and diagnosis is not None:
            r = diagnosis.report
            req = f" ({format_size(r.requested)} requested)" if r.requested else ""
            self._say(f"attempt {attempt.index}: [red]out of memory[/]{step}{req}: [bold]{diagnosis.kind}[/]"
                      f"{' during ' + diagnosis.phase if diagnosis.phase != 'unknown' else ''}")
            for e in diagnosis.evidence[:3]:
                self._say(f"  • {e}")
            return
        if attempt.outcome == "failed":
            self._say(f"attempt {attempt.index}: [red]failed[/] with exit code {attempt.exit_code} (not an OOM)")
        elif attempt.outcome == "interrupted":
            self._say(f"attempt {attempt.index}: interrupted")

    def climb(self, steps: list[Step], exhausted: Exhausted | None, changes: dict[str, Any],
              skipped: list[dict[str, str]] | None = None) -> None:
        reasons = skipped if skipped is not None else [
            {"remedy": n, "reason": w} for n, w in (exhausted.skipped if exhausted else ())]
        if not self.quiet:
            for s in reasons:
                self._say(f"  [dim]skip {s['remedy']}: {s['reason']}[/]")
        if not steps:
            self._say("  → [red]no rung left that can help[/]")
            return
        names = " + ".join(s.remedy.name + (" (again)" if s.pass_no > 1 else "") for s in steps)
        trades = sorted({s.remedy.trades for s in steps})
        notes = "; ".join(dict.fromkeys(s.remedy.trade_note for s in steps if s.remedy.trade_note))
        self._say(f"  → climbing [cyan]{names}[/]: {_changes(changes)}  [dim](trades {', '.join(trades)}"
                  f"{': ' + notes if notes else ''})[/]")
        if len(steps) > 1:
            self._say("  [dim]the memory model predicts that fewer rungs would not be enough[/]")

    def finish(self, report: RunReport, report_path: Path, lock_path: Path | None) -> None:
        from .render import diff_table

        colour = {"stable": "green", "failed": "red", "exhausted": "red", "interrupted": "yellow"}[report.status]
        self._say(f"[bold {colour}]{report.status}[/]: {report.message}")
        if report.diff and report.status in ("stable", "exhausted"):
            title = "What oomguard changed" if report.status == "stable" else "What oomguard tried"
            diff_table(self.out, report.diff, title=title)
        self._say(f"report: {report_path}" + (f"   lock: {lock_path} (replay with --config)" if lock_path else ""))


class JsonLogReporter:
    """One JSON object per line on stderr, for CI logs and other programs."""

    def __init__(self) -> None:
        self.stream = sys.stderr

    def _emit(self, **data: Any) -> None:
        self.stream.write(json.dumps({"oomguard": data.pop("event"), **data}, default=str) + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        self._emit(event="message", text=text)

    def attempt_start(self, index: int, max_attempts: int, remedies: list[str], changes: dict[str, Any],
                      kind: str) -> None:
        self._emit(event="attempt_start", index=index, max_attempts=max_attempts, remedies=remedies,
                   overrides=changes, kind=kind)

    def attempt_end(self, attempt: Attempt, diagnosis: Diagnosis | None) -> None:
        self._emit(event="attempt_end", **attempt.to_dict())

    def climb(self, steps: list[Step], exhausted: Exhausted | None, changes: dict[str, Any],
              skipped: list[dict[str, str]] | None = None) -> None:
        reasons = skipped if skipped is not None else [
            {"remedy": n, "reason": w} for n, w in (exhausted.skipped if exhausted else ())]
        self._emit(event="climb", remedies=[s.remedy.name for s in steps], changes=changes, skipped=reasons)

    def finish(self, report: RunReport, report_path: Path, lock_path: Path | None) -> None:
        self._emit(event="finish", status=report.status, message=report.message, diff=report.diff,
                   report=str(report_path), lock=str(lock_path) if lock_path else None)
