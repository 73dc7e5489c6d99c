"""`oomguard run` as a supervisor: outcomes, exit codes, signals, and no process left behind (no TRL needed)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from oomguard.run.supervisor import UsageError, resolve_command

from helpers import ROOT, SCRIPTS, pid_alive, run_oomguard, still_alive, torchrun


def test_command_forms(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)")
    assert resolve_command([str(script), "--x"]) == [sys.executable, str(script), "--x"]
    assert resolve_command(["-m", "pkg.mod"]) == [sys.executable, "-m", "pkg.mod"]
    assert resolve_command(["python", "t.py"]) == ["python", "t.py"]
    with pytest.raises(UsageError, match="no such script"):
        resolve_command([str(tmp_path / "nope.py")])
    with pytest.raises(UsageError, match="command not found: definitely-not-a-command"):
        resolve_command(["definitely-not-a-command"])
    with pytest.raises(UsageError, match="no command given"):
        resolve_command([])


def test_success_passes_output_through_and_writes_a_report(tmp_path):
    out, rep = run_oomguard(tmp_path, "--", sys.executable, "-c", "print('hello from the job')")
    assert out.returncode == 0 and "hello from the job" in out.stdout
    assert rep["status"] == "stable" and rep["attempts"][0]["outcome"] == "ok" and rep["diff"] == []
    assert (tmp_path / "lock.json").exists()


def test_non_oom_failure_passes_through_with_its_exit_code(tmp_path):
    out, rep = run_oomguard(tmp_path, "--", sys.executable, "-c",
                            "import sys; print('partial output'); sys.stderr.write('KeyError: boom\\n'); sys.exit(3)")
    assert out.returncode == 3
    assert "partial output" in out.stdout and "KeyError: boom" in out.stderr
    assert rep["status"] == "failed" and len(rep["attempts"]) == 1 and rep["attempts"][0]["exit_code"] == 3


def test_oom_seen_only_in_stderr_is_an_oom(tmp_path):
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
           "8.00 GiB of which 100.00 MiB is free. Of the allocated memory 6.00 GiB is allocated by PyTorch, and 1.50 GiB "
           "is reserved by PyTorch but unallocated.")
    out, rep = run_oomguard(tmp_path, "--max-attempts", "3", "--", sys.executable, "-c",
                            f"import sys; sys.stderr.write({msg!r} + '\\n'); sys.exit(1)")
    first = rep["attempts"][0]
    assert first["outcome"] == "oom" and first["oom"]["kind"] == "fragmentation"
    assert first["climbed"] == "expandable_segments"
    assert out.returncode == 75 and rep["status"] == "exhausted"


def test_the_users_own_expandable_segments_off_is_kept_and_the_cache_rung_reaches_the_next_attempt(tmp_path):
    """The user runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, and the command runs out of memory to
    fragmentation: oomguard keeps the user's setting, says so, climbs empty_cache instead, and the next attempt's
    allocator settings add its large-block limit (1/32 of the 8 GiB device) to the user's own."""
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
           "8.00 GiB of which 100.00 MiB is free. Of the allocated memory 6.00 GiB is allocated by PyTorch, and 1.50 GiB "
           "is reserved by PyTorch but unallocated.")
    once = tmp_path / "ran-out"
    code = (f"import os, pathlib, sys\nmarker = pathlib.Path({str(once)!r})\n"
            f"if not marker.exists():\n    marker.touch(); sys.stderr.write({msg!r} + '\\n'); sys.exit(1)\n"
            "print('allocator:', os.environ['PYTORCH_CUDA_ALLOC_CONF'])\n")
    out, rep = run_oomguard(tmp_path, "--ladder", "fastest", "--", sys.executable, "-c", code,
                            env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert out.returncode == 0 and rep["status"] == "stable", out.stderr[-3000:]
    first = rep["attempts"][0]
    assert (first["outcome"], first["oom"]["kind"], first["climbed"]) == ("oom", "fragmentation", "empty_cache")
    assert "oomguard keeps it" in {s["remedy"]: s["reason"] for s in first["skipped"]}["expandable_segments"]
    assert "allocator: expandable_segments:False,max_split_size_mb:256\n" in out.stdout
    assert {r["knob"]: (r["to"], r["remedy"]) for r in rep["diff"]} == {
        "torch_empty_cache_steps": (1, "empty_cache"), "max_split_size_mb": (256, "empty_cache")}


def test_command_not_found_is_one_line(tmp_path):
    out, _ = run_oomguard(tmp_path, "--", "no-such-trainer-cmd")
    assert out.returncode == 127
    assert out.stderr.strip() == "oomguard: command not found: no-such-trainer-cmd (is it installed in this environment?)"


@pytest.mark.parametrize("args, problem", [
    (["--simulate-gpu", "lots", "x.py"], "not a size"),
    (["--ladder", "slowest", "--", "true"], "no ladder named 'slowest'"),
    (["--config", "missing.lock", "--", "true"], "no such lock file"),
])
def test_usage_errors_are_one_line(tmp_path, args, problem):
    out, _ = run_oomguard(tmp_path, *args)
    assert out.returncode == 2 and problem in out.stderr and "Traceback" not in out.stderr


def _ended(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for ``proc`` and close its pipes (reading what is left); its exit code."""
    proc.communicate(timeout=timeout)
    return proc.returncode


def _start_sleeper(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.Popen([sys.executable, "-m", "oomguard", "run", "--report", str(report), "--lock",
                             str(tmp_path / "lock.json"), "--workdir", str(tmp_path / "wd"), str(SCRIPTS / "sleeper.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    line = ""
    deadline = time.time() + 60
    while "ready" not in line and time.time() < deadline:
        line = proc.stdout.readline()
    m = re.search(r"child=(\d+) grandchild=(\d+)", line)
    assert m, line
    return proc, int(m.group(1)), int(m.group(2)), report


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_the_whole_group_without_retry(tmp_path, sig, code):
    proc, child, grandchild, report = _start_sleeper(tmp_path)
    proc.send_signal(sig)
    assert _ended(proc, 60) == code
    assert still_alive([child, grandchild], timeout=2) == []  # the grandchild ignored the signal: it was killed
    rep = json.loads(report.read_text())
    assert rep["status"] == "interrupted" and len(rep["attempts"]) == 1


def test_help_does_not_import_torch():
    code = "import sys, oomguard.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
    out = subprocess.run([sys.executable, "-m", "oomguard", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "oomguard run" in out.stdout


def test_an_attempt_ends_only_when_its_whole_group_is_gone(tmp_path):
    """The child exits and leaves a grandchild holding 512 MiB (output sent elsewhere, so no pipe waits for it).
    Killing the group is not enough: a process that big takes a noticeable time to die, and the next attempt
    would start while it still holds its memory. run_attempt returns only once no process of the group is alive."""
    from oomguard.run.proc import Interrupts, run_attempt

    ready = tmp_path / "grandchild"
    grandchild = ("import mmap, pathlib, time; m = mmap.mmap(-1, 512 << 20)\n"
                  "for i in range(0, 512 << 20, 4096): m[i] = 1\n"
                  f"pathlib.Path({str(ready)!r}).write_text('up'); time.sleep(600)")
    child = ("import subprocess, sys, time, pathlib\n"
             f"g = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL)\n"
             f"while not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.05)\n"
             "print(g.pid, flush=True)\n")
    res = run_attempt([sys.executable, "-c", child], dict(os.environ), Interrupts(), echo=False)
    gpid = int(res.stdout_tail.split()[0])
    assert not pid_alive(gpid)  # checked right away: no grace period
    assert res.returncode == 0 and res.survivors == []


def _read_until(proc: subprocess.Popen, pattern: str, count: int, timeout: float) -> dict[str, re.Match]:
    """The first match of ``pattern`` per distinct first group in ``proc``'s output, once ``count`` of them came.

    Two ranks write to one pipe unbuffered, so one line can hold both ranks' messages (a rank's text, then the other's,
    then both newlines): every match of a line counts. A line never comes while the ranks sleep, so the read has a
    deadline of its own: past ``timeout`` the supervisor is killed, which closes the pipe and ends the read."""
    found: dict[str, re.Match] = {}
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        while len(found) < count:
            line = proc.stdout.readline()
            if not line:
                break
            for m in re.finditer(pattern, line):
                found.setdefault(m.group(1), m)
    finally:
        watchdog.cancel()
    return found


def _start_ranks(tmp_path, *flags):
    """`oomguard run` over torchrun with 2 sleeping ranks; returns the process and the ranks' pids once both are up."""
    proc = subprocess.Popen([sys.executable, "-m", "oomguard", "run", "--report", str(tmp_path / "report.json"),
                             "--lock", str(tmp_path / "lock.json"), "--workdir", str(tmp_path / "wd"), "--",
                             *torchrun(2, str(SCRIPTS / "sleeper_ranks.py"), *flags)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    found = _read_until(proc, r"rank=(\d) pid=(\d+) sid=(\d+)", 2, 120)
    assert len(found) == 2, proc.stderr.read()[-3000:] if proc.poll() is not None else "ranks not up"
    ranks = {int(m.group(2)): int(m.group(3)) for m in found.values()}
    assert all(sid == pid for pid, sid in ranks.items())  # torchrun gave each rank a session of its own
    return proc, list(ranks)


@pytest.mark.e2e
def test_sigint_over_torchrun_with_two_ranks_leaves_no_process(tmp_path):
    proc, ranks = _start_ranks(tmp_path)
    launcher = psutil.Process(proc.pid).children()[0].pid
    proc.send_signal(signal.SIGINT)
    assert _ended(proc, 90) == 130
    assert still_alive([*ranks, launcher], timeout=2) == []  # gone by the time oomguard exits


@pytest.mark.e2e
def test_ranks_whose_launcher_dies_are_ended_with_the_attempt(tmp_path):
    """torchrun killed outright (as the SIGKILL fallback or the OOM killer does) leaves its ranks, in sessions of
    their own and deaf to SIGINT and SIGTERM, out of reach of its process group: the attempt still ends them all."""
    proc, ranks = _start_ranks(tmp_path, "--stubborn")
    launcher = psutil.Process(proc.pid).children()[0]
    launcher.kill()
    assert _ended(proc, 90) == 137  # a SIGKILL without OOM evidence: passed through, not retried
    assert still_alive(ranks, timeout=2) == []
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["attempts"]) == 1


@pytest.mark.e2e
def test_a_second_sigint_ends_stubborn_ranks_at_once(tmp_path):
    """The first SIGINT reaches the ranks through torchrun, which then waits for them (30 s); they ignore it. Once
    both said so, a second SIGINT kills them at once."""
    proc, ranks = _start_ranks(tmp_path, "--stubborn")
    proc.send_signal(signal.SIGINT)
    assert len(_read_until(proc, r"rank=(\d) ignored SIGINT", 2, 60)) == 2, "the ranks never said they ignored it"
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(signal.SIGINT)
    assert _ended(proc, 30) == 130
    assert still_alive(ranks, timeout=2) == []
