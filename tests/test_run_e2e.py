"""End to end, with real TRL on CPU and the simulated device: a first attempt runs out of memory, and one rung of
the fastest ladder (the design card's order, climbed one rung per OOM) makes the run fit. Every rung of the design
card is covered at least once; the default ladder's own rungs (the micro-batch split, bf16 weights) and its choice
by cost are covered in tests/test_choose_e2e.py and tests/test_real_cards.py.

The budgets come from `bench/min_budget.py`, which replays each configuration's allocation trace through the
allocator model: e.g. `--max-completion-length 64` needs 106 MiB without expandable segments and 100 MiB with them,
and just below 106 MiB its OOM is a fragmentation one. Each test starts from a config where the earlier rungs cannot
help (a floor reached, already in force, or a diagnosis they do not address), so the rung under test is the first
climbed.

The rung-by-rung tests are `slow` (CI runs them; the default run stays within 5 minutes on two cores, and each of
these costs two launches of real TRL, about 30 s): which rung a diagnosis climbs is tests/test_ladder.py's, every
ladder step's overrides in TRL's real GRPOConfig tests/test_grpo_config_validity.py's, and a real OOM parsed,
diagnosed and climbed end to end is the default run's test_probe_finds_the_worst_case_first_and_saves_nothing and
tests/test_launchers_resume.py's late OOM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import by_head, env_without_launchers, events_of, grpo_tiny, run_oomguard

pytestmark = pytest.mark.e2e

FLOOR = ["--max-completion-length", "64", "--num-generations", "2", "--per-device-train-batch-size", "2"]


def grpo(tmp: Path, model: str, budget: str, *args: str, env: dict | None = None,
         extra: tuple = ("--no-probe", "--no-predict", "--ladder", "fastest")):
    out, rep = run_oomguard(tmp, "--simulate-gpu", budget, *extra, "--", *grpo_tiny(model, tmp / "out", *args),
                            env=env)
    assert rep is not None, out.stderr[-3000:]
    return out, rep


def assert_rung_fixed_it(out, rep, rung: str):
    attempts = rep["attempts"]
    assert rep["status"] == "stable", (rep["message"], out.stderr[-3000:])
    assert out.returncode == 0
    assert attempts[0]["outcome"] == "oom" and attempts[0]["oom"]["is_oom"]
    assert [a["climbed"] for a in attempts[:-1]] == [rung], [(a["climbed"], a["skipped"]) for a in attempts]
    assert attempts[-1]["outcome"] == "ok" and rung in attempts[-1]["remedies"]
    assert any(row["remedy"] == rung for row in rep["diff"])
    assert "trained 2 steps" in out.stdout
    return attempts


@pytest.mark.slow
def test_expandable_segments(tmp_path, tiny_model):
    out, rep = grpo(tmp_path, tiny_model, "103MiB", "--max-completion-length", "64")
    a = assert_rung_fixed_it(out, rep, "expandable_segments")
    assert a[0]["oom"]["kind"] == "fragmentation"
    assert rep["diff"] == [{"knob": "expandable_segments", "from": False, "to": True, "remedy": "expandable_segments"}]
    assert "What oomguard changed" in out.stderr


@pytest.mark.slow
def test_empty_cache_when_the_user_keeps_expandable_segments_off(tmp_path, tiny_model):
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    out, rep = grpo(tmp_path, tiny_model, "103MiB", "--max-completion-length", "64", env=env)
    a = assert_rung_fixed_it(out, rep, "empty_cache")
    assert a[0]["oom"]["kind"] == "fragmentation"
    assert "oomguard keeps it" in {s["remedy"]: s["reason"] for s in a[0]["skipped"]}["expandable_segments"]
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"torch_empty_cache_steps": 1, "max_split_size_mb": 21}


@pytest.mark.slow
def test_shorter_sequences(tmp_path, tiny_model):
    """Slow: test_probe_finds_the_worst_case_first_and_saves_nothing climbs the same rung on a real OOM."""
    out, rep = grpo(tmp_path, tiny_model, "118MiB", "--max-completion-length", "128")
    a = assert_rung_fixed_it(out, rep, "shorter_sequences")
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"max_completion_length": 64}
    assert a[0]["oom"]["kind"] != "fragmentation"


@pytest.mark.slow
def test_fewer_generations(tmp_path, tiny_model):
    """The same climb under torchrun is test_torchrun_two_ranks_on_the_simulated_device
    (tests/test_launchers_resume.py)."""
    out, rep = grpo(tmp_path, tiny_model, "84MiB", "--max-completion-length", "64")
    a = assert_rung_fixed_it(out, rep, "fewer_generations")
    assert "floor" in {s["remedy"]: s["reason"] for s in a[0]["skipped"]}["shorter_sequences"]
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"num_generations": 2, "per_device_train_batch_size": 2}


@pytest.mark.slow
def test_checkpointing_when_the_script_turned_it_off(tmp_path, tiny_model):
    out, rep = grpo(tmp_path, tiny_model, "80MiB", *FLOOR, "--no-gradient-checkpointing")
    assert_rung_fixed_it(out, rep, "checkpointing")
    assert rep["diff"] == [{"knob": "gradient_checkpointing", "from": False, "to": True, "remedy": "checkpointing"}]


@pytest.mark.slow
def test_optimizer_8bit(tmp_path, tiny_model):
    out, rep = grpo(tmp_path, tiny_model, "64MiB", *FLOOR)
    a = assert_rung_fixed_it(out, rep, "optimizer_8bit")
    assert "checkpointing" in {s["remedy"] for s in a[0]["skipped"]}  # in force by default, or no use in this phase
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"optim": "adamw_bnb_8bit"}


@pytest.mark.slow
def test_lora(tmp_path, tiny_model):
    out, rep = grpo(tmp_path, tiny_model, "48MiB", *FLOOR, "--optim", "adamw_bnb_8bit")
    assert_rung_fixed_it(out, rep, "lora")
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"lora_r": 16, "lora_alpha": 32,
                                                        "lora_target_modules": "all-linear"}


@pytest.mark.slow
def test_load_4bit_with_the_scripts_own_lora(tmp_path, tiny_model):
    out, rep = grpo(tmp_path, tiny_model, "36MiB", *FLOOR, "--optim", "adamw_bnb_8bit", "--lora-r", "8")
    a = assert_rung_fixed_it(out, rep, "load_4bit")
    assert "already in force" in {s["remedy"]: s["reason"] for s in a[0]["skipped"]}["lora"]
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"load_in_4bit": True, "dtype": "bfloat16"}
    assert rep["original"]["lora_r"] == 8  # what the script set, recorded from its peft_config


def write_lock(tmp: Path, **overrides) -> Path:
    lock = tmp / "stable.lock.json"
    lock.write_text(json.dumps({"schema": "oomguard.lock/1", "overrides": overrides}))
    return lock


@pytest.mark.core
def test_lock_file_replays_without_climbing(tmp_path, tiny_model):
    """Every value of the lock is what trains, one that equals TRL's default included: the script accumulates 2
    micro-batches, the lock 1 (TRL's default, which a plan computed against TRL's defaults dropped: issue 45), and the
    report's stable config is what the training process said it ran. Also: a script that saves no checkpoints is
    told how to lose fewer steps, and the trainer is found by its interpreter's path with no python on PATH."""
    lock = write_lock(tmp_path, max_completion_length=64, gradient_accumulation_steps=1)
    out, rep = grpo(tmp_path, tiny_model, "118MiB", "--max-completion-length", "128", "--gradient-accumulation-steps",
                    "2", env=env_without_launchers(), extra=("--no-probe", "--config", str(lock)))
    assert rep["status"] == "stable" and len(rep["attempts"]) == 1, out.stderr[-3000:]
    assert "gradient_accumulation_steps=1 max_completion_length=64" in out.stdout  # the trainer's own arguments
    assert {k: rep["stable"][k] for k in ("max_completion_length", "gradient_accumulation_steps")} == \
        {"max_completion_length": 64, "gradient_accumulation_steps": 1}
    ran = [e for e in events_of(tmp_path, 1) if e["event"] == "ran"][-1]["knobs"]
    assert (ran["max_completion_length"], ran["gradient_accumulation_steps"]) == (64, 1)
    assert rep["diff"] == [{"knob": "max_completion_length", "from": 128, "to": 64, "remedy": "lock"},
                           {"knob": "gradient_accumulation_steps", "from": 2, "to": 1, "remedy": "lock"}]
    assert "saves no checkpoints" in out.stderr and "--checkpoint-every" in out.stderr


def test_a_lock_that_no_longer_fits_is_reported_not_climbed(tmp_path):
    """The supervisor's side of a lock that stopped fitting: one attempt, exit 75, the way out. (The same with real
    TRL is the slow test below; that a lock reaches GRPOConfig is shown by the replay test above.)"""
    lock = write_lock(tmp_path, max_completion_length=64)
    alloc = "import torch; x = torch.empty(100 * 2**20, dtype=torch.uint8)"  # 100 MiB on a 60 MiB device
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "60MiB", "--no-probe", "--config", str(lock), "--",
                            sys.executable, "-c", alloc)
    assert out.returncode == 75 and rep["status"] == "exhausted" and len(rep["attempts"]) == 1, out.stderr[-3000:]
    assert rep["attempts"][0]["outcome"] == "oom" and "without --config" in rep["message"]


@pytest.mark.slow
def test_a_lock_that_no_longer_fits_a_real_grpo_run_is_reported_not_climbed(tmp_path, tiny_model):
    """Slow: the test above shows the same on the supervisor's side in 3 s, the replay test that a lock reaches
    TRL's GRPOConfig."""
    lock = write_lock(tmp_path, max_completion_length=64)
    out, rep = grpo(tmp_path, tiny_model, "60MiB", "--max-completion-length", "128", extra=("--no-probe", "--config", str(lock)))
    assert out.returncode == 75 and rep["status"] == "exhausted" and len(rep["attempts"]) == 1
    assert "without --config" in rep["message"]


@pytest.mark.core
def test_probe_finds_the_worst_case_first_and_saves_nothing(tmp_path, tiny_model):
    """Two prompts are 8x longer than the rest. The probe trains on exactly those, at full completion length, so the
    OOM they cause comes in the first minute; the fix (dropping the prompt tail) is probed, then the real run starts.
    The probes write no checkpoints into the script's output directory."""
    # byte-exact budgets: TRL 1.15 on (the fused head) scores every prompt position on the CPU, so long prompts weigh
    # more there; under TRL 0.29-1.14 the prompts are made 3x longer for the same contrast (tests/compat.sh)
    budget, words = by_head(fused=("100MiB", "8"), logits=("84MiB", "24"))
    out, rep = grpo(tmp_path, tiny_model, budget, "--rows", "64", "--long-prompts", "2", "--save-steps", "1",
                    "--prompt-words", words, extra=("--no-predict", "--probe-steps", "2", "--ladder", "fastest"))
    kinds = [(a["kind"], a["outcome"]) for a in rep["attempts"]]
    assert kinds == [("probe", "oom"), ("probe", "ok"), ("run", "ok")], kinds
    assert rep["status"] == "stable"
    # what was live at the OOM, as the training process counted it: the long prompts' step, not the weights and the
    # optimizer's state, ran out (issue 46: the diagnosis comes from what is live, not from the request's size)
    oom = rep["attempts"][0]["oom"]
    live = oom["live_bytes"]
    assert live["source"] == "tally" and live["parameters"] > 0 and live["optimizer"] > 0, live
    assert (oom["kind"], oom["short_of"]) == ("shortfall", "activations"), oom["evidence"]
    assert rep["attempts"][0]["climbed"] == "shorter_sequences"
    assert "max_prompt_tokens" in {r["knob"] for r in rep["diff"]}
    assert "dropped 2 of 66 prompts" in out.stderr
    events = (tmp_path / "wd").glob("runs/*/attempt-1/events.jsonl")
    probe_events = [json.loads(line) for line in next(events).read_text().splitlines()]
    begin = next(e for e in probe_events if e["event"] == "train_begin")
    assert begin["max_steps"] == 2 and "oomguard-probe" in begin["output_dir"]
    saved = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == ["checkpoint-1", "checkpoint-2"]  # from the real run only


@pytest.mark.slow
def test_guided_climb_reaches_stable_with_one_oom_and_minimize_keeps_only_what_is_needed(tmp_path, tiny_model):
    """At 48 MiB a plain walk needs three OOMs (fewer generations, then 8-bit Adam, then LoRA). The memory model
    stops the user's config before it generates, chooses below the ladder prefix predicted to fit, and --minimize
    then proves with probes that each rung left is needed.

    Slow: the default run's test_choose_e2e.py takes the same configuration (48 MiB, completions of 64) through the
    pre-flight stop and the guided choice and checks the choice keeps only what is needed; what this adds is
    --minimize's undo probes (five launches more)."""
    out, rep = grpo(tmp_path, tiny_model, "48MiB", "--max-completion-length", "64",
                    extra=("--probe-steps", "2", "--minimize", "--ladder", "fastest"))
    attempts = rep["attempts"]
    assert rep["status"] == "stable", rep["message"]
    first_ok = next(i for i, a in enumerate(attempts) if a["outcome"] == "ok")
    assert [a["outcome"] for a in attempts[:first_ok]] == ["predicted"]  # one pre-flight stop, then a fitting config
    assert attempts[0]["climbed"].count("+") >= 2  # several rungs in one go: a plain walk tries them one by one
    assert "fewer rungs would not be enough" in out.stderr
    assert attempts[0]["predicted_bytes"] is not None and attempts[first_ok]["predicted_bytes"] <= 48 * 2**20
    minimized = [a for a in attempts if a["kind"] == "minimize"]
    assert minimized and all(a["note"] for a in minimized)
    final = attempts[-1]
    assert final["kind"] == "run" and final["outcome"] == "ok"
    assert "load_4bit" not in final["remedies"]  # predicted necessary, found unnecessary
    assert {"fewer_generations", "lora"} <= set(final["remedies"])
