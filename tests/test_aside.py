"""What a launcher prints after a training process stopped itself on purpose goes to a file, not the terminal
(``run.proc.Aside``); oomguard's own lines still reach the terminal. The end-to-end cells are the launch matrix's
``predicted`` ones (tests/test_launch_matrix.py: torchrun and accelerate with two ranks print no traceback)."""

from __future__ import annotations

import sys

from oomguard.run.proc import Aside, Interrupts, run_attempt


def test_before_the_stop_everything_shows_and_after_it_only_oomguards_lines(tmp_path):
    stopped = [False]
    a = Aside(lambda: stopped[0], tmp_path / "after.log")
    assert a.split(1, b"step 1\n") == b"step 1\n"
    stopped[0] = True
    shown = a.split(2, b"oomguard: pre-flight: stopping\nTraceback (most recent call last):\n  File \"x\"\nChildFail")
    assert shown == b"oomguard: pre-flight: stopping\n"
    assert a.split(2, b"edError: exit 87\n  oomguard probe 1/8: stopped\n") == b"  oomguard probe 1/8: stopped\n"
    a.flush()
    assert (tmp_path / "after.log").read_bytes() == (b"Traceback (most recent call last):\n  File \"x\"\n"
                                                     b"ChildFailedError: exit 87\n")
    assert a.lines == 3


def test_a_launcher_after_a_stop_on_purpose_prints_into_the_attempts_file(tmp_path, capfd):
    mark = tmp_path / "stopped-on-purpose"
    code = (f"import sys, pathlib; sys.stderr.write('oomguard: pre-flight: too big\\n'); sys.stderr.flush(); "
            f"pathlib.Path({str(mark)!r}).write_text('1'); "
            "sys.stderr.write('Traceback (most recent call last):\\nChildFailedError\\n'); sys.exit(1)")
    aside = Aside(mark.exists, tmp_path / "after-stop.log")
    res = run_attempt([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, Interrupts(), aside=aside)
    err = capfd.readouterr().err
    assert res.returncode == 1
    assert "oomguard: pre-flight: too big" in err and "Traceback" not in err
    assert "ChildFailedError" in (tmp_path / "after-stop.log").read_text()
