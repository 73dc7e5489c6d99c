"""The one owner of a climb's decisions (``oomguard.decide.conductor``) through its public API, without launching
anything: what the memory model learns from an attempt, the budget, what comes after each kind of attempt, the ladder
a run reported distributed takes, and `oomguard run` and ``@oomguard.guard`` making the same choices from the same
outcomes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from oomguard.decide.climb import Climb
from oomguard.decide.conductor import PROBE_TAIL, Conductor, Policy
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import load_ladder
from oomguard.vocab.ended import Ended
from oomguard.vocab.knobs import KNOB_NAMES, TRL_DEFAULTS, RunFacts
from oomguard.vocab.records import Attempt, AttemptKind, Outcome

LLAMA = json.loads((Path(__file__).parent / "fixtures" / "models" / "llama-3.2-1b" / "config.json").read_text())
OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which 1.00 GiB "
            "is free.")


def conductor(judge: bool = True, **policy) -> Conductor:
    """`oomguard run`'s decisions on a 24 GiB device for Llama-3.2-1B (``policy``: its options)."""
    climb = Climb(load_ladder("default"))
    climb.learn(RunFacts(model_config=LLAMA, prompt_tokens_max=200))
    return Conductor(climb, Judge(24 * 2**30) if judge else None, Policy(**policy), launched=True)


def attempt(index: int, kind: AttemptKind, outcome: Outcome, con: Conductor, **kw) -> Attempt:
    return Attempt(index=index, knobs=con.climb.effective()[0].to_dict(), remedies=[], outcome=outcome, exit_code=0,
                   seconds=1.0, kind=kind, **kw)


def test_a_probe_teaches_the_model_its_peak_plus_the_tail_the_real_run_may_add():
    con = conductor()
    a = attempt(1, AttemptKind.PROBE, Outcome.OK, con, step=2, peak_bytes=10 * 2**30)
    assert con.judge is not None
    predicted = con.judge.predict(con.climb.facts, con.climb.effective()[0]).peak_alloc_bytes
    con.record(a, None)
    assert abs(con.judge.coefficients.scale - 10 * 2**30 * (1 + PROBE_TAIL) / predicted) < 1e-6
    assert con.climb.attempts == [a] and a.predicted_bytes is not None


def test_a_one_step_success_teaches_nothing_but_a_call_that_counts_no_steps_does():
    """One optimizer step has no optimizer state in its forward: its peak is not the steady state's. A guarded call
    that ran to its end counts no steps: its peak is the call's."""
    con = conductor()
    assert con.judge is not None
    before = con.judge.coefficients
    con.record(attempt(1, AttemptKind.PROBE, Outcome.OK, con, step=1, peak_bytes=2**30), None)
    assert con.judge.coefficients == before
    con.record(attempt(2, AttemptKind.RUN, Outcome.OK, con, peak_bytes=2**30), None)
    assert con.judge.coefficients != before


def test_undo_trials_do_not_spend_the_budget():
    con = conductor(max_attempts=2)
    con.record(attempt(1, AttemptKind.PROBE, Outcome.OK, con), None)
    for i in range(2, 6):
        con.record(attempt(i, AttemptKind.MINIMIZE, Outcome.OK, con), None)
    assert not con.spent()
    con.record(attempt(6, AttemptKind.RUN, Outcome.OK, con), None)
    assert con.spent()


def test_the_first_attempt_is_a_probe_only_where_a_device_could_run_out():
    assert conductor().first().kind is AttemptKind.PROBE
    assert conductor().first().deferred  # the training process may find the model sure: then it is the run
    assert not conductor(always_probe=True).first().deferred
    assert conductor(device=False).first().kind is AttemptKind.RUN
    assert conductor(probe_steps=0).first().kind is AttemptKind.RUN


def test_what_comes_after_each_attempt():
    con = conductor()
    assert con.after(attempt(1, AttemptKind.PROBE, Outcome.OK, con), None).kind is AttemptKind.RUN
    assert con.after(attempt(2, AttemptKind.RUN, Outcome.OK, con), None).kind is None
    assert con.after(attempt(3, AttemptKind.RUN, Outcome.FAILED, con), None).kind is None  # passed through
    assert con.after(attempt(3, AttemptKind.RUN, Outcome.INTERRUPTED, con), None).kind is None
    stop = attempt(4, AttemptKind.PROBE, Outcome.PREDICTED, con)
    con.record(stop, None)
    nxt = con.after(stop, None)
    assert nxt.kind is AttemptKind.PROBE  # chosen by prediction, verified by a probe
    assert stop.choice is not None and stop.climbed
    assert next(s.decision for s in nxt.said if s.decision is not None).steps  # the front-end shows the climb


def test_a_replayed_lock_is_never_climbed():
    con = conductor(replay=True)
    oom = attempt(1, AttemptKind.RUN, Outcome.OOM, con)
    con.record(oom, None)
    nxt = con.after(oom, None)
    assert nxt.kind is None and nxt.said[0].decision is not None and nxt.said[0].decision.exhausted is not None
    assert con.climb.exhausted is not None and con.climb.exhausted.skipped[0][0] == "lock"


def test_a_failure_right_after_a_rung_whose_overrides_broke_it_takes_the_rung_back():
    con = conductor(judge=False)
    oom = attempt(1, AttemptKind.PROBE, Outcome.OOM, con)
    con.record(oom, None)
    assert con.after(oom, None).kind is AttemptKind.PROBE
    assert con.newly == ["expandable_segments"]
    broke = attempt(2, AttemptKind.PROBE, Outcome.FAILED, con,
                    override_error={"where": "GRPOConfig", "error": "ValueError: nope"})
    con.record(broke, None)
    nxt = con.after(broke, None)
    assert nxt.kind is AttemptKind.PROBE and nxt.said[0].line and "took back" in nxt.said[0].line
    assert "took back expandable_segments" in (broke.note or "")
    assert "expandable_segments" in con.climb.refused and "expandable_segments" not in con.climb.remedies_in_force()


def test_a_trl_newer_than_tested_is_probed_even_under_no_probe():
    con = conductor(probe_steps=0)
    assert con.take_trl("99.0.0", None) and con.probe_steps == 2
    assert con.take_trl("99.0.0", None) == []  # said once


def test_what_the_training_process_could_not_observe_is_said_once_and_probed_even_under_no_probe():
    con = conductor(probe_steps=0)
    small = TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=16, per_device_train_batch_size=2, num_generations=2,
                                 max_completion_length=64)
    est = con.judge.predict(con.climb.facts, small)
    assert est is not None and con.judge.verdict(est).decision == "run"
    line = "the generation engine: the script's rollout_func generates"
    said = con.take_facts(con.climb.facts.replace(unobserved=(line,)))
    assert said == [f"not observed: {line} (the memory model is unsure of this run: a probe goes first)"]
    assert con.probe_steps == 2 and con.judge.unobserved == (line,) and con.judge.verdict(est).decision != "run"
    assert con.take_facts(con.climb.facts.replace(unobserved=(line,))) == []  # said once


def test_a_run_reported_distributed_takes_the_multi_gpu_ladder_unless_one_was_named():
    con = conductor(ladder_auto=True)
    lines = con.take_facts(con.climb.facts.replace(world_size=4))
    assert con.climb.ladder.name == "multi-gpu" and any("ladder multi-gpu" in line for line in lines)
    named = conductor()
    named.take_facts(named.climb.facts.replace(world_size=4))
    assert named.climb.ladder.name == "default"


def test_the_device_the_training_process_sees_replaces_nvmls_size():
    con = conductor()
    assert con.take_device(16 * 2**30, from_nvml=False) is None  # a size the user named stays
    line = con.take_device(16 * 2**30, from_nvml=True)
    assert line and "16.00 GiB" in line and con.capacity == 16 * 2**30
    assert con.judge is not None and con.judge.capacity == 16 * 2**30


def test_the_machine_calibration_keeps_worst_case_probes_of_this_model_only(tmp_path, monkeypatch):
    """A real run's completions may stop early, so its peak is below the worst case the model predicts; only a
    passing probe (the worst case) is recorded, under this model's shape, and another model's probes never scale
    this one's predictions."""
    from oomguard.memory.calibration import load_calibration, machine_key, model_key
    from oomguard.memory.estimate import ModelSpec

    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(tmp_path / "cache"))
    con = conductor()
    con.judge = Judge(24 * 2**30, device_name="NVIDIA H100 80GB HBM3")
    key = machine_key("NVIDIA H100 80GB HBM3", simulated=False)
    mk = model_key(ModelSpec.from_config(LLAMA))
    con.learn(attempt(1, AttemptKind.RUN, Outcome.OK, con, step=5, peak_bytes=5 * 2**30), None)
    assert load_calibration(key) is None
    con.learn(attempt(2, AttemptKind.PROBE, Outcome.OK, con, step=2, peak_bytes=9 * 2**30,
                      peak_reserved_bytes=10 * 2**30), None)
    cal = load_calibration(key, model=mk)
    assert cal is not None and cal.runs == 1 and load_calibration(key, model="L2 h64 i256 a4/4x16 v1000") is None
    # a later run of the same model starts from it; one of another model does not
    same = Judge(24 * 2**30, device_name="NVIDIA H100 80GB HBM3")
    same.predict(con.climb.facts, con.climb.effective()[0])
    assert same.calibration is not None and same.coefficients.scale == cal.apply(same.base).scale
    other = Judge(24 * 2**30, device_name="NVIDIA H100 80GB HBM3")
    other.predict(RunFacts(model_config={**LLAMA, "num_hidden_layers": 8}, prompt_tokens_max=200),
                  con.climb.effective()[0])
    assert other.calibration is None and other.coefficients == other.base


# -- `oomguard run` and the guard: one conductor, the same choices -----------------------------------------------


def _run_choices(tmp_path: Path, user: dict, ooms: int) -> list[dict]:
    """The knobs of each attempt of `oomguard run --no-probe` whose first ``ooms`` launches run out of memory: the
    Supervisor's own loop (the conductor's ``drive``), with a launcher that stands in for the training process (it
    reports the user's config, passes every construction point, and ends as told: an ``Ended``)."""
    from oomguard.display.ui import ConsoleReporter
    from oomguard.oom.diagnose import diagnose
    from oomguard.oom.parse.scan import parse_oom
    from oomguard.run.supervisor import RunOptions, Supervisor
    from oomguard.vocab.events import CodeSeen, ModelSeen

    sup = Supervisor(["train.py"], RunOptions(ladder=load_ladder("default"), workdir=tmp_path / "wd", predict=False,
                                              policy=Policy(probe_steps=0), report_path=tmp_path / "r.json",
                                              lock_path=tmp_path / "l.json"),
                     ConsoleReporter(quiet=True, live=False))
    con = sup.conductor

    def launch(nxt):
        index = len(con.climb.attempts) + 1
        sup.launcher.learn([CodeSeen(point="config", observed=user), CodeSeen(point="trainer"), ModelSeen()])
        oom = index <= ooms
        report = parse_oom(OOM_TEXT)
        return Ended(knobs=con.climb.effective()[0].to_dict(), remedies=con.climb.remedies_in_force(),
                     outcome=Outcome.OOM if oom else Outcome.OK, exit_code=1 if oom else 0, seconds=1.0, kind=nxt.kind,
                     diagnosis=diagnose(report) if oom and report is not None else None)

    sup.launcher.launch = launch  # type: ignore[method-assign]
    assert sup.run() == 0
    return [a.knobs for a in con.climb.attempts]


def _guard_choices(user: dict, ooms: int) -> list[dict]:
    """The same through ``@oomguard.guard``: a function that reads every knob, and runs out of memory ``ooms``
    times."""
    import oomguard

    calls = []

    @oomguard.guard(knobs=user, max_attempts=8, verbose=False)
    def train(knobs):
        for name in KNOB_NAMES:
            getattr(knobs, name)
        calls.append(1)
        if len(calls) <= ooms:
            raise RuntimeError(OOM_TEXT)

    train()
    assert train.report is not None
    return [a.knobs for a in train.report.attempts]


@pytest.mark.parametrize("ooms", [1, 3, 5])
def test_run_and_the_guard_make_the_same_choices_from_the_same_outcomes(tmp_path, ooms):
    user = dataclasses.asdict(TRL_DEFAULTS.replace(per_device_train_batch_size=8, num_generations=8))
    user = {k: v for k, v in user.items() if v is not None}
    run, guarded = _run_choices(tmp_path, user, ooms), _guard_choices(user, ooms)
    assert len(run) == len(guarded) == ooms + 1
    assert len({json.dumps(k, sort_keys=True) for k in run}) == ooms + 1  # each OOM changed something
    assert run == guarded
