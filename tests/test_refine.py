"""After the chosen config's probe fits: choose again with what the probe measured, and probe the changes the memory
model is unsure of, so the config that runs changes no more than memory demands.

Pure tests (no torch, nothing launched): toy memory models where the right answer is known, and the
conductor's decisions after each kind of attempt.
"""

from __future__ import annotations

import json
from pathlib import Path

from oomguard.decide.choose import Preference, Rung
from oomguard.decide.climb import Climb
from oomguard.decide.conductor import Conductor, Policy
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import load_ladder
from oomguard.decide.minimize import Minimizer
from oomguard.strategies import make_remedy
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.records import Attempt, AttemptKind, Outcome

DEFAULT = load_ladder("fastest")  # chosen by its order: the refining below the ceiling these tests know
ORDER = [r.name for r in DEFAULT.rungs]
MiB = 2**20
LLAMA = json.loads((Path(__file__).parent / "fixtures" / "models" / "llama-3.2-1b" / "config.json").read_text())


def gib(k: Knobs) -> float:
    """A toy model in GiB: LoRA saves 10, 8-bit AdamW 3, completions scale 8 GiB of activations; ES saves 0.5."""
    k = TRL_DEFAULTS.merged(k)
    base = 6.0 if k.lora_r else 16.0
    if k.optim and "8bit" in k.optim:
        base -= 3.0
    return base + 8.0 * k.max_completion_length / 512 + (0 if k.expandable_segments else 0.5)


def under(limit: float):
    return lambda k: gib(k) <= limit


def record(c: Climb, outcome: str, kind: str = "probe") -> None:
    c.record(Attempt(index=len(c.attempts) + 1, knobs=c.effective()[0].to_dict(), remedies=c.remedies_in_force(),
                     outcome=outcome, exit_code=0, seconds=1.0, kind=kind))


def climbed_to(limit: float) -> Climb:
    """The user's config (24.5 GiB) ran out of memory; the model, pessimistic, chose below the ladder's prefix."""
    c = Climb(DEFAULT)
    record(c, "oom")
    c.choose_next(None, fits=under(limit))
    return c


def test_preference_ranks_costly_trades_then_closeness_then_free_changes():
    pref = Preference.of([Rung(make_remedy(n)) for n in ("expandable_segments", "shorter_sequences", "lora")], ORDER,
                         TRL_DEFAULTS)
    short = TRL_DEFAULTS.replace(max_completion_length=256)
    assert pref.key(["shorter_sequences"], short) < pref.key(["lora"], TRL_DEFAULTS)  # the earlier-listed wins
    assert pref.key(["shorter_sequences"], TRL_DEFAULTS.replace(max_completion_length=448)) < pref.key(
        ["shorter_sequences"], short)  # closer to yours wins
    assert pref.key(["shorter_sequences"], short) < pref.key(["expandable_segments", "shorter_sequences"], short)


def test_a_probe_that_shows_more_room_lets_the_climb_choose_a_config_closer_to_yours():
    c = climbed_to(10.0)  # pessimistic: LoRA and shorter completions
    before = c.effective()[0]
    assert before.lora_r and before.max_completion_length < 512
    record(c, "ok")  # the probe fits, and measured less than predicted
    choice = c.rechoose(under(15.0))
    assert choice is not None
    after = c.effective()[0]
    assert after.max_completion_length > before.max_completion_length and gib(after) <= 15.0
    assert c.rechoose(under(15.0)) is None  # nothing better left: the next probe goes to the run


def test_rechoose_never_trades_the_config_a_probe_showed_to_fit_for_a_worse_one():
    c = climbed_to(15.0)
    before, rungs = c.effective()[0], c.remedies_in_force()
    record(c, "ok")
    assert c.rechoose(under(8.0)) is None  # the model got stricter: the probe's config still fits, it stays
    assert c.effective()[0] == before and c.remedies_in_force() == rungs


def test_a_rechosen_config_that_does_not_hold_gives_way_to_the_one_its_probe_showed_to_fit():
    c = climbed_to(10.0)
    verified = c.effective()[0]
    record(c, "ok")
    assert c.rechoose(under(15.0)) is not None
    record(c, "oom")  # the closer config ran out of memory
    assert c.settle_rechoice(False)
    assert c.effective()[0] == verified
    assert c.rechoose(under(15.0)) is None  # no more re-choosing in this run
    assert not c.settle_rechoice(True)  # nothing pending


def test_a_config_a_probe_ran_counts_as_fitting_whatever_the_model_learns_later():
    c = climbed_to(10.0)
    verified = c.effective()[0]
    record(c, "ok")
    q4 = Rung(make_remedy("load_4bit"))
    c.climbed, c.applied = [*c.climbed, q4], [*c.applied, q4]
    record(c, "oom")  # a later config ran out of memory; the model now thinks even the first does not fit
    c.choose_next(None, fits=under(1.0))
    assert c.effective()[0] == verified


def test_a_real_run_that_outgrows_its_probe_voids_what_probes_showed():
    c = climbed_to(10.0)
    record(c, "ok")
    record(c, "oom", kind="run")  # the run needed more than the probe showed
    assert not c.verified and c.rechoose(under(15.0)) is None


def test_undo_trials_ask_worth_when_each_rungs_turn_comes():
    c = Climb(DEFAULT)
    c.climbed = c.applied = [Rung(make_remedy(n)) for n in ("expandable_segments", "shorter_sequences", "lora")]
    record(c, "ok")
    asked: list[Knobs] = []

    def worth(k: Knobs) -> bool:
        asked.append(k)
        return not k.expandable_segments  # only the allocator setting is in doubt

    m = Minimizer()
    m.start(c)
    assert m.next_trial(c, worth) == "expandable_segments"
    assert m.next_trial(c, worth) is None
    assert len(asked) == 3  # lora, shorter_sequences (sure), expandable_segments (in doubt)


def test_plausible_means_at_most_doubt_over_the_device():
    g = Judge(10 * 2**30)
    facts = RunFacts(model_config=LLAMA, prompt_tokens_max=200)
    k = TRL_DEFAULTS.replace(max_completion_length=256)
    peak = g.predict(facts, k).peak_bytes
    assert Judge(int(peak / 1.03)).plausible(facts)(k) and not Judge(int(peak / 1.03)).fits(facts)(k)
    assert not Judge(int(peak / 1.10)).plausible(facts)(k)
    assert g.plausible(RunFacts()) is None  # no model config: nothing to predict


def test_a_config_predicted_as_large_as_one_that_ran_out_is_not_worth_an_undo_probe():
    """Under TRL 0.29's logits head the model may over-predict by 40%, so a config predicted just over the device is
    worth a probe without a change; not when it needs at least what a config that ran out of memory here needed
    (an accelerate client under TRL 0.29.1 probed without LoRA a config that was the one that had run out, less its
    8-bit optimizer: a second real OOM)."""
    facts = RunFacts(model_config=LLAMA, prompt_tokens_max=200)
    small = TRL_DEFAULTS.replace(max_completion_length=256, optim="adamw_bnb_8bit")
    big = small.replace(optim="adamw_torch_fused")
    g = Judge(int(Judge(10 * 2**30).predict(facts, big).peak_bytes / 1.2))
    g.set_trl("logits")
    assert g.doubt > 0.3 and g.plausible(facts)(big) and g.plausible(facts)(small)
    g.ran_out(facts, small)  # the smaller config ran out of memory on the device
    assert not g.plausible(facts)(big) and not g.plausible(facts)(small)
    lora = small.replace(lora_r=16)
    assert g.plausible(facts)(lora)  # less than what ran out: still worth a probe


def test_a_config_that_allocates_as_much_where_memory_ran_out_is_judged_not_to_fit():
    """An OOM in generation: a micro-batch split saves memory in training, not in generation (the same rows are
    generated at once), so it neither fits nor is worth a probe, however much lower its predicted peak; fewer rows
    generated at once are. After a fragmentation the ceiling holds only under the allocator settings it ran out
    under (ms-swift's and Unsloth's wider model at half its peak: a split chosen after the pre-flight's stop ran out in
    generation, and the next choice generated the same rows)."""
    facts = RunFacts(model_config=LLAMA, prompt_tokens_max=200)
    user = TRL_DEFAULTS.replace(lora_r=8, max_completion_length=4096, per_device_train_batch_size=8,
                                gradient_accumulation_steps=1, num_generations=8)
    split = user.replace(per_device_train_batch_size=1, gradient_accumulation_steps=8)
    fewer = split.replace(num_generations=4, gradient_accumulation_steps=4)
    g = Judge(10 * 2**30)
    pu, ps, pf = (g.predict(facts, k) for k in (user, split, fewer))
    assert ps.peak_bytes < pu.peak_bytes and ps.phases["generation"] == pu.phases["generation"]
    assert pf.phases["generation"] < 0.9 * pu.phases["generation"]
    g = Judge(int(ps.peak_bytes * 1.5))  # room for the split by its peak
    assert g.fits(facts)(split) and g.plausible(facts)(split)
    g.ran_out(facts, user, "generation")
    assert not g.fits(facts)(split) and not g.plausible(facts)(split)
    assert g.fits(facts)(fewer) and g.plausible(facts)(fewer)
    frag = Judge(int(ps.peak_bytes * 1.5))
    frag.ran_out(facts, user, "generation", fragmented=True)
    assert not frag.fits(facts)(split)
    assert frag.fits(facts)(split.replace(expandable_segments=True))  # what can help a fragmentation


def test_after_an_oom_in_generation_fewer_rows_at_once_are_worth_a_launch_though_the_weights_are_most_of_it():
    """ms-swift's wider model at half its peak (issue 49): bf16 weights, 4 generations of 32 tokens generated 4 rows
    at once, ran out in generation (a 20 MiB segment for one block). Two generations at once allocate 93% as much
    there, the weights being most of both, but a third less of generation's own memory: judged to fit, where the same
    rows split into more micro-steps are not. The phases after generation never ran, so the OOM says nothing of them:
    the training step's prediction, the same for both, is not raised."""
    from test_estimate import SWIFT_WIDE

    from oomguard.vocab.oomreport import OOMReport

    facts = RunFacts(model_config=SWIFT_WIDE, prompt_tokens_max=71, trl_head="logits", lora_dropout=0.05)
    failed = TRL_DEFAULTS.replace(num_generations=4, max_completion_length=32, per_device_train_batch_size=1,
                                  gradient_accumulation_steps=4, dtype="bfloat16", lora_r=8, lora_alpha=32,
                                  lora_target_modules="all-linear", fp16=True, bf16=False, beta=0.04)
    fewer = failed.replace(num_generations=2, gradient_accumulation_steps=2)
    split = failed.replace(gradient_accumulation_steps=4, per_device_train_batch_size=1, steps_per_generation=4)
    g = Judge(49 * 2**20, simulated=True)
    g.set_trl("logits")
    pf, pn = g.predict(facts, failed), g.predict(facts, fewer)
    assert pn.phases["generation"] > (1 - g.doubt) * pf.phases["generation"]  # about as much in all
    assert pn.own("generation") < (1 - g.doubt) * pf.own("generation")  # a third less of its own
    assert g.fits(facts)(failed) and g.fits(facts)(fewer)
    g.learn(facts, failed, "oom", None, OOMReport("cuda", "allocator", "x", requested=20 * 2**20, capacity=49 * 2**20,
                                                  allocated=int(29.3 * 2**20)), phase="generation")
    assert not g.fits(facts)(failed) and not g.fits(facts)(split) and not g.plausible(facts)(split)
    assert g.fits(facts)(fewer) and g.plausible(facts)(fewer)


# -- the conductor's decisions ---------------------------------------------------------------------------------


def conductor(**kw) -> Conductor:
    """The decisions of `oomguard run` with its default policy (``kw``: other options), before any judge."""
    con = Conductor(Climb(DEFAULT), None, Policy(**kw), capacity=24 * 2**30, launched=True)
    con.climb.learn(RunFacts(model_config=LLAMA, prompt_tokens_max=200))
    con.reached = {"config", "trainer", "model"}  # every rung can reach the command
    return con


class ToyJudge:
    """The Judge's judges over the toy model: ``fits`` under ``limit`` GiB, ``plausible`` under ``maybe``."""

    doubt = 0.06
    relax_margin = None  # relaxing is judged as choosing is

    def __init__(self, limit: float, maybe: float) -> None:
        self.limit, self.maybe = limit, maybe

    def stop_margin(self):
        return 0.084, "the toy model"

    def fits(self, facts, margin=None):
        return under(self.limit)

    def plausible(self, facts, doubt=None):
        return under(self.maybe)

    def loads(self, facts, margin=None):
        return lambda k: True  # the toy model's weights are nothing

    def peak(self, facts):
        return lambda k: int(gib(k) * 2**30)


def attempt(con: Conductor, kind: AttemptKind, outcome: Outcome) -> Attempt:
    """An attempt of ``kind`` that ended with ``outcome``, recorded in the climb (the toy judge learns nothing)."""
    c = con.climb
    without = con.minimizer.trial if kind == AttemptKind.MINIMIZE else None
    a = Attempt(index=len(c.attempts) + 1, knobs=c.effective(without)[0].to_dict(),
                remedies=c.remedies_in_force(without), outcome=outcome, exit_code=0, seconds=1.0, kind=kind, step=2)
    c.record(a)
    return a


def test_after_the_probe_fits_a_closer_config_is_probed_then_the_run():
    con = conductor()
    con.judge = ToyJudge(10.0, 10.0)
    first = attempt(con, AttemptKind.PROBE, Outcome.OOM)
    assert con.after(first, None).kind is AttemptKind.PROBE
    chosen = con.climb.effective()[0]
    con.judge = ToyJudge(14.5, 15.5)  # the probe measured less than predicted
    probe = attempt(con, AttemptKind.PROBE, Outcome.OK)
    assert con.after(probe, None).kind is AttemptKind.PROBE  # a closer config, predicted to fit: probe it
    assert probe.choice is not None and probe.choice["after"] == "probe"
    closer = con.climb.effective()[0]
    assert closer.max_completion_length > chosen.max_completion_length
    assert closer.lora_r and con.climb.remedies_in_force() == ["lora"]
    again = attempt(con, AttemptKind.PROBE, Outcome.OK)
    assert con.after(again, None).kind is AttemptKind.RUN  # without LoRA the model is sure: no undo trial


def test_the_last_launch_the_budget_allows_is_the_run_itself():
    """A probe that fit on the last launch --max-attempts allows left no launch for the run (issue 49: ms-swift and
    Unsloth at half their peak ended `exhausted` with "a config fits, but the budget ran out"): the last launch after
    an OOM is the chosen config's run, as is a choice the budget leaves room to probe before its run."""
    con = conductor(max_attempts=3)
    con.judge = ToyJudge(10.0, 10.0)
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None).kind is AttemptKind.PROBE
    last = con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    assert last.kind is AttemptKind.RUN and not last.deferred
    assert any("the run itself" in (s.line or "") for s in last.said)


def test_a_doubtful_change_that_a_probe_shows_is_not_needed_is_dropped():
    """The completions were cut to 384 tokens with LoRA and expandable segments; the model is unsure whether the cut
    (without it: 14.0 GiB of 12) and the allocator setting (12.5) are needed. By default only the change of what
    GRPO learns from is worth a probe: the cut is tried without and dropped; the allocator setting stays."""
    con = conductor()
    con.judge = ToyJudge(12.0, 12.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    assert {"expandable_segments", "shorter_sequences"} <= set(con.climb.remedies_in_force())
    con.judge = ToyJudge(12.0, 14.1)  # unsure whether the cut is needed
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OK), None).kind is AttemptKind.MINIMIZE
    assert con.minimizer.trial == "shorter_sequences"
    trial = attempt(con, AttemptKind.MINIMIZE, Outcome.OK)
    assert con.after(trial, None).kind is AttemptKind.RUN  # expandable_segments costs nothing: no probe for it
    assert "shorter_sequences" not in con.climb.remedies_in_force() and "not needed" in trial.note
    assert "expandable_segments" in con.climb.remedies_in_force()


def test_minimize_probes_even_a_change_that_costs_nothing():
    con = conductor(minimize=True)
    con.judge = ToyJudge(12.0, 12.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    con.judge = ToyJudge(12.0, 12.6)
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OK), None).kind is AttemptKind.MINIMIZE
    tried = []
    while con.minimizer.trial is not None:
        tried.append(con.minimizer.trial)
        if con.after(attempt(con, AttemptKind.MINIMIZE, Outcome.OOM), None).kind is not AttemptKind.MINIMIZE:
            break
    assert "expandable_segments" in tried


def test_no_refine_goes_straight_to_the_run():
    con = conductor(refine=False)
    con.judge = ToyJudge(10.0, 10.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    con.judge = ToyJudge(14.5, 20.0)
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OK), None).kind is AttemptKind.RUN


def test_a_closer_config_never_takes_the_real_runs_place_in_the_budget():
    con = conductor(max_attempts=3)
    con.judge = ToyJudge(10.0, 10.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    con.judge = ToyJudge(14.5, 10.0)
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OK), None).kind is AttemptKind.RUN  # 2 used, 1 left


def test_back_to_a_config_a_probe_ran_goes_on_without_probing_it_again():
    con = conductor()
    con.judge = ToyJudge(10.0, 10.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    verified = con.climb.effective()[0]
    con.judge = ToyJudge(14.5, 10.0)
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OK), None).kind is AttemptKind.PROBE
    con.judge = ToyJudge(1.0, 1.0)  # the closer config ran out of memory, and the model learned
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None).kind is AttemptKind.RUN
    assert con.climb.effective()[0] == verified


def test_the_final_message_counts_undo_trials_that_ran_out_apart_from_the_climbs_ooms():
    from oomguard.run.verdict import conclude

    c = Climb(DEFAULT)
    record(c, "predicted")
    record(c, "ok")
    record(c, "oom", kind="minimize")
    record(c, "ok", kind="run")
    status, code, message = conclude(c.attempts[-1], c)
    assert (status, code) == ("stable", 0)
    assert message.startswith("stable after 0 out-of-memory attempt(s) and 1 pre-flight stop(s)")
    assert "1 probe(s) without a change ran out of memory, showing it needed" in message


def test_a_rechosen_config_whose_overrides_break_the_launch_gives_way_without_ending_the_run():
    con = conductor()
    con.judge = ToyJudge(10.0, 10.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    verified, rungs = con.climb.effective()[0], con.climb.remedies_in_force()
    con.judge = ToyJudge(14.5, 10.0)
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OK), None).kind is AttemptKind.PROBE
    broke = attempt(con, AttemptKind.PROBE, Outcome.FAILED)
    broke.override_error = {"where": "GRPOConfig", "error": "ValueError: nope"}
    assert con.after(broke, None).kind is AttemptKind.RUN  # not "failed": the config before it is known to fit
    assert con.climb.effective()[0] == verified and not con.climb.refused  # no rung refused for good
    assert con.climb.remedies_in_force() == rungs


def test_rungs_that_launched_are_never_taken_back_for_a_later_failure():
    con = conductor()
    con.judge = ToyJudge(10.0, 10.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    assert con.newly
    assert con.after(attempt(con, AttemptKind.PROBE, Outcome.OK), None).kind is AttemptKind.RUN
    broke = attempt(con, AttemptKind.RUN, Outcome.FAILED)
    broke.override_error = {"where": "GRPOTrainer", "error": "ValueError: resume"}
    assert con.after(broke, None).kind is None and not con.climb.refused


def test_no_optional_probe_when_max_time_leaves_no_room_for_it_and_the_run():
    con = conductor(max_time=100.0)
    con.judge = ToyJudge(12.0, 12.0)
    con.after(attempt(con, AttemptKind.PROBE, Outcome.OOM), None)
    con.judge = ToyJudge(14.5, 15.5)
    probe = attempt(con, AttemptKind.PROBE, Outcome.OK)
    probe.seconds = 120.0  # another probe would end past --max-time
    assert con.after(probe, None).kind is AttemptKind.RUN


def test_when_the_budget_ends_after_a_config_fit_the_message_says_so():
    from oomguard.run.verdict import conclude

    c = climbed_to(10.0)
    record(c, "ok")
    record(c, "oom", kind="minimize")
    status, _, message = conclude(c.attempts[-1], c, max_attempts=2)
    assert status == "exhausted"
    assert message.startswith("a config fits (its probe passed), but the budget (--max-attempts 2) ran out")
