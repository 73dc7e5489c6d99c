"""After the chosen config's probe fits: choose again with what the probe measured, and probe the changes the memory
model is unsure of, so the config that runs changes no more than memory demands.

Pure tests (no torch, nothing launched): toy memory models where the right answer is known, and the supervisor's
decisions after each kind of attempt.
"""

from __future__ import annotations

import json
from pathlib import Path

from oomguard.decide.choose import Preference, Rung
from oomguard.decide.climb import Climb
from oomguard.decide.ladder import load_ladder
from oomguard.decide.plan import Guide
from oomguard.display.ui import ConsoleReporter
from oomguard.run.minimize import Minimizer
from oomguard.run.supervisor import RunOptions, Supervisor
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
    g = Guide(10 * 2**30)
    facts = RunFacts(model_config=LLAMA, prompt_tokens_max=200)
    k = TRL_DEFAULTS.replace(max_completion_length=256)
    peak = g.predict(facts, k).peak_bytes
    assert Guide(int(peak / 1.03)).plausible(facts)(k) and not Guide(int(peak / 1.03)).fits(facts)(k)
    assert not Guide(int(peak / 1.10)).plausible(facts)(k)
    assert g.plausible(RunFacts()) is None  # no model config: nothing to predict


def test_a_config_predicted_as_large_as_one_that_ran_out_is_not_worth_an_undo_probe():
    """Under TRL 0.29's logits head the model may over-predict by 40%, so a config predicted just over the device is
    worth a probe without a change; not when it needs at least what a config that ran out of memory here needed
    (an accelerate client under TRL 0.29.1 probed without LoRA a config that was the one that had run out, less its
    8-bit optimizer: a second real OOM)."""
    facts = RunFacts(model_config=LLAMA, prompt_tokens_max=200)
    small = TRL_DEFAULTS.replace(max_completion_length=256, optim="adamw_bnb_8bit")
    big = small.replace(optim="adamw_torch_fused")
    g = Guide(int(Guide(10 * 2**30).predict(facts, big).peak_bytes / 1.2))
    g.set_trl("logits")
    assert g.doubt > 0.3 and g.plausible(facts)(big) and g.plausible(facts)(small)
    g.failed.append((facts, small))  # the smaller config ran out of memory on the device
    assert not g.plausible(facts)(big) and not g.plausible(facts)(small)
    lora = small.replace(lora_r=16)
    assert g.plausible(facts)(lora)  # less than what ran out: still worth a probe


# -- the supervisor's decisions ---------------------------------------------------------------------------------


def supervisor(tmp_path: Path, **kw) -> Supervisor:
    opts = RunOptions(ladder=DEFAULT, workdir=tmp_path / "wd", capacity=24 * 2**30, **kw)
    sup = Supervisor(["true"], opts, ConsoleReporter(quiet=True, live=False))
    sup.climb.learn(RunFacts(model_config=LLAMA, prompt_tokens_max=200))
    sup.reached = {"config", "trainer", "model"}  # every rung can reach the command
    return sup


class ToyGuide:
    """The Guide's judges over the toy model: ``fits`` under ``limit`` GiB, ``plausible`` under ``maybe``."""

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

    def peak(self, facts):
        return lambda k: int(gib(k) * 2**30)


def attempt(sup: Supervisor, kind: AttemptKind, outcome: Outcome) -> Attempt:
    c = sup.climb
    without = sup.minimizer.trial if kind == AttemptKind.MINIMIZE else None
    a = Attempt(index=len(c.attempts) + 1, knobs=c.effective(without)[0].to_dict(),
                remedies=c.remedies_in_force(without), outcome=outcome, exit_code=0, seconds=1.0, kind=kind, step=2)
    c.record(a)
    return a


def test_after_the_probe_fits_a_closer_config_is_probed_then_the_run(tmp_path):
    sup = supervisor(tmp_path)
    sup.guide = ToyGuide(10.0, 10.0)
    first = attempt(sup, AttemptKind.PROBE, Outcome.OOM)
    assert sup._decide(first, None) is AttemptKind.PROBE
    chosen = sup.climb.effective()[0]
    sup.guide = ToyGuide(14.5, 15.5)  # the probe measured less than predicted
    probe = attempt(sup, AttemptKind.PROBE, Outcome.OK)
    assert sup._decide(probe, None) is AttemptKind.PROBE  # a closer config, predicted to fit: probe it
    assert probe.choice is not None and probe.choice["after"] == "probe"
    closer = sup.climb.effective()[0]
    assert closer.max_completion_length > chosen.max_completion_length
    assert closer.lora_r and sup.climb.remedies_in_force() == ["lora"]
    again = attempt(sup, AttemptKind.PROBE, Outcome.OK)
    assert sup._decide(again, None) is AttemptKind.RUN  # without LoRA the model is sure: no undo trial


def test_a_doubtful_change_that_a_probe_shows_is_not_needed_is_dropped(tmp_path):
    """The completions were cut to 384 tokens with LoRA and expandable segments; the model is unsure whether the cut
    (without it: 14.0 GiB of 12) and the allocator setting (12.5) are needed. By default only the change of what
    GRPO learns from is worth a probe: the cut is tried without and dropped; the allocator setting stays."""
    sup = supervisor(tmp_path)
    sup.guide = ToyGuide(12.0, 12.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    assert {"expandable_segments", "shorter_sequences"} <= set(sup.climb.remedies_in_force())
    sup.guide = ToyGuide(12.0, 14.1)  # unsure whether the cut is needed
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OK), None) is AttemptKind.MINIMIZE
    assert sup.minimizer.trial == "shorter_sequences"
    trial = attempt(sup, AttemptKind.MINIMIZE, Outcome.OK)
    assert sup._decide(trial, None) is AttemptKind.RUN  # expandable_segments costs nothing: no probe for it
    assert "shorter_sequences" not in sup.climb.remedies_in_force() and "not needed" in trial.note
    assert "expandable_segments" in sup.climb.remedies_in_force()


def test_minimize_probes_even_a_change_that_costs_nothing(tmp_path):
    sup = supervisor(tmp_path, minimize=True)
    sup.guide = ToyGuide(12.0, 12.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    sup.guide = ToyGuide(12.0, 12.6)
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OK), None) is AttemptKind.MINIMIZE
    tried = []
    while sup.minimizer.trial is not None:
        tried.append(sup.minimizer.trial)
        if sup._decide(attempt(sup, AttemptKind.MINIMIZE, Outcome.OOM), None) is not AttemptKind.MINIMIZE:
            break
    assert "expandable_segments" in tried


def test_no_refine_goes_straight_to_the_run(tmp_path):
    sup = supervisor(tmp_path, refine=False)
    sup.guide = ToyGuide(10.0, 10.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    sup.guide = ToyGuide(14.5, 20.0)
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OK), None) is AttemptKind.RUN


def test_a_closer_config_never_takes_the_real_runs_place_in_the_budget(tmp_path):
    sup = supervisor(tmp_path, max_attempts=3)
    sup.guide = ToyGuide(10.0, 10.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    sup.guide = ToyGuide(14.5, 10.0)
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OK), None) is AttemptKind.RUN  # 2 used, 1 left


def test_back_to_a_config_a_probe_ran_goes_on_without_probing_it_again(tmp_path):
    sup = supervisor(tmp_path)
    sup.guide = ToyGuide(10.0, 10.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    verified = sup.climb.effective()[0]
    sup.guide = ToyGuide(14.5, 10.0)
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OK), None) is AttemptKind.PROBE
    sup.guide = ToyGuide(1.0, 1.0)  # the closer config ran out of memory, and the model learned
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None) is AttemptKind.RUN
    assert sup.climb.effective()[0] == verified


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


def test_a_rechosen_config_whose_overrides_break_the_launch_gives_way_without_ending_the_run(tmp_path):
    sup = supervisor(tmp_path)
    sup.guide = ToyGuide(10.0, 10.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    verified, rungs = sup.climb.effective()[0], sup.climb.remedies_in_force()
    sup.guide = ToyGuide(14.5, 10.0)
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OK), None) is AttemptKind.PROBE
    broke = attempt(sup, AttemptKind.PROBE, Outcome.FAILED)
    broke.override_error = {"where": "GRPOConfig", "error": "ValueError: nope"}
    assert sup._decide(broke, None) is AttemptKind.RUN  # not "failed": the config before it is known to fit
    assert sup.climb.effective()[0] == verified and not sup.climb.refused  # no rung refused for good
    assert sup.climb.remedies_in_force() == rungs


def test_rungs_that_launched_are_never_taken_back_for_a_later_failure(tmp_path):
    sup = supervisor(tmp_path)
    sup.guide = ToyGuide(10.0, 10.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    assert sup.newly
    assert sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OK), None) is AttemptKind.RUN
    broke = attempt(sup, AttemptKind.RUN, Outcome.FAILED)
    broke.override_error = {"where": "GRPOTrainer", "error": "ValueError: resume"}
    assert sup._decide(broke, None) is None and not sup.climb.refused


def test_no_optional_probe_when_max_time_leaves_no_room_for_it_and_the_run(tmp_path):
    sup = supervisor(tmp_path, max_time=100.0)
    sup.guide = ToyGuide(12.0, 12.0)
    sup._decide(attempt(sup, AttemptKind.PROBE, Outcome.OOM), None)
    sup.guide = ToyGuide(14.5, 15.5)
    probe = attempt(sup, AttemptKind.PROBE, Outcome.OK)
    probe.seconds = 120.0  # another probe would end past --max-time
    assert sup._decide(probe, None) is AttemptKind.RUN


def test_when_the_budget_ends_after_a_config_fit_the_message_says_so():
    from oomguard.run.verdict import conclude

    c = climbed_to(10.0)
    record(c, "ok")
    record(c, "oom", kind="minimize")
    status, _, message = conclude(c.attempts[-1], c, max_attempts=2)
    assert status == "exhausted"
    assert message.startswith("a config fits (its probe passed), but the budget (--max-attempts 2) ran out")
