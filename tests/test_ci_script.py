"""tests/ci.sh, the test command's stages, run for real over stand-in stages that record what they are asked.

What CI relies on: every environment is built (in the background, while the main suite runs), each one's tests run
only once it is built, a failed build or a failed suite fails CI with the build's log, nothing of the background build
outlives CI, and CI=1 reaches the tests (a test that needs Chromium then fails instead of skipping).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
STACKS = ("compat", "vllm", "swift", "unsloth")


def sandbox(tmp: Path, fail_setup: str | None = None, fail_suite: bool = False, slow_setup: float = 0.2) -> Path:
    (tmp / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "ci.sh", tmp / "tests" / "ci.sh")
    calls = tmp / "calls"
    for s in STACKS:
        fail = 'exit 3' if s == fail_setup else 'exit 0'
        (tmp / "tests" / f"{s}.sh").write_text(
            f'echo "{s} $1 $(date +%s.%N)" >> {calls}\n'
            f'if [ "$1" = --setup ]; then echo "building {s}"; sleep {slow_setup}; {fail}; fi\n'
            f'echo "{s} tests"\n')
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f'#!/bin/bash\necho "python $* CI=$CI $(date +%s.%N)" >> {calls}\n'
                      f'{"exit 1" if fail_suite else "exit 0"}\n')
    python.chmod(0o755)
    return tmp


def run_ci(tmp: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CI", None)
    out = subprocess.run(["bash", str(tmp / "tests" / "ci.sh")], cwd=tmp, env=env, capture_output=True, text=True,
                         timeout=60)
    calls = (tmp / "calls").read_text().splitlines() if (tmp / "calls").exists() else []
    return out, [" ".join(c.split()[:-1]) for c in calls]


def build_left(tmp: Path) -> list[str]:
    """The stand-in builds (``sleep 30``) of this sandbox still running."""
    left = subprocess.run(["pgrep", "-f", "sleep 30"], capture_output=True, text=True).stdout.split()
    return [p for p in left if str(tmp) in Path(f"/proc/{p}/cwd").resolve().as_posix()]


def assert_the_build_was_stopped(tmp: Path) -> None:
    """Nothing of the 30 s build outlives CI (polled: a killed process may take a moment to die, 10 s at most), and it
    never finished: it wrote no exit status (a CI that waited for it would have found one)."""
    wait_until(lambda: not build_left(tmp), 10, "the background build still runs")
    assert not list((tmp / ".ci-logs").glob("*.rc"))


def test_every_environment_is_built_and_its_tests_run_after_the_main_suite(tmp_path):
    out, calls = run_ci(sandbox(tmp_path))
    assert out.returncode == 0, out.stderr
    assert calls.count("python -m pytest -q -m slow or not slow CI=1") == 1  # one run, default and slow; CI=1
    for s in STACKS:
        assert calls.index(f"{s} --setup") < calls.index(f"{s} --test")
        assert calls.index("python -m pytest -q -m slow or not slow CI=1") < calls.index(f"{s} --test")
    assert [c for c in calls if c.endswith("--test")] == [f"{s} --test" for s in STACKS]
    assert "the swift environment was built in the background" in out.stdout


def test_the_builds_run_while_the_main_suite_runs(tmp_path):
    """The first build starts before the suite ends (here the suite returns at once, the builds take 0.5 s each)."""
    tmp = sandbox(tmp_path, slow_setup=0.5)
    out, _ = run_ci(tmp)
    assert out.returncode == 0
    stamps = {" ".join(c.split()[:2]): float(c.split()[-1]) for c in (tmp / "calls").read_text().splitlines()}
    assert stamps["compat --setup"] < stamps["python -m"] + 0.5


def test_a_failed_build_fails_ci_with_its_log_and_runs_no_later_stage(tmp_path):
    out, calls = run_ci(sandbox(tmp_path, fail_setup="swift"))
    assert out.returncode == 1
    assert "building the swift environment failed (exit 3" in out.stderr and "building swift" in out.stderr
    assert "swift --test" not in calls and "unsloth --test" not in calls
    assert "vllm --test" in calls  # the stages before it ran


def test_a_failed_main_suite_fails_ci_and_stops_the_background_build(tmp_path):
    tmp = sandbox(tmp_path, fail_suite=True, slow_setup=30)
    out, calls = run_ci(tmp)
    assert out.returncode == 1 and not any(c.endswith("--test") for c in calls)
    assert_the_build_was_stopped(tmp)


def test_a_main_suite_that_fails_before_the_build_has_its_own_session_still_stops_it(tmp_path):
    """The race CI met under load: the suite failed at once, before ``setsid`` had made the build's process group,
    so stopping the group found nothing and the build ran on (here setsid starts 0.5 s late, every time)."""
    tmp = sandbox(tmp_path, fail_suite=True, slow_setup=30)
    late = tmp / "bin" / "setsid"
    late.write_text(f"#!{sys.executable}\nimport os, sys, time\ntime.sleep(0.5)\n"
                    f"os.execv({shutil.which('setsid')!r}, ['setsid', *sys.argv[1:]])\n")
    late.chmod(0o755)
    out, calls = run_ci(tmp)
    assert out.returncode == 1 and "python -m pytest -q -m slow or not slow CI=1" in calls
    assert_the_build_was_stopped(tmp)


@pytest.mark.parametrize("script", ["ci", "compat", "vllm", "swift", "unsloth"])
def test_the_stage_scripts_are_valid_shell(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "tests" / f"{script}.sh")]).returncode == 0
