"""An Unsloth GRPO notebook under ``oomguard run``, for real, on the simulated device. These run in the environment
``tests/unsloth.sh`` builds (``pytest -m unsloth``); elsewhere, where Unsloth is not installed, they are skipped.

The script is ``tests/scripts/grpo_unsloth.py``: ``FastLanguageModel.from_pretrained`` then ``get_peft_model`` (LoRA
r=8, Unsloth's checkpointing), then TRL's GRPOTrainer, as Unsloth's notebooks write it. The model is the tests' Qwen2
with a vocabulary padded to 16k, whose logits make a large share of its peak.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unsloth, pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("unsloth") is None,
                                 reason="Unsloth is not installed here (tests/unsloth.sh builds its environment)")]

SCRIPT = str(Path(__file__).parent / "scripts" / "grpo_unsloth.py")
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
# 8 generations of 64 tokens, 8 rows per micro-batch: a peak of about 100 MiB, where the allocator's 20 MiB segments
# are a small part of it
NOTEBOOK = ("--generations", "8", "--completion", "64", "--bs", "8")


def oomguard(tmp: Path, *args: str, script: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    out = subprocess.run([sys.executable, "-m", "oomguard", "run", "--report", str(tmp / "report.json"), "--lock",
                          str(tmp / "lock.json"), "--workdir", str(tmp / "wd"), *args, "--", sys.executable, SCRIPT,
                          *script, "--output-dir", str(tmp / "out")],
                         capture_output=True, text=True, cwd=tmp, timeout=900, env={**os.environ, **ENV})
    return out, json.loads((tmp / "report.json").read_text())


def test_a_notebook_at_half_its_own_peak_climbs_by_prediction_alone(tmp_path, build_model):
    """The done-when of issue 31: measured where it fits, then run on half its own peak. oomguard reads the model as
    Unsloth built it (its LoRA, its checkpointing, float32 on a CPU without bf16, Unsloth's CPU LM head), so the
    pre-flight stops what cannot fit and the first config launched fits: no real OOM, at most three launches, and
    the probe's peak is what the model predicted, within its measured error."""
    from oomguard.memory.estimate import SIMULATED_HEAD_ERROR, ModelSpec, estimate
    from oomguard.vocab.knobs import Knobs

    model = build_model("qwen")
    free = tmp_path / "free"
    free.mkdir()
    out, report = oomguard(free, "--simulate-gpu", "4GiB", "--no-probe", script=(model, *NOTEBOOK))
    assert out.returncode == 0, out.stderr[-3000:]
    facts, original = report["facts"], report["original"]
    assert (facts["stack"], facts["trl_head"], facts["user_peft"]) == ("unsloth", "rowchunk", True)
    assert (original["lora_r"], original["gradient_checkpointing"], original["bf16"]) == (8, True, False)
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
    assert -under - 0.005 <= err <= over, (est.peak_alloc_bytes, probe["peak_bytes"])


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
