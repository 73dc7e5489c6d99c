"""Choosing by what a change costs the experiment (the default ladder, ``choose_by = "cost"``).

Pure tests (no torch): toy memory models where the right answer is known, the climb and its refining, the summary
of what a config keeps and changes, and properties under any additive memory model.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.decide.alternatives import alternatives
from oomguard.decide.cheapest import CostPreference, cheapest, class_distance, pick
from oomguard.decide.choose import Rung, replay
from oomguard.decide.climb import Climb
from oomguard.decide.experiment import summarise
from oomguard.decide.ladder import load_ladder
from oomguard.decide.minimize import Minimizer
from oomguard.strategies import COST_CLASSES, Context, cost_rank, make_remedy
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.records import Attempt

DEFAULT = load_ladder("default")
ORDER = [r.name for r in DEFAULT.rungs]
# learning_rate 1e-4: bf16 weights keep the updates of this rate (at TRL's 1e-6 bf16_load is not offered, see
# test_at_trl_s_learning_rate_bf16_weights_are_never_the_precision_choice)
USER = TRL_DEFAULTS.replace(max_completion_length=256, num_generations=8, per_device_train_batch_size=8,
                            gradient_accumulation_steps=1, dtype="float32", gradient_checkpointing=True,
                            learning_rate=1e-4)


def gib(k: Knobs) -> float:
    """A toy model in GiB: float32 weights+grads+AdamW 16 (bf16 8, LoRA 4, 4-bit LoRA 2; 8-bit AdamW saves 3 of a
    full fine-tune), activations scale with the micro-batch rows and the completion length, generation with the
    rows per round and the generations."""
    k = TRL_DEFAULTS.merged(k)
    if k.load_in_4bit:
        base = 2.0
    elif k.lora_r:
        base = 4.0
    else:
        base = 8.0 if k.dtype == "bfloat16" else 16.0
        if k.optim and "8bit" in k.optim:
            base -= 3.0 if k.dtype != "bfloat16" else 1.5
    bs, _, _ = k.geometry()
    act = 6.0 * (k.max_completion_length / 256) * (bs / 8)
    gen = 2.0 * (k.max_completion_length / 256) * (k.rows_per_device() / 8)
    return base + max(act, gen) + (0 if k.expandable_segments else 0.5)


def under(limit: float):
    return lambda k: gib(k) <= limit


def choose_from_user(fits, ladder=DEFAULT, user=USER):
    return pick(ladder, user, RunFacts(), fits)


def test_a_micro_batch_split_beats_bf16_weights_which_beat_lora_which_beats_any_cut():
    """The user's config needs 22.5 GiB. Each limit has a cheapest answer, by class."""
    assert gib(USER) == 22.5
    split = choose_from_user(under(19.5))  # 16 + 3 + 0.5 with 2 micro-steps of 4 rows
    assert [r.name for r in split.rungs] == ["micro_batch"]
    assert split.knobs.per_device_train_batch_size == 4 and split.knobs.gradient_accumulation_steps == 2
    precision = choose_from_user(under(13.0))  # the split alone cannot do it; bf16 weights can, with a split
    assert {r.remedy.cost for r in precision.rungs} == {"speed", "precision"}
    assert precision.knobs.dtype == "bfloat16" and not precision.knobs.lora_r
    capacity = choose_from_user(under(6.0))
    assert capacity.knobs.lora_r and not capacity.knobs.load_in_4bit  # LoRA before 4-bit: the smaller capacity change
    for c in (split, precision, capacity):  # nothing that changes what GRPO learns from
        k = c.knobs
        assert (k.max_completion_length, k.num_generations) == (256, 8)
        assert k.prompts_per_step() == USER.prompts_per_step()
    signal = choose_from_user(under(2.6))  # even a 4-bit base with one row per micro-step needs more
    assert "signal" in {r.remedy.cost for r in signal.rungs} and signal.knobs.load_in_4bit


def test_at_trl_s_learning_rate_bf16_weights_are_never_the_precision_choice():
    """At 1e-6 a bf16 weight keeps almost no AdamW update: the precision class offers the 8-bit optimizer alone, and
    where that is not enough the choice trains LoRA (whose float32 adapters learn) rather than freeze the model."""
    user = USER.replace(learning_rate=1e-6)
    for limit in (19.0, 13.0, 6.0):
        c = choose_from_user(under(limit), user=user)
        k = c.knobs
        assert k.dtype != "bfloat16" or k.lora_r, (limit, [r.name for r in c.rungs])
    assert choose_from_user(under(13.0), user=user).knobs.lora_r  # where bf16 weights alone would have done


def test_within_a_class_the_smallest_change_wins_over_the_earlier_listed_rung():
    """Signal: 224-token completions cut 12.5%, 4 generations 50%; fewer_generations is listed first, but the
    smaller cut wins. Both kept only with every cheaper rung in force, at its strongest."""
    climbed = [Rung(make_remedy("fewer_generations")), Rung(make_remedy("shorter_sequences"))]
    fits = lambda k: k.max_completion_length <= 224 or (k.num_generations or 8) <= 4  # noqa: E731
    c = cheapest(USER, climbed, fits, order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["shorter_sequences"]
    assert c.knobs.max_completion_length == 224 and c.knobs.num_generations == 8
    assert class_distance(USER, c.knobs)["signal"] == 0.125


def test_generation_rounds_cost_time_so_a_split_that_fits_wins_over_them():
    """Speed: two generation rounds of 16 rows instead of one of 32 take about twice the generation (decoding reads
    every weight once per token whatever the rows), a split into micro-batches of 2 rows a few percent. Either fits;
    the split wins (generation_rounds once cost nothing here, and won)."""
    user = USER.replace(per_device_train_batch_size=4, gradient_accumulation_steps=8)
    climbed = [Rung(make_remedy("micro_batch")), Rung(make_remedy("generation_rounds"))]
    fits = lambda k: k.geometry()[0] <= 2 or k.rows_per_device() <= 16  # noqa: E731
    c = cheapest(user, climbed, fits, order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["micro_batch"]
    rounds = user.replace(steps_per_generation=4)
    assert class_distance(user, rounds)["speed"] == 0.8 > class_distance(user, c.knobs)["speed"] == 0.05


def test_fewer_rungs_of_a_class_beat_a_smaller_change_with_more_of_them():
    """Precision: bf16 weights alone fit; the 8-bit optimizer would also be needed without them. One change wins."""
    climbed = [Rung(make_remedy("optimizer_8bit")), Rung(make_remedy("bf16_load"))]
    c = cheapest(USER, climbed, lambda k: k.dtype == "bfloat16", order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["bf16_load"]


def test_a_costlier_class_is_decided_first_and_a_cheaper_one_shrinks_below_it():
    """With LoRA the completions stay whole and no split is needed: the split climbed on the way is dropped."""
    climbed = [Rung(make_remedy("micro_batch")), Rung(make_remedy("lora")), Rung(make_remedy("shorter_sequences"))]
    c = cheapest(USER, climbed, lambda k: bool(k.lora_r), order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["lora"] and set(c.dropped) == {"micro_batch",
                                                                                         "shorter_sequences"}


def test_a_relaxed_generation_count_keeps_its_rows_when_the_split_below_it_goes():
    """fewer_generations is relaxed with a micro-batch split in force; deciding the speed class afterwards drops the
    split, and the rows fewer_generations kept stay rows, not a split in disguise."""
    climbed = [Rung(make_remedy("micro_batch")), Rung(make_remedy("fewer_generations"))]
    fits = lambda k: k.rows_per_device() <= 4  # noqa: E731  (the split does not help: generation rows do)
    c = cheapest(USER, climbed, fits, order=ORDER)
    assert c is not None and [r.name for r in c.rungs] == ["fewer_generations"]
    bs, ga, spg = c.knobs.geometry()
    assert (bs, ga, spg) == (4, 1, 1) and replay(USER, c.rungs)[0] == c.knobs


def test_the_ceiling_stops_at_the_cheapest_class_that_fits_and_holds_that_class_whole():
    steps, ran_out = DEFAULT.climb_by_cost(Context(knobs=USER), under(13.0))
    assert ran_out is None
    costs = [s.remedy.cost for s in steps]
    assert max(costs, key=cost_rank) == "precision"
    assert {"optimizer_8bit", "bf16_load"} <= {s.remedy.name for s in steps}  # the whole class, to weigh each


def test_a_first_choice_keeps_the_models_error_as_headroom_where_any_config_has_it():
    """A micro-batch split is predicted at 97% of the device (within the model's error), bf16 weights with room:
    the choice takes the room. With nothing roomy anywhere, the tight split is still taken (a probe verifies it)."""
    def climb_with(relax_limit: float) -> Climb:
        c = Climb(DEFAULT)
        c.observe(USER.to_dict(only_set=True))
        c.record(Attempt(index=1, knobs=c.effective()[0].to_dict(), remedies=[], outcome="oom", exit_code=86,
                         seconds=1.0, kind="probe"))
        c.choose_next(None, fits=under(18.0), relax_fits=under(relax_limit))
        return c

    roomy = climb_with(16.2)
    assert "precision" in {r.remedy.cost for r in roomy.applied} and not roomy.effective()[0].lora_r
    tight = climb_with(1.0)  # nothing has room: the cheapest config that fits with the plain margin, a split
    assert {r.remedy.cost for r in tight.applied} <= {"none", "speed"}, tight.remedies_in_force()
    assert "micro_batch" in tight.remedies_in_force()


def test_rechoose_prefers_a_cheaper_config_the_probe_makes_room_for():
    c = Climb(DEFAULT)
    c.observe(USER.to_dict(only_set=True))
    c.record(Attempt(index=1, knobs=c.effective()[0].to_dict(), remedies=[], outcome="oom", exit_code=86, seconds=1.0,
                     kind="probe"))
    c.choose_next(None, fits=under(13.0), relax_fits=under(13.0))
    assert c.effective()[0].dtype == "bfloat16"
    c.record(Attempt(index=2, knobs=c.effective()[0].to_dict(), remedies=c.remedies_in_force(), outcome="ok",
                     exit_code=0, seconds=1.0, kind="probe"))
    assert c.rechoose(under(18.0), relax_fits=under(18.0)) is not None  # the probe measured less: a split will do
    assert c.effective()[0].dtype == "float32" and "micro_batch" in c.remedies_in_force()
    assert {r.remedy.cost for r in c.applied} <= {"none", "speed"}
    pref = c.preference()
    assert isinstance(pref, CostPreference)


def test_without_the_model_the_ladder_climbs_a_cost_block_at_a_time():
    """--no-predict: one rung per OOM in the ladder's order; a graded speed rung steps again before a costlier class."""
    used: dict[str, int] = {}
    knobs, names = USER, []
    for _ in range(4):
        step = DEFAULT.next(Context(knobs=knobs, used=dict(used)))
        names.append(step.remedy.name)
        used[step.remedy.name] = used.get(step.remedy.name, 0) + 1
        knobs = step.knobs
    assert names == ["expandable_segments", "empty_cache", "micro_batch", "micro_batch"]


def test_undo_trials_take_the_costliest_change_first():
    c = Climb(DEFAULT)
    c.applied = c.climbed = [Rung(make_remedy(n)) for n in ("expandable_segments", "micro_batch", "bf16_load",
                                                             "lora", "shorter_sequences")]
    m = Minimizer()
    m.start(c)
    assert m.queue == ["shorter_sequences", "lora", "bf16_load", "micro_batch", "expandable_segments"]


def test_the_summary_says_what_was_kept_and_what_each_change_costs():
    final = USER.replace(dtype="bfloat16", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    rungs = [Rung(make_remedy("micro_batch")), Rung(make_remedy("bf16_load"))]
    who = replay(USER, rungs)[1]
    e = summarise(USER, final, [r.remedy for r in rungs], who, slowdown=lambda before, after: 0.031)
    assert e.kept == ["8 generations per prompt", "256-token completions", "1 prompt per step", "a full fine-tune"]
    assert [c.cost for c in e.changed] == ["precision", "speed"]  # costliest first
    assert e.lines()[1] == ("changed: bf16 weights (yours: float32) (precision), 2 micro-steps of 4 rows per step "
                            "(yours: 1 of 8) (speed, about +3% time per step predicted)")
    cut = summarise(USER, USER.replace(max_completion_length=128, lora_r=16), [make_remedy("shorter_sequences"),
                    make_remedy("lora")], {"max_completion_length": "shorter_sequences", "lora_r": "lora"})
    assert cut.kept == ["8 generations per prompt", "1 prompt per step"]
    assert [c.text() for c in cut.changed] == ["128-token completions (yours: 256) (signal)",
                                               "LoRA r=16 instead of a full fine-tune (capacity)"]


def test_alternatives_leave_one_class_the_choice_pays_in_as_the_user_had_it():
    choice = choose_from_user(under(13.0))  # a split and bf16 weights
    alts = alternatives(USER, choice.knobs, list(choice.rungs), RunFacts(), under(13.0))
    assert alts
    for a in alts:
        costs = {c.cost for c in a.experiment.changed}
        assert a.avoids and not costs & set(a.avoids) and a.knobs != choice.knobs
        assert gib(a.knobs) <= 13.0
    assert alternatives(USER, USER.replace(expandable_segments=True), [Rung(make_remedy("expandable_segments"))],
                        RunFacts(), under(30)) == []


# -- properties ------------------------------------------------------------------------------------------------------
GRADED_LIMITS = st.floats(min_value=2.0, max_value=30.0)


@settings(max_examples=60, deadline=None)
@given(limit=GRADED_LIMITS)
def test_the_choice_fits_needs_its_costliest_class_and_is_minimal(limit: float) -> None:
    """Under the toy model and any device: what is chosen fits; no config of the cheaper classes alone (each rung at
    its strongest) fits; and no single rung of the choice can be left out."""
    fits = under(limit)
    c = choose_from_user(fits)
    if c is None:
        steps, ran_out = DEFAULT.climb_by_cost(Context(knobs=USER), fits)
        assert ran_out is not None or not steps
        return
    assert fits(c.knobs)
    if not c.rungs:  # the user's config fits: nothing to change
        assert fits(USER)
        return
    top = max((r.remedy.cost for r in c.rungs), key=cost_rank)
    cheaper = [r for r in DEFAULT.rungs if cost_rank(r.cost) < cost_rank(top)]
    if cheaper:
        lower = DEFAULT.only([r.name for r in cheaper])
        _, ran_out = lower.climb_to_fit(Context(knobs=USER), fits)
        assert ran_out is not None, f"a config without {top} changes fits"
    for r in c.rungs:
        without = replay(USER, [x for x in c.rungs if x.name != r.name])[0]
        assert without == c.knobs or not fits(without), f"{r.name} could be left out"


@given(st.sampled_from(ORDER), st.sampled_from(ORDER))
def test_the_cost_key_orders_classes_before_counts(a: str, b: str) -> None:
    """A config with one change of a costlier class is worse than one with any number of cheaper changes."""
    ra, rb = make_remedy(a), make_remedy(b)
    pref = CostPreference.of([Rung(ra), Rung(rb)], ORDER, USER)
    if cost_rank(ra.cost) > cost_rank(rb.cost):
        cheap_names = [n for n in ORDER if cost_rank(make_remedy(n).cost) <= cost_rank(rb.cost)]
        many = CostPreference.of([Rung(make_remedy(n)) for n in {*cheap_names, a}], ORDER, USER)
        assert many.key(cheap_names, USER) < many.key([a], USER)
    assert ra.cost in COST_CLASSES and pref.key([], USER) <= pref.key([a], USER)


def test_when_a_chosen_config_runs_out_of_memory_the_next_choice_is_made_below_the_same_ceiling():
    """The split the model chose ran out of memory: it is never chosen again, and the next choice (the model now
    stricter) comes from the rungs already climbed, without climbing further."""
    c = Climb(DEFAULT)
    c.observe(USER.to_dict(only_set=True))
    c.record(Attempt(index=1, knobs=c.effective()[0].to_dict(), remedies=[], outcome="oom", exit_code=86, seconds=1.0,
                     kind="probe"))
    c.choose_next(None, fits=under(13.0), relax_fits=under(13.0))
    first, ceiling = c.effective()[0], list(c.climbed)
    c.record(Attempt(index=2, knobs=first.to_dict(), remedies=c.remedies_in_force(), outcome="oom", exit_code=86,
                     seconds=1.0, kind="probe"))
    d = c.choose_next(None, fits=under(12.0), relax_fits=under(12.0))
    again = c.effective()[0]
    assert d.steps == [] and c.climbed == ceiling  # chosen again below the same rungs
    assert again != first and gib(again) <= 12.0
    assert "lora" not in c.remedies_in_force()  # still the cheapest class that fits: precision
