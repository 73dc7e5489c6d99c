"""Never a costlier class on a guess: where the memory model's choice changes what is trained or learned (LoRA, 4-bit,
fewer generations, shorter completions) and a config of cheaper changes only (speed, precision) is predicted within
the model's error of the device, that config is probed first; the choice follows only if it does not fit.

The end-to-end proof (issue 39's done-when: a full fine-tune of the weights-heavy model on a device where 8-bit AdamW
alone fits, about 20% above that config's peak, ends on the 8-bit optimizer) is the slow test below.
"""

from __future__ import annotations

import pytest

from oomguard.decide.climb import Climb
from oomguard.decide.ladder import load_ladder
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts

from helpers import grpo_tiny, run_oomguard

USER = TRL_DEFAULTS.replace(optim="adamw_torch", learning_rate=1e-5, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=32)


def fits(k: Knobs) -> bool:  # a weights-heavy toy: only LoRA fits with room to spare
    return bool(k.lora_r)


def plausible(k: Knobs) -> bool:  # 8-bit AdamW alone is predicted just over the device, within the model's error
    return bool(k.lora_r) or "8bit" in str(k.optim)


def climbed() -> Climb:
    c = Climb(load_ladder("default"))
    c.observe(USER.to_dict())
    c.learn(RunFacts(world_size=1, prompt_tokens_max=20))
    return c


def test_a_cheaper_config_within_the_models_error_is_tried_before_a_capacity_change():
    c = climbed()
    d = c.choose_next(None, fits=fits, relax_fits=fits, plausible=plausible)
    assert d.trial and "optimizer_8bit" in c.remedies_in_force() and "lora" not in c.remedies_in_force()
    assert [r.name for r in c.trial_of.rungs] == ["lora"] and not c.probe_may_be_skipped()
    # its probe does not fit: the choice comes back
    assert c.settle_rechoice(False) and c.remedies_in_force() == ["lora"]


def test_a_cheaper_trial_that_fits_is_kept():
    c = climbed()
    c.choose_next(None, fits=fits, relax_fits=fits, plausible=plausible)
    assert c.settle_rechoice(True) and c.trial_of is None and "optimizer_8bit" in c.remedies_in_force()


def test_no_trial_without_a_plausible_cheaper_config_nor_for_a_choice_of_cheap_classes_only():
    c = climbed()
    assert not c.choose_next(None, fits=fits, relax_fits=fits, plausible=fits).trial  # nothing cheaper is plausible
    c = climbed()
    d = c.choose_next(None, fits=lambda k: "8bit" in str(k.optim), plausible=plausible)
    assert not d.trial and c.remedies_in_force() == ["optimizer_8bit"]  # the choice costs precision only already
    # (after a trial ran out of memory, the memory model no longer finds configs that need as much plausible:
    # Judge.plausible, tests/test_real_cards.py)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_full_fine_tune_where_an_8bit_optimizer_alone_fits_keeps_the_full_fine_tune(tmp_path, wide_model):
    """The weights-heavy model (tests' ``wide``, 16M parameters in float32): 8-bit AdamW alone peaks at about 163
    MiB, so a 200 MiB device (23% above it) holds it, but not with the model's error as headroom, where LoRA does.
    Slow (about a minute: a pre-flight stop, the 8-bit probe, the run); the decision is the tests above."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "200MiB", "--", *grpo_tiny(wide_model, tmp_path / "out"))
    assert out.returncode == 0 and rep["status"] == "stable", out.stderr[-3000:]
    assert sum(a["outcome"] == "oom" for a in rep["attempts"]) <= 1
    assert {r["knob"]: r["to"] for r in rep["diff"]} == {"optim": "adamw_bnb_8bit"}
    assert "a full fine-tune" in out.stderr and "first without what changes the experiment" in out.stderr
