"""`oomguard run` as a user meets it before and after the command: sizes, exit codes, lock files, kept reports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import ROOT, run_oomguard

STABLE_LOCK = {"schema": "oomguard.lock/1", "overrides": {"num_generations": 4, "per_device_train_batch_size": 4}}


def _marker_command(tmp_path):
    """A command that leaves a file behind when it runs, to show that a refused call ran nothing."""
    return ["--", sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')"]


@pytest.mark.parametrize("flags, hint", [
    (["--simulate-gpu", "300"], "did you mean 300MiB?"),
    (["--gpu-memory", "16"], "did you mean 16GiB?"),
])
def test_a_bare_small_size_is_refused_with_a_hint(tmp_path, flags, hint):
    out, _ = run_oomguard(tmp_path, *flags, *_marker_command(tmp_path))
    assert out.returncode == 2 and hint in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ran").exists()


def test_a_bare_small_size_in_the_environment_is_refused_too(tmp_path):
    out, _ = run_oomguard(tmp_path, *_marker_command(tmp_path), env={"OOMGUARD_SIMULATE_GPU": "300"})
    assert out.returncode == 2 and "OOMGUARD_SIMULATE_GPU 300" in out.stderr and "300MiB" in out.stderr


@pytest.mark.parametrize("overrides, problem", [
    ({"num_generations": -5}, "num_generations must be at least 2"),
    ({"optim": "fastest"}, "optim names no optimizer"),
    ({"per_device_train_batch_size": "8"}, "must be an integer"),
    ({"load_in_4bit": "yes"}, "must be true or false"),
    ({"num_generations": 3, "per_device_train_batch_size": 4}, "divisible by num_generations"),
    ({"lora_target_modules": [1, 2]}, "lora_target_modules"),
    ({"no_such_knob": 1}, "unknown knob"),
])
def test_a_bad_lock_is_refused_before_anything_runs(tmp_path, overrides, problem):
    lock = tmp_path / "bad.lock.json"
    lock.write_text(json.dumps({**STABLE_LOCK, "overrides": overrides}))
    out, rep = run_oomguard(tmp_path, "--config", str(lock), *_marker_command(tmp_path))
    assert out.returncode == 2, out.stderr
    assert problem in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "ran").exists() and rep is None


def test_a_lock_whose_stable_config_is_corrupt_is_refused(tmp_path):
    lock = tmp_path / "bad.lock.json"
    lock.write_text(json.dumps({**STABLE_LOCK, "stable": {"optim": "adamw_torch", "num_generations": 0}}))
    out, _ = run_oomguard(tmp_path, "--config", str(lock), *_marker_command(tmp_path))
    assert out.returncode == 2 and "num_generations must be at least 2" in out.stderr


def test_every_run_keeps_its_report_and_nothing_earlier_is_lost(tmp_path):
    top, lock = tmp_path / "report.json", tmp_path / "lock.json"
    top.write_text('{"schema": "oomguard.report/1", "status": "stable", "by": "an older oomguard"}\n')
    lock.write_text('{"schema": "oomguard.lock/1", "overrides": {}, "by": "an older oomguard"}\n')
    ok, first = run_oomguard(tmp_path, "--", sys.executable, "-c", "pass")
    assert ok.returncode == 0 and first["status"] == "stable"
    kept = sorted((tmp_path / "wd" / "kept").iterdir())
    assert sorted(json.loads(p.read_text())["by"] for p in kept) == ["an older oomguard"] * 2  # the old report, lock
    failed, second = run_oomguard(tmp_path, "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert failed.returncode == 3 and second["status"] == "failed"  # the top-level file is the latest run's
    runs = sorted((tmp_path / "wd" / "runs").iterdir())
    reports = [json.loads((r / "report.json").read_text()) for r in runs]
    assert [r["status"] for r in reports] == ["stable", "failed"]  # the stable run's report is still there
    assert second["kept_at"] == str((runs[1] / "report.json").resolve())
    assert json.loads(lock.read_text())["kept_at"] == str((runs[0] / "lock.json").resolve())  # the lock stays
    assert sorted((tmp_path / "wd" / "kept").iterdir()) == kept  # a copy of a kept record is simply replaced


def test_run_help_lists_every_exit_code():
    """`oomguard run --help` prints RUN_EXIT_CODES; the reference page is generated from the same list
    (tests/test_docs.py checks it)."""
    from oomguard.cli import RUN_EXIT_CODES
    from oomguard.run import supervisor

    codes = {c for code, _ in RUN_EXIT_CODES for c in code.split("/") if c.isdigit()}
    assert {str(supervisor.EXIT_EXHAUSTED), str(supervisor.EXIT_LEAKED), str(supervisor.EXIT_BUG),
            str(supervisor.EXIT_NOT_FOUND), str(supervisor.EXIT_NOT_EXECUTABLE), "2", "130", "143"} == codes
    helptext = subprocess.run([sys.executable, "-m", "oomguard", "run", "--help"], capture_output=True,
                              text=True).stdout
    assert all(code in helptext for code in codes)


# a rank: torch.distributed's init_process_group wraps the excepthook, printing what the hooks under it write to a
# buffer once they return (each line prefixed with the rank); the OOM's hook never returns (os._exit)
RANK = ("import torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='file://' + __file__ + '.store', rank=0, world_size=1)\n")


@pytest.mark.parametrize("rank", [False, True], ids=["python", "a-rank-of-torch-distributed"])
def test_an_ooms_traceback_is_trimmed_on_screen_and_kept_whole_in_the_crash_record(tmp_path, rank):
    # forty distinct frames, like TRL's, then an OOM the bootstrap recognises
    body = "".join(f"def frame_{i}():\n    return frame_{i + 1}()\n" for i in range(40))
    body += ("def frame_40():\n    raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
             "total capacity of 8.00 GiB of which 1.00 GiB is free.')\n" + (RANK if rank else "") + "frame_0()\n")
    script = tmp_path / "deep.py"
    script.write_text(body)
    out, rep = run_oomguard(tmp_path, "--max-attempts", "1", "--no-probe", str(script))
    assert rep["attempts"][0]["outcome"] == "oom" and rep["attempts"][0]["exit_code"] == 86
    shown = re.findall(r"in frame_(\d+)", out.stderr)
    assert shown and len(shown) <= 6 and "40" in shown and "0" not in shown, out.stderr  # the last frames only
    crash = next((tmp_path / "wd").rglob("crash-*.json"))
    # after the traceback (the supervisor's own progress lines may come between)
    said = [line for line in out.stderr.rsplit("CUDA out of memory. Tried to allocate 2.00 GiB", 1)[1].splitlines()
            if line.startswith("oomguard: out of memory")]
    assert said == [f"oomguard: out of memory; the last 6 of 42 frames are above; {crash} keeps the full traceback"]
    record = json.loads(crash.read_text())
    assert all(f"in frame_{i}" in record["traceback"] for i in range(41))  # the record keeps everything
    assert len(record["frames"]) >= 41


def test_an_oom_the_scripts_own_traceback_handler_printed_still_names_its_crash_record(tmp_path):
    """A handler of the script's own (rich's, in effect) replaced oomguard's excepthook: it prints the OOM its way, and
    the line naming the crash record still follows it (written as the interpreter shuts down)."""
    script = tmp_path / "own.py"
    script.write_text("import sys\nsys.excepthook = lambda t, v, tb: print('my handler:', v, file=sys.stderr)\n"
                      "raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                      "of 8.00 GiB of which 1.00 GiB is free.')\n")
    out, rep = run_oomguard(tmp_path, "--max-attempts", "1", "--no-probe", str(script))
    assert rep["attempts"][0]["outcome"] == "oom", out.stderr[-2000:]
    crash = next((tmp_path / "wd").rglob("crash-*.json"))
    said = [line for line in out.stderr.split("my handler: CUDA out of memory", 1)[1].splitlines()
            if line.startswith("oomguard: out of memory")]
    assert said == [f"oomguard: out of memory; {crash} keeps the full traceback"]


@pytest.mark.parametrize("script, code, reason", [
    ("", 2, "it failed before it built a GRPOConfig (its own output above says why)"),  # no such file
    ("import transformers\nraise ValueError('my own bug')\n", 1, "raised ValueError: my own bug"),
])
def test_a_command_that_fails_before_its_grpo_config_says_why_not_that_it_ran_in_full(tmp_path, script, code, reason):
    """A command that never builds a GRPOConfig runs in full (a probe would have nothing to shorten). When it fails
    before that, the message is its failure (what its training process recorded, else a pointer to its output), not
    the note about probes."""
    path = tmp_path / "train.py"
    if script:
        path.write_text(script)
    out, rep = run_oomguard(tmp_path, "--", sys.executable, str(path))
    assert out.returncode == code and rep["status"] == "failed", out.stderr[-2000:]
    assert reason in rep["message"] and "ran in full" not in rep["message"]


@pytest.mark.parametrize("typed, launched, repeated", [
    (["--simulate-gpu", "300MiB", "examples/grpo_gsm8k.py", "--max-steps", "2"],
     [sys.executable, "examples/grpo_gsm8k.py", "--max-steps", "2"],
     ["--simulate-gpu", "300MiB", "--", "examples/grpo_gsm8k.py", "--max-steps", "2"]),
    (["--gpu-memory", "16GiB", "--ladder", "quality-first", "--", "-m", "json.tool", "a b.json"],
     [sys.executable, "-m", "json.tool", "a b.json"],
     ["--gpu-memory", "16GiB", "--", "-m", "json.tool", "a b.json"]),
])
def test_the_run_it_line_repeats_the_command_as_the_user_typed_it(monkeypatch, typed, launched, repeated):
    """An alternative's "run it" line is pasted back into a shell: it names the script as the user typed it (not the
    interpreter's absolute path, which is what is launched) and keeps the options that set the device."""
    import shlex
    from pathlib import Path

    from click.testing import CliRunner

    from oomguard.cli import main
    from oomguard.run import supervisor
    from oomguard.vocab.records import RunReport

    seen: dict = {}
    lock = ".oomguard/runs/1/alternative-1.lock.json"

    class Launched:
        def __init__(self, argv, options, reporter):
            seen.update(argv=argv, reporter=reporter)

        def run(self) -> int:
            alt = {"keeps": ["num_generations 8 (the choice: 4)"], "trades": ["speed: more, smaller micro-steps"],
                   "lock": lock, "overrides": {"optim": "adamw_bnb_8bit"}}
            report = RunReport("stable", [], {}, {}, [], command=seen["argv"], message="stable", alternatives=[alt])
            seen["reporter"].finish(report, Path("oomguard-report.json"), Path("oomguard.lock.json"))
            return 0

    monkeypatch.setattr(supervisor, "Supervisor", Launched)
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, ["run", *typed])
    assert result.exit_code == 0, result.output
    assert seen["argv"] == launched  # the launch still uses the resolved command
    line = next(x for x in result.stderr.splitlines() if "run it:" in x)
    assert shlex.split(line.split("run it: ", 1)[1]) == ["oomguard", "run", "--config", lock, *repeated]
