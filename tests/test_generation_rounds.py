"""Generation in smaller rounds (the ``generation_rounds`` rung, cost class speed): where the rows generated at once
are what runs out, an optimizer step's completions are generated in several rounds of whole groups; the rows per step,
the generations, the completion length and a full fine-tune in float32 stay.

The model is ``kv`` (tests/scripts/build_tiny_model.py): 16 thin layers without GQA, whose KV cache per token is large
against its weights. Its config here (16 rows generated at once, 256-token completions) is predicted at 763 MiB; a
micro-batch split keeps the 16 rows and still needs 121 MiB while generating; rounds of 8 rows need 97 MiB.
"""

from __future__ import annotations

import pytest

from oomguard.decide.plan import make_plan
from oomguard.memory.estimate import ModelSpec
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts

from helpers import grpo_tiny, run_oomguard

KV = ModelSpec(vocab_size=724, hidden_size=128, num_layers=16, num_heads=4, num_kv_heads=4, head_dim=32,
               intermediate_size=256, tie_word_embeddings=True, checkpoint_dtype="float32")
USER = TRL_DEFAULTS.replace(bf16=False, optim="adamw_torch", learning_rate=1e-5, max_completion_length=256,
                            num_generations=4, per_device_train_batch_size=16, gradient_accumulation_steps=1)
DEVICE = 112 * 2**20


def test_the_choice_generates_in_smaller_rounds_and_keeps_the_experiment():
    p = make_plan(KV, USER, DEVICE, facts=RunFacts(trl_head="fused"), prompt_tokens=24, simulated=True)
    assert [s.remedy.name for s in p.steps] == ["micro_batch", "generation_rounds"]
    final = p.climb.effective()[0]
    assert final.geometry() == (1, 16, 8) and final.rows_per_device() == 8  # two rounds of 8 rows a step
    assert final.prompts_per_step() == USER.prompts_per_step()
    assert (final.num_generations, final.max_completion_length, final.dtype, final.optim, final.lora_r) == (
        4, 256, "float32", "adamw_torch", 0)
    assert p.climb.effective()[1]["steps_per_generation"] == "generation_rounds"
    # the split alone keeps the 16 rows generated at once: predicted over the device
    split = p.judge.predict(p.facts, USER.with_geometry(1, 16, 16))
    assert split.peak_bytes > DEVICE and split.dominant_phase == "generation"


def test_the_rung_keeps_whole_groups_and_ends_each_round_with_an_optimizer_step():
    r = make_remedy("generation_rounds")
    k = TRL_DEFAULTS.replace(num_generations=8, per_device_train_batch_size=4, gradient_accumulation_steps=12)
    new = r.apply(Context(knobs=k))
    bs, ga, spg = new.geometry()
    assert (bs, ga) == (4, 12) and spg < 12 and 12 % spg == 0 and (bs * spg) % 8 == 0
    assert r.helps(None) is None
    from oomguard.oom.diagnose import diagnose
    from oomguard.vocab.oomreport import OOMReport

    backward = diagnose(OOMReport("cuda", "allocator", "x", requested=2**30, capacity=2**34, free=0), phase="backward")
    assert "micro-batch sets" in r.helps(backward)
    at_floor = TRL_DEFAULTS.replace(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=4,
                                    steps_per_generation=1)
    assert "whole groups" in r.blocked(Context(knobs=at_floor))


@pytest.mark.slow
@pytest.mark.e2e
def test_a_generation_batch_that_runs_out_is_generated_in_rounds_on_a_full_fine_tune(tmp_path, build_model):
    """Issue 39's done-when: stable on a full fine-tune in float32, generations, completion length and rows per step
    kept, by the speed rung, with at most one real OOM. Slow (about 3 minutes: a pre-flight stop, then the chosen
    config); the choice is test_the_choice_generates_in_smaller_rounds_and_keeps_the_experiment's."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "112MiB", "--",
                            *grpo_tiny(build_model("kv"), tmp_path / "out", "--max-completion-length", "256",
                                       "--num-generations", "4", "--per-device-train-batch-size", "16"))
    assert out.returncode == 0 and rep["status"] == "stable", out.stderr[-3000:]
    assert sum(a["outcome"] == "oom" for a in rep["attempts"]) <= 1
    rows = {r["knob"]: r for r in rep["diff"]}
    assert rows["steps_per_generation"]["remedy"] == "generation_rounds"
    assert set(rows) <= {"per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation"}
    assert "kept: 4 generations per prompt, 256-token completions, 4 prompts per step, a full fine-tune" in out.stderr
    assert "generation rounds of" in out.stderr
