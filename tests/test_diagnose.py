"""Diagnosis: kind from the figures, phase from the frames, evidence with the numbers."""

from oomguard.oom.diagnose import diagnose, phase_from_frames
from oomguard.oom.parse import parse_oom
from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.oomreport import Frame, OOMReport, OtherProcess
from oomguard.vocab.sizes import GiB, MiB

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


# --------------------------------------------------------------------------------------------------------------
# A per-process allowance (set_per_process_memory_fraction, oomguard's --gpu-memory): real H100 runs, 2026-11-22.

from pathlib import Path  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from oomguard.oom.diagnose import FRAGMENTATION_HEADROOM  # noqa: E402
from oomguard.oom.parse import scan_text  # noqa: E402

OOM_FIXTURES = Path(__file__).parent / "fixtures" / "oom"


def h100(name: str):
    (hit,) = scan_text((OOM_FIXTURES / name).read_text(encoding="utf-8"))
    return hit.report, diagnose(hit.report, hit.frames)


def test_live_tensors_filling_the_allowance_are_a_shortfall_not_fragmentation():
    # 636 MiB cached > the 88 MiB request, but 23.33 GiB of 24 GiB are live tensors: no real headroom.
    r, d = h100("cuda_h100_allowance_default.txt")
    assert (r.allowed, r.capacity) == (24 * GiB, round(79.18 * GiB))
    assert d.kind == "shortfall" and d.phase == "backward"
    text = " ".join(d.evidence)
    assert "hit its own allowance of 24.00 GiB" in text and "44.24 GiB free" in text
    assert "yet this is not fragmentation" in text and "23.33 GiB" in text and "of the 24.00 GiB allowance" in text
    assert "598.08 MiB (2.4%)" in text and f"at least {FRAGMENTATION_HEADROOM:.0%}" in text


def test_hitting_its_own_cap_with_the_device_half_free_is_not_a_neighbour():
    # minimize probe 3 shared the GPU with a calibration sweep (Process 844, 2.14 GiB), yet 52.77 GiB were free.
    r, d = h100("cuda_h100_allowance_minimize_attempt3.txt")
    assert r.other_processes[0].pid == 844 and r.free == round(52.77 * GiB)
    assert d.kind == "shortfall"
    assert "52.77 GiB free" in d.evidence[0] and "225.28 MiB more than the allowance" in d.evidence[0]


def test_every_real_h100_oom_is_a_shortfall():
    for name in ("cuda_h100_allowance_default.txt", "cuda_h100_allowance_minimize_attempt1.txt",
                 "cuda_h100_allowance_minimize_attempt3.txt", "cuda_h100_allowance_quality_first_attempt1.txt",
                 "cuda_h100_snapshot_4GiB_allowance.txt"):
        assert h100(name)[1].kind == "shortfall", name


def test_the_allowance_not_the_card_is_the_capacity():
    # On the 80 GiB card this much cache would be fragmentation; in a 24 GiB allowance it is not.
    kw = dict(requested=512 * MiB, capacity=80 * GiB, free=50 * GiB, allocated=22 * GiB, reserved_unallocated=1 * GiB)
    assert diagnose(report(**{**kw, "free": 256 * MiB})).kind == "fragmentation"  # the card as the capacity
    d = diagnose(report(**kw, allowed=24 * GiB))
    assert d.kind == "shortfall"
    assert "of the 24.00 GiB allowance" in " ".join(d.evidence)


def test_fragmentation_inside_an_allowance_with_real_headroom():
    d = diagnose(report(requested=1 * GiB, capacity=80 * GiB, free=50 * GiB, allocated=10 * GiB,
                        reserved_unallocated=2 * GiB, allowed=24 * GiB))
    assert d.kind == "fragmentation"
    assert d.evidence[1].startswith("Live tensors (10.00 GiB) plus the request need 11.00 GiB of the 24.00 GiB "
                                    "allowance, leaving 13.00 GiB (54%)")


def test_a_full_device_is_still_the_neighbours_doing_under_an_allowance():
    d = diagnose(report(requested=1 * GiB, capacity=80 * GiB, free=512 * MiB, allocated=10 * GiB, process=11 * GiB,
                        reserved_unallocated=0, allowed=24 * GiB, other_processes=(OtherProcess(9, 60 * GiB),)))
    assert d.kind == "neighbour"


def test_this_process_listed_as_another_is_not_both():
    d = diagnose(report(requested=3 * GiB, capacity=80 * GiB, free=2 * GiB, allocated=70 * GiB,
                        reserved_unallocated=5 * GiB, other_processes=(OtherProcess(51882, 77 * GiB),)))
    assert d.report.other_processes == () and d.report.process == 77 * GiB


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(8, 96), allowed_share=st.floats(0.1, 0.95), free_share=st.floats(0.0, 1.0),
       alloc_share=st.floats(0.0, 1.0), ru_share=st.floats(0.0, 0.3), req_mib=st.integers(1, 8192),
       others=st.integers(0, 64))
def test_diagnosis_rules_hold_for_any_figures(capacity, allowed_share, free_share, alloc_share, ru_share, req_mib,
                                              others):
    cap = capacity * GiB
    allowed = int(cap * allowed_share)
    alloc = int(allowed * alloc_share)
    ru = int(allowed * ru_share)
    req = req_mib * MiB
    free = int(cap * free_share)
    r = report(requested=req, capacity=cap, free=free, allocated=alloc, reserved_unallocated=ru, allowed=allowed,
               other_processes=(OtherProcess(7, others * GiB),) if others else ())
    d = diagnose(r)
    if free >= req:  # the device had room: the allowance refused it, whoever else is on the card
        assert d.kind != "neighbour"
    if d.kind == "fragmentation":  # fragmentation only with real headroom left in the allowance
        assert allowed - alloc - req >= FRAGMENTATION_HEADROOM * allowed - 1


# --------------------------------------------------------------------------------------------------------------
# Forms added with issue 12: Ray, cudaMallocAsync, THC, vLLM's max seq len, NCCL's size.


def test_ray_kill_is_host_ram_with_the_node_figures():
    (hit,) = scan_text((OOM_FIXTURES / "host_ray_task_killed_node_low_memory.txt").read_text(encoding="utf-8"))
    d = diagnose(hit.report, hit.frames)
    assert d.kind == "host-ram"
    assert "Ray's memory monitor killed the task (pid 4331" in d.evidence[0]
    assert "threshold of 95%" in d.evidence[0] and "not the GPU" in d.evidence[0]


def test_cuda_malloc_async_short_form_names_the_backend():
    d = diagnose(parse_oom("torch.OutOfMemoryError: Allocation on device "))
    assert d.kind == "unknown" and "cudaMallocAsync" in d.evidence[0]
    full = diagnose(parse_oom((OOM_FIXTURES / "cuda_async_full_figures.txt").read_text(encoding="utf-8")))
    assert full.kind == "shortfall" and any("25.18 GiB of the device is neither" in e for e in full.evidence)


def test_vllm_max_seq_len_refusal_names_the_token_counts():
    d = diagnose(parse_oom("ValueError: The model's max seq len (29000) is larger than the maximum number of tokens "
                           "that can be stored in KV cache (23648). Try increasing `gpu_memory_utilization`."))
    assert d.kind == "vllm-reservation"
    assert "23,648 tokens" in d.evidence[0] and "29,000" in d.evidence[0] and "vllm_max_model_length" in d.evidence[0]


def test_nccl_and_thc_are_driver_failures_with_the_size_when_known():
    d = diagnose(scan_text((OOM_FIXTURES / "nccl_cuda_failure_oom.txt").read_text(encoding="utf-8"))[0].report)
    assert d.kind == "driver" and "NCCL" in d.evidence[0] and "(6.00 MiB requested)" in d.evidence[0]
    thc = parse_oom("THCudaCheck FAIL file=/pytorch/torch/lib/THC/generic/THCStorage.cu line=58 error=2 : out of memory")
    assert diagnose(thc).kind == "driver"


# --------------------------------------------------------------------------------------------------------------
# Issue 40: the diagnosis is a verdict with its facts, written into sentences in one place; nothing reads a sentence
# back, and nothing edits a Diagnosis after it is made.

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402

from oomguard.oom import diagnose as diagnose_module  # noqa: E402
from oomguard.oom.diagnose import verdict  # noqa: E402
from oomguard.oom.evidence import sentences  # noqa: E402
from oomguard.vocab.diagnosis import Room, Verdict  # noqa: E402

BUCKET = 2_000_000_000
VLLM_KV = [f("__init__", "trl/trainer/grpo_trainer.py"), f("allocate_kv_cache", "vllm/v1/worker/utils.py")]
LOAD = [f("from_pretrained", "transformers/modeling_utils.py")]
# (report, frames, phase, buffers): every branch that once decided by reading a sentence, and one of each kind
CASES = [
    (report(requested=20 * GiB), (), None, None),  # impossible: smaller shapes
    (report(requested=20 * GiB), LOAD, None, None),  # impossible while loading: a smaller load
    (report(requested=2**52), LOAD, None, None),  # overflowed, while loading
    (report(requested=BUCKET, capacity=1 * GiB), (), None, {"the bucket": BUCKET}),  # a bucket larger than the device
    (report(requested=2**52), (), None, {"the bucket": 2**52}),  # an overflowed bucket
    (report(requested=BUCKET, capacity=80 * GiB, free=1 * GiB, allocated=70 * GiB), (), "backward",
     {"the bucket": BUCKET}),
    (parse_oom(SEED), VLLM_KV, None, None),  # vLLM's start-up: its reservation, whatever the figures said
    (parse_oom(SEED), (), None, None),
    (report(requested=1 * GiB, capacity=80 * GiB, free=50 * GiB, allocated=23 * GiB, reserved_unallocated=2 * GiB,
            allowed=24 * GiB), (), None, None),  # own cap, not fragmentation
    (report(requested=2 * GiB, other_processes=(OtherProcess(123, 10 * GiB),), reserved_unallocated=0), (), None,
     None),
    (report(requested=1 * GiB, process=15 * GiB, allocated=6 * GiB, reserved_unallocated=0), (), None, None),
    (report(requested=20 * MiB, reserved_unallocated=1 * MiB), (), None, None),
    (parse_oom("RuntimeError: CUDA error: out of memory"), (), None, None),
    (parse_oom("MemoryError"), (), "save", None),
]


def test_the_verdict_holds_the_facts_each_decision_rests_on():
    v = verdict(report(requested=2**52))
    assert (v.kind, v.facts.overflowed, v.facts.by_figures) == ("impossible", True, "impossible")
    v = verdict(report(requested=20 * GiB), LOAD)
    assert (v.kind, v.phase, v.facts.overflowed) == ("impossible", "load", False)
    v = verdict(report(requested=BUCKET, capacity=1 * GiB), buffers={"the bucket": BUCKET})
    assert (v.kind, v.buffer) == ("impossible", "the bucket")

    v = verdict(report(requested=1 * GiB, capacity=80 * GiB, free=50 * GiB, allocated=23 * GiB,
                       reserved_unallocated=2 * GiB, allowed=24 * GiB))
    assert v.kind == "shortfall" and v.facts.own_cap and v.facts.cache_fits and v.facts.not_fragmentation
    assert v.facts.room == Room(live=23 * GiB, need=24 * GiB, usable=24 * GiB) and v.facts.room.left == 0
    v = verdict(report(requested=1 * GiB, capacity=80 * GiB, free=50 * GiB, allocated=10 * GiB,
                       reserved_unallocated=2 * GiB, allowed=24 * GiB))
    assert v.kind == "fragmentation" and not v.facts.not_fragmentation and v.facts.room.left == 13 * GiB

    v = verdict(parse_oom(SEED), VLLM_KV)
    assert (v.kind, v.phase, v.facts.by_figures, v.facts.vllm_startup) == (
        "vllm-reservation", "load", "fragmentation", "its KV cache")
    assert v.report.origin == "vllm-startup" and v.frame.name == "allocate_kv_cache"

    v = verdict(report(requested=3 * GiB, capacity=80 * GiB, free=2 * GiB, allocated=70 * GiB,
                       reserved_unallocated=5 * GiB, other_processes=(OtherProcess(51882, 77 * GiB),)))
    assert v.facts.nvml_self == 51882 and v.report.process == 77 * GiB
    d = diagnose(report(requested=1 * GiB, process=15 * GiB, allocated=6 * GiB, reserved_unallocated=0))
    assert d.kind == "non-pytorch" and d.facts.outside_torch == 9 * GiB  # the Diagnosis carries the facts


@pytest.mark.parametrize("case", range(len(CASES)))
def test_no_decision_reads_a_sentence(case, monkeypatch):
    """The verdict is decided before any sentence exists, and the sentences' wording changes no field of the
    Diagnosis but the evidence: the writer is called once, by diagnose, with the verdict."""
    r, frames, phase, buffers = CASES[case]
    before = diagnose(r, frames, phase=phase, buffers=buffers)
    written: list[Verdict] = []

    def reworded(v: Verdict) -> tuple[str, ...]:
        written.append(v)
        return tuple(f"<{s.upper()}>" for s in sentences(v))

    monkeypatch.setattr(diagnose_module, "sentences", reworded)
    monkeypatch.setattr("oomguard.oom.evidence.SMALLER_SHAPES", ": reworded.")
    monkeypatch.setattr("oomguard.oom.evidence.SMALLER_LOAD", ": reworded too.")
    after = diagnose(r, frames, phase=phase, buffers=buffers)
    assert len(written) == 1 and written[0] == verdict(r, frames, phase=phase, buffers=buffers)
    assert (after.kind, after.phase, after.report, after.frame, after.buffer, after.facts) == (
        before.kind, before.phase, before.report, before.frame, before.buffer, before.facts)
    assert len(after.evidence) == len(before.evidence)


def test_the_evidence_is_the_verdict_written():
    for r, frames, phase, buffers in CASES:
        v = verdict(r, frames, phase=phase, buffers=buffers)
        d = diagnose(r, frames, phase=phase, buffers=buffers)
        assert d.evidence == sentences(v) and (d.kind, d.phase, d.facts) == (v.kind, v.phase, v.facts)


def test_a_bucket_or_a_load_words_the_impossible_verdict_from_its_facts():
    shapes = diagnose(report(requested=20 * GiB)).evidence[0]
    assert shapes.endswith("only smaller shapes (shorter sequences, fewer rows per step) can make it fit.")
    load = diagnose(report(requested=20 * GiB), LOAD).evidence[0]
    assert load == shapes.replace("smaller shapes (shorter sequences, fewer rows per step)",
                                  "loading the weights smaller (4-bit, or 16-bit instead of float32)")
    bucket = diagnose(report(requested=BUCKET, capacity=1 * GiB), buffers={"the bucket": BUCKET}).evidence
    assert bucket[0].startswith("The request of 1.86 GiB (more than the whole device) is the bucket")
    assert not any("larger than" in e for e in bucket)  # a bucket's size is the config's, not the shapes'
    overflowed = diagnose(report(requested=2**52), buffers={"the bucket": 2**52}).evidence
    assert overflowed[0].startswith("The request of") and "an overflowed shape" in overflowed[1]


def test_what_the_caller_saw_is_written_with_the_verdict_not_after_it():
    reason = "vLLM's KV cache would hold 100 tokens, fewer than one sequence of 200"
    d = diagnose(OOMReport(backend="vllm", origin="vllm-kv", message=reason), reason=reason)
    assert d.kind == "vllm-reservation" and d.facts.reason == reason
    assert d.evidence[0] == reason + "." and d.evidence[1].startswith("vLLM has no room for the KV cache")

    signs = ["the cgroup's OOM-kill counter rose from 0 to 1", "node 2: resident memory reached 30 GiB"]
    d = diagnose(OOMReport(backend="host", origin="oom-killer", message="killed"), phase="save", host_signs=signs)
    assert d.evidence == ("The kernel's OOM killer ended the process: the host ran out of RAM, not the GPU.",
                          "It happened during a checkpoint save.",
                          "The cgroup's OOM-kill counter rose from 0 to 1.", "Node 2: resident memory reached 30 GiB.")
    assert d.facts.host_signs == tuple(signs)

    d = diagnose(parse_oom(SEED), engine="EngineCore pid=7")
    assert d.evidence[-1].startswith("It happened in vLLM's own engine process (EngineCore pid=7), not in the trainer")
    assert d.facts == replace(diagnose(parse_oom(SEED)).facts, engine="EngineCore pid=7")


def test_the_raylet_summary_is_parsed_once_into_report_fields():
    (hit,) = scan_text((OOM_FIXTURES / "host_ray_raylet_remote_node_wrapped.txt").read_text(encoding="utf-8"))
    assert (hit.report.origin, hit.report.workers_killed, hit.report.node) == ("ray", 1, "10.0.6.140")
    assert "1 worker(s) (tasks or actors) killed by its memory monitor on node 10.0.6.140" in \
        diagnose(hit.report).evidence[0]
    # the diagnosis reads the fields, not the message
    fields = OOMReport(backend="host", origin="ray", message="(raylet) summary", workers_killed=3, node="10.0.0.9")
    assert diagnose(fields).evidence[0].startswith("Ray's raylet reports 3 worker(s) (tasks or actors) killed by its "
                                                   "memory monitor on node 10.0.0.9: the node's RAM")
    (verl,) = scan_text((OOM_FIXTURES / "host_ray_raylet_wrapped_verl_notes.txt").read_text(encoding="utf-8"))
    assert (verl.report.workers_killed, verl.report.node) == (5, None)


# -- what was live at the OOM decides what it is short of (issue 46, point 5) -------------------------------------

from oomguard.oom.recommend import ranked  # noqa: E402
from oomguard.run.classify import live_at_oom  # noqa: E402
from oomguard.vocab.diagnosis import Live  # noqa: E402
from oomguard.vocab.events import MemSampled  # noqa: E402
from oomguard.vocab.records import CrashRecord  # noqa: E402

# a small device, as issue 46 saw it: a 16 MiB request, 305 MiB live, of which the long-lived state was 5.2 MiB
SMALL = dict(requested=16 * MiB, capacity=341 * MiB, free=2 * MiB, allocated=305 * MiB, reserved_unallocated=4 * MiB)
STEP_LIVE = Live(parameters=3 * MiB, gradients=1 * MiB, optimizer=int(1.2 * MiB), other=int(299.8 * MiB))


def test_a_small_request_while_the_steps_activations_fill_memory_is_a_shortfall_of_activations():
    d = diagnose(report(**SMALL), phase="backward", live=STEP_LIVE)
    assert (d.kind, d.facts.short_of) == ("shortfall", "activations")
    said = " ".join(d.evidence)
    assert "the step's shapes are what to shrink" in said and "long-lived state is what to shrink" not in said
    assert "optimizer state 1.20 MiB" in said
    # analyze ranks the step's shapes before the long-lived state
    names = [a.name for a in ranked(d)]
    assert names.index("micro_batch") < names.index("optimizer_8bit"), names
    without = diagnose(report(**SMALL), phase="backward")  # no tally: the request's size decides, as before
    assert without.kind == "small-allocations" and without.facts.short_of is None


def test_in_generation_the_step_is_short_of_generation_buffers():
    d = diagnose(report(**SMALL), phase="generation", live=STEP_LIVE)
    assert (d.kind, d.facts.short_of) == ("shortfall", "generation buffers")
    assert "what generation holds at once is what to shrink" in " ".join(d.evidence)


def test_a_small_request_while_the_long_lived_state_fills_memory_stays_small_allocations():
    state = Live(parameters=100 * MiB, gradients=100 * MiB, optimizer=90 * MiB, other=15 * MiB)
    d = diagnose(report(**SMALL), phase="backward", live=state)
    assert (d.kind, d.facts.short_of) == ("small-allocations", "long-lived state")
    assert "the long-lived state held 290.00 MiB of the 305.00 MiB live" in d.evidence[0]
    assert ranked(d)[0].name in ("optimizer_8bit", "lora", "bf16_load")


def test_the_crash_records_tally_is_read_back_and_the_trace_stands_in_without_it(tmp_path):
    rec = CrashRecord("x", "torch.OutOfMemoryError", report(**SMALL), pid=7,
                      live={"parameters": 3 * MiB, "gradients": MiB, "optimizer": MiB, "other": 300 * MiB})
    rec.write(tmp_path / "crash.json")
    back = CrashRecord.read(tmp_path / "crash.json")
    assert live_at_oom(back, []) == Live(3 * MiB, MiB, MiB, 300 * MiB, "tally")
    older = CrashRecord("x", "torch.OutOfMemoryError", report(**SMALL), pid=7)  # a record without a tally
    assert live_at_oom(older, [MemSampled(step=3, kept=5 * MiB, pid=7)]) == Live(5 * MiB, 0, 0, 300 * MiB, "trace")
    assert live_at_oom(older, []) is None
