"""End to end, with real TRL on CPU and the simulated device: a lock replayed, the probe's worst case; and every
rung of the fastest ladder (the design card's order) reaching the training process and training.

Each rung's changes reach the training process and the run trains with them: one launch applies the changes of a
whole climb to the top of the fastest ladder, as the lock of that climb (its diff names the rung behind each change),
and the training process says what it ran (its ``ran`` events: the config, model and trainer it built) and what it
trained with (tests/scripts/grpo_tiny.py's last line: the optimizer's class, the LoRA rank, 4-bit weights, gradient
checkpointing, the simulated allocator's settings). Two climbs, because two rungs stand in for others: the allocator's
empty_cache where the user keeps expandable segments off, and a 4-bit load under the script's own LoRA.

Until 2026-11-29 each rung had a test of its own (8 `slow` tests, each two launches of real TRL: a first attempt that
ran out of memory at a budget from ``bench/min_budget.py``, one rung climbed, a second that fit). What each proved is
now proven by parts:
- that a rung's overrides reach the training process and it trains with them, and that the diff names the rung:
  test_every_rung_of_a_climb_reaches_the_training_process_and_trains below (2 launches instead of 16), with
  test_a_climb_to_the_top_of_the_fastest_ladder_writes_this_lock (the climb behind each lock, in milliseconds);
- which rung a diagnosis climbs and why the others are passed over (a floor reached, already in force, no
  fragmentation, the user's own allocator setting): that test and tests/test_ladder.py;
- every ladder step's overrides in TRL's real GRPOConfig: tests/test_grpo_config_validity.py; each knob class of a
  lock reaching TRL's real GRPOTrainer and from_pretrained in-process: tests/test_lock_replay.py;
- a real OOM read, diagnosed and climbed end to end, per process tree: the default run's
  test_probe_finds_the_worst_case_first_and_saves_nothing (``python``: shorter sequences after a real OOM) and
  tests/test_launchers_resume.py's test_torchrun_two_ranks_on_the_simulated_device (torchrun's two ranks: fewer
  generations); the simulated device's own fragmentation OOM read as fragmentation, whose rung is expandable
  segments: tests/test_simulate.py; the supervisor keeping the user's ``expandable_segments:False`` and climbing
  empty_cache instead: tests/test_run_process.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import by_head, env_without_launchers, events_of, grpo_tiny, run_oomguard, story


def grpo(tmp: Path, model: str, budget: str, *args: str, env: dict | None = None,
         extra: tuple = ("--no-probe", "--no-predict", "--ladder", "fastest")):
    out, rep = run_oomguard(tmp, "--simulate-gpu", budget, *extra, "--", *grpo_tiny(model, tmp / "out", *args),
                            env=env)
    assert rep is not None, out.stderr[-3000:]
    return out, rep


@dataclass(frozen=True)
class Climbed:
    """A climb to the top of the fastest ladder: the script's flags (tests/scripts/grpo_tiny.py) and the environment
    it runs in, the values the script sets that the rungs change (what its training process reports), each change
    with the rung behind it, the rungs passed over with a word of why, and what the run then trains with."""

    script: tuple[str, ...]
    observed: dict
    changes: dict  # knob -> (value, rung)
    passed_over: dict  # rung -> a word of its reason
    trained_with: str
    env: dict = field(default_factory=dict)


CLIMBS = {
    # every rung of the design card, from a script that turns checkpointing off
    "every-rung": Climbed(
        script=("--max-completion-length", "128", "--no-gradient-checkpointing"),
        observed={"max_completion_length": 128, "num_generations": 4, "per_device_train_batch_size": 4,
                  "gradient_checkpointing": False, "optim": "adamw_torch", "dtype": "float32"},
        changes={"expandable_segments": (True, "expandable_segments"),
                 "max_completion_length": (64, "shorter_sequences"),
                 "num_generations": (2, "fewer_generations"), "per_device_train_batch_size": (2, "fewer_generations"),
                 "gradient_checkpointing": (True, "checkpointing"), "optim": ("adamw_bnb_8bit", "optimizer_8bit"),
                 "lora_r": (16, "lora"), "lora_alpha": (32, "lora"), "lora_target_modules": ("all-linear", "lora"),
                 "load_in_4bit": (True, "load_4bit"), "dtype": ("bfloat16", "load_4bit")},
        passed_over={"empty_cache": "no fragmentation"},
        trained_with="trained with optimizer=bitsandbytes.AdamW states_8bit=True lora_r=16 weights_4bit=True "
                     "gradient_checkpointing=True expandable_segments=True max_split_size_mb=None"),
    # the user keeps expandable segments off, and the script has its own LoRA and 8-bit Adam, at the floors
    "users-own-allocator-and-lora": Climbed(
        script=("--max-completion-length", "64", "--num-generations", "2", "--per-device-train-batch-size", "2",
                "--optim", "adamw_bnb_8bit", "--lora-r", "8"),
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
        observed={"max_completion_length": 64, "num_generations": 2, "per_device_train_batch_size": 2,
                  "gradient_checkpointing": True, "optim": "adamw_bnb_8bit", "dtype": "float32", "lora_r": 8,
                  "lora_alpha": 16, "lora_target_modules": "all-linear"},
        changes={"torch_empty_cache_steps": (1, "empty_cache"), "max_split_size_mb": (21, "empty_cache"),
                 "load_in_4bit": (True, "load_4bit"), "dtype": ("bfloat16", "load_4bit")},
        passed_over={"expandable_segments": "oomguard keeps it", "shorter_sequences": "floor",
                     "fewer_generations": "floor", "checkpointing": "already in force",
                     "optimizer_8bit": "already in force", "lora": "already in force"},
        trained_with="trained with optimizer=bitsandbytes.AdamW states_8bit=True lora_r=8 weights_4bit=True "
                     "gradient_checkpointing=True expandable_segments=False max_split_size_mb=21"),
}


@pytest.mark.parametrize("name", list(CLIMBS))
def test_a_climb_to_the_top_of_the_fastest_ladder_writes_this_lock(name):
    """The script's config runs out of memory to fragmentation first, then short of memory until the ladder ends:
    one rung per OOM, each passed-over rung with its reason, and the diff names the rung behind each change (what
    the lock replayed below carries)."""
    from oomguard.decide.climb import Climb
    from oomguard.decide.ladder import load_ladder
    from oomguard.oom.diagnose import diagnose
    from oomguard.vocab import allocconf
    from oomguard.vocab.facts import RunFacts
    from oomguard.vocab.oomreport import OOMReport
    from oomguard.vocab.sizes import MiB

    case = CLIMBS[name]
    # on the 64 MiB device the lock is replayed on (empty_cache keeps blocks of 1/32 of it whole, 21 MiB at least)
    frag = diagnose(OOMReport("cuda", "allocator", "x", requested=4 * MiB, capacity=64 * MiB, free=1 * MiB,
                              reserved_unallocated=8 * MiB))
    short = diagnose(OOMReport("cuda", "allocator", "x", requested=16 * MiB, capacity=64 * MiB, free=4 * MiB,
                               reserved_unallocated=0), phase="forward")
    user = allocconf.user_settings(case.env)
    climb = Climb(load_ladder("fastest"), env_knobs={"expandable_segments": bool(user.expandable_segments)},
                  facts=RunFacts(alloc_conf_locked=user.locked_text()))
    climb.observe(case.observed)
    climbed, skipped, diag = [], {}, frag
    while not (d := climb.choose_next(diag)).exhausted:
        climbed += [s.remedy.name for s in d.steps]
        skipped.update({n: why for n, why in d.skipped.items() if n not in skipped})
        diag = short
    rungs = list(dict.fromkeys(rung for _value, rung in case.changes.values()))
    assert climbed == rungs, skipped
    for rung, why in case.passed_over.items():
        assert why in skipped[rung], (rung, skipped[rung])
    final = climb.effective()[0]
    assert climb.overrides(final) == {k: v for k, (v, _rung) in case.changes.items()}
    diff = climb.report("stable", "", 0).diff
    assert {r["knob"]: (r["to"], r["remedy"]) for r in diff} == case.changes


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLIMBS))
def test_every_rung_of_a_climb_reaches_the_training_process_and_trains(tmp_path, tiny_model, name):
    """The lock of a climb to the top of the fastest ladder, replayed: the training process runs every change (its
    ``ran`` events), trains with it (the optimizer, LoRA, 4-bit weights, checkpointing, the allocator's settings),
    and the report's diff names the rung behind each change. What else the 8 per-rung tests this replaced proved:
    the module's docstring."""
    case = CLIMBS[name]
    lock = tmp_path / "climbed.lock.json"
    lock.write_text(json.dumps({
        "schema": "oomguard.lock/1", "overrides": {k: v for k, (v, _rung) in case.changes.items()},
        "original": case.observed, "stable": {**case.observed, **{k: v for k, (v, _rung) in case.changes.items()}},
        "diff": [{"knob": k, "from": case.observed.get(k), "to": v, "remedy": rung}
                 for k, (v, rung) in case.changes.items()]}))
    out, rep = grpo(tmp_path, tiny_model, "64MiB", *case.script, env=case.env,
                    extra=("--no-probe", "--config", str(lock)))
    assert rep["status"] == "stable" and out.returncode == 0, (story(rep), out.stderr[-3000:])
    assert [a["outcome"] for a in rep["attempts"]] == ["ok"], story(rep)
    ran = [e for e in events_of(tmp_path, 1) if e["event"] == "ran"][-1]["knobs"]
    in_config = {k: v for k, (v, _rung) in case.changes.items() if k not in ("expandable_segments",
                                                                              "max_split_size_mb")}
    assert {k: ran.get(k) for k in in_config} == in_config  # the allocator's two: the line below
    assert "trained 2 steps" in out.stdout and case.trained_with in out.stdout, out.stdout[-2000:]
    assert {r["knob"]: (r["to"], r["remedy"]) for r in rep["diff"]} == case.changes
    assert {k: rep["original"][k] for k in case.observed} == case.observed  # the script's own, as it set them
    assert "What oomguard changed" in out.stderr


def write_lock(tmp: Path, **overrides) -> Path:
    lock = tmp / "stable.lock.json"
    lock.write_text(json.dumps({"schema": "oomguard.lock/1", "overrides": overrides}))
    return lock


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_lock_that_no_longer_fits_is_reported_not_climbed(tmp_path):
    """The supervisor's side of a lock that stopped fitting: one attempt, exit 75, the way out. (The same with real
    TRL is the slow test below; that a lock reaches GRPOConfig is shown by the replay test above.)"""
    lock = write_lock(tmp_path, max_completion_length=64)
    alloc = "import torch; x = torch.empty(100 * 2**20, dtype=torch.uint8)"  # 100 MiB on a 60 MiB device
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "60MiB", "--no-probe", "--config", str(lock), "--",
                            sys.executable, "-c", alloc)
    assert out.returncode == 75 and rep["status"] == "exhausted" and len(rep["attempts"]) == 1, out.stderr[-3000:]
    assert rep["attempts"][0]["outcome"] == "oom" and "without --config" in rep["message"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_lock_that_no_longer_fits_a_real_grpo_run_is_reported_not_climbed(tmp_path, tiny_model):
    """Slow: the test above shows the same on the supervisor's side in 3 s, the replay test that a lock reaches
    TRL's GRPOConfig."""
    lock = write_lock(tmp_path, max_completion_length=64)
    out, rep = grpo(tmp_path, tiny_model, "60MiB", "--max-completion-length", "128", extra=("--no-probe", "--config", str(lock)))
    assert out.returncode == 75 and rep["status"] == "exhausted" and len(rep["attempts"]) == 1
    assert "without --config" in rep["message"]


@pytest.mark.e2e
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
    # the kind follows what was live: TRL 1.x's step holds most of it (activations); TRL 0.29's, at this budget, a
    # little less than the state's half (the long-lived state, small allocations)
    from oomguard.vocab.diagnosis import STATE_SHARE, Live

    held = Live.of(live)
    state_holds = held.state >= STATE_SHARE * (held.total + oom["requested_bytes"])
    assert (oom["kind"], oom["short_of"]) == (("small-allocations", "long-lived state") if state_holds else
                                              ("shortfall", "activations")), (live, oom["evidence"])
    import trl

    assert state_holds is trl.__version__.startswith("0."), live
    assert rep["attempts"][0]["climbed"] == "shorter_sequences"
    assert "max_prompt_tokens" in {r["knob"] for r in rep["diff"]}
    assert "dropped 2 of 66 prompts" in out.stderr
    events = (tmp_path / "wd").glob("runs/*/attempt-1/events.jsonl")
    probe_events = [json.loads(line) for line in next(events).read_text().splitlines()]
    begin = next(e for e in probe_events if e["event"] == "train_begin")
    assert begin["max_steps"] == 2 and "oomguard-probe" in begin["output_dir"]
    saved = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == ["checkpoint-1", "checkpoint-2"]  # from the real run only
