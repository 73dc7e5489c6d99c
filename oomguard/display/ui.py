"""What the supervisor tells the user while it works: plain lines on stderr (the training log owns stdout)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decide.experiment import cost_note, experiment_lines
from ..decide.ladder import Exhausted, Step
from ..vocab.diagnosis import Diagnosis
from ..vocab.records import Attempt, RunReport, ran_to_end, rung_label
from ..vocab.sizes import format_size
from ..vocab.stacks import told


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return "unset" if v is None else str(v)


def _changes(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in changes.items())


@dataclass
class Progress:
    """What the live view shows: the attempt, the rungs in force, the child's step and peak against capacity."""

    index: int = 0
    max_attempts: int = 0
    kind: str = "run"
    remedies: list[str] = field(default_factory=list)
    step: int | None = None
    max_steps: int | None = None
    peak: int | None = None
    capacity: int | None = None
    started: float = field(default_factory=time.monotonic)
    run_started: float = field(default_factory=time.monotonic)
    label: str | None = None  # how the console names the attempt ("probe 2/8", "minimize trial 1")

    def title(self) -> str:
        return self.label or f"{self.kind} {self.index}/{self.max_attempts}"

    def update(self, ev: Any) -> None:
        """Follow one event of the training process (a process may build several trainers: each has its own count)."""
        from ..vocab.events import StepDone, TrainBegin

        if isinstance(ev, TrainBegin):
            self.step, self.max_steps = ev.step, ev.max_steps
        elif isinstance(ev, StepDone):
            if ev.step is not None:
                self.step = ev.step
            if ev.peak is not None:
                self.peak = max(self.peak or 0, ev.peak)

    def elapsed(self) -> str:
        return _clock(time.monotonic() - self.started)

    def line(self) -> str:
        """One plain line (logs without a terminal)."""
        step = f"step {self.step}" + (f"/{self.max_steps}" if self.max_steps and self.max_steps > 0 else "") \
            if self.step is not None else "starting"
        peak = f", peak {format_size(self.peak)}" + (f" of {format_size(self.capacity)}" if self.capacity else "") \
            if self.peak is not None else ""
        return f"{self.title()}: {step}{peak}, {self.elapsed()}"


KIND_NAMES = {"probe": "probe", "minimize": "minimize probe"}  # how the console names an attempt of each kind


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def status_panel(p: Progress) -> Any:
    """The live view as a rich renderable (also used by the tests)."""
    from rich.bar import Bar
    from rich.table import Table

    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold magenta")
    t.add_column()
    t.add_row("oomguard", f"{p.title()}   elapsed {p.elapsed()} "
                          f"(run {_clock(time.monotonic() - p.run_started)})")
    t.add_row("rungs", ", ".join(p.remedies) if p.remedies else "none: your config as it is")
    step = "starting" if p.step is None else f"{p.step}" + (f" / {p.max_steps}" if p.max_steps and p.max_steps > 0
                                                           else "")
    t.add_row("step", step)
    if p.peak is not None:
        if p.capacity:
            grid = Table.grid(padding=(0, 1))
            grid.add_row(Bar(size=p.capacity, begin=0, end=min(p.peak, p.capacity), width=30,
                             color="red" if p.peak > 0.9 * p.capacity else "green"),
                         f"{format_size(p.peak)} of {format_size(p.capacity)} ({p.peak / p.capacity:.0%})")
            t.add_row("peak", grid)
        else:
            t.add_row("peak", format_size(p.peak))
    return t


class ConsoleReporter:
    """Human-readable progress, one block per attempt, a live status panel on a terminal, the diff at the end."""

    def __init__(self, quiet: bool = False, live: bool | None = None, lock: str | None = None,
                 command: list[str] | None = None, options: list[str] | None = None) -> None:
        from rich.console import Console

        self.quiet = quiet
        self.lock = lock  # the lock file replayed with --config, if any
        # The command in the user's own words, and the options that set its device: what a "run it" line repeats
        # (the launch uses the resolved command, whose interpreter is an absolute path the user never typed).
        self.command = command
        self.options = options or []
        self.out = Console(stderr=True, highlight=False, soft_wrap=True)
        self.live_enabled = (not quiet and self.out.is_terminal) if live is None else live
        self._live: Any = None
        self._last_line = 0.0
        self.state = Progress()

    def _say(self, text: str) -> None:
        self.out.print(f"[bold magenta]oomguard[/] {text}")

    def message(self, text: str) -> None:
        self._say(_plain(text))

    def attempt_start(self, index: int, max_attempts: int, remedies: list[str], changes: dict[str, Any],
                      kind: str) -> None:
        # minimize trials do not count against --max-attempts: they are numbered apart, the others without them
        self._trials = trials = getattr(self, "_trials", 0) + (kind == "minimize")
        what = KIND_NAMES.get(kind, "attempt")
        label = f"minimize trial {trials}" if kind == "minimize" else f"{what} {index - trials}/{max_attempts}"
        self.state = Progress(index=index, max_attempts=max_attempts, kind=kind, remedies=list(remedies),
                              capacity=self.state.capacity, run_started=self.state.run_started, label=label)
        if self.quiet:
            return
        extra = (f" with {', '.join(remedies)}" if remedies
                 else f" replaying the {len(changes)} override(s) of {self.lock}" if self.lock and changes
                 else " with your config as it is")
        self._say(f"[bold]{label}[/]{extra}")
        if changes:
            self._say(f"  overrides: {_changes(changes)}")

    # -- the live view ------------------------------------------------------------------------------------------
    def live(self) -> Any:
        """A context manager around a running attempt: the status panel stays at the bottom of the terminal while
        the training output scrolls above it (Live redirects stdout and stderr)."""
        import contextlib

        if not self.live_enabled:
            return contextlib.nullcontext()
        from rich.live import Live

        self._live = Live(status_panel(self.state), console=self.out, refresh_per_second=4, transient=True,
                          redirect_stdout=True, redirect_stderr=True)
        return self._live

    def progress(self, state: Progress) -> None:
        self.state = state
        if self._live is not None and self._live.is_started:
            self._live.update(status_panel(state))
        elif not self.quiet and time.monotonic() - self._last_line >= 30:
            self._last_line = time.monotonic()
            self._say(f"[dim]{state.line()}[/]")

    def attempt_end(self, attempt: Attempt, diagnosis: Diagnosis | None) -> None:
        self._live = None
        # the name attempt_start gave it ("attempt 3/8", "minimize trial 1"), so that start and end lines match
        what = (self.state.label if self.state.index == attempt.index and self.state.label
                else f"{KIND_NAMES.get(attempt.kind, 'attempt')} {attempt.index}")
        peak = f", peak {format_size(attempt.peak_bytes)}" if attempt.peak_bytes else ""
        step = f" at step {attempt.step}" if attempt.step is not None else ""
        if attempt.outcome == "ok":
            if not self.quiet:
                self._say(f"{what}: [green]finished[/] in {attempt.seconds:.1f}s{peak}")
            return
        if attempt.outcome == "oom" and diagnosis is not None:
            r = diagnosis.report
            req = f" ({format_size(r.requested)} requested)" if r.requested else ""
            self._say(f"{what}: [red]out of memory[/]{step}{req}: [bold]{diagnosis.kind}[/]"
                      f"{' during ' + diagnosis.phase if diagnosis.phase != 'unknown' else ''}")
            for e in diagnosis.evidence[:3]:
                self._say(f"  • {_plain(e)}")
            return
        if attempt.outcome == "predicted":
            self._say(f"{what}: [yellow]stopped by the pre-flight check[/]: predicted "
                      f"{format_size(attempt.predicted_bytes or 0)}, too far over the device to run")
            return
        if attempt.outcome == "failed" and attempt.unmet:
            self._say(f"{what}: [red]stopped before training[/]: it does not run the lock's "
                      f"{_plain(str(attempt.unmet.get('knob')))}")
        elif attempt.outcome == "failed":
            self._say(f"{what}: [red]failed[/] with exit code {attempt.exit_code} (not an OOM)")
        elif attempt.outcome == "interrupted":
            self._say(f"{what}: interrupted")

    def decision(self, steps: list[Step], exhausted: Exhausted | None, changes: dict[str, Any],
              skipped: list[dict[str, str]] | None = None) -> None:
        reasons = skipped if skipped is not None else [
            {"remedy": n, "reason": w} for n, w in (exhausted.skipped if exhausted else ())]
        if not self.quiet:
            for s in reasons:
                self._say(f"  [dim]skip {s['remedy']}: {_plain(s['reason'])}[/]")
        if not steps and exhausted is None:
            # the memory model learned from a chosen config's OOM and chose again below the same rungs
            self._say(f"  → choosing again with what was learned: {_changes(changes)}")
            return
        if not steps:
            self._say("  → [red]no rung left that can help[/]")
            return
        # named by what each did: a fewer_generations rung that kept num_generations is fewer_prompts_per_step
        names = rung_label([(s.remedy.name_for(changes), s.pass_no) for s in steps])
        # what it costs: only the rungs whose knobs changed (the memory model may find a climbed rung not needed)
        note = cost_note([s.remedy for s in steps], changes)
        # the values are the choice's, below the rungs climbed: the lines after say what it dropped and relaxed
        self._say(f"  → climbing [cyan]{names}[/]; the choice: {_changes(changes)}  [dim]({_plain(note)})[/]")
        if len(steps) > 1:
            self._say("  [dim]the memory model predicts that fewer rungs would not be enough[/]")

    def finish(self, report: RunReport, report_path: Path, lock_path: Path | None) -> None:
        from .render import diff_table

        colour = {"stable": "green", "failed": "red", "exhausted": "red", "interrupted": "yellow",
                  "leaked": "yellow"}[report.status]
        self._say(f"[bold {colour}]{report.status}[/]: {_plain(report.message)}")
        if report.diff and report.status in ("stable", "exhausted", "leaked"):
            ran = ran_to_end(report.status, report.exit_code)
            diff_table(self.out, report.diff, title="What oomguard changed" if ran else "What oomguard tried",
                       stable=ran)
        said = [r["flag"] for r in report.diff if r.get("flag")]
        if said and report.status == "stable":
            self._say(_plain(f"{told((report.facts or {}).get('stack'), said)} (the lock replays them: oomguard run "
                             "--config LOCK -- COMMAND)"))
        for line in experiment_lines(report.experiment):
            self._say(_plain(line))
        for line in alternatives_lines(report.alternatives, self.command or report.command, self.options):
            self._say(_plain(line))
        self._say(_plain(f"report: {report_path}" + (f"   lock: {lock_path} (replay with --config)" if lock_path
                                                     else "")))


def alternatives_lines(alts: list[dict[str, Any]], command: list[str] | None = None,
                       options: list[str] | None = None) -> list[str]:
    """The final message's lines for the configs predicted to fit that trade differently (the choice stays the
    default): what each leaves as you had it, how fast a step is against the choice, what it changes instead, its
    predicted peak, and the lock (or knobs) that run it.

    ``command`` is the user's command as they typed it and ``options`` the oomguard options that set its device, so
    the "run it" line can be pasted as it is:

    >>> alt = {"avoids": ["speed"], "keeps": ["no speed change (the choice: 2 micro-steps of 4 rows per step)"],
    ...        "trades": ["bf16 weights (yours: float32) (precision)"], "lock": "alt-1.lock.json", "overrides": {}}
    >>> alternatives_lines([alt], ["train.py", "--epochs", "1"], ["--simulate-gpu", "300MiB"])[-1]
    '     run it: oomguard run --config alt-1.lock.json --simulate-gpu 300MiB -- train.py --epochs 1'
    """
    if not alts:
        return []
    from ..vocab.sizes import format_size

    lines = ["these are also predicted to fit, and trade differently:"]
    tail = " ".join([*map(shlex.quote, options or []), "--", shlex.join(command) if command else "COMMAND"])
    for n, a in enumerate(alts, 1):
        peak = f"; predicted {format_size(a['predicted_bytes'])}" if a.get("predicted_bytes") else ""
        v = a.get("versus_choice")
        speed = ("" if v is None or abs(v) < 0.005 else f", about {1 + v:.1f}x the time per step" if v >= 1
                 else f", about {abs(v):.0%} {'slower' if v > 0 else 'faster'} per step")
        lines.append(f"  {n}. {'; '.join(a['keeps'])}{speed}{peak}")
        lines.append(f"     changes {', '.join(a['trades']) or 'nothing that costs'}")
        if a.get("lock"):
            lines.append(f"     run it: oomguard run --config {a['lock']} {tail}")
        else:
            lines.append("     knobs: " + " ".join(f"{k}={_plain_value(v)}" for k, v in a["overrides"].items()))
    return lines


def _plain_value(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v).lower() if isinstance(v, bool) else str(v)


class JsonLogReporter:
    """One JSON object per line on stderr, for CI logs and other programs."""

    def __init__(self) -> None:
        self.stream = sys.stderr
        self._last = 0.0

    def live(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def progress(self, state: Progress) -> None:
        """At most one line every 5 s, and one at once when a new attempt or trainer starts (its length changes)."""
        key = (state.index, state.kind, state.max_steps)
        if time.monotonic() - self._last >= 5 or key != getattr(self, "_last_key", None):
            self._last, self._last_key = time.monotonic(), key
            self._emit(event="progress", attempt=state.index, kind=state.kind, step=state.step,
                       max_steps=state.max_steps, peak_bytes=state.peak, capacity_bytes=state.capacity,
                       remedies=state.remedies)

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

    def decision(self, steps: list[Step], exhausted: Exhausted | None, changes: dict[str, Any],
              skipped: list[dict[str, str]] | None = None) -> None:
        reasons = skipped if skipped is not None else [
            {"remedy": n, "reason": w} for n, w in (exhausted.skipped if exhausted else ())]
        self._emit(event="climb", remedies=[s.remedy.name for s in steps], changes=changes, skipped=reasons)

    def finish(self, report: RunReport, report_path: Path, lock_path: Path | None) -> None:
        self._emit(event="finish", status=report.status, message=report.message, diff=report.diff,
                   report=str(report_path), lock=str(lock_path) if lock_path else None)


def _plain(text: str) -> str:
    """``text`` as rich prints it literally: a training process's error, a path or a command may hold ``[...]``
    that rich would read as markup (and fail on: ``[/__w/pytorch/.../pair.cc:553]``).

    >>> from rich.console import Console
    >>> Console(width=80).print(_plain("Connection closed by peer [/__w/gloo/pair.cc:553]"))
    Connection closed by peer [/__w/gloo/pair.cc:553]
    """
    from rich.markup import escape

    return escape(text)
