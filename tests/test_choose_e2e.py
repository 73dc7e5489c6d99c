"""End to end, real TRL on CPU with the simulated device: the climb chooses the best config by prediction.

- pre-flight: a config the memory model is sure cannot fit stops before it generates (outcome ``predicted``);
- pruning: rungs of the ladder prefix that memory does not demand are dropped, and the report says why;
- relaxing: a graded knob ends at the value closest to the user's predicted to fit, not at the blind halving;
- fall-back: when a chosen config's probe runs out of memory, the model learns and a bigger config is chosen.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import PYTHON, SCRIPTS, by_head, run_oomguard

pytestmark = pytest.mark.e2e


def grpo(tmp: Path, model: str, budget: str, *args: str, extra: tuple = ()):
    out, rep = run_oomguard(tmp, "--simulate-gpu", budget, *extra, "--", PYTHON, str(SCRIPTS / "grpo_tiny.py"),
                            "--model", model, "--output-dir", str(tmp / "out"), *args)
    assert rep is not None, out.stderr[-3000:]
    return out, rep


@pytest.mark.core
def test_preflight_stops_a_sure_overflow_and_the_choice_keeps_only_what_is_needed(tmp_path, tiny_model):
    """At 48 MiB the user's config is predicted far over the device: it stops before generating, with no real OOM.
    The choice keeps only part of the ladder prefix predicted to fit and says why the others go. Under TRL 1.15 on
    (the fused LM head: three rungs kept) the model is then unsure whether one kept change is needed (without it, it
    predicts a few percent over the device): one probe without it fits, so the run goes without it. Under TRL
    0.29-1.14 (materialised logits, less memory on the CPU) LoRA alone is chosen with room to spare."""
    out, rep = grpo(tmp_path, tiny_model, "48MiB", "--max-completion-length", "64")
    attempts = rep["attempts"]
    assert rep["status"] == "stable", (rep["message"], out.stderr[-3000:])
    assert attempts[0]["outcome"] == "predicted" and attempts[0]["kind"] == "probe"
    assert "pre-flight" in out.stderr and "stopped by the pre-flight check" in out.stderr
    assert not any(a["outcome"] == "oom" for a in attempts)  # zero real OOMs: the model was sure
    trials = [a for a in attempts if a["kind"] == "minimize"]
    assert len(trials) == by_head(fused=1, logits=0)
    assert [(a["kind"], a["outcome"]) for a in attempts[1:]] == [("probe", "ok"), *[("minimize", "ok")] * len(trials),
                                                                ("run", "ok")]
    assert "pre-flight stop" in rep["message"]
    choice = attempts[0]["choice"]
    assert choice["dropped"] and all(d["predicted_bytes_without"] <= 48 * 2**20 for d in choice["dropped"])
    assert "not needed:" in out.stderr
    undone = {t["note"].split(" is not needed")[0] for t in trials}
    for t in trials:
        name = t["note"].split(" is not needed")[0]
        assert name in choice["rungs"] and t["note"] == f"{name} is not needed: the probe fits without it"
    final = attempts[-1]
    assert set(final["remedies"]) == set(choice["rungs"]) - undone
    assert "lora" in final["remedies"]  # LoRA's end-to-end test in the default run (test_lora is slow)
    assert "expandable_segments" not in {r["knob"] for r in rep["diff"]}


def test_a_script_that_keeps_trls_precision_is_predicted_as_it_runs_and_probed_at_its_longest_prompt(tmp_path,
                                                                                                      tiny_model):
    """TRL turns bf16 autocast on by default, on the CPU too (a script that does not pass ``bf16=False``): the memory
    model reads that from the script's GRPOConfig and predicts the probe's peak (before, assuming no autocast on the
    simulated device, it predicted half as much again). One prompt is 8x longer than the rest: every step of the
    probe trains on it, the second too (the optimizer state exists from then on), so both steps score as many
    tokens. (--max-attempts 1: the probe alone.)"""
    out, rep = grpo(tmp_path, tiny_model, "1GiB", "--trl-precision", "--long-prompts", "1", "--max-completion-length",
                    "64", extra=("--max-attempts", "1"))
    probe = rep["attempts"][0]
    assert (probe["kind"], probe["outcome"]) == ("probe", "ok"), (rep["message"], out.stderr[-3000:])
    assert probe["knobs"]["bf16"] is True and rep["original"]["bf16"] is True and not rep["diff"]
    # the device prediction is the allocated peak plus the fragmentation margin (14% on the simulated device)
    assert probe["peak_bytes"] <= probe["predicted_bytes"] <= 1.2 * probe["peak_bytes"], probe
    tokens = [float(t) for t in re.findall(r"'num_tokens': '([0-9.e+]+)'", out.stdout)]
    assert len(tokens) == 2 and tokens[1] == 2 * tokens[0], tokens  # cumulative: the second step as long as the first


@pytest.mark.slow
def test_a_graded_knob_is_relaxed_instead_of_halved(tmp_path, tiny_model):
    """Completions of 128 tokens do not fit 132 MiB; halving to 64 would. The choice keeps the longest length on the
    grid predicted to fit with room for the simulated device's fragmentation (80), and the probe and the run confirm
    it. Slow: the default run's fall-back test below starts from the same config and its first choice relaxes the
    length too (between 64 and 128)."""
    out, rep = grpo(tmp_path, tiny_model, "132MiB", "--max-completion-length", "128")
    assert rep["status"] == "stable", (rep["message"], out.stderr[-3000:])
    final = {r["knob"]: r["to"] for r in rep["diff"]}
    assert 64 < final["max_completion_length"] < 128, rep["diff"]
    relaxed = [r for a in rep["attempts"] if a.get("choice") for r in a["choice"]["relaxed"]]
    assert {"knob": "max_completion_length", "climbed": 64, "chosen": final["max_completion_length"]} in relaxed
    assert "relaxed max_completion_length: 64 →" in out.stderr


def test_when_a_chosen_config_runs_out_of_memory_the_climb_learns_and_puts_something_back(tmp_path, tiny_model):
    """The memory model is told the device is 40% larger than the simulated one, so its first choice is too small
    for the real budget: that probe runs out of memory, the model learns, and the next choice fits. No config is
    tried twice. (Without refining, so that the probe that fits is followed by the run.)"""
    from oomguard.decide.ladder import load_ladder
    from oomguard.display.ui import ConsoleReporter
    from oomguard.run.supervisor import RunOptions, Supervisor

    budget = 118 * 2**20
    opts = RunOptions(ladder=load_ladder("default"), simulate_gpu=budget, capacity=int(budget * 1.4), probe_steps=2,
                      preflight_margin=None, refine=False, report_path=tmp_path / "r.json", lock_path=tmp_path / "l.json",
                      workdir=tmp_path / "wd", echo=False)
    import json
    import os
    import sys

    argv = [sys.executable, str(SCRIPTS / "grpo_tiny.py"), "--model", tiny_model, "--output-dir", str(tmp_path / "o"),
            "--max-completion-length", "128"]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = Supervisor(argv, opts, ConsoleReporter(quiet=True)).run()
    finally:
        os.chdir(cwd)
    rep = json.loads((tmp_path / "r.json").read_text())
    kinds = [(a["kind"], a["outcome"]) for a in rep["attempts"]]
    assert code == 0 and rep["status"] == "stable", kinds
    assert kinds[0] == ("probe", "oom")
    assert ("probe", "oom") in kinds[1:], kinds  # the chosen config's probe ran out of memory...
    assert kinds[-2:] == [("probe", "ok"), ("run", "ok")], kinds  # ...and the next choice held
    tried = [json.dumps(a["knobs"], sort_keys=True) for a in rep["attempts"] if a["kind"] == "probe"]
    assert len(tried) == len(set(tried))  # never the same config twice
    first_choice = next(a for a in rep["attempts"][1:] if a["outcome"] == "oom")
    last = rep["attempts"][-1]["knobs"]
    # the first choice relaxed the completions on the grid (not a blind halving); the next one is no longer
    assert any(r["knob"] == "max_completion_length" and 64 < r["chosen"] < 128 for a in rep["attempts"]
               if a.get("choice") for r in a["choice"]["relaxed"])
    assert last["max_completion_length"] <= first_choice["knobs"]["max_completion_length"]
    assert last["max_completion_length"] < first_choice["knobs"]["max_completion_length"] or (
        len(rep["attempts"][-1]["remedies"]) > len(first_choice["remedies"]))
