"""Evaluation as its own phase: the knobs, the memory model's evaluation pass, the rung that changes evaluation only,
and an OOM whose traceback runs through an evaluation (or a save) diagnosed as such. Pure logic, no torch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomguard.memory.estimate import ModelSpec, estimate
from oomguard.oom.diagnose import diagnose, phase_from_frames
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts, check_values
from oomguard.vocab.oomreport import Frame, OOMReport

TINY = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True)
EVAL = TRL_DEFAULTS.replace(eval_strategy="steps", num_generations=4, per_device_train_batch_size=4,
                            max_completion_length=128, per_device_eval_batch_size=16)


def predict(k: Knobs):
    return estimate(TINY, k, prompt_tokens=32, simulated=True)


def test_the_evaluation_phase_exists_only_for_a_run_that_evaluates_and_leaves_training_alone():
    trains = predict(EVAL.replace(eval_strategy="no"))
    evaluates = predict(EVAL)
    assert "evaluation" not in trains.phases and "evaluation" in evaluates.phases
    assert {ph: v for ph, v in evaluates.phases.items() if ph != "evaluation"} == trains.phases
    assert evaluates.dominant_phase == "evaluation" and evaluates.peak_bytes > trains.peak_bytes
    # the training batch does not enter it; the evaluation batch does
    assert predict(EVAL.replace(per_device_train_batch_size=2, gradient_accumulation_steps=2)).phases[
        "evaluation"] == evaluates.phases["evaluation"]


@given(rows=st.integers(1, 64), more=st.integers(1, 32))
def test_the_evaluation_pass_grows_with_its_rows(rows, more):
    small = predict(EVAL.replace(per_device_eval_batch_size=rows, num_generations_eval=1)).phases["evaluation"]
    big = predict(EVAL.replace(per_device_eval_batch_size=rows + more, num_generations_eval=1)).phases["evaluation"]
    assert big >= small


def test_eval_knobs_follow_grpos_rule_for_whole_groups():
    assert Knobs(eval_strategy="steps", per_device_eval_batch_size=6, num_generations=4).validate() == [
        "the global eval batch size (6 x 1) must be divisible by num_generations_eval (4)"]
    assert Knobs(eval_strategy="steps", per_device_eval_batch_size=6, num_generations=4).validate(world_size=2) == []
    assert Knobs(eval_strategy="no", per_device_eval_batch_size=6, num_generations=4).validate() == []
    assert check_values({"eval_strategy": "sometimes"}) == [
        "eval_strategy must be one of no, steps, epoch, not 'sometimes'"]


def ctx(k: Knobs, phase: str | None = None, world: int = 1) -> Context:
    d = None if phase is None else Diagnosis("shortfall", phase, (), OOMReport(backend="cuda", origin="allocator",
                                                                              message=""))
    return Context(knobs=k, facts=RunFacts(world_size=world), diagnosis=d)


def test_the_eval_rung_halves_the_rows_and_keeps_whole_groups():
    r = make_remedy("eval_batch")
    assert r.foreign(ctx(EVAL.replace(eval_strategy="no"))) == "the run does not evaluate"
    k = r.apply(ctx(EVAL))
    assert k.eval_geometry() == (8, 4) and k.num_generations_eval is None  # unset stays unset: TRL takes 4
    k = r.apply(ctx(r.apply(ctx(k))))
    assert k.eval_geometry() == (2, 2) and not k.validate()
    assert {row.knob for row in EVAL.diff(k)} == {"per_device_eval_batch_size", "num_generations_eval"}
    assert r.blocked(ctx(EVAL.replace(per_device_eval_batch_size=1, num_generations_eval=1))).startswith("at its floor")
    # two ranks: one completion group spans both, so each may hold half of it
    assert r.apply(ctx(EVAL.replace(per_device_eval_batch_size=4), world=2)).eval_geometry() == (2, 4)


def test_the_eval_rung_answers_only_an_oom_of_an_evaluation():
    r = make_remedy("eval_batch")
    assert r.helps(ctx(EVAL, "evaluation").diagnosis) is None
    assert "not in an evaluation pass" in r.helps(ctx(EVAL, "backward").diagnosis)
    assert r.cost == "none" and "training is unchanged" in r.trade_for({"per_device_eval_batch_size": 8})


@given(rows=st.integers(1, 64), g=st.integers(1, 16), world=st.integers(1, 4))
def test_every_step_of_the_eval_rung_is_a_config_trl_accepts_with_fewer_rows(rows, g, world):
    k = TRL_DEFAULTS.replace(eval_strategy="steps", num_generations=max(2, g), per_device_eval_batch_size=rows,
                             num_generations_eval=g)
    if k.validate(world):
        return
    r = make_remedy("eval_batch")
    c = ctx(k, world=world)
    if r.blocked(c):
        assert rows == 1 or g == 1 or (rows // 2) * world < 1
        return
    new = r.apply(c)
    assert not new.validate(world) and new.eval_geometry()[0] < rows
    # training knobs untouched
    assert {row.knob for row in k.diff(new)} <= {"per_device_eval_batch_size", "num_generations_eval"}


def test_a_traceback_through_an_evaluation_or_a_save_names_it():
    gen = [Frame("trl/trainer/grpo_trainer.py", 1, "_generate_and_score_completions"),
           Frame("transformers/generation/utils.py", 2, "generate")]
    ev = [Frame("transformers/trainer.py", 1, "_maybe_log_save_evaluate"), Frame("transformers/trainer.py", 2,
                                                                                  "evaluate"),
          Frame("transformers/trainer.py", 3, "evaluation_loop"), Frame("trl/trainer/grpo_trainer.py", 4,
                                                                        "prediction_step"), *gen]
    assert phase_from_frames(gen)[0] == "generation"
    assert phase_from_frames(ev)[0] == "evaluation"
    save = [Frame("transformers/trainer.py", 1, "_maybe_log_save_evaluate"),
            Frame("transformers/trainer.py", 2, "_save_checkpoint"), Frame("torch/serialization.py", 3, "save")]
    assert phase_from_frames(save)[0] == "save"
    d = diagnose(OOMReport(backend="host", origin="oom-killer", message="killed"), phase="save")
    assert d.kind == "host-ram" and "checkpoint save" in d.evidence[-1]


@pytest.mark.parametrize("ladder", ["default", "fastest", "quality-first", "multi-gpu"])
def test_every_shipped_ladder_offers_the_eval_rung_before_any_that_changes_training(ladder):
    from oomguard.decide.ladder import load_ladder

    names = [r.name for r in load_ladder(ladder).rungs]
    # DeepSpeed's buffers sized to the model change no training either (they come first where a ladder says so)
    costly = [i for i, r in enumerate(load_ladder(ladder).rungs) if r.cost != "none" and r.name != "deepspeed_buffers"]
    assert "eval_batch" in names and names.index("eval_batch") < min(costly)


def test_plan_fit_answers_the_largest_evaluation_batch_a_card_holds():
    from oomguard.decide.fit import largest

    def fits(capacity):
        return lambda k: predict(k).peak_bytes <= capacity

    base = EVAL.replace(eval_strategy="no", per_device_eval_batch_size=None)  # the question presumes evaluation
    small, big = (largest(fits(c * 2**20), base, "per_device_eval_batch_size") for c in (200, 400))
    assert small % 4 == 0 and big % 4 == 0 and 8 <= small < big
    assert predict(EVAL.replace(per_device_eval_batch_size=small)).peak_bytes <= 200 * 2**20
    assert predict(EVAL.replace(per_device_eval_batch_size=small + 4)).peak_bytes > 200 * 2**20
