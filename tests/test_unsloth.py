"""An Unsloth GRPO notebook under ``oomguard run``, for real, on the simulated device. These run in the environment
``tests/unsloth.sh`` builds (``pytest -m unsloth``); elsewhere, where Unsloth is not installed, they are skipped.

The script is ``tests/scripts/grpo_unsloth.py``: ``FastLanguageModel.from_pretrained`` then ``get_peft_model`` (LoRA
r=8, Unsloth's checkpointing), then TRL's GRPOTrainer, as Unsloth's notebooks write it. The model is the tests' Qwen2
with a vocabulary padded to 16k, whose logits make a large share of its peak; issue 49's wider Qwen2 (hidden 512, its
own small vocabulary) puts half of its peak at tens of MiB.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import once_per_session

pytestmark = [pytest.mark.unsloth, pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("unsloth") is None,
                                 reason="Unsloth is not installed here (tests/unsloth.sh builds its environment)")]

SCRIPT = str(Path(__file__).parent / "scripts" / "grpo_unsloth.py")
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
# 8 generations of 64 tokens, 8 rows per micro-batch: a peak of about 100 MiB, where the allocator's 20 MiB segments
# are a small part of it
NOTEBOOK = ("--generations", "8", "--completion", "64", "--bs", "8")
# Issue 49's wider model: 128-token completions, so that half of its peak (58 MiB) holds the bf16 weights and the
# generation of 8 rows in the allocator's 20 MiB segments; at 64 tokens (48 MiB) no config that keeps the experiment
# generates them (a micro-batch split runs out there, with expandable segments or not; 4-bit is not offered there)
WIDE_NOTEBOOK = ("--generations", "8", "--completion", "128", "--bs", "8")
# the notebook's LoRA targets (tests/scripts/grpo_unsloth.py)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cpu_bf16(out: subprocess.CompletedProcess) -> bool:
    """Whether Unsloth's CPU backend trains in bfloat16 on this CPU, as its banner says (its own check: AMX or
    AVX512-BF16 on x86, BF16 on Arm)."""
    said = re.search(r"bfloat16 = (True|False)", out.stdout + out.stderr)
    assert said, "Unsloth's banner says whether this CPU has bfloat16"
    return said.group(1) == "True"


def oomguard(tmp: Path, *args: str, script: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    out = subprocess.run([sys.executable, "-m", "oomguard", "run", "--report", str(tmp / "report.json"), "--lock",
                          str(tmp / "lock.json"), "--workdir", str(tmp / "wd"), *args, "--", sys.executable, SCRIPT,
                          *script, "--output-dir", str(tmp / "out")],
                         capture_output=True, text=True, cwd=tmp, timeout=900, env={**os.environ, **ENV})
    return out, json.loads((tmp / "report.json").read_text())


def test_a_notebook_at_half_its_own_peak_climbs_by_prediction_alone(tmp_path, build_model):
    """The done-when of issue 31: measured where it fits, then run on half its own peak. oomguard reads the model as
    Unsloth built it (its LoRA, its checkpointing, bf16 where the CPU has it and float32 where not, Unsloth's CPU LM
    head), so the pre-flight stops what cannot fit and the first config launched fits: no real OOM, at most three
    launches, and the probe's peak is what the model predicted, within its measured error (measured where Unsloth
    trains in float32; its bf16 CPU path, on a CPU with bf16, is within the looser bound measured there)."""
    from oomguard.memory.estimate import SIMULATED_HEAD_ERROR, ModelSpec, estimate
    from oomguard.vocab.knobs import Knobs

    model = build_model("qwen")
    free = tmp_path / "free"
    free.mkdir()
    out, report = oomguard(free, "--simulate-gpu", "4GiB", "--no-probe", script=(model, *NOTEBOOK))
    assert out.returncode == 0, out.stderr[-3000:]
    facts, original = report["facts"], report["original"]
    assert (facts["stack"], facts["trl_head"], facts["user_peft"]) == ("unsloth", "rowchunk", True)
    # Unsloth trains in bf16 where the CPU has it (its own check, which it prints), else in float32
    bf16 = cpu_bf16(out)
    assert (original["lora_r"], original["gradient_checkpointing"], original["bf16"]) == (8, True, bf16)
    assert report["experiment"]["kept"][-1] == "your LoRA (r=8)"
    peak = report["attempts"][-1]["peak_reserved_bytes"]

    half = tmp_path / "half"
    half.mkdir()
    out, report = oomguard(half, "--simulate-gpu", str(peak // 2), script=(model, *NOTEBOOK))
    assert out.returncode == 0, out.stderr[-4000:]
    attempts = report["attempts"]
    outcomes = [a["outcome"] for a in attempts]
    assert report["status"] == "stable" and "oom" not in outcomes and len(attempts) <= 3, outcomes
    kept = report["experiment"]["kept"]
    assert kept[:3] == ["8 generations per prompt", "64-token completions", "1 prompt per step"], kept
    probe = next(a for a in attempts if a["kind"] == "probe" and a["outcome"] == "ok")
    est = estimate(ModelSpec.from_config(report["facts"]["model_config"]), Knobs.from_dict(probe["knobs"]),
                   prompt_tokens=report["facts"]["prompt_tokens_max"], simulated=True, head="rowchunk")
    over, under = SIMULATED_HEAD_ERROR["rowchunk"]
    err = (est.peak_alloc_bytes - probe["peak_bytes"]) / probe["peak_bytes"]
    if not bf16:  # the rows that measured the error are float32 ones (a CPU without bf16): within it there
        assert -under - 0.005 <= err <= over, (est.peak_alloc_bytes, probe["peak_bytes"])
    else:  # Unsloth's bf16 CPU path is not among them (10.8% under on an avx512_bf16 CPU, 2026-11-29)
        assert -0.15 <= err <= over, (est.peak_alloc_bytes, probe["peak_bytes"])


@pytest.fixture(scope="module")
def wide_half(tmp_path_factory, build_model) -> dict:
    """Issue 49's wider model (hidden 512) under the notebook, measured where it fits (64 GiB), then run on half its
    peak: once per session (its outcomes are asserted by two tests, one of them an expected failure)."""
    model = build_model("qwen_wide")

    def run(tmp: Path) -> dict:
        free, half = tmp / "free", tmp / "half"
        free.mkdir()
        half.mkdir()
        out, measured = oomguard(free, "--simulate-gpu", "64GiB", "--no-probe", script=(model, *WIDE_NOTEBOOK))
        assert out.returncode == 0, out.stderr[-3000:]
        peak = measured["attempts"][-1]["peak_reserved_bytes"]
        out, report = oomguard(half, "--simulate-gpu", str(peak // 2), "--max-attempts", "3",
                               script=(model, *WIDE_NOTEBOOK))
        return {"peak": peak, "measured": measured, "report": report, "stderr": out.stderr[-4000:], "bf16": cpu_bf16(out)}

    return once_per_session(tmp_path_factory, "unsloth-wide", run)


def test_a_wider_model_at_half_its_peak_keeps_what_the_notebook_set(wide_half):
    """Issue 49, Unsloth: ``original`` is what the notebook set (8 generations of 128 tokens, 8 rows, its LoRA r=8 on
    its seven projections, Unsloth's checkpointing and its dtype for this CPU), and every launch trains the notebook's
    own LoRA: no rung replaces its rank."""
    report, peak = wide_half["report"], wide_half["peak"]
    assert 40 * 2**20 < peak // 2 < 60 * 2**20, peak  # tens of MiB, not the few above the weights
    original = report["original"]
    mine = {"num_generations": 8, "max_completion_length": 128, "per_device_train_batch_size": 8, "lora_r": 8,
            "lora_alpha": 8, "lora_target_modules": sorted(PROJECTIONS), "gradient_checkpointing": True,
            "load_in_4bit": False, "dtype": "bfloat16" if wide_half["bf16"] else "float32"}
    assert {k: original[k] for k in mine} == mine and not report.get("unseen"), wide_half["stderr"]
    assert wide_half["measured"]["original"] == original
    assert all(a["knobs"]["lora_r"] == 8 for a in report["attempts"]), [a["knobs"] for a in report["attempts"]]
    assert report["status"] != "failed", wide_half["stderr"]


def test_a_wider_model_at_half_its_peak_is_stable_within_three_launches(wide_half):
    """Issue 49's done-when for Unsloth, at issue 49's --max-attempts 3: stable within 3 launches, at most 1 real OOM,
    the experiment kept (8 generations of 128 tokens, the rows per step, the notebook's LoRA r=8). Neither the 8-bit
    optimizer (Unsloth's CPU backend replaces it) nor the 4-bit load (it fails on the simulated device) is launched,
    and the last launch the budget allows is the run itself."""
    report = wide_half["report"]
    outcomes = [a["outcome"] for a in report["attempts"]]
    assert report["status"] == "stable" and len(outcomes) <= 3 and outcomes.count("oom") <= 1, outcomes
    assert report["experiment"]["kept"] == ["8 generations per prompt", "128-token completions", "1 prompt per step",
                                            "your LoRA (r=8)"]
    assert report["stable"]["lora_r"] == 8 and report["attempts"][-1]["kind"] == "run"
    assert not any(a["knobs"]["load_in_4bit"] or "8bit" in str(a["knobs"]["optim"]) for a in report["attempts"])


def test_the_trainer_unsloth_generates_is_patched(tmp_path, build_model):
    """``import unsloth.models`` runs Unsloth's trainer patcher on this CPU as ``import unsloth`` does on a GPU: it
    writes ``UnslothGRPOTrainer`` (a rewritten copy of TRL's, not a subclass) and binds it to ``trl.GRPOTrainer``.
    oomguard patches that class when it is bound: it sees the script's LoRA and measures the steps, and, as no
    measurement covers that trainer's loss, a probe verifies the config first."""
    model = build_model("qwen")
    out, report = oomguard(tmp_path, "--simulate-gpu", "4GiB", script=(model, "--generated-trainer"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"class": "UnslothGRPOTrainer.UnslothGRPOTrainer"' in out.stdout
    facts = report["facts"]
    assert facts["user_peft"] and facts["stack_untested"] and report["original"]["lora_r"] == 8
    assert report["status"] == "stable" and report["attempts"][0]["kind"] == "probe"
    assert all(a["peak_bytes"] for a in report["attempts"])
    assert "Unsloth's generated GRPO trainer" in out.stderr
