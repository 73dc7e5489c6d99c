"""Late OOMs told apart, and the cure for each (issue 42), without launching anything: what the trace says of an OOM
(``oom.trend.at_oom``), the diagnosis it makes, what the conductor decides for a leak, the status and exit code the
run ends with, and the guard's view of memory from call to call. The end-to-end runs are in test_late_oom_e2e.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from oomguard.decide.climb import Climb
from oomguard.decide.conductor import Conductor, Policy, resumed_step
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import load_ladder
from oomguard.oom.diagnose import diagnose
from oomguard.oom.parse import parse_oom
from oomguard.oom.recommend import recommend
from oomguard.oom.trend import at_oom
from oomguard.run.command import EXIT_LEAKED
from oomguard.run.verdict import conclude
from oomguard.vocab.knobs import RunFacts
from oomguard.vocab.records import Attempt, AttemptKind, Outcome
from oomguard.vocab.trace import MemSample

MiB = 1 << 20
LLAMA = json.loads((Path(__file__).parent / "fixtures" / "models" / "llama-3.2-1b" / "config.json").read_text())
OOM = parse_oom("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 112.00 MiB of which "
                "2.00 MiB is free. Of the allocated memory 100.00 MiB is allocated by PyTorch, and 2.00 MiB is reserved "
                "by PyTorch but unallocated.")
LEAKING = [MemSample(s, kept=64 * MiB + 6 * MiB * s, peak=90 * MiB + 6 * MiB * s) for s in range(1, 13)]
FLAT = [MemSample(s, kept=64 * MiB, peak=90 * MiB, prompt_tokens=20, completion_tokens=32) for s in range(1, 12)]


def leak_diagnosis():
    assert OOM is not None
    return diagnose(OOM, trend=at_oom(LEAKING, step=13, capacity=112 * MiB))


# -- the diagnosis ------------------------------------------------------------------------------------------------


def test_a_leak_is_its_own_kind_with_its_rate_and_no_remedy_helps_it():
    d = leak_diagnosis()
    assert d.kind == "leak" and d.facts.by_figures == "small-allocations"
    assert d.evidence[0].startswith("Leak: the memory kept at the end of each step grew by 6.00 MiB per step")
    assert "the long-lived state is what to shrink" not in " ".join(d.evidence)  # the figures' cure would mislead
    assert recommend(d) == []  # analyze names no config change for it either


def test_a_long_sample_at_the_step_that_ran_out_keeps_the_figures_kind_and_names_its_lengths():
    assert OOM is not None
    d = diagnose(OOM, trend=at_oom(FLAT, step=12, prompt_tokens=160, completion_tokens=32))
    assert d.kind == "small-allocations"  # what a shortfall gets
    assert d.evidence[1].startswith("Long sample: step 12 ran out of memory on a batch longer than the usual (prompt "
                                     "160 + completion 32 = 192 tokens, usually 52)")
    usual = diagnose(OOM, trend=at_oom(FLAT, step=12, prompt_tokens=20, completion_tokens=32))
    assert usual.facts.late == ()


def test_without_the_batch_s_lengths_the_dataset_s_longest_prompt_names_a_likely_long_sample():
    trend = at_oom(FLAT, step=12, dataset_prompt_max=400)
    (long,) = trend.long_samples
    assert long.at_oom and long.prompt_tokens == 400
    assert at_oom(FLAT, step=12, dataset_prompt_max=21).verdicts == ()  # no longer than the steps before


def test_a_host_leak_makes_a_host_oom_a_host_leak():
    from oomguard.vocab.oomreport import OOMReport

    host = [MemSample(s, kept=64 * MiB, peak=90 * MiB, host_rss=(2 << 30) + 64 * MiB * s) for s in range(1, 13)]
    killed = OOMReport(backend="host", origin="oom-killer", message="the training process was killed by SIGKILL")
    d = diagnose(killed, trend=at_oom(host, step=13, host_limit=4 << 30), host_signs=["the OOM-kill counter rose"])
    assert d.kind == "host-leak" and d.evidence[0].startswith("Host leak: the training process's resident host memory")
    assert diagnose(killed, trend=at_oom(LEAKING, step=13)).kind == "host-ram"  # a device leak: not the host's


def test_fragmentation_that_grew_makes_a_shortfall_fragmentation():
    grows = [MemSample(s, kept=64 * MiB, peak=90 * MiB, reserved=96 * MiB + 3 * MiB * s) for s in range(1, 13)]
    shortfall = parse_oom("CUDA out of memory. Tried to allocate 60.00 MiB. GPU 0 has a total capacity of 160.00 MiB of "
                          "which 10.00 MiB is free. Of the allocated memory 140.00 MiB is allocated by PyTorch, and "
                          "2.00 MiB is reserved by PyTorch but unallocated.")
    assert shortfall is not None
    plain = diagnose(shortfall)
    d = diagnose(shortfall, trend=at_oom(grows, step=13, capacity=160 * MiB))
    assert plain.kind == "shortfall" and d.kind == "fragmentation"
    assert d.evidence[0].startswith("Fragmentation growing:")


# -- the conductor: a leak gets no remedy ------------------------------------------------------------------------


def conductor(**policy) -> Conductor:
    climb = Climb(load_ladder("default"))
    climb.learn(RunFacts(model_config=LLAMA, prompt_tokens_max=200))
    con = Conductor(climb, Judge(24 * 2**30), Policy(**policy), launched=True)
    assert con.reached is not None
    con.reached.update(("config", "trainer", "model"))  # a TRL script: every knob reaches it
    return con


def oom_at(con: Conductor, index: int, step: int, resumed_from: int | None = None, diagnosis=leak_diagnosis) -> Attempt:
    """Attempt ``index`` ran out of memory at ``step`` (resumed from ``checkpoint-<resumed_from>``), diagnosed so."""
    a = Attempt(index=index, knobs=con.climb.effective()[0].to_dict(), remedies=[], outcome=Outcome.OOM, exit_code=86,
                seconds=1.0, kind=AttemptKind.RUN, step=step, peak_bytes=20 * 2**30,
                resume={"mode": "continue", "checkpoint": f"/out/checkpoint-{resumed_from}"} if resumed_from else None)
    a.oom = {"evidence": list(diagnosis().evidence)}
    con.record(a, diagnosis())
    return a


def test_a_leak_resumes_with_the_same_config_and_checkpoints_often_enough_within_max_attempts():
    con = conductor()
    before = con.judge.coefficients if con.judge else None
    knobs = con.climb.effective()[0]
    nxt = con.after(oom_at(con, 1, step=11), leak_diagnosis())
    assert nxt.kind is AttemptKind.RUN and nxt.checkpoint_every == 5  # half the steps it made
    assert con.climb.effective()[0] == knobs and not con.climb.climbed  # nothing climbed
    assert con.judge is not None and con.judge.coefficients == before  # the code ran out, not the config
    assert "a leak, not a shortfall" in (nxt.said[0].line or "")
    # each restart that gets further resumes again, and counts: --max-attempts (8) bounds them, so a run never loops
    for i, (step, resumed) in enumerate([(21, 10), (31, 20), (41, 30), (51, 40), (61, 50), (71, 60)], 2):
        assert con.after(oom_at(con, i, step=step, resumed_from=resumed), leak_diagnosis()).kind is AttemptKind.RUN
    last = oom_at(con, 8, step=81, resumed_from=70)
    assert con.after(last, leak_diagnosis()).kind is None and con.spent()
    status, code, message = conclude(last, con.climb, leaks=[a for a in con.climb.attempts if a.index in con.leaks])
    assert (status, code) == ("leaked", EXIT_LEAKED)
    assert "the budget (--max-attempts 8) is spent after 7 restart(s); raise it to restart again" in message


def test_a_restart_that_gets_no_further_stops_and_so_does_no_leak_restart():
    con = conductor()
    con.after(oom_at(con, 1, step=4), leak_diagnosis())
    stuck = con.after(oom_at(con, 2, step=4, resumed_from=4), leak_diagnosis())
    assert stuck.kind is None and con.climb.exhausted is not None and con.climb.exhausted.skipped[0][0] == "leak"
    off = conductor(leak_restart=False)
    assert off.after(oom_at(off, 1, step=11), leak_diagnosis()).kind is None
    assert "--no-leak-restart" in off.climb.exhausted.skipped[0][1]  # type: ignore[union-attr]


def test_the_step_a_run_resumed_from():
    assert resumed_step({"mode": "continue", "checkpoint": "/o/checkpoint-8"}) == 8
    assert resumed_step({"mode": "weights", "checkpoint": "/o/checkpoint-8"}) == 0  # a new run starts at step 0


# -- a warm-up is not a leak; a young leak is confirmed by a restart ---------------------------------------------

GiB = 1 << 30
SHORT_24 = parse_oom("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 24.00 GiB of which "
                     "200.00 MiB is free. Of the allocated memory 23.20 GiB is allocated by PyTorch, and 300.00 MiB is "
                     "reserved by PyTorch but unallocated.")


def warm_up(tau: float, peak_base: float) -> tuple[list[MemSample], int]:
    """A config that is simply too tight on 24 GiB: kept memory rises by 3 GiB over a few steps (``3 GiB (1 -
    exp(-step / tau))``: a cache sized by the largest batch so far, optimizer state made lazily), the peak with it,
    and the step whose peak crosses the device runs out (the review's traces, 2026-11-29, section 3.1)."""
    rise = [3 * GiB * (1 - math.exp(-s / tau)) for s in range(1, 40)]
    trace = [MemSample(s, kept=round(10 * GiB + r), peak=round(peak_base * GiB + r), capacity=24 * GiB)
             for s, r in enumerate(rise, 1)]
    oom = next(t.step for t in trace if t.peak > 24 * GiB)  # type: ignore[operator]
    return trace[:oom - 1], oom


@pytest.mark.parametrize("tau,peak_base,meets", [(2.5, 21.2, 7), (3, 21.2, 9), (3, 21.3, 7), (3, 21.4, 7)])
def test_a_warm_up_that_settles_late_and_meets_the_device_is_the_shortfall_and_a_rung_is_climbed(tau, peak_base,
                                                                                                  meets):
    trace, step = warm_up(tau, peak_base)
    assert step == meets  # it met the device while still settling
    assert SHORT_24 is not None
    d = diagnose(SHORT_24, trend=at_oom(trace, step=step, capacity=24 * GiB))
    assert d.kind == d.facts.by_figures and d.kind not in ("leak", "host-leak"), d.evidence
    con = conductor()
    a = Attempt(index=1, knobs=con.climb.effective()[0].to_dict(), remedies=[], outcome=Outcome.OOM, exit_code=86,
                seconds=1.0, kind=AttemptKind.RUN, step=step - 1, peak_bytes=24 * GiB)
    con.record(a, d)
    nxt = con.after(a, d)
    assert nxt.kind is not None and con.climb.climbed and not con.leaks  # a rung climbed, no restart as it was


YOUNG = [MemSample(s, kept=46 * MiB + 6 * MiB * s, peak=64 * MiB + 6 * MiB * s, capacity=112 * MiB) for s in range(1, 8)]


def young_diagnosis():
    """The issue-42 client's first OOM: 112 MiB, 6 MiB kept a step, out of memory at step 8 with five settled steps of
    trace (too few for a verdict on the trace alone)."""
    assert OOM is not None
    d = diagnose(OOM, trend=at_oom(YOUNG, step=8))
    assert d.kind == "leak" and d.facts.young_leak
    return d


def young_at(con: Conductor, index: int, step: int, resumed_from: int | None = None) -> Attempt:
    return oom_at(con, index, step, resumed_from, diagnosis=young_diagnosis)


def test_a_young_leak_is_confirmed_by_a_restart_that_gets_further_and_grows_again():
    con = conductor()
    first = con.after(young_at(con, 1, step=7), young_diagnosis())
    assert first.kind is AttemptKind.RUN and "a leak, it seems (too few steps to be sure)" in (first.said[0].line or "")
    assert "That rests on 5 step(s), too few to be sure" in young_diagnosis().evidence[0]
    again = con.after(young_at(con, 2, step=13, resumed_from=6), young_diagnosis())
    assert again.kind is AttemptKind.RUN and "a leak, not a shortfall" in (again.said[0].line or "")
    assert con.leak_confirmed and con.leaks == [1, 2] and not con.climb.climbed


def test_a_young_leak_whose_restart_gets_no_further_is_the_shortfall_and_a_rung_is_climbed():
    con = conductor()
    con.after(young_at(con, 1, step=7), young_diagnosis())
    stuck = young_at(con, 2, step=6, resumed_from=6)  # ran out again before passing its checkpoint
    nxt = con.after(stuck, young_diagnosis())
    assert nxt.kind is not None and con.climb.climbed and con.climb.exhausted is None
    assert not con.leaks and "not a leak after all" in (stuck.note or "")
    done = Attempt(index=3, knobs={}, remedies=[], outcome=Outcome.OK, exit_code=0, seconds=1.0, kind=AttemptKind.RUN)
    con.climb.record(done)
    assert conclude(done, con.climb, leaks=[])[0] == "stable"
    # a script that saved nothing before the first OOM: the restart starts from step 0 and runs out where it did, the
    # late-settling warm-up a young leak looked like, not a confirmation
    scratch = conductor()
    scratch.after(young_at(scratch, 1, step=7), young_diagnosis())
    from_zero = young_at(scratch, 2, step=7)
    assert scratch.after(from_zero, young_diagnosis()).kind is not None and scratch.climb.climbed
    assert not scratch.leak_confirmed and "not a leak after all" in (from_zero.note or "")
    # without restarts (--no-leak-restart, the guard) a young leak is the shortfall at once
    off = conductor(leak_restart=False)
    assert off.after(young_at(off, 1, step=7), young_diagnosis()).kind is not None and off.climb.climbed


# -- how the run ends --------------------------------------------------------------------------------------------


def test_a_run_that_finished_through_restarts_ends_leaked_with_exit_0_and_one_that_stopped_with_76():
    con = conductor()
    first = oom_at(con, 1, step=11)
    con.after(first, leak_diagnosis())
    done = Attempt(index=2, knobs={}, remedies=[], outcome=Outcome.OK, exit_code=0, seconds=1.0, kind=AttemptKind.RUN)
    con.climb.record(done)
    status, code, message = conclude(done, con.climb, leaks=[first], held="It is held here: rewards.py:9.")
    assert (status, code) == ("leaked", 0)
    assert "finished every step after 1 restart(s)" in message and "6.00 MiB per step" in message
    assert "It is held here: rewards.py:9." in message
    off = conductor(leak_restart=False)
    last = oom_at(off, 1, step=11)
    off.after(last, leak_diagnosis())
    status, code, message = conclude(last, off.climb)
    assert (status, code) == ("leaked", EXIT_LEAKED) and "--no-leak-restart" in message


# -- the guard: memory from call to call --------------------------------------------------------------------------


def simulated(size: int):
    """The simulated device for a whole test, across calls (``guard(simulate_gpu=...)`` starts one per call)."""
    import contextlib

    from oomguard.child import simulate

    @contextlib.contextmanager
    def device():
        simulate.start(size)
        try:
            yield
        finally:
            simulate.stop()

    return device()


def test_the_guard_says_once_that_a_function_keeps_memory_from_call_to_call(caplog):
    import torch

    import oomguard

    kept: list = []

    @oomguard.guard
    def epoch():
        kept.append(torch.ones(3 << 19))  # 6 MiB kept a call
        return len(kept)

    with simulated(512 * MiB), caplog.at_level("WARNING", logger="oomguard"):
        for _ in range(12):
            epoch()
    said = [r.getMessage() for r in caplog.records if "keeps memory from call to call" in r.getMessage()]
    assert len(said) == 1 and "6.00 MiB per step" in said[0]


def test_the_guard_stops_at_a_leak_without_changing_a_knob():
    import pytest
    import torch

    import oomguard

    kept: list = []

    @oomguard.guard(max_attempts=4, verbose=False)
    def epoch(knobs):
        kept.append(torch.ones(3 << 19))  # 6 MiB kept a call, until the device is full
        return knobs.per_device_train_batch_size

    with simulated(160 * MiB), pytest.raises(oomguard.OOMGuardExhausted) as e:
        for _ in range(40):
            epoch()
    assert "it leaks memory" in str(e.value)
    report = epoch.report
    assert report is not None and report.status == "leaked" and report.diff == []
