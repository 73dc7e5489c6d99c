"""CI's scripts run for real over stand-ins that record what they are asked: .ci/run, tests/ci.sh (the test command's
stages) and tests/compat.sh (the oldest TRL's).

What CI relies on: a clean clone is set up as the README says and then runs the stages, every environment is built
(in the background, while the main suite runs), each one's tests run only once it is built, a failed build or a failed
suite fails CI with the build's log, nothing of the background build outlives CI, CI=1 reaches the tests (a test that
needs Chromium then fails instead of skipping), and the oldest TRL's `core` tests run on the TRL and transformers that
installing oomguard keeps.
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


def sandbox(tmp: Path, fail_setup: str | None = None, fail_suite: bool = False, slow_setup: float = 0.2,
            fail_mypy: bool = False) -> Path:
    (tmp / "tests").mkdir()
    for script in ("ci.sh", "stackenv.sh"):
        shutil.copy(ROOT / "tests" / script, tmp / "tests" / script)
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
                      f'if [ "$2" = mypy ]; then {"exit 1" if fail_mypy else "exit 0"}; fi\n'
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
    assert calls.index("python -m mypy CI=1") < calls.index("python -m pytest -q -m slow or not slow CI=1")
    # the main environment's bytecode is written before the suite, in the mode `hardlink -t` leaves valid
    compiled = [i for i, c in enumerate(calls) if "-m compileall" in c and "unchecked-hash" in c]
    assert compiled and compiled[0] < calls.index("python -m pytest -q -m slow or not slow CI=1")


def test_a_type_error_fails_ci_before_the_suite_and_stops_the_background_build(tmp_path):
    """mypy over oomguard/ is a stage of its own, run first: an error fails CI in seconds, not after the suite."""
    tmp = sandbox(tmp_path, fail_mypy=True, slow_setup=30)
    out, calls = run_ci(tmp)
    assert out.returncode == 1
    assert "python -m mypy CI=1" in calls and not any(c.startswith("python -m pytest") for c in calls)
    assert_the_build_was_stopped(tmp)


def test_the_builds_run_while_the_main_suite_runs(tmp_path):
    """The first build starts before the suite ends (here the suite returns at once, the builds take 0.5 s each)."""
    tmp = sandbox(tmp_path, slow_setup=0.5)
    out, _ = run_ci(tmp)
    assert out.returncode == 0
    calls = (tmp / "calls").read_text().splitlines()
    at = lambda start: next(float(c.split()[-1]) for c in calls if c.startswith(start))  # noqa: E731
    assert at("compat --setup") < at("python -m pytest") + 0.5


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


def stand_in(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def compat_sandbox(tmp: Path, trl_after_install: str = "0.29.1") -> tuple[dict[str, str], Path]:
    """An environment for tests/compat.sh whose python records what it is asked: pip reports TRL 0.29.1 and
    transformers 5.3.0, and ``trl_after_install`` once oomguard is installed."""
    calls = tmp / "calls"
    stand_in(tmp / "venv" / "bin" / "python",
             f'echo "$*" >> {calls}\n'
             f'if [ "$1 $2 $3" = "-m pip list" ]; then\n'
             f'  if grep -q -- "-e .\\[all\\]" {calls}; then echo "trl=={trl_after_install}"; else echo "trl==0.29.1"; fi\n'
             f'  echo "transformers==5.3.0"\nfi')
    env = {**os.environ, "OOMGUARD_COMPAT_VENV": str(tmp / "venv")}
    return env, calls


def test_compat_runs_the_core_tests_under_the_oldest_trl_kept_by_installing_oomguard(tmp_path):
    """tests/compat.sh, run for real over a stand-in environment: TRL 0.29.1 and transformers 5.3.0 installed, then
    oomguard (which keeps them), then DeepSpeed as the main suite has it, then the `core` tests in one run."""
    env, calls = compat_sandbox(tmp_path)
    out = subprocess.run(["bash", str(ROOT / "tests" / "compat.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    asked = calls.read_text().splitlines()
    first = lambda prefix: next(i for i, c in enumerate(asked) if c.startswith(prefix))  # noqa: E731
    assert first("-m pip install -q --no-compile trl==0.29.1 transformers==5.3.0") < first("-m pip install -q --no-compile -e .[all]")
    deepspeed = first("-m pip install -q --no-compile --no-build-isolation deepspeed==0.19.8")
    assert first("-m pip install -q --no-compile -e .[all]") < deepspeed < first("-m pytest -q -m core")
    assert [c for c in asked if c.startswith("-m pytest")] == ["-m pytest -q -m core"]  # one run, one collection
    # the bytecode written once, after the last install, in the mode that survives tests/ci.sh's links
    compiled = first("-m compileall")
    assert deepspeed < compiled < first("-m pytest")
    assert "--invalidation-mode unchecked-hash" in asked[compiled] and all(
        "--no-compile" in c for c in asked if c.startswith("-m pip install"))
    assert "compat: transformers==5.3.0 trl==0.29.1 kept by pip install -e ." in out.stdout


def test_compat_fails_when_installing_oomguard_changes_the_environments_trl(tmp_path):
    env, calls = compat_sandbox(tmp_path, trl_after_install="1.16.0")
    out = subprocess.run(["bash", str(ROOT / "tests" / "compat.sh"), "--setup"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert ("installing oomguard changed the environment's TRL or transformers: transformers==5.3.0 trl==0.29.1 -> "
            "transformers==5.3.0 trl==1.16.0") in out.stderr
    assert "-m pytest" not in calls.read_text()  # no test ran


def ci_clone(tmp: Path, fail: str | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """.ci/run in a stand-in clone: python3 makes a venv whose pip records what it installs (and fails on ``fail``),
    chromium is there, and tests/ci.sh records that it ran."""
    calls = tmp / "calls"
    shutil.copytree(ROOT / ".ci", tmp / ".ci")
    stand_in(tmp / "tests" / "ci.sh", f'echo "tests/ci.sh $*" >> {calls}')
    stand_in(tmp / "pip", f'echo "pip $*" >> {calls}\n' + (f'case "$*" in *{fail}*) exit 1 ;; esac' if fail else ""))
    stand_in(tmp / "bin" / "python3",
             f'echo "python3 $*" >> {calls}\n'
             f'mkdir -p "$3/bin" && cp {tmp / "pip"} "$3/bin/pip"\n'
             'echo "export PATH=\\"$(cd "$3/bin" && pwd):\\$PATH\\"" > "$3/bin/activate"')
    stand_in(tmp / "bin" / "chromium", "exit 0")
    env = {**os.environ, "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(tmp / ".ci" / "run")], cwd=tmp, env=env, capture_output=True, text=True,
                         timeout=60)
    return out, calls.read_text().splitlines() if calls.exists() else []


def test_ci_sets_up_a_clean_clone_as_the_readme_says_then_runs_the_stages(tmp_path):
    out, calls = ci_clone(tmp_path)
    assert out.returncode == 0, out.stderr
    assert calls == ["python3 -m venv .venv", "pip install -q --no-compile torch==2.13.0",
                     "pip install -q --no-compile --no-build-isolation deepspeed==0.19.8 einops", "pip install -q --no-compile -e .[test]",
                     "tests/ci.sh "]


def test_ci_stops_at_a_set_up_step_that_fails(tmp_path):
    out, calls = ci_clone(tmp_path, fail="deepspeed")
    assert out.returncode != 0 and calls[-1].startswith("pip install -q --no-compile --no-build-isolation deepspeed")
