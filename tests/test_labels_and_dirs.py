"""Attempt labels never read "9/8" (minimize trials are numbered apart), and a resumed run's fresh directory stays
flat under the user's output dir, never nested in the previous oomguard-attempt-N and never an existing dir."""

from __future__ import annotations

from pathlib import Path

from oomguard.decide.choose import Rung
from oomguard.decide.ladder import load_ladder
from oomguard.display.ui import ConsoleReporter
from oomguard.run.resume import resume_plan
from oomguard.run.supervisor import RunOptions, Supervisor
from oomguard.strategies import make_remedy
from oomguard.vocab.protocol import ResumePlan


def test_minimize_trials_are_labelled_apart_from_the_counted_attempts(capsys):
    ui = ConsoleReporter(live=False)
    progress = []
    for index, kind in enumerate(["probe", "run", "probe", "minimize", "minimize", "minimize", "run"], start=1):
        ui.attempt_start(index, 4, ["lora"], {}, kind)
        progress.append(ui.state.line().split(":")[0])  # the progress line a log without a terminal gets
    labels = [line.split(" with ")[0].removeprefix("oomguard ") for line in capsys.readouterr().err.splitlines()]
    assert labels == ["probe 1/4", "attempt 2/4", "probe 3/4", "minimize trial 1", "minimize trial 2",
                      "minimize trial 3", "attempt 4/4"]
    assert progress == labels  # never "run 7/4" beside "attempt 4/4"


def test_an_attempts_end_line_names_it_as_its_start_line_did(capsys):
    from oomguard.vocab.records import Attempt

    ui = ConsoleReporter(live=False)
    for index, kind in enumerate(["probe", "minimize", "run"], start=1):
        ui.attempt_start(index, 8, ["lora"], {}, kind)
        ui.attempt_end(Attempt(index=index, knobs={}, remedies=["lora"], outcome="ok", exit_code=0, seconds=1.0,
                               kind=kind), None)
    ends = [line.removeprefix("oomguard ").split(":")[0] for line in capsys.readouterr().err.splitlines()
            if "finished" in line]
    assert ends == ["probe 1/8", "minimize trial 1", "attempt 2/8"]


def _after_a_new_run_rung(tmp_path: Path) -> Supervisor:
    """A supervisor whose climb took optimizer_8bit (a rung a checkpoint cannot continue) since the checkpoint."""
    sup = Supervisor(["true"], RunOptions(ladder=load_ladder("default"), workdir=tmp_path / "wd", predict=False),
                     ConsoleReporter(quiet=True, live=False))
    sup.launcher.checkpoint_knobs = sup.conductor.climb.effective()[0]
    rung = Rung(make_remedy("optimizer_8bit"))
    sup.conductor.climb.climbed, sup.conductor.climb.applied = [rung], [rung]
    return sup


def _resume(sup: Supervisor, index: int) -> ResumePlan:
    """The resume plan the supervisor builds for real run ``index``."""
    run, c = sup.launcher, sup.conductor.climb
    return resume_plan(run.checkpoint, run.checkpoint_knobs, c.effective()[0], c.climbed, run.output_dir, index)


def _checkpoint(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def test_a_resumed_run_writes_flat_under_the_users_output_dir(tmp_path):
    out = tmp_path / "out"
    sup = _after_a_new_run_rung(tmp_path)
    sup.launcher.checkpoint = str(_checkpoint(out / "oomguard-attempt-6" / "checkpoint-4"))
    sup.launcher.output_dir = str(out / "oomguard-attempt-6")  # the previous resumed run already wrote there
    resume = _resume(sup, 8)
    assert resume.mode == "weights" and resume.output_dir == str(out / "oomguard-attempt-8")


def test_a_fresh_dir_is_never_one_that_exists(tmp_path):
    out = tmp_path / "out"
    sup = _after_a_new_run_rung(tmp_path)
    sup.launcher.checkpoint = str(_checkpoint(out / "checkpoint-2"))
    sup.launcher.output_dir = str(out)
    (out / "oomguard-attempt-3" / "checkpoint-2").mkdir(parents=True)  # an earlier oomguard run's checkpoints
    resume = _resume(sup, 3)
    assert resume.output_dir == str(out / "oomguard-attempt-3-2")
    assert _resume(sup, 4).output_dir == str(out / "oomguard-attempt-4")
