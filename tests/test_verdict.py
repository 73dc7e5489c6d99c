"""An ending says what happened (issue 45, point 6): the line a run ends with, and the table of what it changed or
tried, for each way a run ends. Pure: no launch, no torch."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from oomguard.decide.climb import Climb
from oomguard.decide.ladder import Exhausted, load_ladder
from oomguard.display.html import run_html
from oomguard.display.ui import ConsoleReporter
from oomguard.run.verdict import conclude
from oomguard.vocab.records import Attempt, AttemptKind, Outcome, RunReport

ROWS = [{"knob": "per_device_train_batch_size", "from": 8, "to": 4, "remedy": "micro_batch"}]


def attempt(index: int, outcome: str, kind: str = AttemptKind.RUN) -> Attempt:
    return Attempt(index, {}, [], outcome, 0 if outcome == Outcome.OK else 1, 1.0, kind=kind)


def ended(*attempts: Attempt, exhausted: bool = False) -> tuple[str, int, str]:
    climb = Climb(load_ladder("default"))
    for a in attempts:
        climb.record(a)
    if exhausted:
        climb.exhausted = Exhausted((("micro_batch", "at its floor"),))
    return conclude(attempts[-1], climb, max_attempts=len(attempts))


def test_fit_on_the_first_attempt_only_after_one_launch():
    assert ended(attempt(1, Outcome.OK))[2] == "the command fit on the first attempt; nothing changed"
    status, code, message = ended(attempt(1, Outcome.OK, AttemptKind.PROBE), attempt(2, Outcome.OK))
    assert (status, code) == ("stable", 0)
    assert "first attempt" not in message
    assert message == "the command fit in 2 launches (a probe, then the run); nothing changed"


def test_a_run_that_never_ran_out_of_memory_does_not_say_it_did():
    """Every attempt stopped by the pre-flight check until the budget ran out: no OOM, and the line says so."""
    stops = [attempt(i, Outcome.PREDICTED, AttemptKind.PROBE) for i in (1, 2)]
    status, code, message = ended(*stops)
    assert (status, code) == ("exhausted", 75)
    assert "ran out of memory" not in message.replace("no attempt ran out of memory", "")
    assert "predicted not to fit" in message and "no attempt ran out of memory" in message
    # an OOM first, then a config the pre-flight stopped: the last one was not an OOM either
    message = ended(attempt(1, Outcome.OOM), attempt(2, Outcome.PREDICTED, AttemptKind.PROBE))[2]
    assert "still ran out of memory" not in message and "predicted not to fit" in message
    # and one that did run out of memory still says so
    assert ended(attempt(1, Outcome.OOM), attempt(2, Outcome.OOM))[2].endswith("while the run still ran out of memory")


def test_a_replayed_lock_stopped_by_the_pre_flight_is_not_said_to_have_run_out():
    from oomguard.vocab.lock import Lock

    climb = Climb(load_ladder("default"))
    last = attempt(1, Outcome.PREDICTED)
    climb.record(last)
    climb.give_up("lock", "a locked config is replayed without climbing")
    message = conclude(last, climb, replay=Lock(overrides={"num_generations": 4}))[2]
    assert "ran out of memory" not in message and "predicted not to fit" in message


def finish_text(status: str, diff: list[dict]) -> str:
    rep = ConsoleReporter(live=False)
    rep.out = Console(file=io.StringIO(), width=200, color_system=None, highlight=False, soft_wrap=True)
    rep.finish(RunReport(status=status, attempts=[], original={}, stable=None, diff=diff, message="m"),
               Path("r.json"), None)
    return rep.out.file.getvalue()


def test_the_table_of_what_was_tried_has_no_stable_column_when_nothing_was_stable():
    tried = finish_text("exhausted", ROWS)
    assert "What oomguard tried" in tried and "last tried" in tried and "stable" not in tried
    changed = finish_text("stable", ROWS)
    assert "What oomguard changed" in changed and "stable" in changed and "last tried" not in changed


def test_the_html_table_of_what_was_tried_has_no_stable_column_when_nothing_was_stable():
    page = run_html({"status": "exhausted", "message": "", "diff": ROWS, "original": {},
                     "attempts": [{"index": 1, "kind": "run", "outcome": "oom", "seconds": 1.0}]})
    table = page.split('<table id="diff">', 1)[1].split("</table>", 1)[0]
    assert "<th>last tried</th>" in table and "<th>stable</th>" not in table
    assert "What was tried" in page
    page = run_html({"status": "stable", "message": "", "diff": ROWS, "original": {},
                     "attempts": [{"index": 1, "kind": "run", "outcome": "ok", "seconds": 1.0}]})
    assert "<th>stable</th>" in page.split('<table id="diff">', 1)[1] and "What changed" in page
    # a leaking run that finished every step through restarts ran its config to the end, as the terminal says
    page = run_html({"status": "leaked", "exit_code": 0, "message": "", "diff": ROWS, "original": {},
                     "attempts": [{"index": 1, "kind": "run", "outcome": "ok", "seconds": 1.0}]})
    assert "What changed" in page
