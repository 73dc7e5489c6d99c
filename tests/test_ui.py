"""What the supervisor shows: the live panel, quiet and JSON-lines modes, and plain text without a terminal."""

import io
import json
import sys

from rich.console import Console

from oomguard.display.ui import Progress, status_panel

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


# -- what the climb line and the attempt line say (issue 12 §4) ---------------------------------------------------
def _console_reporter(**kw):
    from oomguard.display.ui import ConsoleReporter

    rep = ConsoleReporter(live=False, **kw)
    rep.out = Console(file=io.StringIO(), width=200, color_system=None, highlight=False, soft_wrap=True)
    return rep


def _steps(*names_passes):
    from oomguard.decide.ladder import Step
    from oomguard.strategies import make_remedy
    from oomguard.vocab.knobs import TRL_DEFAULTS

    return [Step(make_remedy(n), TRL_DEFAULTS, p) for n, p in names_passes]


def test_trade_note_names_only_what_changed():
    rep = _console_reporter()
    rep.decision(_steps(("shorter_sequences", 1)), None, {"max_completion_length": 64})
    line = rep.out.file.getvalue()
    assert "long reasoning is cut off" in line and "prompts" not in line  # max_prompt_tokens stayed unset
    rep = _console_reporter()
    rep.decision(_steps(("shorter_sequences", 1)), None, {"max_completion_length": 64, "max_prompt_tokens": 300})
    assert "the longest prompts leave the dataset" in rep.out.file.getvalue()
    # a climbed rung the memory model then found not needed (its knobs unchanged) trades nothing
    rep = _console_reporter()
    rep.decision(_steps(("empty_cache", 1), ("shorter_sequences", 1)), None, {"max_completion_length": 160})
    line = rep.out.file.getvalue()
    assert "empty_cache + shorter_sequences" in line and "(costs signal: long reasoning is cut off)" in line


def test_a_repeated_rung_reads_the_same_in_the_terminal_and_the_html():
    from oomguard.display.html import run_html

    rep = _console_reporter()
    rep.decision(_steps(("shorter_sequences", 1), ("fewer_generations", 1), ("shorter_sequences", 2)), None,
              {"max_completion_length": 64})
    label = "shorter_sequences + fewer_generations + shorter_sequences (again)"
    assert label in rep.out.file.getvalue()
    page = run_html({"status": "stable", "message": "", "diff": [], "original": {}, "attempts": [
        {"index": 1, "kind": "probe", "outcome": "oom", "seconds": 1.0, "peak_bytes": MiB,
         "climbed": "shorter_sequences+fewer_generations+shorter_sequences",
         "oom": {"kind": "impossible", "phase": "forward", "backend": "cuda", "evidence": []}},
        {"index": 2, "kind": "run", "outcome": "ok", "seconds": 1.0, "peak_bytes": MiB}]})
    assert label in page and "shorter_sequences+fewer" not in page.split('id="raw-json"')[0]


def test_replaying_a_lock_says_what_was_done(tmp_path):
    lock = {"schema": "oomguard.lock/1", "overrides": {"max_completion_length": 64, "num_generations": 4,
                                                       "per_device_train_batch_size": 4}}
    (tmp_path / "in.lock.json").write_text(json.dumps(lock))
    out, rep = run_oomguard(tmp_path, "--config", str(tmp_path / "in.lock.json"), "--", sys.executable, "-c", "pass")
    assert out.returncode == 0, out.stderr
    assert "as it is" not in out.stderr and "nothing changed" not in out.stderr
    assert "replaying the 3 override(s) of" in out.stderr
    assert "replayed the lock's 3 override(s)" in out.stderr and rep["message"].startswith("the locked config fit")


def test_a_failure_message_with_brackets_is_printed_as_it_is(tmp_path):
    """A gloo error names its source as ``[/__w/.../pair.cc:553]``: rich must not read it as markup (it raised
    MarkupError, and the run ended in a traceback instead of its report)."""
    from oomguard.vocab.records import RunReport

    rep = _console_reporter()
    why = "rank 0 (pid 7) raised RuntimeError: Connection closed by peer [/__w/pytorch/gloo/pair.cc:553] [bold]"
    rep.message(why)
    rep.finish(RunReport(status="failed", attempts=[], original={}, stable=None, diff=[], message=why),
               tmp_path / "r[1].json", None)
    text = rep.out.file.getvalue()
    assert text.count("[/__w/pytorch/gloo/pair.cc:553] [bold]") == 2 and "r[1].json" in text
