"""Issue 46, points 3 and 4, through the conductor's public API (no launch): a memory model the run proved wrong stops
being sure (it says which term missed, probes first, and tries speed and allocator changes before any trade on its
word alone); a rung that changed nothing of what failed is taken back; a fixed allocation the model does not know
ends the climb with that diagnosis and leaves the run's signal alone; a pre-flight stop is followed by the config the
model credits with enough, all rungs at once, never a chain of stops; a config the pre-flight would stop again is not
launched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from oomguard.decide.choose import Rung, replay
from oomguard.decide.climb import Climb
from oomguard.decide.conductor import Conductor, Policy
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import load_ladder
from oomguard.oom.diagnose import diagnose
from oomguard.oom.parse import parse_oom
from oomguard.strategies import Context
from oomguard.vocab.diagnosis import Live
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.records import Attempt, AttemptKind, Outcome
from oomguard.vocab.sizes import GiB, MiB, format_size

from helpers import grpo_tiny, run_oomguard

QWEN = json.loads((Path(__file__).parent / "fixtures" / "models" / "qwen3-0.6b" / "config.json").read_text())
# the script's own GRPOConfig: 8 generations of up to 1024 tokens, 32 rows generated at once
USER = {"num_generations": 8, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
        "steps_per_generation": 4, "max_completion_length": 1024, "learning_rate": 1e-5, "bf16": True,
        "dtype": "bfloat16"}
FACTS = RunFacts(model_config=QWEN, prompt_tokens_max=200)


def conductor(capacity: int, **policy) -> Conductor:
    climb = Climb(load_ladder("default"))
    climb.observe(USER)
    climb.learn(FACTS)
    con = Conductor(climb, Judge(capacity), Policy(**policy), launched=True)
    con.reached = {"config", "trainer", "model"}  # the script passed every construction point
    return con


def predicted(con: Conductor, knobs: Knobs | None = None) -> int:
    assert con.judge is not None
    est = con.judge.predict(con.climb.facts, knobs or con.climb.effective()[0])
    assert est is not None
    return est.peak_alloc_bytes


def oom_text(request: int, capacity: int, allocated: int) -> str:
    return (f"CUDA out of memory. Tried to allocate {format_size(request)}. GPU 0 has a total capacity of "
            f"{format_size(capacity)} of which {format_size(capacity - allocated - 300 * MiB)} is free. Including "
            f"non-PyTorch memory, this process has {format_size(allocated + 300 * MiB)} memory in use. Of the "
            f"allocated memory {format_size(allocated)} is allocated by PyTorch, and 0 bytes is reserved by PyTorch "
            "but unallocated.")


def launch(con: Conductor, kind: AttemptKind, outcome: Outcome, text: str | None = None, phase: str = "generation",
           **kw):
    """One attempt of the config in force, recorded, and what the conductor does next."""
    index = len(con.climb.attempts) + 1
    a = Attempt(index=index, knobs=con.climb.effective()[0].to_dict(), remedies=con.climb.remedies_in_force(),
                outcome=outcome, exit_code=0, seconds=1.0, kind=kind, **kw)
    d = None
    if text is not None:
        report = parse_oom(text)
        assert report is not None
        d = diagnose(report, phase=phase)
    con.record(a, d)
    return a, con.after(a, d)


def lines(nxt) -> str:
    return "\n".join(s.line for s in nxt.said if s.line)


def test_a_fixed_allocation_the_model_does_not_know_ends_the_climb_and_spends_no_signal():
    """Continuous batching's paged cache as issue 46 saw it: a 10.74 GiB request at the start of every generation,
    whatever the generations, on a device of half the run's peak. The second OOM with the same request ends the run,
    naming the allocation; num_generations and max_completion_length stay the script's in every attempt."""
    p = predicted(conductor(80 * GiB))
    capacity = int(3.67 * p)  # 5.54 GiB for a run predicted at 1.51 GiB
    con = conductor(capacity)
    request = int(1.94 * capacity)  # 10.74 GiB of 5.54
    text = oom_text(request, capacity, int(0.8 * p))
    first, nxt = launch(con, AttemptKind.RUN, Outcome.OOM, text)
    # the model predicted a fit: the OOM's lower bound proves it wrong, and it says by how much
    assert first.miss is not None and first.miss["at_least"] and first.miss["factor"] > 2
    assert "the memory model was wrong here" in lines(nxt) and "unsure" in lines(nxt)
    assert nxt.kind is AttemptKind.PROBE and not nxt.deferred  # unsure: probed first
    assert con.proofs.unsure  # the pre-flight stops nothing on its word (run/attempts.py): a probe measures
    second, nxt = launch(con, AttemptKind.PROBE, Outcome.OOM, text)
    assert nxt.kind is None and con.climb.exhausted is not None
    reason, why = con.climb.exhausted.skipped[0]
    assert reason == "fixed-allocation" and f"a fixed allocation of {format_size(request)} in generation" in why
    assert "does not count" in why and "fixed allocation" in (second.note or "")
    for a in (first, second):
        assert (a.knobs["num_generations"], a.knobs["max_completion_length"]) == (8, 1024), a.knobs
    assert second.knobs != first.knobs  # a speed change was tried, and taken back
    assert not con.climb.remedies_in_force() and set(con.climb.refused) >= {"generation_rounds"}


def test_under_continuous_batching_a_request_larger_than_the_device_is_first_its_paged_cache():
    """The same request where the script generates with transformers' continuous batching: a request larger than the
    device while generating is the paged cache (transformers sized it from more free memory than the process may
    use), so its share is lowered with the first speed changes, before any signal; only when the request stays the
    same after that does the climb end on the fixed allocation."""
    p = predicted(conductor(80 * GiB))
    capacity = int(3.67 * p)
    con = conductor(capacity)
    con.climb.observe({**USER, "use_transformers_continuous_batching": True})
    con.climb.learn(FACTS.replace(generation_engine="continuous_batching"))
    text = oom_text(int(1.94 * capacity), capacity, int(0.8 * p))
    launch(con, AttemptKind.RUN, Outcome.OOM, text)
    assert "paged_cache" in con.climb.remedies_in_force()
    knobs = con.climb.effective()[0]
    assert knobs.cb_max_memory_percent < 0.5 and (knobs.num_generations, knobs.max_completion_length) == (8, 1024)
    launch(con, AttemptKind.PROBE, Outcome.OOM, text)
    assert con.climb.exhausted is not None and con.climb.exhausted.skipped[0][0] == "fixed-allocation"
    assert "paged_cache" in con.climb.refused  # taken back: it changed nothing of what failed


def test_a_rung_that_changed_nothing_of_what_failed_is_taken_back_and_not_tried_again():
    """Without the memory model (--no-predict) the ladder climbs one rung at a time: an OOM that fails on the same
    request, in the same phase, as much live, after the micro-batch split, takes the split back (the memory that ran
    out was not the micro-batch's)."""
    capacity = 24 * GiB
    climb = Climb(load_ladder("default"))
    climb.observe(USER)
    climb.learn(FACTS)
    con = Conductor(climb, None, Policy(probe_steps=0), launched=True)
    con.reached = {"config", "trainer", "model"}
    text = oom_text(16 * MiB, capacity, int(23.5 * GiB))
    launch(con, AttemptKind.RUN, Outcome.OOM, text, phase="backward")
    assert con.climb.remedies_in_force() == ["micro_batch"]
    _, nxt = launch(con, AttemptKind.RUN, Outcome.OOM, text, phase="backward")
    assert "took back micro_batch" in lines(nxt) and "micro_batch" in con.climb.refused
    assert "micro_batch" not in con.climb.remedies_in_force() and nxt.kind is AttemptKind.RUN
    assert con.climb.remedies_in_force() and con.climb.exhausted is None  # the next rung, not the end
    # an OOM that moved (less live, another request) takes nothing back
    before = list(con.climb.remedies_in_force())
    launch(con, AttemptKind.RUN, Outcome.OOM, oom_text(40 * MiB, capacity, int(20 * GiB)), phase="backward")
    assert set(before) <= set(con.climb.remedies_in_force())


def out_of_memory_at(need: float) -> tuple[Conductor, Attempt, Any]:
    """The user's config on a device 1.3 times its prediction, run out of memory in backward having needed ``need``
    times the prediction (the step's own memory): the attempt, and what the conductor does next."""
    p = predicted(conductor(24 * GiB))
    capacity = int(p * 1.3)
    con = conductor(capacity)
    state = con.judge.predict(FACTS, con.climb.effective()[0]).breakdown["weights"]
    req = 64 * MiB
    allocated = int(need * p) - req
    report = parse_oom(oom_text(req, capacity, allocated))
    d = diagnose(report, phase="backward", live=Live(parameters=state, other=allocated - state))
    a = Attempt(index=1, knobs=con.climb.effective()[0].to_dict(), remedies=[], outcome=Outcome.OOM, exit_code=1,
                seconds=1.0, kind=AttemptKind.RUN)
    con.record(a, d)
    return con, a, con.after(a, d)


def test_a_proven_wrong_model_tries_a_speed_change_before_any_trade_on_its_word():
    """The tool-calling script of issue 46: predicted sure to fit, it needed 1.7 times the prediction (the prompts'
    activations). The next config keeps precision, capacity and signal: the speed and allocator changes at their
    strongest, probed, with the pre-flight off; what missed is named from what was live."""
    con, a, nxt = out_of_memory_at(1.7)
    assert a.miss is not None and a.miss["term"] == "activations" and a.miss["at_least"]
    assert "what missed: the step's own memory" in lines(nxt)
    k = con.climb.effective()[0]
    classes = {r.remedy.cost for r in con.climb.applied}
    assert classes and classes <= {"none", "speed"}, con.climb.remedies_in_force()
    assert (k.dtype, k.lora_r, k.optim, k.num_generations) == ("bfloat16", 0, TRL_DEFAULTS.optim, 8)
    assert nxt.kind is AttemptKind.PROBE and not nxt.deferred and con.proofs.unsure


def test_a_stable_run_far_above_its_prediction_says_so():
    con = conductor(80 * GiB)
    p = predicted(con)
    a, nxt = launch(con, AttemptKind.RUN, Outcome.OK, step=5, peak_bytes=7 * p,
                    trace=[{"step": s, "kept": p // 4, "peak": 7 * p} for s in range(1, 6)])
    assert nxt.kind is None and a.miss is not None and a.miss["factor"] > 6
    assert "the config held, but predictions of this run are not to be trusted" in lines(nxt)
    assert a.miss["term"] == "generation buffers"  # the model's dominant phase: where the peak is
    from oomguard.run.verdict import conclude

    status, _code, message = conclude(a, con.climb)
    assert status == "stable" and "its peak was 7.00x the memory model's prediction" in message


def test_a_peak_within_the_models_error_is_no_miss():
    con = conductor(80 * GiB)
    a, nxt = launch(con, AttemptKind.RUN, Outcome.OK, step=5, peak_bytes=int(predicted(con) * 1.05))
    assert a.miss is None and not con.proofs.unsure and not lines(nxt)


def test_after_a_preflight_stop_the_next_config_takes_every_rung_the_model_credits_at_once():
    """Nothing the ladder reaches is predicted to fit with the model's margin, but its strongest configs are within
    the pre-flight's margin of the device: the next config is the cheapest of those, every rung it needs at once (its
    probe tells), not the allocator's rung alone, to be stopped again."""
    big = conductor(80 * GiB)
    steps, _ = big.climb.ladder.climb_by_cost(Context(knobs=big.climb.start(), facts=FACTS), lambda _k: False)
    least = big.judge.predict(FACTS, replay(big.climb.start(), [Rung(s.remedy) for s in steps], FACTS)[0]).peak_bytes
    con = conductor(int(least / 1.06))  # over the device by 6%: not a fit, within the 8.4% the pre-flight allows
    _, nxt = launch(con, AttemptKind.PROBE, Outcome.PREDICTED)
    assert nxt.kind is AttemptKind.PROBE and con.climb.exhausted is None
    in_force = con.climb.remedies_in_force()
    assert len(in_force) > 1, in_force  # not the allocator's rung alone, as one rung per stop climbed
    assert con.judge.plausible(con.climb.facts, con.stop_margin()[0])(con.climb.effective()[0])


def test_a_config_the_preflight_would_stop_again_is_not_launched():
    """Nothing the ladder reaches is predicted within the pre-flight's margin of the device: the run ends after the
    stop, saying so, instead of climbing one rung per stop (issue 46's Qwen2.5-VL: 8 stops in a row)."""
    con = conductor(8 * MiB)
    stop, nxt = launch(con, AttemptKind.PROBE, Outcome.PREDICTED)
    assert nxt.kind is None and con.climb.exhausted is not None
    assert con.climb.exhausted.skipped[0][0] == "predicted"
    assert "every config the ladder reaches is predicted over the device" in (stop.note or "")
    assert "none launched, the pre-flight stops beyond" in lines(nxt)
    from oomguard.run.verdict import conclude

    status, _code, message = conclude(stop, con.climb)
    assert status == "exhausted" and message.startswith("every config the ladder reaches")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_fixed_allocation_at_each_generation_ends_the_run_with_its_diagnosis(tmp_path, tiny_model):
    """End to end, real TRL: the script allocates 300 MiB at the start of every generation on a 256 MiB device, a
    buffer no term of the memory model counts. The model was sure of the config; the OOM proves it wrong (the miss is
    reported, with what was live, as the training process counted it); a speed change is probed and fails the same
    way; the run ends after those two launches naming the fixed allocation, with the script's generations and
    completion length in every attempt. (The parts: the tests above.)"""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "256MiB", "--",
                            *grpo_tiny(tiny_model, tmp_path / "out", "--per-device-train-batch-size", "4",
                                       "--gradient-accumulation-steps", "2", "--fixed-mib", "300"))
    assert rep is not None, out.stderr[-3000:]
    attempts = rep["attempts"]
    assert rep["status"] == "exhausted" and rep["message"].startswith("a fixed allocation of 300.00 MiB in generation")
    assert [a["outcome"] for a in attempts] == ["oom", "oom"], [(a["kind"], a["outcome"]) for a in attempts]
    assert all((a["knobs"]["num_generations"], a["knobs"]["max_completion_length"]) == (4, 32) for a in attempts)
    first = attempts[0]
    assert first["miss"]["at_least"] and first["miss"]["factor"] > 2 and first["miss"]["phase"] == "generation"
    live = first["oom"]["live_bytes"]
    assert live["source"] == "tally" and live["parameters"] > 0 and live["optimizer"] == 0  # before the first step
    assert "the memory model was wrong here" in out.stderr and "took back" in out.stderr


def test_under_a_stack_no_measurement_covers_a_stop_is_followed_by_what_the_preflight_lets_run():
    """ms-swift at 44 MiB made three pre-flight stops in a row, climbing allocator settings one at a time. Under a
    stack whose memory no measurement covers the pre-flight stops only beyond 3 times the device; the config after a
    stop is one it lets run, chosen at once, never an allocator setting that leaves the prediction where it was."""
    big = conductor(80 * GiB)
    steps, _ = big.climb.ladder.climb_by_cost(Context(knobs=big.climb.start(), facts=FACTS), lambda _k: False)
    least = big.judge.predict(FACTS, replay(big.climb.start(), [Rung(s.remedy) for s in steps], FACTS)[0]).peak_bytes
    con = conductor(int(least / 1.5))  # nothing the ladder reaches fits; the script's config is far beyond 3x
    assert big.judge.predict(FACTS, big.climb.effective()[0]).peak_bytes > 3 * con.capacity
    assert con.take_trl("1.16.0", "fused", stack_untested="ms-swift")
    assert abs(con.stop_margin()[0] - 2.02) < 1e-9
    _, nxt = launch(con, AttemptKind.PROBE, Outcome.PREDICTED)
    assert nxt.kind is AttemptKind.PROBE
    in_force = con.climb.remedies_in_force()
    assert {r.remedy.cost for r in con.climb.applied} - {"none"}, in_force  # more than the allocator's settings
    assert con.judge.plausible(con.climb.facts, con.stop_margin()[0])(con.climb.effective()[0])


def test_a_proven_wrong_model_s_speed_only_trial_is_one_whose_weights_load():
    """ms-swift's wider model (issue 49): its float32 weights were stopped before they loaded, the bf16 choice ran out
    in generation and proved the model wrong. The speed-only trial would load the float32 weights again, which the
    pre-flight knows do not fit whatever the model gets wrong about the step: it is not launched, and the next config
    is the choice. Where the weights load, the trial goes first."""
    diag = diagnose(parse_oom(oom_text(64 * MiB, 24 * GiB, 23 * GiB)), phase="generation")

    def climb_after(loads):
        climb = Climb(load_ladder("default"))
        climb.observe({**USER, "dtype": "float32", "bf16": False})
        climb.learn(FACTS)
        d = climb.choose_next(diag, fits=lambda k: k.dtype == "bfloat16" and k.num_generations <= 4, unsure=True,
                              loads=loads)
        return d, climb.effective()[0]

    d, k = climb_after(lambda k: k.dtype != "float32")
    assert not d.trial and k.dtype == "bfloat16"
    d, k = climb_after(lambda k: True)
    assert d.trial and k.dtype == "float32" and k.num_generations == 8
