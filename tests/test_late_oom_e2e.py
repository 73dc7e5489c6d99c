"""Late OOMs end to end under real TRL on the simulated device (issue 42): a reward function that keeps 6 MiB of tensors
a step is a leak, resumed with the user's config until every step is done, and named where it is held; a leak stops
the run with --no-leak-restart; one long sample late in the data is what a shortfall is (and never runs out with the
default up-front checks); a growing host cache is reported while the run goes on. The parts are proved faster in
tests/test_late_oom.py (the decisions), tests/test_memtrace.py (the trace and the census) and tests/test_trend.py (the
verdicts); these are `slow` (CI runs them)."""

from __future__ import annotations

import json
import re

import pytest

from helpers import SCRIPTS, grpo_tiny, run_oomguard

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MiB = 1 << 20


def leak_line() -> int:
    return next(i for i, text in enumerate((SCRIPTS / "leaky_rewards.py").read_text().splitlines(), 1)
                if "CACHE.append" in text)


# the client: 70 MiB on its first step, 6 MiB more each step (2 prompts x 2 generations, 32 tokens)
LEAKER = ("--leak-mib", "6", "--per-device-train-batch-size", "2", "--num-generations", "2")


def test_a_leak_is_resumed_with_your_config_until_every_step_is_done_and_named_where_it_is_held(tmp_path, tiny_model):
    """On 112 MiB it runs out at step 8, with five settled steps of trace: a young leak, which the first restart
    confirms by getting further and growing again. The script saves every 5 steps and keeps 2: oomguard's cadence
    (every 3 steps) saves beside it and deletes its own checkpoints again, and the script keeps exactly its own."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "112MiB", "--",
                            *grpo_tiny(tiny_model, tmp_path / "out", "--max-steps", "16", *LEAKER, "--save-steps", "5",
                                       "--save-total-limit", "2"))
    assert out.returncode == 0 and rep is not None and rep["status"] == "leaked", out.stderr[-3000:]
    attempts = rep["attempts"]
    assert len(attempts) >= 3 and attempts[-1]["outcome"] == "ok" and attempts[-1]["step"] == 16
    # no knob changed for the leak: only the checkpoint cadence, an adaptation in the diff and the lock
    assert [(r["knob"], r["remedy"]) for r in rep["diff"]] == [("checkpoint_every", "adaptation")], rep["diff"]
    lock = json.loads((tmp_path / "lock.json").read_text())  # it ran every step: its lock replays the cadence
    assert lock["overrides"] == {"checkpoint_every": attempts[-1]["knobs"]["checkpoint_every"]}
    assert "What oomguard changed" in out.stdout + out.stderr
    assert len({str(sorted((k, v) for k, v in a["knobs"].items() if k != "checkpoint_every"))
                for a in attempts}) == 1
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-15", "checkpoint-16"]
    assert not list((tmp_path / "out").glob("*/oomguard-added.json"))
    leaks = [a for a in attempts if a["outcome"] == "oom"]
    assert leaks and all(a["oom"]["kind"] == "leak" for a in leaks)
    rate = float(re.search(r"grew by ([\d.]+) MiB per step", leaks[0]["oom"]["evidence"][0]).group(1))
    assert abs(rate - 6) <= 0.2 * 6
    assert re.search(r"is full by step \d+ at the latest", rep["message"])
    assert f"leaky_rewards.py:{leak_line()} in leaky_reward" in rep["message"]
    assert "list `CACHE` of module `leaky_rewards`" in rep["message"]
    assert attempts[0]["trace"] and attempts[0]["trace"][0]["step"] == 1  # the trace, for the HTML report


def test_no_leak_restart_stops_at_the_first_leak_with_its_own_exit_code_and_warns_while_it_runs(tmp_path,
                                                                                                  tiny_model):
    """On 160 MiB the trace is long enough before the OOM for a warning while it runs."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "160MiB", "--no-leak-restart", "--",
                            *grpo_tiny(tiny_model, tmp_path / "out", "--max-steps", "30", "--leak-mib", "6"))
    assert out.returncode == 76 and rep is not None and rep["status"] == "leaked", out.stderr[-3000:]
    assert len(rep["attempts"]) == 1 and rep["diff"] == []
    assert "--no-leak-restart" in rep["message"] and "6.00 MiB per step" in rep["message"]
    assert any(w.startswith("while it runs: Leak:") for w in rep["warnings"])  # said before it ran out


def test_one_long_sample_late_in_the_data_is_what_a_shortfall_is_and_the_up_front_checks_cover_it(tmp_path,
                                                                                                 tiny_model):
    script = ("--max-steps", "8", "--long-at-step", "6")  # every other step fits the 112 MiB device
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "112MiB", "--no-probe", "--no-preflight", "--",
                            *grpo_tiny(tiny_model, tmp_path / "out", *script))
    assert out.returncode == 0 and rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    first = rep["attempts"][0]
    assert first["outcome"] == "oom" and first["oom"]["kind"] not in ("leak", "host-leak")
    assert any(e.startswith("Long sample: step 6 ran out of memory") and "prompt 69" in e
               for e in first["oom"]["evidence"])
    assert rep["diff"] and sum(a["outcome"] == "oom" for a in rep["attempts"]) == 1
    checked = tmp_path / "checked"
    checked.mkdir()
    out, rep = run_oomguard(checked, "--simulate-gpu", "112MiB", "--",
                            *grpo_tiny(tiny_model, checked / "out", *script))
    assert out.returncode == 0 and rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    # the worst case was judged before training: a probe of the longest prompt, never the real run, ran out
    assert not any(a["outcome"] == "oom" and a["kind"] == "run" for a in rep["attempts"])


def test_a_growing_host_cache_is_reported_as_a_host_leak_while_the_run_goes_on(tmp_path, tiny_model):
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "1GiB", "--no-probe", "--",
                            *grpo_tiny(tiny_model, tmp_path / "out", "--max-steps", "14", "--host-leak-mib", "48"))
    assert out.returncode == 0 and rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    (said,) = [w for w in rep["warnings"] if w.startswith("while it runs: Host leak:")]
    assert "resident host memory grew by" in said and "Only a fix to the code that keeps it" in said
    assert "warning: while it runs: Host leak:" in out.stderr
