"""TRL's GRPO defaults release by release (oomguard/vocab/trlreleases.py) against the facts read from TRL's own
GRPOConfig at each tag (tests/fixtures/reports/trl-defaults.json), and the config `oomguard plan` judges from them
(oomguard/decide/planconfig.py): a release's defaults, read in the installed TRL's terms, its LM head, and what the
run does that the memory model does not count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.decide.planconfig import planned, release_base
from oomguard.vocab.knobs import TRL_DEFAULTS
from oomguard.vocab.trlrange import head_of
from oomguard.vocab.trlreleases import RELEASES, defaults, in_current_terms, release

FIXTURE = Path(__file__).parent / "fixtures" / "reports" / "trl-defaults.json"
RELEASE_FACTS = json.loads(FIXTURE.read_text())["releases"]


def expected(facts: dict) -> dict:
    """A release's facts in oomguard's knob names, by the table's documented readings."""
    d = facts["defaults"]

    def value(v, absent=None):
        return absent if isinstance(v, str) and (v.startswith("n/a") or v == "removed") else v

    mpl = value(d["max_prompt_length"])
    return {
        "per_device_train_batch_size": d["per_device_train_batch_size"],
        "gradient_accumulation_steps": d["gradient_accumulation_steps"],
        "num_generations": d["num_generations"],
        # before 0.18 TRL generated for every micro-step (no steps_per_generation field)
        "steps_per_generation": 1 if value(d["steps_per_generation"], "absent") == "absent" else d["steps_per_generation"],
        # max_prompt_length truncated the prompts while it had a default (before 0.26)
        "max_prompt_tokens": mpl if isinstance(mpl, int) else None,
        "max_completion_length": d["max_completion_length"],
        "beta": d["beta"],
        "loss_type": "grpo" if str(d["loss_type"]).startswith("n/a") else d["loss_type"],
        "gradient_checkpointing": d["gradient_checkpointing"],
        "bf16": d["bf16"] if isinstance(d["bf16"], bool) else str(d["bf16"]).startswith("None -> True"),
        "use_vllm": d["use_vllm"],
        # vLLM on a GPU of its own before 0.18 (in the trainer, then a server), server by default until 1.0
        "vllm_mode": "server" if str(d["vllm_mode"]).startswith("n/a") else d["vllm_mode"],
        "vllm_enable_sleep_mode": value(d["vllm_enable_sleep_mode"], False),
        "learning_rate": d["learning_rate"],
        "use_liger_kernel": d["use_liger_kernel"],
        "dtype": "auto" if str(d["model_load_dtype"]).startswith("auto") else "float32",
    }


@pytest.mark.parametrize("facts", RELEASE_FACTS, ids=lambda f: f["version"])
def test_each_release_s_defaults_are_trl_s_own(facts):
    got = defaults(facts["version"])
    want = expected(facts)
    assert {k: got.get(k) for k in want} == want
    # colocate's share of the GPU from 0.18 (before: vLLM's own 0.9 on its GPU, in the trainer or the server)
    util = facts["defaults"]["vllm_gpu_memory_utilization"]
    assert got["vllm_gpu_memory_utilization"] == (util if isinstance(util, float) else 0.9)
    assert head_of(facts["version"]) == ("fused" if facts["defaults"]["fused_chunked_lm_head"] else "logits")
    assert release(facts["version"]).date == facts["date"]


def test_the_table_holds_every_release_and_the_newest_is_the_installed_defaults():
    assert [r.version for r in RELEASES] == [f["version"] for f in RELEASE_FACTS]
    assert release_base("1.16.0") == TRL_DEFAULTS  # plan under TRL 1.16 answers as it did before releases
    assert release("1.16.3").version == "1.16.0" and release("1.17.0.dev0").version == "1.16.0"
    assert release("0.13.2") is None and release("garbled") is None


def test_a_config_reads_in_the_installed_trl_s_terms():
    out, lines = in_current_terms({"per_device_train_batch_size": 1, "num_generations": 8}, "0.14.0")
    assert out["per_device_train_batch_size"] == 8 and "counts per_device_train_batch_size in prompts" in lines[0]
    assert in_current_terms({"per_device_train_batch_size": 8, "num_generations": 8}, "0.15.0")[0][
        "per_device_train_batch_size"] == 8
    # a colocated vLLM of 0.18-0.25 without a context of its own takes the prompt and completion lengths
    colocate = {"use_vllm": True, "vllm_mode": "colocate", "max_prompt_tokens": 512, "max_completion_length": 2048}
    assert in_current_terms(colocate, "0.18.0")[0]["vllm_max_model_length"] == 2560
    assert "vllm_max_model_length" not in in_current_terms({**colocate, "max_prompt_tokens": None}, "0.26.0")[0]


def test_plan_fills_a_config_with_its_release_s_defaults_and_head():
    old = planned({"max_completion_length": 1024}, trl_version="0.17.0")
    assert (old.knobs.beta, old.knobs.gradient_checkpointing, old.knobs.bf16) == (0.04, False, False)
    assert old.knobs.max_completion_length == 1024 and old.knobs.max_prompt_tokens == 512
    assert old.facts.trl_head == "logits" and "the defaults of 0.17.0 (2025-04-24)" in old.lines[0]
    assert any("below 0.29" in line for line in old.lines)  # `oomguard run` refuses it: a prediction only
    new = planned({}, trl_version="1.16.0", given=False)
    assert new.knobs == TRL_DEFAULTS and new.facts.trl_head == "fused" and "(installed)" in new.lines[0]
    with pytest.raises(ValueError, match="must be divisible by num_generations"):
        planned({"per_device_train_batch_size": 3}, trl_version="1.16.0")


def test_plan_says_what_it_does_not_model():
    u = planned({"use_vllm": True}, trl_version="1.15.0", stack="unsloth")
    assert u.facts.unmodelled == ("unsloth_standby", "unsloth_offloaded_checkpointing", "unsloth_chunked_loss")
    assert u.facts.stack_untested and u.facts.load_takes_4bit  # judged as `oomguard run` judges Unsloth's trainer
    assert planned({}, trl_version="1.16.0", padding_free=True).facts.unmodelled == ("padding_free",)
    assert planned({}, trl_version="1.16.0").facts.unmodelled == ()
