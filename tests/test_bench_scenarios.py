"""bench/scenarios.py's pure parts: what it counts in a report, how it undoes one remedy in a lock, how it judges
minimality and prints the table. No GRPO runs: the bench itself runs those."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from helpers import load_bench

ROOT = Path(__file__).resolve().parents[1]
sc = load_bench("scenarios")

# A stable lock as `oomguard run` writes it after the default ladder's prefix walk reached the 8-bit optimizer.
DIFF = [
    {"knob": "expandable_segments", "from": False, "to": True, "remedy": "expandable_segments"},
    {"knob": "max_completion_length", "from": 128, "to": 64, "remedy": "shorter_sequences"},
    {"knob": "num_generations", "from": 4, "to": 2, "remedy": "fewer_generations"},
    {"knob": "per_device_train_batch_size", "from": 4, "to": 2, "remedy": "fewer_generations"},
    {"knob": "optim", "from": "adamw_torch", "to": "adamw_bnb_8bit", "remedy": "optimizer_8bit"},
    {"knob": "lora_r", "from": None, "to": 16, "remedy": "lora"},
    {"knob": "lora_alpha", "from": None, "to": 32, "remedy": "lora"},
]
LOCK = {
    "schema": "oomguard.lock/1", "command": ["python", "train.py"], "ladder": "default",
    "overrides": {r["knob"]: r["to"] for r in DIFF},
    "original": {"max_completion_length": 128, "num_generations": 4, "per_device_train_batch_size": 4,
                 "optim": "adamw_torch", "lora_r": None, "lora_alpha": None, "expandable_segments": False},
    "stable": {r["knob"]: r["to"] for r in DIFF},
    "diff": DIFF,
}


def test_doctests():
    assert doctest.testmod(sc).failed == 0


def test_a_remedy_that_changed_several_knobs_is_undone_as_one():
    groups = dict(sc.undo_groups(DIFF))
    assert list(groups) == ["expandable_segments", "shorter_sequences", "fewer_generations", "optimizer_8bit", "lora"]
    assert [r["knob"] for r in groups["fewer_generations"]] == ["num_generations", "per_device_train_batch_size"]
    assert [r["knob"] for r in groups["lora"]] == ["lora_r", "lora_alpha"]


def test_undo_sets_the_users_original_value_not_a_midpoint_and_leaves_the_rest():
    rows = dict(sc.undo_groups(DIFF))
    shorter = sc.undo_lock(LOCK, rows["shorter_sequences"])
    assert shorter["overrides"]["max_completion_length"] == 128
    assert shorter["stable"]["max_completion_length"] == 128  # the lock stays self-consistent for the loader
    assert {k: v for k, v in shorter["overrides"].items() if k != "max_completion_length"} == \
        {k: v for k, v in LOCK["overrides"].items() if k != "max_completion_length"}
    assert "max_completion_length" not in {r["knob"] for r in shorter["diff"]}
    gens = sc.undo_lock(LOCK, rows["fewer_generations"])
    assert (gens["overrides"]["num_generations"], gens["overrides"]["per_device_train_batch_size"]) == (4, 4)
    lora = sc.undo_lock(LOCK, rows["lora"])  # an original of None: the override goes, the user's value applies
    assert "lora_r" not in lora["overrides"] and "lora_alpha" not in lora["overrides"]
    assert lora["schema"] == LOCK["schema"] and lora["command"] == LOCK["command"]
    assert LOCK["overrides"]["max_completion_length"] == 64 and LOCK["overrides"]["lora_r"] == 16  # not mutated
    json.dumps(lora)  # written as a lock file


def test_rows_that_are_not_knobs_cannot_be_undone_by_a_lock():
    rows = [{"knob": "deepspeed config", "from": None, "to": "/tmp/ds.json", "remedy": "zero2"}]
    assert sc.undo_lock(LOCK, rows) is None
    assert sc.undo_lock(LOCK, rows, frozenset({"optim"})) is None


def test_minimality_names_each_needless_change_and_never_guesses():
    checks = [{"remedy": "shorter_sequences", "result": "fits"}, {"remedy": "fewer_generations", "result": "fits"},
              {"remedy": "optimizer_8bit", "result": "oom"}]
    assert sc.minimal_verdict(checks) == "no: shorter_sequences, fewer_generations needless"
    assert sc.minimal_verdict([{"remedy": "optimizer_8bit", "result": "oom"}]) == "yes"
    # a pre-flight stop is a prediction, not a measurement: no verdict from it
    assert sc.minimal_verdict([{"remedy": "lora", "result": "predicted"}]).startswith("unknown")
    assert sc.minimal_verdict(None) == ""  # not checked (the run did not become stable)


def test_report_counts_launches_real_ooms_and_predicted_stops_apart():
    rep = {"status": "stable", "device": {"capacity": 200 * sc.MiB},
           "attempts": [{"kind": "probe", "outcome": "predicted"}, {"kind": "probe", "outcome": "oom"},
                        {"kind": "probe", "outcome": "ok"}, {"kind": "minimize", "outcome": "oom"},
                        {"kind": "run", "outcome": "ok", "peak_bytes": 150 * sc.MiB}],
           "diff": DIFF[4:5]}
    s = sc.summarise(rep, None)
    assert (s["launches"], s["ooms"], s["predicted"], s["peak_fraction"]) == (5, 2, 1, 0.75)
    assert (s["trials"], s["trial_ooms"]) == (1, 1)
    assert s["diff"] == "optim=adamw_bnb_8bit"
    assert s["trail"] == "probe:predicted → probe:oom → probe:ok → minimize:oom → run:ok"


def test_a_report_missing_fields_gives_blanks_not_a_crash():
    assert sc.summarise(None, 100)["launches"] is None
    s = sc.summarise({"status": "stable", "attempts": [{"outcome": "ok"}]}, 100)  # no peak, no diff
    assert (s["launches"], s["ooms"], s["peak_fraction"], s["diff"]) == (1, 0, None, None)
    table = sc.format_table([{"scenario": "x", "strategy": "guided", **s}])
    assert table.splitlines()[-1] == "| x | guided | stable | 1 | 0 | 0 | 0 |  |  |  |  |  |"


def test_table_is_markdown_with_one_scenario_label_per_group_and_escaped_pipes():
    rows = [{"scenario": "a", "strategy": "default", "status": "stable", "launches": 3, "ooms": 1, "predicted": 0,
             "wall": 40.04, "peak_fraction": 0.83, "diff": "C=64|x", "minimal": "yes", "misses": ""},
            {"scenario": "a", "strategy": "guided", "status": "exhausted"},
            {"scenario": "b", "strategy": "default", "status": "stable"}]
    lines = sc.format_table(rows).splitlines()
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert len({line.count(" | ") for line in lines if not line.startswith("|-")}) == 1  # same column count
    assert lines[2] == "| a | default | stable | 3 |  | 1 | 0 | 40.0 s | 83% | C=64\\|x | yes |  |"
    assert lines[3].startswith("|  | guided |") and lines[4].startswith("| b | default |")


def test_targets_count_the_pre_flight_and_the_launches():
    assert sc.missed_targets({"status": "stable", "ooms": 0, "first_predicted": True, "launches": 3,
                              "minimal": "yes"}) == ""
    assert sc.missed_targets({"status": "stable", "ooms": 1, "first_predicted": True, "launches": 4,
                              "minimal": "no: lora needless"}) == "OOMs 1>0, launches 4>3, not minimal"
    # an undo trial's launch and OOM buy the minimal diff where the model is unsure: not held against the targets
    assert sc.missed_targets({"status": "stable", "ooms": 1, "trial_ooms": 1, "trials": 1, "first_predicted": True,
                              "launches": 4, "minimal": "yes"}) == ""


def test_selectors_take_keys_or_parts_of_names_and_refuse_unknown_ones():
    keys = [s.key for s in sc.SCENARIOS]
    assert "weights" in keys
    assert sc.select(list(sc.STRATEGIES), ["guided"], "strategy") == ["guided"]  # exact beats substring
    assert sc.select(list(sc.STRATEGIES), ["minimize"], "strategy") == ["guided --minimize"]
    with pytest.raises(SystemExit, match="no strategy matches"):
        sc.select(list(sc.STRATEGIES), ["fastest"], "strategy")


def test_strategies_use_probes_as_users_get_them():
    for name, flags in sc.STRATEGIES.items():
        assert "--no-probe" not in flags and "--probe-steps" not in flags, name
    assert sc.STRATEGIES["guided"] == ("--ladder", "default")
