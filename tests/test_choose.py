"""Choosing by the ladder's order (``choose_by = "order"``, the `fastest` and `quality-first` ladders): drop what
memory does not demand below the climbed rungs, relax graded knobs.

Pure tests (no torch): toy memory models where the right answer is known, the real memory model on the H100
quickstart case, and a property test that the choice is 1-minimal under any additive memory model. The default
ladder's choice by cost is tested in tests/test_cheapest.py.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from oomguard.decide.choose import Rung, choose, replay
from oomguard.decide.climb import Climb
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import load_ladder
from oomguard.strategies import make_remedy
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.records import Attempt

DEFAULT = load_ladder("fastest")  # the earlier default, chosen by its order
ORDER = [r.name for r in DEFAULT.rungs]
GiB = 2**30
QWEN_3B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
           "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": True}


def rungs(*names: str) -> list[Rung]:
    by_name = {r.name: r for r in DEFAULT.rungs}
    return [Rung(by_name[n]) for n in names]


def memory(k: Knobs) -> float:
    """A toy additive model in GiB: weights+optimizer dominate, completions and rows scale the activations."""
    k = TRL_DEFAULTS.merged(k)
    base = 4.0 if k.lora_r else 16.0
    if k.optim and "8bit" in k.optim:
        base -= 3.0 if not k.lora_r else 0.1
    act = 6.0 * (k.max_completion_length / 512) * (k.rows_per_device() / 8)
    if k.gradient_checkpointing is False:
        act *= 3
    return base + act + (0 if k.expandable_segments else 0.5)


def test_the_quickstart_shape_keeps_lora_alone():
    """The H100 finding: six rungs climbed, LoRA alone was enough; completions and generations stay the user's."""
    climbed = rungs("expandable_segments", "empty_cache", "shorter_sequences", "fewer_generations", "optimizer_8bit",
                    "lora")
    c = choose(TRL_DEFAULTS, climbed, lambda k: memory(k) <= 12, order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["lora"]
    assert c.knobs.max_completion_length == 512 and c.knobs.num_generations == 8
    assert set(c.dropped) == {"expandable_segments", "empty_cache", "shorter_sequences", "fewer_generations",
                              "optimizer_8bit"}


def test_a_graded_knob_is_relaxed_to_the_closest_value_that_fits():
    c = choose(TRL_DEFAULTS, rungs("shorter_sequences"), lambda k: k.max_completion_length <= 448, order=ORDER)
    assert c is not None and c.knobs.max_completion_length == 448  # not the blind halving to 256
    assert c.relaxed == (("max_completion_length", 256, 448),)
    # replaying the chosen rungs gives the same knobs: the relaxed value is what the next attempt runs
    assert replay(TRL_DEFAULTS, c.rungs)[0] == c.knobs


def test_relaxing_stops_where_the_stricter_judge_says_but_the_rungs_are_chosen_by_fits():
    """Relaxing pushes a config to the device's edge, so the Judge judges it with more room (``relax_fits``): the
    completions relax only to 352, though 448 is predicted to fit; which rungs are kept still follows ``fits``."""
    c = choose(TRL_DEFAULTS, rungs("expandable_segments", "shorter_sequences"), lambda k: memory(k) <= 21.3,
               order=ORDER, relax_fits=lambda k: memory(k) <= 20.3)
    assert c is not None and c.knobs.max_completion_length == 352, c.knobs
    assert [r.name for r in c.rungs] == ["expandable_segments", "shorter_sequences"]
    loose = choose(TRL_DEFAULTS, rungs("expandable_segments", "shorter_sequences"), lambda k: memory(k) <= 21.3,
                   order=ORDER)
    assert loose is not None and loose.knobs.max_completion_length == 448


def test_a_free_rung_stays_when_it_lets_a_graded_knob_stay_closer_to_yours():
    """Allocator settings trade nothing: with them, completions relax to 288 tokens; without, only 256 fit. The run
    that keeps more of the user's completions wins over the one with one change fewer."""
    climbed = rungs("expandable_segments", "shorter_sequences")
    c = choose(TRL_DEFAULTS, climbed, lambda k: memory(k) <= 19.5, order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["expandable_segments", "shorter_sequences"]
    assert c.knobs.max_completion_length == 288
    # when the free rung buys nothing (LoRA alone leaves room for every token), it goes
    c = choose(TRL_DEFAULTS, rungs("expandable_segments", "shorter_sequences", "lora"), lambda k: memory(k) <= 11,
               order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["lora"]


def test_a_rung_climbed_twice_relaxes_between_both_steps():
    climbed = rungs("shorter_sequences", "shorter_sequences")  # 512 -> 256 -> 128
    c = choose(TRL_DEFAULTS, climbed, lambda k: k.max_completion_length <= 200, order=ORDER)
    assert c is not None and c.knobs.max_completion_length == 192
    assert len(c.rungs) == 1


def test_generations_relax_before_completions_the_later_rung_first():
    """Both graded rungs are needed; the later-listed one (generations) gets back as much as it can first."""
    climbed = rungs("shorter_sequences", "fewer_generations")
    c = choose(TRL_DEFAULTS, climbed, lambda k: memory(k) <= 16 + 6 * 0.5 * 0.75 + 0.5, order=ORDER)
    assert c is not None
    assert c.knobs.num_generations == 6 and c.knobs.max_completion_length == 256


def test_between_equal_trades_the_earlier_listed_rung_wins():
    """shorter_sequences and lora each fit alone and both trade quality: the ladder lists shortening first."""
    climbed = rungs("shorter_sequences", "lora")
    c = choose(TRL_DEFAULTS, climbed, lambda k: k.max_completion_length <= 256 or bool(k.lora_r), order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["shorter_sequences"]


def test_fewer_quality_trades_beat_an_earlier_listed_one():
    """A speed trade that fits alone wins over a quality trade listed earlier."""
    ladder = load_ladder("quality-first")
    order = [r.name for r in ladder.rungs]
    by_name = {r.name: r for r in ladder.rungs}
    climbed = [Rung(by_name[n]) for n in ("bf16_load", "micro_batch")]
    c = choose(TRL_DEFAULTS, climbed, lambda k: k.dtype == "bfloat16" or (k.per_device_train_batch_size or 8) <= 4,
               order=order)
    assert c is not None and [r.name for r in c.rungs] == ["micro_batch"]


def test_a_config_that_ran_out_of_memory_is_never_chosen_again():
    climbed = rungs("shorter_sequences")
    first = choose(TRL_DEFAULTS, climbed, lambda k: k.max_completion_length <= 448, order=ORDER)
    assert first is not None
    again = choose(TRL_DEFAULTS, climbed, lambda k: k.max_completion_length <= 448, order=ORDER, avoid=[first.knobs])
    assert again is not None and again.knobs.max_completion_length == 416


def test_nothing_fits_gives_none():
    assert choose(TRL_DEFAULTS, rungs("shorter_sequences", "lora"), lambda k: False, order=ORDER) is None


@given(cap=st.floats(min_value=5, max_value=40), subset=st.sets(st.sampled_from(ORDER[:7]), min_size=1))
def test_the_choice_fits_and_no_single_rung_can_be_undone(cap: float, subset: set[str]) -> None:
    """Under any capacity, what is chosen fits, and dropping any one of its rungs or relaxing a graded knob one more
    grid step would not fit (1-minimal)."""
    climbed = rungs(*[n for n in ORDER if n in subset])
    fits = lambda k: memory(k) <= cap  # noqa: E731
    c = choose(TRL_DEFAULTS, climbed, fits, order=ORDER)
    if c is None:
        assert not fits(replay(TRL_DEFAULTS, climbed)[0])
        return
    assert fits(c.knobs)
    for r in c.rungs:
        without = replay(TRL_DEFAULTS, [x for x in c.rungs if x.name != r.name])[0]
        assert without == c.knobs or not fits(without), f"{r.name} could be undone"
        for closer in r.remedy.relax(TRL_DEFAULTS, c.knobs):
            assert not fits(closer), f"{r.name} could come closer to the user's value: {closer}"


def _quickstart_climb() -> tuple[Climb, Judge]:
    facts = RunFacts(model_config=QWEN_3B, prompt_tokens_max=128, model_source="string")
    return Climb(DEFAULT, facts=facts), Judge(24 * GiB)


def test_climb_on_the_real_model_chooses_lora_for_the_quickstart_case():
    """By the fastest ladder's order: TRL's quickstart shape (fp32, 8 x 512) with Qwen2.5-3B on a 24 GiB card: LoRA alone, predicted to fit."""
    c, g = _quickstart_climb()
    c.record(Attempt(index=1, knobs=c.effective()[0].to_dict(), remedies=[], outcome="oom", exit_code=86,
                     seconds=1.0))
    d = c.choose_next(None, fits=g.fits(c.facts), peak=g.peak(c.facts))
    assert d.exhausted is None and c.remedies_in_force() == ["lora"]
    k = c.effective()[0]
    assert k.max_completion_length == 512 and k.num_generations == 8 and k.lora_r == 16
    assert d.choice is not None and "shorter_sequences" in d.choice.dropped
    assert all(row["predicted_bytes_without"] <= 24 * GiB for row in d.choice.to_dict()["dropped"])


def test_when_a_chosen_config_runs_out_of_memory_the_climb_chooses_again_and_never_repeats():
    c, g = _quickstart_climb()
    c.record(Attempt(index=1, knobs=c.effective()[0].to_dict(), remedies=[], outcome="oom", exit_code=86,
                     seconds=1.0))
    c.choose_next(None, fits=g.fits(c.facts), peak=g.peak(c.facts))
    chosen = c.effective()[0]
    # the probe of the chosen config runs out of memory: the model learns (here: much tighter), and chooses again
    c.record(Attempt(index=2, knobs=chosen.to_dict(), remedies=c.remedies_in_force(), outcome="oom", exit_code=86,
                     seconds=1.0))
    tighter = Judge(24 * GiB, margin=0.6)
    d = c.choose_next(None, fits=tighter.fits(c.facts), peak=tighter.peak(c.facts))
    assert d.exhausted is None
    again = c.effective()[0]
    assert again != chosen and tighter.fits(c.facts)(again)
    assert "lora" in c.remedies_in_force() and len(c.remedies_in_force()) > 1  # something was put back


def test_without_the_model_the_ladder_climbs_one_rung_as_before():
    c = Climb(DEFAULT)
    c.record(Attempt(index=1, knobs=c.effective()[0].to_dict(), remedies=[], outcome="oom", exit_code=86,
                     seconds=1.0))
    d = c.choose_next(None)
    assert d.label() == "expandable_segments" and c.remedies_in_force() == ["expandable_segments"]
    assert d.choice is None


def test_minimize_trial_without_a_rung_climbed_twice_removes_every_pass():
    c = Climb(DEFAULT)
    seq = make_remedy("shorter_sequences")
    c.climbed = c.applied = [Rung(seq), Rung(make_remedy("lora")), Rung(seq)]
    assert c.effective()[0].max_completion_length == 128
    assert c.effective("shorter_sequences")[0].max_completion_length == 512
    c.drop("shorter_sequences")
    assert c.remedies_in_force() == ["lora"]
