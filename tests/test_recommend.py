"""Recommendations for analyze: names shared with the ladder, ranked for the diagnosis, with bytes freed."""

from oomguard.diagnose import diagnose
from oomguard.oom import OOMReport, OtherProcess
from oomguard.recommend import recommend
from oomguard.sizes import GiB, MiB
from oomguard.strategies import REGISTRY


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
