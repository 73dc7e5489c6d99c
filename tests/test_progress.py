"""Progress while an attempt runs: --json-log gets `progress` events; a second trainer restarts the step counter."""

from __future__ import annotations

import json
import sys

from helpers import run_oomguard

# A command that reports like the bootstrap's callback: a first trainer of 36 steps, then a second one of 18.
TWO_TRAINERS = """
import json, os, time
events = json.load(open(os.environ["OOMGUARD_PLAN"]))["events"]
def emit(**ev):
    with open(events, "a") as f:
        f.write(json.dumps(ev) + "\\n")
emit(event="train_begin", step=0, max_steps=36, output_dir="out", save_strategy="steps")
emit(event="step", step=36, peak=1000)
emit(event="train_end", step=36, peak=1000)
time.sleep(0.6)
emit(event="train_begin", step=0, max_steps=18, output_dir="out2", save_strategy="steps")
emit(event="step", step=3, peak=900)
time.sleep(0.6)
"""


def test_json_log_reports_progress_and_each_trainer_has_its_own_step_counter(tmp_path):
    out, _ = run_oomguard(tmp_path, "--json-log", "--no-probe", "--", sys.executable, "-c", TWO_TRAINERS)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    progress = [e for e in lines if e.get("oomguard") == "progress"]
    assert progress, [e.get("oomguard") for e in lines]
    assert all(e["step"] is None or e["max_steps"] is None or e["step"] <= e["max_steps"] for e in progress), progress
    assert progress[0]["attempt"] == 1 and progress[0]["max_steps"] == 36 and progress[0]["peak_bytes"] == 1000
    assert progress[-1]["max_steps"] == 18 and progress[-1]["step"] in (0, 3)  # not "36/18"


def test_the_live_view_follows_the_second_trainer(tmp_path):
    from oomguard.decide.ladder import load_ladder
    from oomguard.display.ui import ConsoleReporter
    from oomguard.run.supervisor import RunOptions, Supervisor
    from oomguard.run.watch import Watch as _Watch
    from oomguard.vocab.events import EventTail
    from oomguard.vocab.knobs import Knobs
    from oomguard.vocab.records import AttemptKind

    ui = ConsoleReporter(quiet=True, live=False)
    sup = Supervisor(["true"], RunOptions(ladder=load_ladder("default"), workdir=tmp_path / "wd"), ui)
    events = tmp_path / "events.jsonl"
    ui.attempt_start(1, 8, [], {}, "run")
    watch = _Watch(AttemptKind.RUN, Knobs(), EventTail(events), sup.launcher.progress_state(1, AttemptKind.RUN, []))

    def emit(*evs):
        with events.open("a") as f:
            f.writelines(json.dumps(e) + "\n" for e in evs)
        sup.launcher.poll(watch)

    emit({"event": "train_begin", "step": 0, "max_steps": 36}, {"event": "step", "step": 36, "peak": 10})
    assert (ui.state.step, ui.state.max_steps) == (36, 36)
    emit({"event": "train_begin", "step": 0, "max_steps": 18}, {"event": "step", "step": 3, "peak": 5})
    assert (ui.state.step, ui.state.max_steps, ui.state.peak) == (3, 18, 10)
    assert "step 3/18" in ui.state.line()
