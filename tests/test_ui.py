"""What the supervisor shows: the live panel, quiet and JSON-lines modes, and plain text without a terminal."""

import io
import json
import sys

from rich.console import Console

from oomguard.ui import Progress, status_panel

from helpers import run_oomguard

MiB = 2**20
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 8.00 GiB "
       "of which 100.00 MiB is free. Of the allocated memory 6.00 GiB is allocated by PyTorch, and 1.50 GiB is "
       "reserved by PyTorch but unallocated.").replace("1.50 GiB", "100.00 MiB")


def render(p: Progress) -> str:
    c = Console(file=io.StringIO(), width=100, color_system=None)
    c.print(status_panel(p))
    return c.file.getvalue()


def test_live_panel_shows_attempt_rungs_step_peak_and_time():
    text = render(Progress(index=2, max_attempts=8, kind="probe", remedies=["shorter_sequences", "lora"], step=5,
                           max_steps=100, peak=124 * MiB, capacity=300 * MiB))
    assert "probe 2/8" in text and "elapsed 0:00:0" in text
    assert "shorter_sequences, lora" in text
    assert "5 / 100" in text and "124.00 MiB of 300.00 MiB (41%)" in text
    assert "starting" in render(Progress(index=1, max_attempts=8))
    assert Progress(index=1, max_attempts=3, step=2, peak=2 * MiB).line().startswith("run 1/3: step 2, peak 2.00 MiB")


def failing_then(tmp_path, *flags):
    script = f"import sys; sys.stderr.write({OOM!r} + '\\n'); sys.exit(1)"
    return run_oomguard(tmp_path, "--max-attempts", "2", *flags, "--", sys.executable, "-c", script)


def test_json_log_is_one_object_per_line(tmp_path):
    out, rep = failing_then(tmp_path, "--json-log")
    ours = [json.loads(line) for line in out.stderr.splitlines() if line.startswith('{"oomguard"')]
    kinds = [o["oomguard"] for o in ours]
    assert kinds[0] == "attempt_start" and "attempt_end" in kinds and "climb" in kinds and kinds[-1] == "finish"
    assert ours[-1]["status"] == rep["status"] == "exhausted"
    assert not [line for line in out.stderr.splitlines() if line.startswith("oomguard ")]  # no human lines


def test_quiet_and_plain_text_without_a_terminal(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    loud, _ = failing_then(tmp_path / "a", "--no-probe")
    quiet, _ = failing_then(tmp_path / "b", "--quiet")
    assert "skip " in loud.stderr and "skip " not in quiet.stderr
    assert "\x1b[" not in loud.stderr  # no terminal, no escape codes
    assert "no rung left" in quiet.stderr and "exhausted" in quiet.stderr
