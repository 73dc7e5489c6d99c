"""Long runs and many ranks: late OOMs resume from the newest checkpoint; a torchrun group stops together and is
relaunched with the next rung on every rank; a SIGKILL takes the host-RAM path. (One rank's OOM under accelerate's
two ranks is the launch matrix's: its rank-1-oom ending under torchrun and accelerate's relay of a killed rank.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TINY, env_without_launchers, events_of, grpo_tiny, run_oomguard, torchrun

pytestmark = pytest.mark.e2e
PLAIN = ("--no-probe", "--no-predict")


def test_late_oom_resumes_from_the_newest_checkpoint(tmp_path, tiny_model):
    """Checkpoints every 2 steps; an OOM at the start of step 4 (injected) loses one step, not three."""
    out, rep = run_oomguard(tmp_path, *PLAIN, "--", *grpo_tiny(
        tiny_model, tmp_path / "out", "--max-steps", "4", "--save-steps", "2", "--oom-at-step", "3",
        "--oom-marker", str(tmp_path / "oomed")))
    a1, a2 = rep["attempts"]
    assert a1["outcome"] == "oom" and a1["step"] == 3 and a1["climbed"] == "micro_batch"
    ckpt2 = tmp_path / "out" / "checkpoint-2"
    assert a2["resume"]["mode"] == "continue" and a2["resume"]["checkpoint"] == str(ckpt2)
    assert "data position" in a2["resume"]["why"]  # the micro-batch split changed the batch geometry
    begin = next(e for e in events_of(tmp_path, 2) if e["event"] == "train_begin")
    assert begin["step"] == 2  # resumed at checkpoint-2: the next step trained is step 3
    assert a2["outcome"] == "ok" and a2["step"] == 4 and rep["status"] == "stable"
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert "saves no checkpoints" not in out.stderr


@pytest.mark.slow
def test_a_rung_that_changes_what_is_trained_starts_a_new_run_from_the_weights(tmp_path, tiny_model):
    """Slow: the resume plan after such a rung (weights only, a fresh directory that never exists) is
    tests/test_labels_and_dirs.py's, a resume through real TRL the late-OOM test above."""
    ladder = tmp_path / "eight-bit.toml"
    ladder.write_text("[[rung]]\nremedy = 'optimizer_8bit'\n")
    _out, rep = run_oomguard(tmp_path, *PLAIN, "--ladder", str(ladder), "--", *grpo_tiny(
        tiny_model, tmp_path / "out", "--max-steps", "3", "--save-steps", "2", "--oom-at-step", "2",
        "--oom-marker", str(tmp_path / "oomed")))
    ckpt2 = tmp_path / "out" / "checkpoint-2"
    before = {p.name: p.stat().st_mtime_ns for p in ckpt2.iterdir()}
    a1, a2 = rep["attempts"]
    assert a1["climbed"] == "optimizer_8bit"
    assert a2["resume"]["mode"] == "weights" and "optimizer" in a2["resume"]["why"]
    assert any(e["event"] == "weights_from" and e["checkpoint"] == str(ckpt2) for e in events_of(tmp_path, 2))
    fresh = Path(a2["resume"]["output_dir"])
    assert fresh.parent == tmp_path / "out" and (fresh / "checkpoint-2").is_dir()
    assert {p.name: p.stat().st_mtime_ns for p in ckpt2.iterdir()} == before  # never overwritten
    assert not (tmp_path / "out" / "checkpoint-3").exists()
    assert rep["status"] == "stable"


@pytest.mark.slow
def test_a_script_that_saves_nothing_is_told_at_the_start(tmp_path, tiny_model):
    """Slow: the default run's lock replay test (tests/test_run_e2e.py) runs the same kind of script, which saves
    nothing, and checks the same hint, also without python on PATH."""
    out, rep = run_oomguard(tmp_path, *PLAIN, "--", *grpo_tiny(tiny_model, tmp_path / "out", "--max-steps", "1"),
                            env=env_without_launchers())  # and the trainer is found without PATH
    assert rep["status"] == "stable" and "--checkpoint-every" in out.stderr


@pytest.mark.slow
def test_sigkill_takes_the_host_ram_path_with_its_own_remedies(tmp_path, tiny_model):
    """The kernel's OOM killer SIGKILLs the trainer and counts it in the cgroup (a stand-in cgroup here): host RAM,
    so the host rungs are climbed, not the GPU ones. Slow: the launch matrix (tests/test_launch_matrix.py) sees the
    same ending behind torchrun by default, and under every form with -m slow."""
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
    (cgroup / "memory.max").write_text("max\n")
    _out, rep = run_oomguard(tmp_path, *PLAIN, "--", *grpo_tiny(
        tiny_model, tmp_path / "out", "--max-steps", "1", "--dataloader-num-workers", "2", "--kill-self-at-step", "0",
        "--oom-marker", str(tmp_path / "killed"), "--oom-kill-counter", str(cgroup / "memory.events")),
        env={"OOMGUARD_CGROUP": str(cgroup)})
    a1, a2 = rep["attempts"]
    assert a1["exit_code"] == 137 and a1["oom"]["kind"] == "host-ram"
    assert a1["climbed"] == "fewer_workers"  # not a GPU remedy
    assert rep["diff"] == [{"knob": "dataloader_num_workers", "from": 2, "to": 1, "remedy": "fewer_workers"}]
    assert a2["outcome"] == "ok" and rep["status"] == "stable"


@pytest.mark.slow
def test_torchrun_two_ranks_on_the_simulated_device(tmp_path, tiny_model):
    """Each rank has its own simulated 100 MiB device; the ranks run out of memory, the group is relaunched with
    fewer generations on every rank, and the run ends stable. (Budgets from bench/min_budget.py on a 2-rank trace.)
    torchrun is this interpreter's torch.distributed.run, with no launcher or python on PATH. Slow: the default run's
    launch-matrix cell torchrun-2-predicted stops two torchrun ranks before they generate, and
    test_probe_finds_the_worst_case_first_and_saves_nothing climbs after a real OOM."""
    _out, rep = run_oomguard(tmp_path, *PLAIN, "--ladder", "fastest", "--simulate-gpu", "100MiB", "--",
                            *torchrun(2, TINY, "--model", tiny_model, "--output-dir", str(tmp_path / "out"),
                                      "--max-completion-length", "64"), env=env_without_launchers())
    a1, a2 = rep["attempts"]
    assert a1["outcome"] == "oom" and a1["oom"]["rank"] in (0, 1)
    assert a1["climbed"] == "fewer_generations" and rep["facts"]["world_size"] == 2
    assert "floor" in {s["remedy"]: s["reason"] for s in a1["skipped"]}["shorter_sequences"]  # 64 tokens: its floor
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"num_generations": 2, "per_device_train_batch_size": 2}
    configs = [e for e in events_of(tmp_path, 2) if e["event"] == "config"]
    assert sorted(e["rank"] for e in configs) == [0, 1]  # the bootstrap reached every worker, not the launcher
    assert a2["knobs"]["num_generations"] == 2 and a2["outcome"] == "ok" and rep["status"] == "stable"

