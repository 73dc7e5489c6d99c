"""Recommendations for analyze: names shared with the ladder, ranked for the diagnosis, with bytes freed."""

from oomguard.oom.diagnose import diagnose
from oomguard.oom.recommend import recommend
from oomguard.strategies import REGISTRY
from oomguard.vocab.oomreport import OOMReport, OtherProcess
from oomguard.vocab.sizes import GiB, MiB


def names(d):
    return [a.name for a in recommend(d)]


def test_fragmentation_first_allocator_with_freed_bytes():
    d = diagnose(OOMReport("cuda", "allocator", "x", requested=1 * GiB, capacity=16 * GiB, free=0,
                           reserved_unallocated=2 * GiB))
    advice = recommend(d)
    assert advice[0].name == "expandable_segments" and advice[0].frees_bytes == 2 * GiB


def test_optimizer_phase_points_at_optimizer_state():
    d = diagnose(OOMReport("cuda", "allocator", "x", requested=4 * GiB, capacity=16 * GiB, free=1 * GiB),
                 phase="optimizer")
    assert names(d)[0] == "optimizer_8bit"
    assert "shorter_sequences" not in names(d)


def test_generation_phase_points_at_sequences_not_checkpointing():
    d = diagnose(OOMReport("cuda", "allocator", "x", requested=4 * GiB, capacity=16 * GiB, free=1 * GiB),
                 phase="generation")
    assert names(d)[:2] == ["shorter_sequences", "fewer_generations"]
    assert "checkpointing" not in names(d)


def test_neighbours_host_vllm_and_overflow():
    d = diagnose(OOMReport("cuda", "allocator", "x", requested=1 * GiB, capacity=16 * GiB, free=0,
                           other_processes=(OtherProcess(7, 9 * GiB),)))
    assert names(d)[0] == "free_gpu" and recommend(d)[0].frees_bytes == 9 * GiB
    assert names(diagnose(OOMReport("host", "python", "MemoryError")))[0] == "fewer_workers"
    assert names(diagnose(OOMReport("vllm", "vllm-kv", "x"))) == ["vllm_memory"]
    huge = diagnose(OOMReport("cuda", "allocator", "x", requested=10**6 * GiB, capacity=16 * GiB, free=0))
    assert names(huge) == ["fix_shapes"]


def test_small_allocations_shrink_long_lived_state_first():
    d = diagnose(OOMReport("cuda", "allocator", "x", requested=20 * MiB, capacity=16 * GiB, free=0), phase="forward")
    assert names(d)[0] == "optimizer_8bit"


def test_every_ladder_remedy_can_advise():
    d = diagnose(OOMReport("cuda", "allocator", "x", requested=1 * GiB, capacity=16 * GiB, free=0))
    for cls in REGISTRY.values():
        a = cls().advise(d)
        assert a.name == cls.name and a.reason


# --------------------------------------------------------------------------------------------------------------
# Ranked, a short list first, each with a line to paste.

from oomguard.oom.recommend import TOP_MAX, TOP_MIN, paste_lines, ranked  # noqa: E402
from oomguard.vocab.knobs import TRL_DEFAULTS  # noqa: E402


def frag(phase="forward"):
    return diagnose(OOMReport("cuda", "allocator", "x", requested=1 * GiB, capacity=16 * GiB, free=0, allocated=8 * GiB,
                              reserved_unallocated=2 * GiB), phase=phase)


def test_ranks_are_one_to_n_and_the_top_is_three_to_five():
    for d in (frag(), frag("generation"), frag("optimizer"),
              diagnose(OOMReport("cuda", "allocator", "x", requested=4 * GiB, capacity=16 * GiB, free=1 * GiB))):
        recs = ranked(d)
        assert [r.rank for r in recs] == list(range(1, len(recs) + 1))
        shown = [r for r in recs if r.top]
        assert shown == recs[:len(shown)]
        assert min(TOP_MIN, len(recs)) <= len(shown) <= TOP_MAX


def test_the_top_extends_past_three_only_within_the_same_tier():
    recs = ranked(frag())  # allocator tier (2), then checkpointing/micro-batch/shapes, then state
    assert [r.name for r in recs if r.top] == ["expandable_segments", "empty_cache", "micro_batch",
                                               "shorter_sequences", "fewer_generations"]
    assert all(r.tier == recs[2].tier for r in recs[2:5])


def test_within_a_tier_more_bytes_freed_ranks_higher():
    recs = ranked(frag())
    tier = [r for r in recs if r.tier == recs[2].tier]
    frees = [r.advice.frees_bytes or 0 for r in tier]
    assert frees == sorted(frees, reverse=True)


def test_paste_lines_are_the_environment_or_the_grpo_config():
    d = frag()
    assert paste_lines("expandable_segments", d) == ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",)
    assert paste_lines("shorter_sequences", d) == ("GRPOConfig(max_completion_length=256)",)
    assert paste_lines("micro_batch", d) == ("GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2)",)
    assert paste_lines("empty_cache", d) == ("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512",
                                             "GRPOConfig(torch_empty_cache_steps=1)")
    assert paste_lines("bf16_load", d) == ('GRPOConfig(model_init_kwargs={"dtype": "bfloat16"})',)
    hip = diagnose(OOMReport("hip", "allocator", "x", requested=1 * GiB, capacity=16 * GiB, free=0, allocated=8 * GiB,
                             reserved_unallocated=2 * GiB))
    assert paste_lines("expandable_segments", hip) == ("PYTORCH_HIP_ALLOC_CONF=expandable_segments:True",)


def test_paste_lines_follow_the_runs_own_knobs():
    d = frag()
    knobs = TRL_DEFAULTS.replace(max_completion_length=1024, per_device_train_batch_size=2)
    assert paste_lines("shorter_sequences", d, knobs) == ("GRPOConfig(max_completion_length=512)",)
    by_name = {r.name: r for r in ranked(d, {"max_completion_length": 1024, "unknown_future_knob": 1})}
    assert by_name["shorter_sequences"].paste == ("GRPOConfig(max_completion_length=512)",)


def test_remedies_that_cannot_apply_to_the_run_go_last_saying_why():
    d = frag("generation")
    recs = ranked(d, {"use_vllm": False})
    last = {r.name: r.advice.reason for r in recs[-2:]}
    assert "the run does not use vLLM" in last["vllm_memory"]
    # at TRL's learning rate bf16 weights would not learn: offered last, saying so
    assert "bfloat16's resolution" in last["bf16_load"]
    assert "bf16_load" not in {r.name for r in ranked(d, {"use_vllm": False, "learning_rate": 1e-4})[-1:]}
    assert [r.name for r in ranked(d)][:3] == ["expandable_segments", "empty_cache", "shorter_sequences"]


def test_state_first_when_the_request_is_a_sliver_of_the_live_tensors():
    d = diagnose(OOMReport("cuda", "allocator", "x", requested=88 * MiB, capacity=80 * GiB, free=44 * GiB,
                           allocated=23 * GiB, reserved_unallocated=600 * MiB, allowed=24 * GiB), phase="backward")
    assert d.kind == "shortfall"
    assert names(d)[:2] == ["lora", "optimizer_8bit"]
    assert names(d)[-1] == "expandable_segments"  # the cache did exceed the request: a last resort


def test_json_dict_keeps_every_remedy_with_rank_and_paste():
    recs = ranked(frag())
    assert recs[0].to_dict() == {"name": "expandable_segments", "reason": recs[0].advice.reason,
                                 "frees_bytes": 2 * GiB, "rank": 1,
                                 "paste": ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"], "top": True}
