"""transformers' continuous batching (issue 46, point 2): its paged cache takes a share of the free device memory each
generation round (``memory/estimate/paged.py``), the ``cb_max_memory_percent`` knob reaches TRL through
``transformers_continuous_batching_config``, the ``paged_cache`` rung lowers it before any change of what is
generated, the generation engine is a reported fact (``child/engine.py``), and under the simulated device the cache is
sized as on a GPU of the device's size, its generation thread counted (``child/stacks/paged.py``). The end-to-end run
is tests/test_facts_e2e.py's.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from oomguard.child import engine
from oomguard.decide.cheapest import class_distance
from oomguard.decide.ladder import available_ladders, load_ladder
from oomguard.memory.estimate import ModelSpec, estimate
from oomguard.memory.estimate.paged import paged_cache
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.oomreport import OOMReport

MIB = 2**20
TINY = ModelSpec(724, 256, 4, 8, 2, 32, 1024, True)  # tests/scripts/build_tiny_model.py's Llama
CB = TRL_DEFAULTS.replace(use_transformers_continuous_batching=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=32, bf16=False, optim="adamw_torch", dtype="float32")

# One generation round of transformers 5.24 under the simulated device, as on a GPU of the device's size: what the
# cache, its masks and the batch allocate beside the model (the tiny Llama in float32), against the memory model.
ROUND = """
import sys, torch
from oomguard.child import simulate
from oomguard.child.stacks import paged
import transformers.generation.continuous_batching.cache as cache
import transformers.generation.continuous_batching.continuous_api as api
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation import ContinuousBatchingConfig
dev = simulate.start(int(sys.argv[1]), expandable=False)
paged.size_like_the_device(None, cache)
paged.count_the_generation_thread(None, api)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=724, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2, head_dim=32, pad_token_id=2,
                                     eos_token_id=1, tie_word_embeddings=True))
dev.adopt(list(model.parameters()))
before = dev.model.allocated
dev.reset_peak()
gen = GenerationConfig(max_new_tokens=32, min_new_tokens=32, do_sample=True, pad_token_id=2, eos_token_id=1)
with torch.no_grad():
    out = model.generate_batch([[5 + (i + j) % 600 for j in range(11)] for i in range(16)], generation_config=gen,
        continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=float(sys.argv[2]),
                                                            max_batch_tokens=int(sys.argv[3])), progress_bar=False)
assert all(len(o.generated_tokens) == 32 for o in out.values()), [len(o.generated_tokens) for o in out.values()]
print(before, dev.peak - before)
"""


@pytest.mark.parametrize("capacity_mib, share, tokens", [
    (512, 0.5, 512),
    pytest.param(1024, 0.5, 8192, marks=pytest.mark.slow, id="transformers-default-batch-tokens"),  # masks, mostly
])
def test_a_round_allocates_what_the_memory_model_says(capacity_mib, share, tokens):
    """The simulated device answers transformers' memory query as a GPU would (the cache takes ``share`` of what is
    free), and the round's allocations, its own thread's included, are the model's within 3%."""
    out = subprocess.run([sys.executable, "-c", ROUND, str(capacity_mib * MIB), str(share), str(tokens)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    resident, grown = map(int, out.stdout.split()[-2:])
    available = int(share * (capacity_mib * MIB - resident))
    predicted = paged_cache(TINY, available=available, dtype_bytes=4, requests=16, sequence=43,
                            max_batch_tokens=tokens)
    assert abs(predicted - grown) <= 0.03 * grown, (predicted / MIB, grown / MIB)
    assert grown < available  # what it keeps for the round's activations is not all used


def test_the_paged_cache_follows_its_share_and_its_batch_tokens():
    base = {"dtype_bytes": 4, "requests": 16, "sequence": 43}
    a = paged_cache(TINY, available=600 * MIB, **base)
    assert paged_cache(TINY, available=300 * MIB, **base) < a < 600 * MIB
    assert paged_cache(TINY, available=0, **base) == 0


def test_the_generation_phase_holds_the_cache_and_a_smaller_share_predicts_less():
    big = estimate(TINY, CB.replace(cb_max_memory_percent=0.5), prompt_tokens=14, simulated=True, capacity=4096 * MIB)
    small = estimate(TINY, CB.replace(cb_max_memory_percent=0.1), prompt_tokens=14, simulated=True,
                     capacity=4096 * MIB)
    assert big.dominant_phase == small.dominant_phase == "generation"
    assert big.breakdown["kv_cache"] > 4 * small.breakdown["kv_cache"] > 0
    assert 0.4 * 4096 * MIB < big.peak_bytes < 0.55 * 4096 * MIB  # half of what is free, beside the model
    # the training phases do not hold it (freed when the round ends), and without a device size it is not counted
    assert big.phases["forward_backward"] == small.phases["forward_backward"]
    bare = estimate(TINY, CB, prompt_tokens=14, simulated=True)
    assert "transformers' paged cache not counted: pass capacity" in bare.notes
    # vLLM generates first where both are set (TRL's order)
    assert "kv_cache" not in {k for k, v in estimate(TINY, CB.replace(use_vllm=True, vllm_mode="server"),
                                                       prompt_tokens=14, simulated=True,
                                                       capacity=4096 * MIB).breakdown.items() if v}


def generation_oom() -> Diagnosis:
    return Diagnosis(kind="shortfall", phase="generation", evidence=(), report=OOMReport(backend="cuda", origin="allocator", message="", requested=MIB))


def test_the_rung_lowers_the_share_to_its_floor_and_only_for_continuous_batching():
    rung = make_remedy("paged_cache")
    ctx = Context(knobs=CB, diagnosis=generation_oom())
    assert rung.foreign(ctx) is None and rung.helps(generation_oom()) is None
    k = rung.apply(ctx)
    assert k.cb_max_memory_percent == 0.25 and rung.blocked(ctx) is None
    floor = CB.replace(cb_max_memory_percent=0.05)
    assert rung.blocked(Context(knobs=floor)).startswith("at its floor")
    assert rung.foreign(Context(knobs=TRL_DEFAULTS)) == "the run does not generate with transformers' continuous batching"
    assert rung.foreign(Context(knobs=CB.replace(use_vllm=True))) is not None
    backward = Diagnosis(kind="shortfall", phase="backward", evidence=(), report=OOMReport(backend="cuda", origin="allocator", message="", requested=MIB))
    assert "exists only while generating" in rung.helps(backward)
    assert [x.cb_max_memory_percent for x in rung.relax(CB, k)] == [0.45, 0.4, 0.35, 0.3]
    assert rung.describe_change(CB, k) == "the paged cache takes 0.25 of the free memory (yours: 0.5)"


def test_the_rung_costs_speed_and_comes_before_any_change_of_what_is_generated():
    assert make_remedy("paged_cache").cost == "speed"
    halved = class_distance(CB, CB.replace(cb_max_memory_percent=0.25))
    assert halved["speed"] > 0 and halved["signal"] == 0
    for name in available_ladders():
        names = [r.name for r in load_ladder(name).rungs]
        assert "paged_cache" in names, name
        assert all(names.index("paged_cache") < names.index(r) for r in ("smaller_images", "fewer_generations",
                                                                          "shorter_sequences") if r in names), name


def test_the_engines_knobs_are_read_from_and_set_on_grpo_config(tmp_path):
    from trl import GRPOConfig

    cfg = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_transformers_continuous_batching=True,
                     transformers_continuous_batching_config={"max_batch_tokens": 512, "page_size": 128})
    assert engine.observe(cfg) == {"use_transformers_continuous_batching": True, "cb_max_batch_tokens": 512}
    rt = SimpleNamespace(overrides=Knobs(cb_max_memory_percent=0.25))
    engine.apply(rt, cfg)
    assert cfg.transformers_continuous_batching_config == {"max_batch_tokens": 512, "page_size": 128,
                                                           "max_memory_percent": 0.25}
    assert engine.engine_of(cfg) == "continuous_batching"
    assert engine.engine_of(GRPOConfig(str(tmp_path), use_cpu=True, bf16=False)) == "generate"


class _Rt:
    def __init__(self) -> None:
        self.unobserved: list[str] = []

    def cannot_observe(self, line: str) -> None:
        self.unobserved.append(line)


@pytest.mark.parametrize("cfg, rollout, engine_name, said", [
    (SimpleNamespace(use_vllm=False), lambda prompts, trainer: {}, "rollout_func", "rollout_func"),
    (SimpleNamespace(use_vllm=True, vllm_mode="colocate"), None, "vllm_colocate", None),
    (SimpleNamespace(use_transformers_continuous_batching=True, transformers_continuous_batching_config=None,
                     bf16=True), None, "continuous_batching", "casts the trained model"),
    (SimpleNamespace(use_transformers_paged=True, bf16=False), None, "continuous_batching",
     "passes no transformers_continuous_batching_config"),
    (SimpleNamespace(use_transformers_continuous_batching=True, transformers_continuous_batching_config={}),
     None, "continuous_batching", None),
])
def test_the_engine_is_reported_and_what_is_not_modelled_is_said(cfg, rollout, engine_name, said):
    rt = _Rt()
    assert engine.report(rt, cfg, rollout_func=rollout) == {"generation_engine": engine_name}
    if said is None:
        assert rt.unobserved == []
    else:
        assert len(rt.unobserved) == 1 and said in rt.unobserved[0]


def test_a_dispatch_mode_entered_on_a_thread_counts_that_threads_tensors():
    import torch

    from oomguard.child.simulate import SimulatedDevice

    dev = SimulatedDevice(64 * MIB, expandable=False)

    def work() -> None:
        with dev.counting():
            t = torch.zeros(MIB // 4)  # 1 MiB of float32
            dev.reset_peak()
            del t

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert dev.model.allocated == 0 and dev.model.peak_allocated >= 0
    with dev.counting():
        kept = torch.ones(MIB // 4)
    assert dev.model.allocated >= MIB and kept.numel()


def test_an_oom_that_ends_the_generation_thread_reaches_the_training_process():
    import torch

    from oomguard.child.stacks import paged

    class Manager:
        def _handle_critical_error(self, error, batch_processor=None):
            return None

    class Mixin:
        def generate_batch(self, inputs):
            Manager()._handle_critical_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB"))
            return {"partial": inputs}

    module = SimpleNamespace(ContinuousBatchingManager=Manager, ContinuousMixin=Mixin)
    paged.raise_from_the_thread(None, module)
    with pytest.raises(torch.OutOfMemoryError):
        Mixin().generate_batch([1])
    Manager._handle_critical_error = lambda self, error, batch_processor=None: None  # another error: left as it is
    assert Mixin().generate_batch([1]) == {"partial": [1]}


def test_the_engine_is_a_run_fact():
    assert RunFacts.from_dict({"generation_engine": "continuous_batching"}).generation_engine == "continuous_batching"


def test_under_gpu_memory_the_cache_is_sized_for_the_rehearsed_card(monkeypatch):
    """transformers asks CUDA for the whole card's free memory, which ``--gpu-memory``'s cap leaves as it is: the
    query answers for the card of that size, so the cache's share is of what the capped allocator may still take."""
    import torch

    from oomguard.child.stacks import paged

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.29)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    module = SimpleNamespace(get_device_and_memory_breakdown=lambda: ("cuda", 80 * gib, 2 * gib, 10 * gib))
    paged.size_like_the_device(SimpleNamespace(plan=SimpleNamespace(gpu_memory=24 * gib)), module)
    device, total, reserved, in_use = module.get_device_and_memory_breakdown()
    assert (device, total, reserved) == ("cuda", 24 * gib, 2 * gib)
    assert total - max(in_use, reserved) == int(0.29 * 80 * gib) - 2 * gib  # transformers' "available"
    untouched = SimpleNamespace(get_device_and_memory_breakdown=lambda: ("cuda", 80 * gib, 2 * gib, 10 * gib))
    paged.size_like_the_device(SimpleNamespace(plan=SimpleNamespace(gpu_memory=None)), untouched)
    assert untouched.get_device_and_memory_breakdown() == ("cuda", 80 * gib, 2 * gib, 10 * gib)
