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


# ---------------------------------------------------------------------------------------------------------------
# The knob table: each knob declared once, the rest derived from it


def test_every_field_is_one_entry_of_the_table_with_its_real_type():
    import typing
    from dataclasses import fields

    from oomguard.vocab.knobtable import POINTS, TABLE

    assert [f.name for f in fields(Knobs)] == list(TABLE)
    hints = typing.get_type_hints(Knobs)
    for name, info in TABLE.items():
        assert info.meaning and info.reaches and set(info.reaches) <= set(POINTS), name
        assert info.hint == hints[name] and type(None) in typing.get_args(hints[name]), name
        assert getattr(TRL_DEFAULTS, name) == info.trl, name
    kinds = {n: i.kind for n, i in TABLE.items()}
    assert kinds["gradient_checkpointing"] is bool and kinds["reduce_bucket_size"] is int
    assert kinds["beta"] is float and kinds["optim"] is str and kinds["lora_target_modules"] is tuple


def test_the_derived_tables_say_what_the_entries_say():
    from oomguard.child.config import CONFIG_KNOBS
    from oomguard.cli import KNOB_MEANINGS
    from oomguard.vocab.knobs import DS_SIZE_KNOBS, REACH, STACK_ONLY
    from oomguard.vocab.knobtable import TABLE

    assert set(CONFIG_KNOBS) == {n for n, i in TABLE.items() if i.grpo_field}
    assert set(CONFIG_KNOBS) <= REACH["config"] and "zero_stage" not in CONFIG_KNOBS  # a DeepSpeed config key
    assert REACH["model"] == {"dtype", "load_in_4bit"} and REACH["env"] == {"expandable_segments", "max_split_size_mb"}
    assert DS_SIZE_KNOBS == ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    assert {"offload_during_generation"} == STACK_ONLY
    assert {n: i.meaning for n, i in TABLE.items()} == KNOB_MEANINGS


def test_the_grpo_fields_are_grpo_config_s_own():
    import dataclasses

    import trl

    from oomguard.child.config import CONFIG_KNOBS

    assert set(CONFIG_KNOBS) <= {f.name for f in dataclasses.fields(trl.GRPOConfig)}


def _edges(info):
    """A value at each end of a knob's range and one just outside it."""
    if info.allowed:
        return list(info.allowed), ["nonsense"]
    if info.minimum is not None:
        return [info.minimum, info.minimum + 8], [info.minimum - 1]
    if info.above is not None:
        inside = info.maximum if info.maximum is not None else info.above + 1
        return [inside], [info.above] + ([info.maximum + 1] if info.maximum is not None else [])
    return [], []


def test_every_range_in_the_table_is_checked_where_values_come_from_outside():
    from oomguard.vocab.knobs import check_values
    from oomguard.vocab.knobtable import TABLE

    base = TRL_DEFAULTS.replace(lora_r=8)  # so that a 4-bit load has its LoRA
    checked = 0
    for name, info in TABLE.items():
        inside, outside = _edges(info)
        for v in inside:  # (GRPO's batch rules may still refuse a value inside its range, with these defaults)
            assert not [p for p in check_values({name: v}, base=base) if p.startswith(f"{name} must be")], (name, v)
        for v in outside:
            problems = check_values({name: v}, base=base)
            assert problems and problems[0].startswith(f"{name} must be"), (name, v, problems)
            assert base.replace(**{name: v}).validate(), (name, v)  # the same rule holds for any Knobs
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("name, text, value", [
    ("max_split_size_mb", "128", 128), ("beta", "0.04", 0.04), ("use_vllm", "on", True), ("dtype", "bfloat16",
                                                                                            "bfloat16"),
    ("reduce_bucket_size", "5e7", 50_000_000), ("reduce_bucket_size", "AUTO", "auto"), ("lora_r", "none", None),
])
def test_parse_knob_reads_the_type_the_table_gives(name, text, value):
    assert parse_knob(name, text) == value


def test_a_type_the_table_does_not_give_is_refused_in_its_words():
    from oomguard.vocab.knobs import check_values

    assert check_values({"reduce_bucket_size": "big"}) == ['reduce_bucket_size must be a number of elements or "auto", '
                                                             "not 'big'"]
    assert check_values({"lora_target_modules": ["q_proj", 3]})[0].startswith("lora_target_modules must be a list")
    assert check_values({"lora_target_modules": ".*proj"}) == []  # a pattern, as PEFT takes one
    with pytest.raises(ValueError, match="reduce_bucket_size takes a number of elements"):
        parse_knob("reduce_bucket_size", "big")
