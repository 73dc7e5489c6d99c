"""vLLM beside the trainer, without vLLM: its OOMs recognised as vLLM's, the rung that climbs the way each points,
and the memory model's reservation. (The end-to-end runs with vLLM's CPU build are tests/test_vllm.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.decide.judge import Judge
from oomguard.memory.estimate import ModelSpec, estimate
from oomguard.memory.estimate.vllm import vllm_memory
from oomguard.oom.analyze import analyze_paths
from oomguard.oom.diagnose import diagnose
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
from oomguard.vocab.oomreport import Frame, OOMReport

FIXTURES = Path(__file__).parent / "fixtures" / "oom"
MiB, GiB = 2**20, 2**30
TINY = ModelSpec(724, 256, 1, 8, 2, 32, 1024, True, max_positions=2048)  # tests' one-layer vLLM model
VLLM = TRL_DEFAULTS.replace(use_vllm=True, vllm_gpu_memory_utilization=0.9, vllm_max_model_length=256,
                            num_generations=4, max_completion_length=32, per_device_train_batch_size=4)
RUNG = make_remedy("vllm_memory")


def ctx(knobs=VLLM, diagnosis=None, **facts):
    return Context(knobs=knobs, facts=RunFacts(prompt_tokens_max=20, **facts), diagnosis=diagnosis)


def finding_of(name: str) -> dict:
    (f,) = analyze_paths([str(FIXTURES / name)]).findings
    return f


def test_a_kv_cache_allocation_that_runs_out_is_vllm_starting_up_beside_training():
    f = finding_of("vllm_kv_cache_allocation.txt")
    assert (f["kind"], f["origin"], f["phase"]) == ("vllm-reservation", "vllm-startup", "load")
    assert f["evidence"][0].startswith("vLLM ran out of memory starting up: its KV cache asked for 1024.00 MiB")
    assert f["remedies"][0]["name"] == "vllm_memory"


@pytest.mark.parametrize("name, origin", [("vllm_cpu_startup_node.txt", "vllm-startup"),
                                          ("vllm_kv_needed_cpu.txt", "vllm-kv"),
                                          ("vllm_server_no_cache_blocks.txt", "vllm-kv")])
def test_vllm_s_own_refusals_are_vllm_s(name, origin):
    f = finding_of(name)
    assert (f["backend"], f["kind"], f["origin"]) == ("vllm", "vllm-reservation", origin)


def test_the_cpu_build_s_start_up_check_is_read_with_its_figures():
    f = finding_of("vllm_cpu_startup_node.txt")
    assert f["evidence"][0] == ("vLLM wanted 12.45 GiB at start-up (gpu_memory_utilization × total) but only "
                                "11.53 GiB of 13.84 GiB was free: the training side already holds the rest.")


def test_one_sequence_that_does_not_fit_says_by_how_many_tokens():
    f = finding_of("vllm_kv_needed_cpu.txt")
    assert (f["max_seq_len"], f["kv_cache_tokens"]) == (256, 128)
    assert "set vllm_max_model_length to at most 128" in f["evidence"][0]


def test_an_oom_in_a_vllm_server_s_log_is_named_as_the_server_s():
    f = finding_of("vllm_server_no_cache_blocks.txt")
    assert f["vllm_process"] == "EngineCore pid=2178"
    assert any(e.startswith("It happened in vLLM's own engine process (EngineCore pid=2178), not in the trainer")
               for e in f["evidence"])
    colocated = finding_of("vllm_kv_needed_cpu.txt")  # vLLM in the trainer's process: no engine process named
    assert "vllm_process" not in colocated


def test_analyze_cli_says_so_for_a_server_log():
    out = subprocess.run([sys.executable, "-m", "oomguard", "analyze", "--json",
                          str(FIXTURES / "vllm_server_no_cache_blocks.txt")], capture_output=True, text=True)
    (f,) = json.loads(out.stdout)["findings"]
    assert f["vllm_process"] == "EngineCore pid=2178" and out.returncode == 0


# -- the rung -----------------------------------------------------------------------------------------------------

def test_training_beside_the_reservation_gets_a_smaller_one_and_a_max_model_length_of_the_run_s_sequences():
    shortfall = diagnose(OOMReport("cuda", "allocator", "x", requested=40 * MiB, capacity=1 * GiB, free=10 * MiB),
                         [Frame("torch/autograd/graph.py", 1, "backward")])
    assert RUNG.helps(shortfall) is None
    k = RUNG.apply(ctx(diagnosis=shortfall))
    assert k.vllm_gpu_memory_utilization == 0.675 and k.vllm_max_model_length == 64  # 20-token prompts + 32
    assert (k.num_generations, k.max_completion_length, k.per_device_train_batch_size) == (4, 32, 4)


def test_one_full_length_sequence_that_does_not_fit_gets_a_shorter_max_model_length_else_a_larger_reservation():
    kv = diagnose(OOMReport("vllm", "vllm-kv", "x", max_seq_len=32768, kv_cache_tokens=4000))
    k = RUNG.apply(ctx(VLLM.replace(vllm_max_model_length=None, vllm_gpu_memory_utilization=0.3), kv))
    assert (k.vllm_max_model_length, k.vllm_gpu_memory_utilization) == (64, 0.3)
    k = RUNG.apply(ctx(VLLM.replace(vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3), kv))
    assert (k.vllm_max_model_length, k.vllm_gpu_memory_utilization) == (64, 0.4)
    assert make_remedy("micro_batch").helps(kv) is not None  # the training batch cannot help it


def test_the_start_up_check_gets_a_reservation_that_fits_what_is_free():
    start = diagnose(OOMReport("vllm", "vllm-startup", "x", requested=900 * MiB, capacity=1000 * MiB,
                               free=600 * MiB))
    assert RUNG.apply(ctx(diagnosis=start)).vllm_gpu_memory_utilization == 0.54


def test_sleep_mode_only_where_the_platform_has_it():
    low = VLLM.replace(vllm_gpu_memory_utilization=0.1, vllm_max_model_length=64)
    assert RUNG.apply(ctx(low, vllm_sleep=True)).vllm_enable_sleep_mode is True
    assert RUNG.blocked(ctx(low, vllm_sleep=False)) == "at its floor (the platform has no sleep mode)"
    server = VLLM.replace(vllm_mode="server")
    assert "runs as a server" in RUNG.blocked(ctx(server))


def test_a_4bit_load_is_not_offered_to_vllm_s_cpu_build():
    load4 = make_remedy("load_4bit")
    assert "no bitsandbytes" in load4.blocked(ctx(vllm_platform="cpu"))
    assert load4.blocked(ctx(vllm_platform="cuda")) is None


# -- the memory model ---------------------------------------------------------------------------------------------

def test_the_reservation_is_counted_in_every_phase_and_what_it_keeps_allocated_in_the_allocated_peak():
    trainer = estimate(TINY, VLLM.replace(use_vllm=False), prompt_tokens=20, simulated=True, capacity=GiB)
    both = estimate(TINY, VLLM, prompt_tokens=20, simulated=True, capacity=GiB)
    v = vllm_memory(TINY, VLLM, GiB, prefill_tokens=16 * 20)
    assert v.reservation == int(0.9 * GiB) + 1
    # training holds the engine and the KV cache; generating, a 320-token prefill's share of the profile's room too
    assert v.training == v.reservation - v.activations < v.generating < v.reservation
    assert both.breakdown["vllm"] == v.training  # the peak is the scoring pass's, a training phase
    assert both.peak_alloc_bytes - v.held > 0 and v.held == v.reservation - v.activations - 20 * MiB
    assert both.peak_bytes > trainer.peak_bytes + 0.8 * GiB
    server = estimate(TINY, VLLM.replace(vllm_mode="server"), prompt_tokens=20, simulated=True, capacity=GiB)
    assert server.breakdown["vllm"] == 0  # the server generates on its own device


def test_a_reservation_vllm_would_refuse_is_never_judged_to_fit():
    tight = VLLM.replace(vllm_gpu_memory_utilization=0.05, vllm_max_model_length=2048)
    est = estimate(TINY, tight, prompt_tokens=20, simulated=True, capacity=GiB)
    assert est.vllm_lacks > 0 and not est.fits(GiB) and est.peak_bytes < GiB
    assert not Judge(GiB, simulated=True).judge(est)
    assert any(n.startswith("vLLM's reservation (") for n in est.notes)


def test_the_reservation_never_shrinks_below_what_vllm_needs_to_start():
    """The memory model's floor (engine, profile activations, one of the run's sequences, with its margin) bounds the
    rung: below it vLLM would refuse to start, and no smaller reservation could ever fit."""
    cfg = {"vocab_size": 724, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 1024, "tie_word_embeddings": True}
    floor = Judge(150 * MiB, simulated=True).vllm_floor(RunFacts(model_config=cfg, prompt_tokens_max=20), VLLM)
    assert 0.4 < floor < 0.5
    k = RUNG.apply(Context(knobs=VLLM.replace(vllm_gpu_memory_utilization=0.55),
                           facts=RunFacts(prompt_tokens_max=20, vllm_min_utilization=floor)))
    assert k.vllm_gpu_memory_utilization == floor
