"""The supervisor's decisions without launching anything: what the memory model learns from a probe, the budget,
and what comes after each kind of attempt."""

from __future__ import annotations

import json
from pathlib import Path

from oomguard.decide.ladder import load_ladder
from oomguard.display.ui import ConsoleReporter
from oomguard.run.supervisor import PROBE_TAIL, RunOptions, Supervisor
from oomguard.vocab.knobs import RunFacts
from oomguard.vocab.records import Attempt, AttemptKind, Outcome

LLAMA = json.loads((Path(__file__).parent / "fixtures" / "models" / "llama-3.2-1b" / "config.json").read_text())


def supervisor(tmp_path: Path, **kw) -> Supervisor:
    opts = RunOptions(ladder=load_ladder("default"), workdir=tmp_path / "wd", capacity=24 * 2**30, **kw)
    sup = Supervisor(["true"], opts, ConsoleReporter(quiet=True, live=False))
    sup.climb.learn(RunFacts(model_config=LLAMA, prompt_tokens_max=200))
    return sup


def attempt(index: int, kind: AttemptKind, outcome: Outcome, sup: Supervisor, **kw) -> Attempt:
    return Attempt(index=index, knobs=sup.climb.effective()[0].to_dict(), remedies=[], outcome=outcome, exit_code=0,
                   seconds=1.0, kind=kind, **kw)


def test_a_probe_teaches_the_model_its_peak_plus_the_tail_the_real_run_may_add(tmp_path):
    sup = supervisor(tmp_path)
    a = attempt(1, AttemptKind.PROBE, Outcome.OK, sup, step=2, peak_bytes=10 * 2**30)
    predicted = sup.guide.predict(sup.climb.facts, sup.climb.effective()[0]).peak_alloc_bytes
    sup._teach_guide(a, None)
    assert abs(sup.guide.coefficients.scale - 10 * 2**30 * (1 + PROBE_TAIL) / predicted) < 1e-6


def test_a_one_step_success_teaches_nothing(tmp_path):
    """One optimizer step has no optimizer state in its forward: its peak is not the steady state's."""
    sup = supervisor(tmp_path)
    before = sup.guide.coefficients
    sup._teach_guide(attempt(1, AttemptKind.PROBE, Outcome.OK, sup, step=1, peak_bytes=2**30), None)
    assert sup.guide.coefficients == before


def test_minimize_trials_do_not_spend_the_budget(tmp_path):
    sup = supervisor(tmp_path, max_attempts=2)
    sup.climb.record(attempt(1, AttemptKind.PROBE, Outcome.OK, sup))
    for i in range(2, 6):
        sup.climb.record(attempt(i, AttemptKind.MINIMIZE, Outcome.OK, sup))
    assert not sup._budget_spent()
    sup.climb.record(attempt(6, AttemptKind.RUN, Outcome.OK, sup))
    assert sup._budget_spent()


def test_what_comes_after_each_attempt(tmp_path):
    sup = supervisor(tmp_path)
    assert sup._decide(attempt(1, AttemptKind.PROBE, Outcome.OK, sup), None) is AttemptKind.RUN
    assert sup._decide(attempt(2, AttemptKind.RUN, Outcome.OK, sup), None) is None
    assert sup._decide(attempt(3, AttemptKind.RUN, Outcome.FAILED, sup), None) is None  # passed through
    stop = attempt(4, AttemptKind.PROBE, Outcome.PREDICTED, sup)
    sup.climb.record(stop)
    assert sup._decide(stop, None) is AttemptKind.PROBE  # chosen by prediction, verified by a probe
    assert stop.choice is not None and stop.climbed


def test_a_failure_right_after_a_rung_whose_overrides_broke_it_takes_the_rung_back(tmp_path):
    sup = supervisor(tmp_path, predict=False)
    oom = attempt(1, AttemptKind.PROBE, Outcome.OOM, sup)
    sup.climb.record(oom)
    assert sup._decide(oom, None) is AttemptKind.PROBE
    first = list(sup.newly)
    assert first == ["expandable_segments"]
    broke = attempt(2, AttemptKind.PROBE, Outcome.FAILED, sup,
                    override_error={"where": "GRPOConfig", "error": "ValueError: nope"})
    sup.climb.record(broke)
    assert sup._decide(broke, None) is AttemptKind.PROBE
    assert "took back expandable_segments" in broke.note
    assert "expandable_segments" in sup.climb.refused and "expandable_segments" not in sup.climb.remedies_in_force()


def test_minimize_never_probes_the_same_overrides_twice():
    """A graded rung climbed twice is one trial (every pass of it leaves together), and a rung whose removal changes
    nothing (blocked by a later rung) is no trial at all."""
    from oomguard.decide.choose import Rung
    from oomguard.decide.climb import Climb
    from oomguard.run.minimize import Minimizer
    from oomguard.strategies import make_remedy

    c = Climb(load_ladder("default"))
    seq, lora, q4 = make_remedy("shorter_sequences"), make_remedy("lora"), make_remedy("load_4bit")
    c.climbed = c.applied = [Rung(seq), Rung(lora), Rung(seq), Rung(q4)]
    m = Minimizer()
    m.start(c)
    trials = []
    while (name := m.next_trial(c)) is not None:
        trials.append((name, c.effective(name)[0]))
    names = [n for n, _ in trials]
    assert sorted(names) == sorted(set(names))  # no rung twice
    assert len({k for _, k in trials}) == len(trials)  # no overrides twice
    assert "shorter_sequences" in names
    # without lora, load_4bit brings its own LoRA r=16: the same knobs as with it, so that trial is skipped
    assert "lora" not in names


def test_the_machine_calibration_keeps_worst_case_probes_of_this_model_only(tmp_path, monkeypatch):
    """A real run's completions may stop early, so its peak is below the worst case the model predicts; only a
    passing probe (the worst case) is recorded, under this model's shape, and another model's probes never scale
    this one's predictions."""
    from oomguard.decide.plan import Guide
    from oomguard.memory.calibration import load_calibration, machine_key, model_key
    from oomguard.memory.estimate import ModelSpec

    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(tmp_path / "cache"))
    sup = supervisor(tmp_path)
    sup.guide = Guide(24 * 2**30, device_name="NVIDIA H100 80GB HBM3")
    key = machine_key("NVIDIA H100 80GB HBM3", simulated=False)
    mk = model_key(ModelSpec.from_config(LLAMA))
    sup._teach_guide(attempt(1, AttemptKind.RUN, Outcome.OK, sup, step=5, peak_bytes=5 * 2**30), None)
    assert load_calibration(key) is None
    sup._teach_guide(attempt(2, AttemptKind.PROBE, Outcome.OK, sup, step=2, peak_bytes=9 * 2**30,
                             peak_reserved_bytes=10 * 2**30), None)
    cal = load_calibration(key, model=mk)
    assert cal is not None and cal.runs == 1 and load_calibration(key, model="L2 h64 i256 a4/4x16 v1000") is None
    # a later run of the same model starts from it; one of another model does not
    same = Guide(24 * 2**30, device_name="NVIDIA H100 80GB HBM3")
    same.predict(sup.climb.facts, sup.climb.effective()[0])
    assert same.calibration is not None and same.coefficients.scale == cal.apply(same.base).scale
    other = Guide(24 * 2**30, device_name="NVIDIA H100 80GB HBM3")
    other.predict(RunFacts(model_config={**LLAMA, "num_hidden_layers": 8}, prompt_tokens_max=200),
                  sup.climb.effective()[0])
    assert other.calibration is None and other.coefficients == other.base
