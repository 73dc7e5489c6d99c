"""Diagnosis: kind from the figures, phase from the frames, evidence with the numbers."""

from oomguard.diagnose import Diagnosis, diagnose, phase_from_frames
from oomguard.oom import Frame, OOMReport, OtherProcess, parse_oom
from oomguard.sizes import GiB, MiB

SEED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total capacity of 15.73 GiB "
        "of which 1.28 GiB is free. Including non-PyTorch memory, this process has 14.43 GiB memory in use. Of the "
        "allocated memory 11.82 GiB is allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but unallocated.")


def report(**kw) -> OOMReport:
    base = dict(backend="cuda", origin="allocator", message="x", capacity=16 * GiB, free=1 * GiB)
    base.update(kw)
    return OOMReport(**base)


def test_seed_oom_is_fragmentation_with_the_numbers_first():
    d = diagnose(parse_oom(SEED))
    assert d.kind == "fragmentation"
    assert "2.41 GiB" in d.evidence[0] and "1.90 GiB" in d.evidence[0]


def test_request_larger_than_device_is_impossible():
    d = diagnose(report(requested=20 * GiB, reserved_unallocated=0))
    assert d.kind == "impossible"
    assert "larger than the whole device" in d.evidence[0]


def test_request_larger_than_allowed_fraction_is_impossible():
    d = diagnose(report(requested=3 * GiB, allowed=2 * GiB))
    assert d.kind == "impossible"


def test_neighbours_holding_a_large_share():
    d = diagnose(report(requested=2 * GiB, other_processes=(OtherProcess(123, 10 * GiB),), reserved_unallocated=0))
    assert d.kind == "neighbour"
    assert "pid 123" in d.evidence[0]


def test_fragmentation_wins_over_neighbours():
    d = diagnose(report(requested=1 * GiB, reserved_unallocated=2 * GiB, other_processes=(OtherProcess(1, 8 * GiB),)))
    assert d.kind == "fragmentation"


def test_small_request_is_death_by_small_allocations():
    d = diagnose(report(requested=20 * MiB, reserved_unallocated=1 * MiB))
    assert d.kind == "small-allocations"


def test_large_request_without_fragmentation_is_a_shortfall():
    d = diagnose(report(requested=4 * GiB, reserved_unallocated=100 * MiB))
    assert d.kind == "shortfall"
    assert "3.00 GiB more" in d.evidence[0]
    assert d.shortfall == 3 * GiB


def test_non_pytorch_memory_of_this_process():
    d = diagnose(report(requested=1 * GiB, process=15 * GiB, allocated=6 * GiB, reserved_unallocated=0))
    assert d.kind == "non-pytorch"


def test_host_ram_and_vllm_and_driver():
    assert diagnose(parse_oom("MemoryError")).kind == "host-ram"
    assert diagnose(parse_oom("Out of memory: Killed process 42 (python) total-vm:1kB, anon-rss:2048kB")).kind == "host-ram"
    assert diagnose(parse_oom("ValueError: No available memory for the cache blocks. Try increasing "
                              "`gpu_memory_utilization`.")).kind == "vllm-reservation"
    assert diagnose(parse_oom("RuntimeError: CUDA error: out of memory")).kind == "driver"


def test_no_figures_is_unknown():
    d = diagnose(OOMReport(backend="cuda", origin="allocator", message="CUDA out of memory."))
    assert d.kind == "unknown"


def f(name: str, path: str = "x.py") -> Frame:
    return Frame(path, 1, name)


def test_phase_from_trl_frames():
    trainer = "trl/trainer/grpo_trainer.py"
    assert phase_from_frames([f("training_step", trainer), f("_generate_and_score_completions", trainer),
                              f("_generate_single_turn", trainer), f("forward")])[0] == "generation"
    assert phase_from_frames([f("training_step", trainer), f("_generate_and_score_completions", trainer),
                              f("_get_per_token_logps_and_entropies", trainer), f("forward")])[0] == "scoring"
    assert phase_from_frames([f("training_step", trainer), f("compute_loss", trainer), f("_compute_loss", trainer),
                              f("_get_per_token_logps_and_entropies", trainer), f("forward")])[0] == "forward"
    assert phase_from_frames([f("training_step", trainer), f("backward", "accelerate/accelerator.py"),
                              f("backward", "torch/_tensor.py"), f("_engine_run_backward", "torch/autograd/graph.py")]
                             )[0] == "backward"
    assert phase_from_frames([f("_inner_training_loop"), f("step", "torch/optim/optimizer.py"),
                              f("_multi_tensor_adamw", "torch/optim/adamw.py")])[0] == "optimizer"
    assert phase_from_frames([f("__init__", trainer), f("create_model_from_path", "trl/trainer/utils.py"),
                              f("from_pretrained", "transformers/modeling_utils.py")])[0] == "load"
    assert phase_from_frames([f("main", "train.py")])[0] == "unknown"


def test_phase_in_a_plain_pytorch_loop():
    assert phase_from_frames([f("train"), f("_wrapped_call_impl"), f("forward")])[0] == "forward"
    assert phase_from_frames([f("train"), f("backward", "torch/_tensor.py")])[0] == "backward"


def test_phase_override_and_evidence_sentence():
    d = diagnose(parse_oom(SEED), [f("_generate_single_turn", "trl/trainer/grpo_trainer.py")])
    assert d.phase == "generation"
    assert any("during generation" in e for e in d.evidence)
    assert diagnose(parse_oom(SEED), phase="optimizer").phase == "optimizer"
    assert isinstance(d, Diagnosis) and d.to_dict()["kind"] == "fragmentation"
