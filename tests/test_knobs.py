"""Knobs: immutable, GRPO's batch rules, the diff, and command-line parsing."""

import pytest

from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, parse_knob, reachable


def test_knobs_are_immutable_and_replace_checks_names():
    k = Knobs(num_generations=4)
    with pytest.raises(AttributeError):
        k.num_generations = 2  # type: ignore[misc]
    with pytest.raises(KeyError):
        k.replace(nonsense=1)


def test_geometry_follows_trl():
    k = TRL_DEFAULTS.replace(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert k.geometry() == (4, 2, 2) and k.rows_per_device() == 8
    assert k.replace(steps_per_generation=3).rows_per_device() == 12
    assert k.replace(generation_batch_size=16).geometry(world_size=2) == (4, 2, 2)


@pytest.mark.parametrize("changes, problem", [
    (dict(per_device_train_batch_size=2, num_generations=8), "divisible by num_generations"),
    (dict(num_generations=1), "at least 2"),
    (dict(generation_batch_size=16, steps_per_generation=2), "cannot both be set"),
    (dict(generation_batch_size=10, per_device_train_batch_size=4), "divisible by the global batch"),
    (dict(load_in_4bit=True, lora_r=0), "needs LoRA"),
    (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization"),
    (dict(per_device_train_batch_size=0), "positive integer"),
])
def test_validate_names_the_broken_rule(changes, problem):
    assert any(problem in p for p in TRL_DEFAULTS.replace(**changes).validate())


def test_validate_accepts_the_research_examples():
    assert TRL_DEFAULTS.replace(per_device_train_batch_size=2, gradient_accumulation_steps=4).validate() == []
    assert TRL_DEFAULTS.replace(per_device_train_batch_size=4, steps_per_generation=2).validate() == []


def test_with_geometry_keeps_the_users_form():
    k = TRL_DEFAULTS.replace(generation_batch_size=16, per_device_train_batch_size=8)
    assert k.with_geometry(4, 2, 4).generation_batch_size == 16
    assert k.with_geometry(4, 2, 4).steps_per_generation is None
    assert TRL_DEFAULTS.with_geometry(4, 2, 2).steps_per_generation is None  # follows GA by default
    assert TRL_DEFAULTS.with_geometry(4, 1, 2).steps_per_generation == 2


def test_diff_rows_and_dict_round_trip():
    a = TRL_DEFAULTS
    b = a.replace(max_completion_length=256, lora_target_modules=("q_proj", "v_proj"))
    rows = a.diff(b)
    assert [r.knob for r in rows] == ["max_completion_length", "lora_target_modules"]
    assert rows[1].to_dict()["to"] == ["q_proj", "v_proj"]
    assert Knobs.from_dict(b.to_dict()) == b


def test_parse_knob_types_and_errors():
    assert parse_knob("num_generations", "4") == 4
    assert parse_knob("beta", "0.04") == 0.04
    assert parse_knob("load_in_4bit", "yes") is True
    assert parse_knob("lora_target_modules", "all-linear") == "all-linear"
    with pytest.raises(KeyError, match="unknown knob"):
        parse_knob("max_prompt_length", "1")
    with pytest.raises(ValueError, match="integer"):
        parse_knob("num_generations", "four")


def test_reach_of_construction_points():
    assert reachable(set()) == {"expandable_segments", "max_split_size_mb"}
    assert "max_completion_length" in reachable({"config"})
    assert "dtype" in reachable({"model"}) and "lora_r" not in reachable({"model"})


def test_the_static_optimizer_list_is_transformers_own():
    from transformers.training_args import OptimizerNames

    from oomguard.vocab.knobs import OPTIMIZER_NAMES

    assert {o.value for o in OptimizerNames} == OPTIMIZER_NAMES


def test_check_values_refuses_what_a_lock_may_hold_wrongly():
    from oomguard.vocab.knobs import check_values

    assert check_values({"num_generations": 4, "per_device_train_batch_size": 4, "optim": "adamw_bnb_8bit"}) == []
    assert check_values({"lora_target_modules": ["q_proj", "v_proj"], "dtype": "bfloat16", "beta": 0.04}) == []
    problems = check_values({"num_generations": -5, "optim": "fast"})
    assert any("num_generations" in p for p in problems) and any("optim" in p for p in problems)
    assert check_values({"vllm_mode": "remote"}) == ["vllm_mode must be colocate or server, not 'remote'"]
    assert check_values({"beta": True}) == ["beta must be a number, not True"]
