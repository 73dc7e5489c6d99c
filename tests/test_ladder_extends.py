"""A ladder built on another (``extends``): a rung is named once, in the ladder that first lists it; a user's ladder
may extend a shipped one (docs/how-to/custom-ladders.md). And a rung whose cost within its class is not declared is
refused when a ladder is loaded, never counted as free."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.decide.ladder import LadderBug, LadderError, load_ladder
from oomguard.strategies import REGISTRY, Remedy

# the shipped ladders' orders, as they were when each was a whole list of its own
DEFAULT = ["expandable_segments", "empty_cache", "eval_batch", "micro_batch", "generation_rounds", "checkpointing",
           "liger_kernel", "vllm_memory", "paged_cache", "deepspeed_buffers", "optimizer_8bit", "bf16_load", "lora",
           "load_4bit", "smaller_images", "fewer_generations", "shorter_sequences"]
ORDERS = {
    "default": DEFAULT,
    "multi-gpu": ["expandable_segments", "empty_cache", "eval_batch", "deepspeed_buffers", "zero2", "zero3",
                  "zero3_gather", "offload_optimizer", "offload_params", "fsdp_offload", "micro_batch",
                  "generation_rounds", "checkpointing", "liger_kernel", "vllm_memory", "paged_cache", "optimizer_8bit",
                  "bf16_load", "lora", "load_4bit", "smaller_images", "fewer_generations", "shorter_sequences"],
    "fastest": ["expandable_segments", "empty_cache", "deepspeed_buffers", "eval_batch", "paged_cache", "smaller_images",
                "shorter_sequences", "fewer_generations", "checkpointing", "liger_kernel", "optimizer_8bit", "lora",
                "load_4bit", "vllm_memory"],
    "quality-first": ["expandable_segments", "empty_cache", "deepspeed_buffers", "eval_batch", "bf16_load",
                      "micro_batch", "generation_rounds", "checkpointing", "liger_kernel", "optimizer_8bit", "lora",
                      "load_4bit", "vllm_memory", "paged_cache", "smaller_images", "fewer_generations",
                      "shorter_sequences"],
}


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_the_shipped_ladders_keep_their_orders(name):
    ladder = load_ladder(name)
    assert [r.name for r in ladder.rungs] == ORDERS[name]
    assert [r.name for r in ladder.host_rungs] == ["fewer_workers", "smaller_prefetch", "no_cpu_offload"]
    assert ladder.choose_by == ("order" if name in ("fastest", "quality-first") else "cost")
    assert ladder.max_passes == 3 and ladder.path is not None and ladder.path.stem == name


def test_a_users_ladder_extends_a_shipped_one(tmp_path: Path):
    """What a user writes to keep the default ladder but for a few rungs: drop bf16 weights, try LoRA (rank 8) before
    any split, and give smaller images up before the 8-bit optimizer."""
    p = tmp_path / "mine.toml"
    p.write_text('extends = "default"\nremove = ["bf16_load"]\n'
                 '[[rung]]\nremedy = "lora"\nr = 8\nbefore = "micro_batch"\n'
                 '[[rung]]\nremedy = "smaller_images"\nafter = "paged_cache"\n'
                 '[[rung]]\nremedy = "shorter_sequences"\nfactor = 0.75\n')
    ladder = load_ladder(str(p))
    names = [r.name for r in ladder.rungs]
    assert names[:5] == ["expandable_segments", "empty_cache", "eval_batch", "lora", "micro_batch"]
    assert names.index("smaller_images") == names.index("paged_cache") + 1 and "bf16_load" not in names
    assert names[-1] == "shorter_sequences" and len(names) == len(DEFAULT) - 1
    rungs = {r.name: r for r in ladder.rungs}
    assert rungs["lora"].p["r"] == 8 and rungs["shorter_sequences"].p["factor"] == 0.75
    assert rungs["fewer_generations"].p["min_generations"] == 2  # the base's parameters, where none are given
    assert ladder.name == "mine" and ladder.choose_by == "cost"  # the base's rule, its own name
    assert [r.name for r in ladder.host_rungs] == ["fewer_workers", "smaller_prefetch", "no_cpu_offload"]


def test_new_rungs_follow_the_one_listed_before_them_and_a_base_can_be_a_path(tmp_path: Path):
    (tmp_path / "base.toml").write_text('[[rung]]\nremedy = "expandable_segments"\n[[rung]]\nremedy = "lora"\n')
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "mine.toml"
    p.write_text('extends = "../base.toml"\nchoose_by = "order"\n'
                 '[[rung]]\nremedy = "micro_batch"\nafter = "expandable_segments"\n'
                 '[[rung]]\nremedy = "checkpointing"\n[[host_rung]]\nremedy = "fewer_workers"\n')
    ladder = load_ladder(str(p))
    assert [r.name for r in ladder.rungs] == ["expandable_segments", "micro_batch", "checkpointing", "lora"]
    assert ladder.choose_by == "order" and [r.name for r in ladder.host_rungs] == ["fewer_workers"]


def test_a_ladder_that_extends_itself_is_refused(tmp_path: Path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n[[rung]]\nremedy = "lora"\n')
    with pytest.raises(LadderError, match=r"extends itself \(a.toml -> b.toml -> a.toml\)"):
        load_ladder(str(tmp_path / "a.toml"))


def test_a_rung_without_a_declared_cost_is_refused_at_load(monkeypatch, tmp_path: Path):
    """A speed rung whose knob declares no speed cost would count as free in the choice by cost (four rungs did:
    generation_rounds, liger_kernel, fewer_workers, smaller_prefetch): the ladder that lists it does not load."""

    class Faster(Remedy):
        name, cost, changes = "faster", "speed", ("torch_empty_cache_steps",)

        def apply(self, ctx):
            return ctx.knobs.replace(torch_empty_cache_steps=1)

    monkeypatch.setitem(REGISTRY, "faster", Faster)
    p = tmp_path / "mine.toml"
    p.write_text('[[rung]]\nremedy = "faster"\n')
    with pytest.raises(LadderBug) as e:
        load_ladder(str(p))
    assert "rung faster (cost class speed) declares no speed_cost for torch_empty_cache_steps" in str(e.value)
    assert "\n" not in str(e.value)


def test_every_rung_of_a_weighed_class_declares_what_it_costs():
    for name, remedy in REGISTRY.items():
        assert remedy.undeclared_cost() is None, name
