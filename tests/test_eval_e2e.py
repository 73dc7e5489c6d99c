"""End to end, with real TRL on CPU and the simulated device: a GRPO run whose evaluation, not its training, exceeds
the device. The training step (4 rows of 14 + 32 tokens) peaks at 74 MiB; an evaluation pass of 16 rows at 141 MiB
(measured on the tiny model, the fused head's CPU fallback holding a [rows x 45, 32768] buffer). On 110 MiB the
training fits and the evaluation does not: what must change is evaluation's batch, never the training experiment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import grpo_tiny, run_oomguard

pytestmark = pytest.mark.e2e

EVALUATES = ["--max-steps", "2", "--eval-steps", "2", "--per-device-eval-batch-size", "16", "--eval-rows", "4"]
EVAL_KNOBS = {"per_device_eval_batch_size", "num_generations_eval"}


def events(tmp: Path, attempt: int) -> list[dict]:
    path = next((tmp / "wd").glob(f"runs/*/attempt-{attempt}/events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(tmp: Path, model: str, *extra: str):
    out, rep = run_oomguard(tmp, "--simulate-gpu", "110MiB", *extra, "--", *grpo_tiny(model, tmp / "out", *EVALUATES))
    assert rep is not None, out.stderr[-3000:]
    assert rep["status"] == "stable" and out.returncode == 0, (rep["message"], out.stderr[-3000:])
    return out, rep


def only_evaluation_changed(rep: dict) -> None:
    assert {row["knob"] for row in rep["diff"]} <= EVAL_KNOBS and rep["diff"], rep["diff"]
    # nothing the script left unset is written where it keeps its value (4 completions per prompt, as training)
    assert all(row["to"] != 4 for row in rep["diff"] if row["knob"] == "num_generations_eval")
    assert all(row["remedy"] == "eval_batch" for row in rep["diff"])
    stable = rep["stable"]["knobs"] if "knobs" in rep["stable"] else rep["stable"]
    rows, per_prompt = stable["per_device_eval_batch_size"], stable.get("num_generations_eval") or 4
    assert rows < 16 and rows % per_prompt == 0
    # the training experiment as the script set it
    assert (stable["per_device_train_batch_size"], stable["num_generations"], stable["max_completion_length"]) == (
        4, 4, 32)
    assert not stable.get("lora_r") and stable.get("optim") == "adamw_torch"
    changed = rep["experiment"]["changed"]
    assert [c["remedy"] for c in changed] == ["eval_batch"] and changed[0]["cost"] == "none"
    assert "training unchanged" in changed[0]["change"]


@pytest.mark.slow
def test_an_evaluation_that_exceeds_the_device_is_predicted_and_only_evaluation_changes(tmp_path, tiny_model):
    """The memory model's evaluation phase stops the config before it loads, the probe runs one evaluation pass
    (its peak above the training step's), and the run evaluates without an OOM. Slow (about 60 s: three launches):
    the phase and the eval rung are tests/test_evaluation.py's, the probe's one evaluation pass in TRL's real
    GRPOConfig tests/test_grpo_config_validity.py's, a pre-flight stop and a choice through real TRL the default run's
    test_the_default_choice_keeps_the_experiment_and_shows_what_trades_differently."""
    _, rep = run(tmp_path, tiny_model, "--always-probe")  # the probe's evaluation pass is what is checked here
    attempts = rep["attempts"]
    assert not [a for a in attempts if a["outcome"] == "oom"], [a["outcome"] for a in attempts]
    assert attempts[0]["outcome"] == "predicted"
    only_evaluation_changed(rep)
    probe = next(a for a in attempts if a["kind"] == "probe" and a["outcome"] == "ok")
    evaluated = [e for e in events(tmp_path, probe["index"]) if e["event"] == "evaluated"]
    assert len(evaluated) == 1 and evaluated[0]["step"] == 2  # one pass, after the probe's last step
    run_events = events(tmp_path, attempts[-1]["index"])
    assert [e["step"] for e in run_events if e["event"] == "evaluated"] == [2]


@pytest.mark.slow
def test_an_oom_in_an_evaluation_pass_is_diagnosed_as_evaluations(tmp_path, tiny_model):
    """Without the pre-flight, the probe's evaluation pass runs out of memory: its traceback goes through
    Trainer.evaluate and GRPO's prediction_step, so the diagnosis says evaluation, and the one rung that changes
    evaluation alone fixes it."""
    _, rep = run(tmp_path, tiny_model, "--no-preflight")
    ooms = [a for a in rep["attempts"] if a["outcome"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["oom"]["phase"] == "evaluation", ooms
    assert "evaluation pass" in " ".join(ooms[0]["oom"]["evidence"])
    only_evaluation_changed(rep)


@pytest.mark.slow
def test_a_config_that_saves_is_probed_with_one_save_into_the_probes_own_directory(tmp_path, tiny_model):
    """The probe saves once after its last step, so the save's device and host peaks are measured, into a scratch
    directory of its own that is gone after it; the user's output directory gets only the real run's checkpoints."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "1GiB", "--always-probe", "--",
                            *grpo_tiny(tiny_model, tmp_path / "out", "--max-steps", "3", "--save-steps", "3"))
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    probe, real = rep["attempts"][0], rep["attempts"][-1]
    assert probe["kind"] == "probe" and real["kind"] == "run"
    saved = [e for e in events(tmp_path, probe["index"]) if e["event"] == "checkpoint"]
    assert len(saved) == 1 and saved[0]["step"] == 2 and saved[0]["host_peak"] > 0 and saved[0]["peak"] > 0
    assert not Path(saved[0]["path"]).exists() and not str(saved[0]["path"]).startswith(str(tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3"]
