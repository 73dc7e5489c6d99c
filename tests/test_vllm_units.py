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


def test_once_its_context_is_the_run_s_the_rung_raises_the_share_only_to_what_holds_it():
    """After a pre-flight stop for vLLM's KV cache the rung first sets vLLM's context to the run's sequences; it then
    raises the share only as far as the memory model says holds one of them (``vllm_min_utilization``), never on
    towards 0.9, which would take training's room (a 3B model on 24 GiB: 0.9 of it left training 7 GiB short)."""
    kv = diagnose(OOMReport("vllm", "vllm-kv", "x"))
    short = VLLM.replace(vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3)
    assert RUNG.apply(ctx(short, kv, vllm_min_utilization=0.25)) == short  # it holds them already
    assert RUNG.apply(ctx(short, kv, vllm_min_utilization=0.37)).vllm_gpu_memory_utilization == 0.37
    assert RUNG.apply(ctx(short, kv)).vllm_gpu_memory_utilization == 0.4  # no model: the old step


# -- the colocated split (`oomguard plan --fit vllm_gpu_memory_utilization` / `vllm_max_model_length`) -------------

CFG4 = {"vocab_size": 724, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 1024, "tie_word_embeddings": True}


def test_the_shares_where_both_fit_are_one_range_bounded_by_each_side():
    """Below the range vLLM's share cannot hold its weights and a KV cache for its context and the generation batch
    (with the model's margin); above it training does not fit beside it; inside, both do."""
    from oomguard.decide.split import share_split, vllm_needs

    judge, facts = Judge(150 * MiB, simulated=True), RunFacts(model_config=CFG4, prompt_tokens_max=20)
    s = share_split(judge, facts, VLLM)
    assert s.short is None and 0 < s.low < s.high < 0.9
    fits = judge.fits(facts)

    def at(u):
        return VLLM.replace(vllm_gpu_memory_utilization=round(u, 2))

    assert vllm_needs(judge, facts, at(s.low)) <= s.low * 150 * MiB < vllm_needs(judge, facts, at(s.low)) + 1.5 * MiB
    assert not (vllm_needs(judge, facts, at(s.low - 0.01)) <= (s.low - 0.01) * 150 * MiB)
    assert fits(at(s.high)) and not fits(at(s.high + 0.01))
    assert all(fits(at(u / 100)) for u in range(round(100 * s.low), round(100 * s.high) + 1))
    assert s.low == judge.vllm_floor(facts, VLLM)  # the rung's floor: vLLM holds one of the run's sequences


def test_where_no_share_fits_the_answer_names_the_short_side_and_by_how_much():
    from oomguard.decide.split import share_split, vllm_needs

    facts = RunFacts(model_config=CFG4, prompt_tokens_max=20)
    small = Judge(60 * MiB, simulated=True)
    s = share_split(small, facts, VLLM)
    assert (s.low, s.short.side, s.short.at) == (None, "vllm", 1.0)
    assert s.short.bytes == vllm_needs(small, facts, VLLM) - 60 * MiB > 0 and "whole 60.00 MiB card" in s.short.why
    mid = Judge(90 * MiB, simulated=True)
    s = share_split(mid, facts, VLLM)
    est = mid.predict(facts, VLLM.replace(vllm_gpu_memory_utilization=s.short.at))
    assert s.short.side == "training" and s.short.bytes == int(est.peak_bytes * 1.02) + 1 - 90 * MiB > 0
    assert vllm_needs(mid, facts, VLLM) <= s.short.at * 90 * MiB  # at the least share vLLM fits


def test_the_longest_context_at_a_share_is_the_one_vllm_still_holds():
    from oomguard.decide.split import length_split, vllm_needs

    judge, facts = Judge(300 * MiB, simulated=True), RunFacts(model_config=CFG4, prompt_tokens_max=20)
    k = VLLM.replace(vllm_gpu_memory_utilization=0.4)
    s = length_split(judge, facts, k, upper=1 << 20)
    room = 0.4 * 300 * MiB
    assert vllm_needs(judge, facts, k.replace(vllm_max_model_length=s.high)) <= room
    assert vllm_needs(judge, facts, k.replace(vllm_max_model_length=s.high + 16)) > room  # one more KV block
    assert length_split(judge, facts, k, upper=2048).high == 2048  # never past the model's window
    tight = length_split(judge, facts, k.replace(vllm_gpu_memory_utilization=0.1), upper=2048)
    assert tight.high is None and tight.short.side == "vllm"


def test_plan_fit_vllm_gpu_memory_utilization_answers_per_card():
    model = str(Path(__file__).parent / "fixtures" / "models" / "qwen2.5-3b")
    out = subprocess.run([sys.executable, "-m", "oomguard", "plan", "--model", model, "--gpu", "24GiB,80GiB",
                          "use_vllm=true", "dtype=bfloat16", "lora_r=16", "vllm_max_model_length=2048",
                          "--fit", "vllm_gpu_memory_utilization", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    small, big = json.loads(out.stdout)["cards"]
    for card in (small, big):
        low, high = card["fit_range"]
        assert 0 < card["vllm_starts_from"] <= low < high <= 1 and card["run_value"] == 0.3
        assert card["fit_value"] == high and card["fit_short"] is None
    assert big["fit_range"][1] > small["fit_range"][1] and big["fit_range"][0] < small["fit_range"][0]
    text = subprocess.run([sys.executable, "-m", "oomguard", "plan", "--model", model, "--gpu", "24GiB",
                           "dtype=bfloat16", "--fit", "vllm_gpu_memory_utilization"], capture_output=True, text=True)
    assert text.returncode == 2 and "give use_vllm=true" in text.stderr


def test_a_probe_first_card_is_answered_as_judged_before_any_oom():
    """plan follows run past a "probe first" verdict by assuming the probe runs out of memory (to show run's next
    choice); the card's `--fit` answer is still the range where both sides fit, not one shrunk by that pretended OOM
    (which marked the user's config failed, and so every share above it: "training 0 bytes short")."""
    from oomguard.decide.plan import PROBE, card_row, make_plan
    from oomguard.decide.split import share_split
    from oomguard.memory.estimate import load_model_spec

    spec = load_model_spec(Path(__file__).parent / "fixtures" / "models" / "deepseek-r1-distill-qwen-1.5b")
    k = TRL_DEFAULTS.replace(use_vllm=True, dtype="bfloat16", max_completion_length=1024, num_generations=8,
                             per_device_train_batch_size=8, vllm_max_model_length=4096, zero_stage=3)
    p = make_plan(spec, k, 18 * GiB, facts=RunFacts(world_size=4))
    row = card_row(p, "18GiB", "vllm_gpu_memory_utilization", world_size=4)
    fresh = Judge(18 * GiB, spec=spec)
    fresh.set_trl(p.facts.trl_head, False)
    expected = share_split(fresh, p.facts, p.knobs)
    assert p.first == PROBE and expected.low is not None
    assert row["fit_range"] == [expected.low, expected.high] and row["fit_short"] is None


def test_a_stop_where_both_sides_are_short_names_training_first_and_the_climb_may_use_every_rung():
    """A full fine-tune of a 7B beside vLLM's default share on a 40 GiB card: training is 37 GiB over, and vLLM's
    share cannot hold its engine either. The stop is training's (only vLLM's own rungs answer a stop for its share,
    which left "no rung of the ladder applies"), and its line names both sides."""
    from oomguard.decide.plan import make_plan
    from oomguard.memory.estimate import load_model_spec

    spec = load_model_spec(Path(__file__).parent / "fixtures" / "models" / "qwen2.5-7b-instruct")
    p = make_plan(spec, TRL_DEFAULTS.replace(use_vllm=True, dtype="bfloat16"), 40 * GiB, facts=RunFacts())
    assert p.first == "stop" and p.verdict.short[0] == "training" and p.verdict.short[1] > 30 * GiB
    assert "vLLM's reservation (12.00 GiB) cannot hold its engine" in p.verdict.line()
    assert not p.exhausted and p.steps


def test_fit_on_vllm_under_a_trl_whose_default_is_server_asks_for_colocate_only():
    """TRL 0.x's vLLM default is a server: a user who gave use_vllm=true is told the one setting missing."""
    from oomguard.decide.fit import FitError, check_knob
    from oomguard.vocab.trlreleases import defaults

    old = TRL_DEFAULTS.replace(**{k: v for k, v in defaults("0.19.0").items() if hasattr(TRL_DEFAULTS, k)})
    with pytest.raises(FitError, match=r"give vllm_mode=colocate \(TRL's default mode from 1.0; before it, server\)"):
        check_knob("vllm_gpu_memory_utilization", old.replace(use_vllm=True))
    with pytest.raises(FitError, match="give use_vllm=true vllm_mode=colocate"):
        check_knob("vllm_max_model_length", TRL_DEFAULTS)
