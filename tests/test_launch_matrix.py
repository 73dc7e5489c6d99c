"""Every way people launch GRPO x every way an attempt can end, end to end with real TRL on the simulated device.

oomguard learns how an attempt ended from what its training processes recorded (events, crash records), never from
the exit code of a launcher between them, so each ending must read the same under every launch form. A launch form
is a row of ``FORMS`` and an ending a row of ``ENDINGS``; a new one is a new row, not a new mechanism.

Cost: a cell is one launch where that is enough to see the ending (``--max-attempts 1`` where oomguard would go on
to climb: the decision after an ending is the same code whatever the form), a whole climb to a stable config where
the promise is the whole run (``stable``). The default run takes torchrun, where the pre-flight stop was first lost
(``DEFAULT``); the rest of the cross product, and an interrupt under
every form, are ``slow`` (CI runs them). Two-rank forms run the endings that
differ between ranks: one rank's OOM or kill while the other waits at a collective, a pre-flight stop on every rank,
both finishing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from oomguard.vocab.sizes import parse_size

from helpers import (
    ACCELERATE_LAUNCH,
    PYTHON,
    SCRIPTS,
    TINY,
    env_without_launchers,
    free_port,
    reads_as_under_python,
    torchrun,
    wait_until,
)

pytestmark = pytest.mark.e2e

# The training config every form runs: grpo_tiny's flags, and the same values in TRL's CLI spelling.
STEPS, COMPLETION = "2", "64"
TRL_SCRIPT = os.path.join(os.path.dirname(sys.executable), "trl")  # the console script next to this interpreter


def tiny_args(model: str, out: Path) -> list[str]:
    return ["--model", model, "--output-dir", str(out), "--max-steps", STEPS, "--max-completion-length", COMPLETION]


def trl_args(model: str, out: Path, data: Path) -> list[str]:
    return ["grpo", "--model_name_or_path", model, "--dtype", "float32", "--dataset_name", str(data),
            "--reward_funcs", "endings.reward", "--output_dir", str(out), "--max_steps", STEPS,
            "--max_completion_length", COMPLETION, "--per_device_train_batch_size", "4", "--num_generations", "4",
            "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1"]


def gsm_like_data(tmp: Path) -> Path:
    """A local dataset directory for ``trl grpo --dataset_name`` (no hub here): 64 conversational prompts."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    with open(data / "train.jsonl", "w", encoding="utf-8") as f:
        for i in range(64):
            text = " ".join(words[(i + j) % len(words)] for j in range(8))
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{i}: {text}"}]}) + "\n")
    return data


def shell_script(tmp: Path, name: str, body: str) -> str:
    path = tmp / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


def accelerate_config(tmp: Path, processes: int) -> str:
    """An ``accelerate config`` file: one CPU process, or two ranks over gloo (``MULTI_GPU`` without GPUs)."""
    path = tmp / f"accelerate-{processes}.yaml"
    kind = "MULTI_GPU" if processes > 1 else "'NO'"
    path.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: {kind}\nnum_machines: 1\n"
                    f"num_processes: {processes}\nmachine_rank: 0\nmain_process_port: {free_port()}\n"
                    f"mixed_precision: 'no'\nuse_cpu: {'false' if processes > 1 else 'true'}\n")
    return str(path)


@dataclass(frozen=True)
class Form:
    """A launch form: how it builds the command, and how many training processes it starts."""

    name: str
    argv: Callable[[Path, str], list[str]]  # (tmp, model) -> the command after `oomguard run --`
    ranks: int = 1
    launcher: str | None = None  # the error a launcher between prints when its training process fails


def _python_m(tmp: Path, model: str) -> list[str]:
    pkg = tmp / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(f"import runpy\nrunpy.run_path({TINY!r}, run_name='__main__')\n")
    return [PYTHON, "-m", "pkg.train", *tiny_args(model, tmp / "out")]


FORMS = {f.name: f for f in [
    Form("python", lambda tmp, m: [PYTHON, TINY, *tiny_args(m, tmp / "out")]),
    Form("python-m", _python_m),
    Form("trl-grpo", lambda tmp, m: [TRL_SCRIPT, *trl_args(m, tmp / "out", gsm_like_data(tmp))],
         launcher="CalledProcessError"),
    Form("accelerate-1", lambda tmp, m: [*ACCELERATE_LAUNCH, "--num_processes", "1", TINY,
                                         *tiny_args(m, tmp / "out")], launcher="CalledProcessError"),
    Form("accelerate-1-config", lambda tmp, m: [*ACCELERATE_LAUNCH, "--config_file", accelerate_config(tmp, 1), TINY,
                                                *tiny_args(m, tmp / "out")], launcher="CalledProcessError"),
    Form("accelerate-2", lambda tmp, m: [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2",
                                         "--main_process_port", str(free_port()), TINY, *tiny_args(m, tmp / "out")],
         ranks=2, launcher="ChildFailedError"),
    Form("accelerate-2-config", lambda tmp, m: [*ACCELERATE_LAUNCH, "--config_file", accelerate_config(tmp, 2), TINY,
                                                *tiny_args(m, tmp / "out")], ranks=2, launcher="ChildFailedError"),
    Form("torchrun-2", lambda tmp, m: torchrun(2, TINY, *tiny_args(m, tmp / "out")), ranks=2,
         launcher="ChildFailedError"),
    # a shell script that calls one of these (and stays their parent), and one that exits 1 whatever its child did
    Form("shell", lambda tmp, m: [shell_script(tmp, "train.sh", f'set -e\necho "training"\n{PYTHON} {TINY} "$@"\n'
                                               'echo "done"'), *tiny_args(m, tmp / "out")]),
    Form("exit-1", lambda tmp, m: [shell_script(tmp, "flaky.sh", f'{PYTHON} {TINY} "$@"\nexit 1'),
                                   *tiny_args(m, tmp / "out")]),
]}


@dataclass
class Cell:
    """What one oomguard run of a cell left: its process, report and workdir."""

    form: Form
    out: subprocess.CompletedProcess
    rep: dict
    tmp: Path
    budget: str

    @property
    def first(self) -> dict:
        return self.rep["attempts"][0]

    def events(self, attempt: int) -> list[dict]:
        path = next((self.tmp / "wd").glob(f"runs/*/attempt-{attempt}/events.jsonl"))
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def why(self) -> str:
        return f"{self.rep.get('message')}\n{self.out.stderr[-4000:]}"


@dataclass(frozen=True)
class Ending:
    """An ending: the budget and environment that cause it, oomguard's options, and what every form must show."""

    name: str
    check: Callable[[Cell], None]
    budget: str = "1GiB"
    options: tuple[str, ...] = ("--no-probe", "--max-attempts", "1")
    env: dict[str, str] = field(default_factory=dict)


def _fits(c: Cell) -> None:
    assert c.first["outcome"] == "ok" and c.rep["status"] == "stable", c.why()
    assert c.out.returncode == c.first["exit_code"]  # 0, or a launcher's own code, passed through
    assert sorted(e["rank"] or 0 for e in c.events(1) if e["event"] == "train_end") == list(range(c.form.ranks))


def _predicted(c: Cell) -> None:
    assert c.first["outcome"] == "predicted", c.why()
    assert c.first["climbed"], c.first  # the climb chose the next config, as after an OOM
    assert c.rep["status"] == "exhausted" and "--max-attempts 1" in c.rep["message"]
    stops = [e for e in c.events(1) if e["event"] == "end" and e["how"] == "predicted"]
    assert len(stops) == c.form.ranks  # every rank stopped before generating
    # a stop is a stop: the training process's own code, and no launcher's traceback of it on the terminal
    assert c.first["exit_code"] == 87
    assert "Traceback" not in c.out.stderr and "ChildFailedError" not in c.out.stderr, c.out.stderr[-3000:]


def _stable_after_predicted(c: Cell) -> None:
    """The promise of the pre-flight under every launcher: stopped before generating, then stable, every rank
    trained the chosen config, and nothing left in the temporary directory by the probes."""
    attempts = c.rep["attempts"]
    assert c.rep["status"] == "stable" and c.out.returncode == attempts[-1]["exit_code"], c.why()
    assert attempts[0]["outcome"] == "predicted" and attempts[-1]["outcome"] == "ok"
    # no real OOM where the memory model is sure: a config predicted well inside the device fits
    sure = [a for a in attempts if a["outcome"] == "oom" and (a["predicted_bytes"] or 0) < SURE * parse_size(c.budget)]
    assert not sure, [(a["predicted_bytes"], a["peak_bytes"]) for a in sure]
    last = c.events(len(attempts))
    assert sorted(e["rank"] or 0 for e in last if e["event"] == "train_end") == list(range(c.form.ranks))
    assert c.rep["diff"] and {r["remedy"] for r in c.rep["diff"]} <= set(attempts[-1]["remedies"])


def _oom_at_load(c: Cell) -> None:
    assert c.first["outcome"] == "oom" and c.first["oom"]["phase"] == "load", c.why()
    assert c.rep["status"] == "exhausted"
    _reads_as_under_python(c)


def _reads_as_under_python(c: Cell) -> None:
    assert c.first["exit_code"] == 86, c.why()  # the training process's own code, not a launcher's 1
    reads_as_under_python(c.out.stderr, c.tmp / "wd", c.form.launcher)


def _oom_scoring(c: Cell) -> None:
    assert c.first["outcome"] == "oom" and c.first["oom"]["is_oom"], c.why()
    assert c.first["climbed"] and c.first["oom"]["kind"] != "host-ram"
    _reads_as_under_python(c)


def _host_ram(c: Cell) -> None:
    assert c.first["outcome"] == "oom" and c.first["oom"]["kind"] == "host-ram", c.why()
    # never a GPU rung; and no host rung applies to these runs (no dataloader workers, nothing offloaded to the CPU):
    # a host rung climbed after a kill is tests/test_launchers_resume.py's (fewer_workers)
    assert c.first["climbed"] is None and {s["remedy"] for s in c.first["skipped"]} >= set(HOST_RUNGS), c.why()


def _error(c: Cell) -> None:
    assert c.first["outcome"] == "failed" and c.rep["status"] == "failed", c.why()
    assert c.out.returncode == c.first["exit_code"] != 0  # the command's own code, passed through
    assert "ValueError" in (c.first["note"] or "") and "ValueError" in c.rep["message"]
    assert len(c.rep["attempts"]) == 1  # never retried


def _one_rank_oom(c: Cell) -> None:
    """Rank 1 runs out of memory; rank 0 would wait for it at the next collective. The job ends once, as an OOM."""
    assert c.first["outcome"] == "oom" and c.first["oom"]["rank"] == 1, c.why()
    assert c.first["seconds"] < 90 and c.first["climbed"]
    _reads_as_under_python(c)


def _one_rank_killed(c: Cell) -> None:
    assert c.first["outcome"] == "oom" and c.first["oom"]["kind"] == "host-ram", c.why()
    assert c.first["seconds"] < 90


SURE = 0.85  # a prediction below this share of the device is one the memory model is sure of (its error is ~6%)
HOST_RUNGS = ("fewer_workers", "smaller_prefetch", "no_cpu_offload")
TIGHT = "40MiB"  # the tiny model's weights load (16 MiB); its config is predicted at more than twice this
ENDINGS = {e.name: e for e in [
    Ending("fits", _fits, options=("--no-probe",)),
    Ending("predicted", _predicted, budget=TIGHT),
    Ending("stable", _stable_after_predicted, budget="64MiB", options=("--no-probe", "--no-refine")),
    Ending("oom-load", _oom_at_load, budget="8MiB", options=("--no-probe", "--no-preflight", "--max-attempts", "1")),
    Ending("oom", _oom_scoring, env={"OOMGUARD_TEST_ENDING": "oom"}),
    Ending("host-ram", _host_ram, env={"OOMGUARD_TEST_ENDING": "kill"}),
    Ending("error", _error, env={"OOMGUARD_TEST_ENDING": "error"}),
    # the other rank waits at a collective for the one that is gone: oomguard stops it after OOMGUARD_RANK_GRACE
    Ending("rank-1-oom", _one_rank_oom, env={"OOMGUARD_TEST_ENDING": "oom", "OOMGUARD_TEST_ENDING_RANK": "1",
                                             "OOMGUARD_RANK_GRACE": "3"}),
    Ending("rank-1-killed", _one_rank_killed, env={"OOMGUARD_TEST_ENDING": "kill", "OOMGUARD_TEST_ENDING_RANK": "1",
                                                   "OOMGUARD_RANK_GRACE": "3"}),
]}

# (form, ending) run by default: the launcher where the pre-flight stop was first lost (torchrun, two ranks). How
# every ending is read from the ranks' records whatever the launcher exits with (a rank killed without a word, one
# rank's OOM, a stop) is tests/test_classify.py's, an OOM while loading tests/test_real_cards.py's. The other cells
# run with -m slow (CI runs them; each launches real TRL, 15-50 s, and the default run stays within 5 minutes).
DEFAULT = {("torchrun-2", "predicted")}
# One cell per launcher runs under the oldest supported TRL too (marker `core`, tests/compat.sh): plain python,
# TRL's CLI (which runs `accelerate launch`), torchrun; accelerate's two ranks run there in tests/test_deepspeed.py's
# accelerate YAML (a pre-flight stop, then stable).
CORE = {("python", "oom"), ("trl-grpo", "predicted"), ("torchrun-2", "predicted")}
SINGLE = ("fits", "predicted", "stable", "oom-load", "oom", "host-ram", "error")
MULTI = ("fits", "predicted", "stable", "rank-1-oom", "rank-1-killed", "error")
# the whole climb after the stop is the same code under every form: run it where the issue's users run it
STABLE_FORMS = ("trl-grpo", "torchrun-2", "accelerate-2", "exit-1")

# Which cells run: the matrix is covered pairwise, not crosswise. A launch form can break three things, and only
# these: the bootstrap reaching its training processes, the exit codes and signals relayed through what sits between
# oomguard and them, and ranks that wait for each other. How an ending is read has no branch per form (it comes from
# the training processes' own records: oomguard.run.classify). So every form runs a config that fits (its training
# processes are reached and reported), every ending runs under one form of each process tree (TREES: one process,
# a launcher or shell between, two ranks), and the cells where a form's own relay is what the ending tests run too
# (RELAYS). A cell left out is covered by its form's `fits` cell and its ending's cell in a form of the same tree
# (`covered_by`; test_every_cell_left_out_is_covered_by_its_form_and_its_ending checks that each has both).
TREES = {"one process": ("python", "python-m"),
         "a launcher or shell between": ("trl-grpo", "accelerate-1", "accelerate-1-config", "shell", "exit-1"),
         "two ranks": ("torchrun-2", "accelerate-2", "accelerate-2-config")}
EVERY_ENDING_UNDER = ("python", "trl-grpo", "torchrun-2")  # one form of each tree
RELAYS = {
    ("shell", "error"), ("exit-1", "error"),  # the command's own exit code through a non-Python parent
    ("accelerate-1", "host-ram"), ("accelerate-2", "rank-1-killed"),  # a kill seen through accelerate's agent
    ("accelerate-1-config", "predicted"), ("accelerate-2-config", "predicted"),  # ranks from an accelerate config
    ("accelerate-2", "stable"), ("exit-1", "stable"),  # the whole climb where the issue's users run it
}


# Cells whose launch another test makes, with more assertions: that test's run is the cell's (the cell is kept, and
# its own parametrised run left out). trl-grpo-fits: `trl grpo` reaching and reporting its training processes, which
# the replay of a recipe on two ranks under `trl grpo` shows (and every rank trains); trl-grpo-stable: the climb after
# the stop under `trl grpo`, which the run whose probe saves into the temporary directory makes, probe included;
# torchrun-2-stable: the climb after the stop on torchrun's two ranks, which tests/test_deepspeed.py's guided climb
# makes (judged per rank, the multi-gpu ladder picked for the two ranks), with this ending's checks.
FOLDED = {("trl-grpo", "fits"): "test_a_recipe_replayed_under_trl_grpo_on_two_ranks_trains_every_locked_value",
          ("trl-grpo", "stable"): "test_trl_grpo_stops_before_generating_and_its_probe_leaves_nothing_in_the_temporary_directory",
          ("torchrun-2", "stable"): "test_deepspeed.py::test_the_guided_climb_chooses_from_the_per_rank_prediction_without_an_oom"}


def _valid() -> list[tuple[str, str]]:
    """Every (form, ending) that means something: a two-rank ending under two ranks, the climb under STABLE_FORMS."""
    return [(form.name, ending) for form in FORMS.values() for ending in (MULTI if form.ranks > 1 else SINGLE)
            if ending != "stable" or form.name in STABLE_FORMS]


def kept(form: str, ending: str) -> bool:
    return ending == "fits" or form in EVERY_ENDING_UNDER or (form, ending) in RELAYS


def covered_by(form: str, ending: str) -> tuple[str, str]:
    """The two kept cells that cover a cell left out: its form's `fits` cell, and its ending under a form of the
    same process tree."""
    tree = next(forms for forms in TREES.values() if form in forms)
    same = next(f for f in tree if kept(f, ending) and (f, ending) in set(_valid()))
    return f"{form}-fits", f"{same}-{ending}"


def _cells() -> list:
    out = []
    for form, ending in _valid():
        if not kept(form, ending) or (form, ending) in FOLDED:
            continue
        marks = [] if (form, ending) in DEFAULT else [pytest.mark.slow]
        if (form, ending) in CORE:
            marks.append(pytest.mark.core)
        out.append(pytest.param(form, ending, marks=marks, id=f"{form}-{ending}"))
    return out


def test_every_cell_left_out_is_covered_by_its_form_and_its_ending():
    """The pairwise rule holds for every cell of the cross product (a form or ending added without its cells fails
    here), and the cells CORE and DEFAULT name are among those that run."""
    ran = {(f, e) for f, e in _valid() if kept(f, e)}
    assert {f for forms in TREES.values() for f in forms} == set(FORMS)
    for form, ending in set(_valid()) - ran:
        fits, same = covered_by(form, ending)
        assert (form, "fits") in ran, fits
        assert same.endswith(f"-{ending}") and any(f"{f}-{e}" == same for f, e in ran), (form, ending)
    assert ran >= CORE | DEFAULT
    assert len(ran) < len(_valid()) * 0.6  # pairwise: it grows with forms plus endings, not their product
    assert all(folded_test_exists(test) for test in FOLDED.values()) and not set(FOLDED) & (CORE | DEFAULT)


def folded_test_exists(test: str) -> bool:
    """A folded cell's test: one of this module's, or ``FILE::NAME`` in another file of the suite."""
    if "::" not in test:
        return callable(globals().get(test))
    file, name = test.split("::")
    return f"\ndef {name}(" in (Path(__file__).parent / file).read_text()


def run_cell(tmp: Path, model: str, form: Form, ending: Ending, extra: tuple[str, ...] = (),
             popen: bool = False, env: dict[str, str] | None = None) -> Cell | subprocess.Popen:
    env = {**os.environ, **env_without_launchers(), **ending.env, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if ending.env.get("OOMGUARD_TEST_ENDING") == "kill":
        cgroup = tmp / "cgroup"  # a stand-in cgroup whose OOM-kill counter the process bumps before it dies
        cgroup.mkdir()
        (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
        (cgroup / "memory.max").write_text("max\n")
        env["OOMGUARD_CGROUP"] = str(cgroup)
    if "OOMGUARD_TEST_ENDING" in ending.env:
        env["OOMGUARD_TEST_MARKER"] = str(tmp / "acted")
    cmd = [sys.executable, "-m", "oomguard", "run", "--report", str(tmp / "report.json"), "--lock",
           str(tmp / "lock.json"), "--workdir", str(tmp / "wd"), "--simulate-gpu", ending.budget, *ending.options,
           *extra, "--", *form.argv(tmp, model)]
    if popen:
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    report = tmp / "report.json"
    assert report.exists(), out.stderr[-4000:]
    return Cell(form, out, json.loads(report.read_text()), tmp, ending.budget)


@pytest.mark.parametrize("form, ending", _cells())
def test_every_ending_reads_the_same_under_every_launch_form(tmp_path, tiny_model, form, ending):
    f, e = FORMS[form], ENDINGS[ending]
    extra = ("--ladder", "multi-gpu") if f.ranks > 1 and ending == "stable" and form.startswith("accelerate") else ()
    cell = run_cell(tmp_path, tiny_model, f, e, extra)
    e.check(cell)


# A signal is relayed by what sits between oomguard and the training processes: one process, a shell, a launcher
# chain, two ranks in sessions of their own. The other forms are the same trees (TREES).
INTERRUPT_FORMS = ("python", "shell", "trl-grpo", "torchrun-2")


@pytest.mark.slow
@pytest.mark.parametrize("form", INTERRUPT_FORMS)
def test_an_interrupt_stops_every_process_under_every_launch_form(tmp_path, tiny_model, form):
    """SIGINT to oomguard while a reward function sleeps in step 0: interrupted, exit 130, no process left (under one
    form of each process tree, INTERRUPT_FORMS; tests/test_run_process.py's interrupt tests show the supervisor's side)."""
    sleep = Ending("interrupt", lambda c: None, env={"OOMGUARD_TEST_ENDING": "sleep"})
    proc = run_cell(tmp_path, tiny_model, FORMS[form], sleep, popen=True)
    marker = tmp_path / "acted"

    def asleep() -> int | None:
        """The pid of the process whose reward function sleeps, once it is asleep (it writes the marker first)."""
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        pid = marker.read_text() if marker.exists() else ""
        try:
            return int(pid) if pid and psutil.Process(int(pid)).status() == psutil.STATUS_SLEEPING else None
        except psutil.Error:
            return None

    wait_until(asleep, 300, "no reward function reached its sleep", every=0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["status"] == "interrupted" and [a["outcome"] for a in rep["attempts"]] == ["interrupted"]
    from helpers import pid_alive

    assert not pid_alive(int(marker.read_text()))


@pytest.mark.slow
def test_trl_grpo_stops_before_generating_and_its_probe_leaves_nothing_in_the_temporary_directory(tmp_path, tiny_model):
    """The held-out case of issue 16: `trl grpo` (TRL's CLI, which runs `accelerate launch`) on a device its config
    does not fit. The pre-flight stop is seen through both launchers and the chosen config is probed, then run to
    stable (the trl-grpo-stable cell, ``FOLDED``). The probe wrote into a directory of oomguard's own in the temporary
    directory (TRL's script saves the model at its end), deleted when the probe ended; only the run wrote into the
    user's output directory. Slow: the default run's test_probe_finds_the_worst_case_first_and_saves_nothing shows a
    probe writes nothing into the user's output directory, tests/test_grpo_config_validity.py that a probe's
    output_dir is oomguard's own, and the torchrun-2-predicted cell a stop seen through a launcher."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    with_probe = dataclasses.replace(ENDINGS["stable"], options=("--no-refine",))
    cell = run_cell(tmp_path, tiny_model, FORMS["trl-grpo"], with_probe, env={"TMPDIR": str(scratch)})
    assert [(a["kind"], a["outcome"]) for a in cell.rep["attempts"]] == [("probe", "predicted"), ("probe", "ok"),
                                                                          ("run", "ok")], cell.why()
    with_probe.check(cell)
    begin = next(e for e in cell.events(2) if e["event"] == "train_begin")
    assert Path(begin["output_dir"]).parent == scratch and not Path(begin["output_dir"]).exists()
    assert "Model saved to " + begin["output_dir"] in cell.out.stdout  # TRL's script saved a whole model there
    assert not list(scratch.glob("oomguard-*"))
    run = next(e for e in cell.events(3) if e["event"] == "train_begin")
    assert Path(run["output_dir"]) == tmp_path / "out"  # the user's output_dir: the run's, never a probe's


@pytest.mark.slow
def test_a_recipe_replayed_under_trl_grpo_on_two_ranks_trains_every_locked_value(tmp_path, tiny_model):
    """Issue 45's forms in one launch: `trl grpo --config recipe.yaml` with a flag of its own, on two ranks (the recipe
    names its accelerate config, as multi-GPU recipes do), replaying a lock whose values are TRL's defaults where the
    recipe and the flag set others: gradient_accumulation_steps 1 (the recipe's 2), per_device_train_batch_size 8 (the
    flag's 4). Both ranks train with the lock's values, and the report's stable config is what they said they ran.
    It is also the matrix's trl-grpo-fits cell (``FOLDED``): `trl grpo`'s training processes reached and reporting.
    Slow: the default run's test_lock_file_replays_without_climbing replays a script's own value the same way, and
    tests/test_lock_replay.py holds the override computation and the training process's half in seconds."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"dtype: float32\nreward_funcs:\n- endings.reward\nmax_steps: {STEPS}\nmax_completion_length: "
                      f"{COMPLETION}\nnum_generations: 4\ngradient_accumulation_steps: 2\nuse_cpu: true\nreport_to: "
                      "none\nsave_strategy: 'no'\nlogging_steps: 1\n"
                      f"accelerate_config: {accelerate_config(tmp_path, 2)}\n")
    locked = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    lock = tmp_path / "in.lock.json"
    lock.write_text(json.dumps({"schema": "oomguard.lock/1", "overrides": locked}))
    form = Form("trl-grpo-recipe-2", lambda tmp, m: [TRL_SCRIPT, "grpo", "--config", str(recipe), "--model_name_or_path",
                                                     m, "--dataset_name", str(gsm_like_data(tmp)), "--output_dir",
                                                     str(tmp / "out"), "--per_device_train_batch_size", "4"], ranks=2)
    cell = run_cell(tmp_path, tiny_model, form, Ending("replay", _fits, options=("--config", str(lock))))
    _fits(cell)  # both ranks trained
    ran = {e["rank"]: e["knobs"] for e in cell.events(1) if e["event"] == "ran"}  # each rank's last word
    assert sorted(ran) == [0, 1] and all({k: r[k] for k in locked} == locked for r in ran.values()), ran
    assert {k: cell.rep["stable"][k] for k in locked} == locked
    assert {k: cell.rep["original"][k] for k in locked} == {"per_device_train_batch_size": 4,
                                                            "gradient_accumulation_steps": 2}
    assert json.loads((tmp_path / "lock.json").read_text())["overrides"] == locked  # and its lock replays the same
