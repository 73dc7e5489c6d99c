"""An error of oomguard's own while an attempt runs (a bug, an event from another version of oomguard): nothing the
attempt started is left running, the run's report (and the lock of a stable attempt) is still written, and the user
reads one line naming the error, not a traceback. A command that cannot start is still named for what it is."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from oomguard.decide.ladder import load_ladder
from oomguard.display.ui import ConsoleReporter
from oomguard.run.command import EXIT_BUG, EXIT_NOT_EXECUTABLE, UsageError
from oomguard.run.supervisor import RunOptions, Supervisor

from helpers import run_oomguard, still_alive, wait_until

# The command of these tests: a training process that starts a helper in a session of its own, deaf to SIGTERM (as
# torchrun starts its ranks), writes both PIDs to PIDS, and waits; with BAD, it then writes an event no oomguard knows
# (a training process of another version), which the supervisor's strict reading (OOMGUARD_STRICT_EVENTS, set by the
# test suite) turns into an error of its own in the middle of the attempt.
TRAINING = """
import json, os, pathlib, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                           "time.sleep(600)"], start_new_session=True)
pathlib.Path(sys.argv[1]).write_text(f"{os.getpid()} {helper.pid}")
if len(sys.argv) > 2:
    plan = json.loads(pathlib.Path(os.environ["OOMGUARD_PLAN"]).read_text())
    with open(plan["events"], "a") as f:
        f.write(json.dumps({"event": "from-a-newer-oomguard"}) + "\\n")
time.sleep(600)
"""


def _pids(path: Path, timeout: float = 60) -> list[int]:
    try:
        wait_until(path.exists, timeout, f"{path} written")
    except AssertionError:
        return []
    return [int(p) for p in path.read_text().split()]


def _kill(pids: list[int]) -> None:
    """After a test: whatever a failed run left behind."""
    for p in pids:
        try:
            os.kill(p, 9)
        except OSError:
            pass


def test_an_error_of_the_supervisor_mid_attempt_ends_every_process_and_is_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    pids_file = tmp_path / "pids"
    try:
        out, rep = run_oomguard(tmp_path, "--", sys.executable, str(script), str(pids_file), "bad", timeout=120)
        pids = _pids(pids_file, timeout=0)
        assert len(pids) == 2, out.stderr[-3000:]
        assert still_alive(pids) == []  # the training process, and its helper in a session of its own
        assert out.returncode == EXIT_BUG, out.stderr[-3000:]
        assert "Traceback" not in out.stderr
        said = [line for line in out.stderr.splitlines() if "internal error" in line]
        assert len(said) == 1 and "during attempt 1 (ProtocolError: " in said[0], out.stderr[-3000:]
        assert "from-a-newer-oomguard" in said[0] and "please report it" in said[0]
        where = Path(said[0].split(" is in ")[1].split()[0].rstrip(":;,"))
        assert "Traceback" in where.read_text()  # the traceback went to a file the line names
        assert rep is not None and rep["status"] == "failed" and rep["exit_code"] == EXIT_BUG
        assert rep["message"] in said[0]
    finally:
        _kill(_pids(pids_file, timeout=0))


def _supervisor(tmp_path: Path, argv: list[str], reporter=None) -> Supervisor:
    return Supervisor(argv, RunOptions(ladder=load_ladder("default"), workdir=tmp_path / "wd", predict=False,
                                       report_path=tmp_path / "report.json", lock_path=tmp_path / "lock.json",
                                       echo=False), reporter or ConsoleReporter(quiet=True, live=False))


def test_an_oserror_of_a_tick_is_oomguards_error_not_a_command_that_cannot_execute(tmp_path):
    """Before, a PermissionError raised while the attempt ran (not by starting it) read "permission denied: ... is
    not executable" (exit 126), and the command went on running."""
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    pids_file = tmp_path / "pids"
    sup = _supervisor(tmp_path, [sys.executable, str(script), str(pids_file)])
    tick = sup.launcher._tick

    def failing(watch):
        if pids_file.exists():
            raise PermissionError(13, "Permission denied", "/proc/4242/status")
        return tick(watch)

    sup.launcher._tick = failing
    try:
        assert sup.run() == EXIT_BUG
        assert still_alive(_pids(pids_file, timeout=0)) == []
        rep = json.loads((tmp_path / "report.json").read_text())
        assert "PermissionError" in rep["message"] and "not executable" not in rep["message"]
    finally:
        _kill(_pids(pids_file, timeout=0))


class _FailsAfterTheEnd(ConsoleReporter):
    """A reporter whose line after an attempt fails (a bug in what people read)."""

    def attempt_end(self, attempt, diagnosis):
        raise RuntimeError("the live view broke")


def test_an_error_after_a_stable_attempt_still_writes_its_report_and_lock(tmp_path):
    sup = _supervisor(tmp_path, [sys.executable, "-c", "print('trained')"], _FailsAfterTheEnd(quiet=True, live=False))
    assert sup.run() == EXIT_BUG
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["status"] == "stable" and "the live view broke" in rep["message"]
    assert (tmp_path / "lock.json").exists()


def test_a_command_that_cannot_start_is_still_named_for_what_it_is(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho hi\n")  # no execute permission: Popen raises PermissionError
    sup = _supervisor(tmp_path, [str(script)])
    with pytest.raises(UsageError, match="is not executable") as e:
        sup.run()
    assert e.value.code == EXIT_NOT_EXECUTABLE


def test_an_html_page_that_cannot_be_rendered_costs_only_the_page(tmp_path, monkeypatch, capsys):
    """--html: a failure of the renderer is one warning; the stable run's report and lock are written."""
    import oomguard.display.html as html

    def broken(*args, **kwargs):
        raise ValueError("a chart with no points")

    monkeypatch.setattr(html, "write_run_html", broken)
    sup = _supervisor(tmp_path, [sys.executable, "-c", "print('trained')"], ConsoleReporter(live=False))
    sup.o.html_path = tmp_path / "report.html"
    assert sup.run() == 0
    assert json.loads((tmp_path / "report.json").read_text())["status"] == "stable"
    assert (tmp_path / "lock.json").exists() and not (tmp_path / "report.html").exists()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "HTML" in line] == [
        f"oomguard warning: the HTML page {tmp_path / 'report.html'} could not be written (ValueError: a chart with no "
        "points); the report and the lock are written"]
