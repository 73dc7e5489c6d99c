"""Rungs that need a package the training environment lacks are skipped with the reason; a rung whose overrides
break the launch is taken back instead of passing the failure off as the user's."""

from __future__ import annotations

import json

import pytest

from oomguard.child.patching import OPTIONAL_PACKAGES, missing_packages
from oomguard.decide.ladder import Exhausted, load_ladder
from oomguard.strategies import Context
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts

from helpers import PYTHON, SCRIPTS, run_oomguard


def test_the_training_process_reports_what_it_cannot_import():
    import importlib.util

    missing = missing_packages()
    assert set(missing) <= set(OPTIONAL_PACKAGES)
    assert "peft" not in missing and "bitsandbytes" not in missing  # installed with oomguard
    assert ("deepspeed" in missing) == (importlib.util.find_spec("deepspeed") is None)  # optional: see README


def test_facts_read_from_json_keep_the_missing_packages_as_a_tuple():
    facts = RunFacts.from_dict({"missing_packages": ["deepspeed"], "world_size": 2})
    assert facts.missing_packages == ("deepspeed",)
    assert facts.replace(world_size=4).missing_packages == ("deepspeed",)


def test_zero_rungs_are_skipped_without_deepspeed_and_the_climb_goes_on():
    """The multi-gpu ladder on two ranks without DeepSpeed: the ZeRO rungs are passed over, saying why."""
    ladder = load_ladder("multi-gpu")
    facts = RunFacts(world_size=2, missing_packages=("deepspeed",))
    step = ladder.next(Context(knobs=TRL_DEFAULTS, facts=facts, used={"expandable_segments": 1, "empty_cache": 1}))
    assert not isinstance(step, Exhausted)
    assert step.remedy.name not in ("zero2", "zero3", "offload_optimizer", "offload_params")
    reasons = dict(step.skipped)
    zero = [n for n in reasons if n.startswith("zero")]
    assert zero and all("deepspeed" in reasons[n] and "pip install deepspeed" in reasons[n] for n in zero)


def test_lora_is_skipped_when_peft_cannot_be_imported():
    ladder = load_ladder("default")
    facts = RunFacts(missing_packages=("peft", "bitsandbytes"))
    used = {r.name: 3 for r in ladder.rungs if r.name not in ("optimizer_8bit", "lora", "load_4bit")}
    step = ladder.next(Context(knobs=TRL_DEFAULTS, facts=facts, used=used))
    assert isinstance(step, Exhausted)
    reasons = dict(step.skipped)
    assert "peft" in reasons["lora"] and "bitsandbytes" in reasons["optimizer_8bit"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_rung_whose_overrides_break_the_launch_is_taken_back(tmp_path, tiny_model):
    """A custom ladder's LoRA targets a module the model does not have: PEFT rejects it inside GRPOTrainer. That is
    oomguard's change failing, not the script: the rung is taken back, said so, and the next rung makes it fit.
    Slow: taking a rung back after a failure right after it is tests/test_supervisor_units.py's and
    tests/test_refine.py's; that a failure inside GRPOTrainer is read as such, tests/test_classify.py's."""
    ladder = tmp_path / "bad-lora.toml"
    ladder.write_text('[[rung]]\nremedy = "lora"\ntarget_modules = ["no_such_module"]\n\n'
                      '[[rung]]\nremedy = "load_4bit"\n')
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "48MiB", "--no-probe", "--no-predict", "--ladder", str(ladder),
                            "--", PYTHON, str(SCRIPTS / "grpo_tiny.py"), "--model", tiny_model, "--output-dir",
                            str(tmp_path / "out"), "--max-completion-length", "64", "--num-generations", "2",
                            "--per-device-train-batch-size", "2", "--optim", "adamw_bnb_8bit")
    assert rep is not None, out.stderr[-3000:]
    outcomes = [(a["outcome"], a["climbed"]) for a in rep["attempts"]]
    assert rep["status"] == "stable" and out.returncode == 0, (outcomes, out.stderr[-3000:])
    assert outcomes[0] == ("oom", "lora")
    assert rep["attempts"][1]["outcome"] == "failed" and "took back lora" in rep["attempts"][1]["note"]
    assert rep["attempts"][1]["climbed"] == "load_4bit"
    assert "took back lora" in out.stderr and "no_such_module" in out.stderr
    assert {r["remedy"] for r in rep["diff"]} == {"load_4bit"}
    lock = json.loads((tmp_path / "lock.json").read_text())
    assert lock["overrides"].get("lora_target_modules") != ["no_such_module"]


@pytest.mark.parametrize("error, reported", [
    (ValueError("target modules ['no_such_module'] not found in the base model"), True),
    (OSError(98, "Address already in use"), False),
    (ConnectionRefusedError(111, "Connection refused"), False),
    (RuntimeError("Engine core initialization failed"), "chained"),
])
def test_an_error_no_knob_can_cause_is_not_blamed_on_the_overrides(tmp_path, error, reported):
    """A rendezvous port taken by another job (two runs that start vLLM or torch.distributed at once) is the machine's:
    the failure passes through as the script's, and no rung is taken back for it (on CI two vLLM tests met on
    TRL's port 29500, and the rung that had just been climbed was taken back)."""
    from oomguard.child.patching import overrides_reported
    from oomguard.child.runtime import Runtime
    from oomguard.vocab.protocol import Plan

    events = tmp_path / "events.jsonl"
    rt = Runtime(Plan(overrides={"vllm_gpu_memory_utilization": 0.3}, crash_dir=str(tmp_path), events=str(events)))
    if reported == "chained":  # a stack that wraps the network's error in its own: the chain is read
        error.__cause__, reported = OSError(98, "Address already in use"), False
    with pytest.raises(type(error)), overrides_reported(rt, "GRPOTrainer"):
        raise error
    said = [json.loads(line)["event"] for line in events.read_text().splitlines()] if events.exists() else []
    assert ("override_error" in said) == reported, said


def test_torch_s_rendezvous_error_is_a_network_error():
    torch_distributed = pytest.importorskip("torch.distributed")
    from oomguard.child.patching import network_error

    err = torch_distributed.DistNetworkError("The server socket has failed to listen on any local network address. "
                                             "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE")
    assert network_error(err)
