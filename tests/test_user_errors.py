"""Every failure a user can cause is one line and the documented exit code, never a traceback; and a stable run's
report and lock are written wherever the user pointed them (refused before anything runs where they cannot be)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

MODEL = str(ROOT / "tests" / "fixtures" / "models" / "llama-3.2-1b")


def oomguard(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomguard", *args], capture_output=True, text=True, cwd=tmp,
                          timeout=120)


def one_line(out: subprocess.CompletedProcess) -> str:
    """The one line oomguard wrote for a user's mistake (and no traceback)."""
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("oomguard: "), lines[0]
    return lines[0]


def test_a_report_path_that_is_a_directory_gets_the_report_inside_it_and_the_lock_is_written(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    out = oomguard(tmp_path, "run", "--report", str(reports), "--", "true")
    assert out.returncode == 0, out.stderr
    assert json.loads((reports / "oomguard-report.json").read_text())["status"] == "stable"
    assert json.loads((tmp_path / "oomguard.lock.json").read_text())["schema"].startswith("oomguard.lock/")


def test_a_stable_run_writes_into_directories_it_creates_with_normal_file_modes(tmp_path):
    out = oomguard(tmp_path, "run", "--report", "out/new/", "--lock", "out/locks/my.lock.json", "--", "true")
    assert out.returncode == 0, out.stderr
    report = tmp_path / "out" / "new" / "oomguard-report.json"
    lock = tmp_path / "out" / "locks" / "my.lock.json"
    assert report.is_file() and lock.is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(report.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    assert stat.S_IMODE(lock.stat().st_mode) == 0o666 & ~umask


def test_a_command_that_builds_no_grpo_config_is_not_said_to_keep_an_experiment(tmp_path):
    out = oomguard(tmp_path, "run", "--", "true")
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "oomguard-report.json").read_text())
    assert "generations per prompt" not in out.stdout + out.stderr
    assert report["experiment"] == {"kept": [], "changed": [], "seen": False}


@pytest.mark.parametrize("option", ["--report", "--lock", "--html"])
def test_an_output_path_under_a_file_is_refused_before_anything_runs(tmp_path, option):
    (tmp_path / "notes.txt").write_text("mine")
    marker = tmp_path / "ran"
    out = oomguard(tmp_path, "run", option, "notes.txt/out.json", "--", "touch", str(marker))
    line = one_line(out)
    assert out.returncode == 2 and option in line and "is a file, not a directory" in line
    assert not marker.exists()  # refused before the command ran
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_workdir_that_is_a_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "wd").write_text("mine")
    out = oomguard(tmp_path, "run", "--workdir", "wd", "--", "true")
    line = one_line(out)
    assert out.returncode == 2 and "--workdir wd: a file, not a directory" in line
    assert (tmp_path / "wd").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere; the permission check is the next test's")
def test_an_output_directory_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    out = oomguard(tmp_path, "run", "--report", str(locked / "r.json"), "--", "true")
    assert out.returncode == 2 and "permission denied" in one_line(out)


def test_an_output_directory_without_write_permission_is_refused_whoever_runs_it(tmp_path, monkeypatch):
    """Root passes any permission check, so the check itself is exercised with ``os.access`` answering no."""
    from oomguard.run.command import UsageError, output_file

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(UsageError, match=r"cannot write in .* \(permission denied\); give a writable path"):
        output_file(str(tmp_path / "r.json"), "oomguard-report.json", "--report")


def test_a_script_without_a_shebang_is_exit_126_with_the_way_out(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("echo training\n")
    script.chmod(0o755)
    out = oomguard(tmp_path, "run", "--", "./train.sh")
    line = one_line(out)
    assert out.returncode == 126
    assert "cannot execute ./train.sh: it has no #! line" in line and "bash ./train.sh" in line


@pytest.mark.parametrize("rung, problem", [
    ('remedy = "lora"\nr = -4', "r must be an integer between 1 and 4096 (the LoRA rank), not -4"),
    ('remedy = "shorter_sequences"\nfactor = "half"', "factor must be a number between 0 and 1"),
    ('remedy = "shorter_sequences"\nfactor = 1.5', "not 1.5"),
    ('remedy = "fewer_generations"\nmin_generations = 1', "min_generations must be an integer of at least 2"),
    ('remedy = "lora"\nrank = 8', "remedy 'lora' takes no parameter(s) rank; it takes r, alpha, target_modules"),
    ('remedy = "vllm_memory"\nmin_utilization = true', "min_utilization must be a number"),
])
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_ladder_file_with_a_bad_parameter_is_refused_at_load(tmp_path, rung, problem, command):
    ladder = tmp_path / "mine.toml"
    ladder.write_text(f'name = "mine"\n[[rung]]\nremedy = "micro_batch"\n[[rung]]\n{rung}\n')
    args = (["run", "--ladder", str(ladder), "--", "true"] if command == "run"
            else ["plan", "--model", MODEL, "--gpu", "4GiB", "--ladder", str(ladder)])
    out = oomguard(tmp_path, *args)
    line = one_line(out)
    assert out.returncode == 2 and "rung #2" in line and problem in line, line


def test_a_misspelt_top_level_key_is_refused_with_the_right_spelling(tmp_path):
    ladder = tmp_path / "mine.toml"
    ladder.write_text('choose_bye = "order"\n[[rung]]\nremedy = "micro_batch"\n')
    out = oomguard(tmp_path, "run", "--ladder", str(ladder), "--", "true")
    assert out.returncode == 2
    assert "unknown key 'choose_bye' (did you mean 'choose_by'?)" in one_line(out)


def test_a_patch_of_oomguard_s_that_fails_is_named_in_the_report(tmp_path):
    """A TRL whose GRPOConfig oomguard cannot patch (here a stand-in package without ``__post_init__``): the run goes
    on, and the report names the patch and the error instead of saying the command builds no GRPOConfig."""
    pkg = tmp_path / "fake" / "trl" / "trainer"
    pkg.mkdir(parents=True)
    (tmp_path / "fake" / "trl" / "__init__.py").write_text('__version__ = "1.16.0"\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "grpo_config.py").write_text("class GRPOConfig:\n    pass\n")
    script = tmp_path / "train.py"
    script.write_text("from trl.trainer.grpo_config import GRPOConfig\nGRPOConfig()\nprint('trained')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    out = subprocess.run([sys.executable, "-m", "oomguard", "run", "train.py"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "oomguard-report.json").read_text())
    line = ("oomguard's patch of trl.trainer.grpo_config (patch_grpo_config) failed: KeyError: '__post_init__'; the "
            "knobs it carries cannot reach the training (please report it)")
    assert report["warnings"] == [line]
    assert report["attempts"][0]["note"] == line
    assert "builds no GRPOConfig" not in out.stdout + out.stderr
