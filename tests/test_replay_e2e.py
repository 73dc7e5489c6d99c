"""A lock replays as exactly what it recorded, end to end (issue 39's done-when): a cookbook-style client (a script
that loads its own model, gives GRPOTrainer a LoRA config) whose lock changes the batch and the load's dtype replays
from its lock, and from the lock that replay wrote, with the same config, the same peak and no OOM; each report's
original is the script's (float32), and the diff and each lock carry the dtype. The lock also holds a value equal to
TRL's default where the script sets another (num_generations: the script 4, the lock 8, TRL's default): each replay
trains with it (issue 45). The per-knob-class halves are tests/test_lock_replay.py's."""

from __future__ import annotations

import json

import pytest

from helpers import PYTHON, SCRIPTS, run_oomguard

pytestmark = pytest.mark.e2e

CLIENT = str(SCRIPTS / "clients" / "cookbook.py")
LOCK = {"schema": "oomguard.lock/1", "command": [], "ladder": "default", "world_size": 1,
        "overrides": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "dtype": "bfloat16",
                      "num_generations": 8},
        "diff": [{"knob": "num_generations", "from": 4, "to": 8, "remedy": "lock"},
                 {"knob": "per_device_train_batch_size", "from": 8, "to": 4, "remedy": "micro_batch"},
                 {"knob": "gradient_accumulation_steps", "from": 1, "to": 2, "remedy": "micro_batch"},
                 {"knob": "dtype", "from": "float32", "to": "bfloat16", "remedy": "bf16_load"}]}


def replay(tmp, lock_path, model):
    tmp.mkdir()
    out, rep = run_oomguard(tmp, "--simulate-gpu", "1GiB", "--config", str(lock_path), "--",
                            PYTHON, CLIENT, model, str(tmp / "out"))
    assert out.returncode == 0 and rep["status"] == "stable", out.stderr[-3000:]
    assert "steps with 4 x 2 rows and 8 generations" in out.stdout  # what the script's trainer trained with
    return rep, json.loads((tmp / "lock.json").read_text())


def test_a_replayed_lock_replays_again_as_the_same_config(tmp_path, tiny_model):
    first = tmp_path / "first.lock.json"
    first.write_text(json.dumps(LOCK))
    rep1, lock1 = replay(tmp_path / "a", first, tiny_model)
    rep2, lock2 = replay(tmp_path / "b", tmp_path / "a" / "lock.json", tiny_model)
    for rep, lock in ((rep1, lock1), (rep2, lock2)):
        assert [a["outcome"] for a in rep["attempts"]] == ["ok"]
        assert rep["original"]["dtype"] == "float32" and rep["stable"]["dtype"] == "bfloat16"  # the script's own
        assert rep["facts"]["lora_dropout"] == 0.1  # its LoRA's dropout, which the memory model counts
        assert (rep["original"]["num_generations"], rep["stable"]["num_generations"]) == (4, 8)
        assert lock["overrides"] == LOCK["overrides"]
        assert {r["knob"]: r["remedy"] for r in rep["diff"]} == {r["knob"]: r["remedy"] for r in LOCK["diff"]}
    assert rep1["attempts"][0]["peak_bytes"] == rep2["attempts"][0]["peak_bytes"]
    assert (lock1["original"], lock1["stable"], lock1["diff"]) == (lock2["original"], lock2["stable"], lock2["diff"])
