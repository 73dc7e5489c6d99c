"""A refactoring guard: the memory model gives the same answer, to the byte, as the saved outputs of a broad grid of
configurations.

This does not check that the model is right: a deliberate change to the model and the regenerated fixture land in
the same commit, so the grid only guards changes meant to leave the model's answers as they were (a refactoring, a
split into phases). The model's correctness checks are the measured rows: tests/test_gpu_rows.py (the H100 rows),
tests/test_trl_range.py (the CPU rows of each tested TRL release), tests/test_unsloth_units.py (Unsloth's),
tests/test_distributed.py (DeepSpeed's per rank) and tests/test_real_cards.py (the crash records and cards).

The grid (:func:`make_cases`) varies every knob the model reads, five model shapes, the GPU and the simulated device,
world sizes, prompt lengths, capacities and coefficients. ``tests/fixtures/estimate_golden.json`` keeps, per case, a
digest of its inputs and of the full ``Estimate.to_dict()`` it produced (or the ``EstimateError`` message), with the
peak and dominant phase in clear for the failure message. Any change to a term, a rounding or a note fails here with
the case's name. A deliberate change to the model regenerates the file::

    python tests/test_estimate_golden.py --write
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from oomguard.memory.estimate import Coefficients, EstimateError, ModelSpec, estimate
from oomguard.vocab.knobs import Knobs

FIXTURE = Path(__file__).parent / "fixtures" / "estimate_golden.json"

MODELS: dict[str, ModelSpec] = {
    "qwen2.5-3b": ModelSpec(151936, 2048, 36, 16, 2, 128, 11008, True, qkv_bias=True, model_type="qwen2",
                            checkpoint_dtype="bfloat16"),
    "llama-3.2-1b": ModelSpec(128256, 2048, 16, 32, 8, 64, 8192, True, checkpoint_dtype="bfloat16"),
    # untied head, o/mlp biases, Qwen3 q/k norms, a float32 checkpoint, multi-head attention (no GQA)
    "odd-7b": ModelSpec(32000, 4096, 32, 32, 32, 128, 11008, False, qkv_bias=True, model_type="qwen3",
                        checkpoint_dtype="float32", o_bias=True, mlp_bias=True, qk_norm=True),
    "tiny-llama": ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True),  # bench/cpu_calibrate.py's shapes
    "tiny-qwen": ModelSpec(40000, 128, 2, 4, 2, 32, 512, True, qkv_bias=True, model_type="qwen2"),
}

# Each knob with the values the grid draws from (None: TRL's default).
AXES: dict[str, list[Any]] = {
    "dtype": [None, "float32", "bfloat16", "float16", "auto", "bf16"],
    "lora_r": [None, 0, 8, 32],
    "lora_target_modules": [None, "all-linear", "q_proj,v_proj", ("gate_proj", "up_proj", "down_proj"),
                            "model.layers.0.self_attn.o_proj"],
    "load_in_4bit": [None, True],
    "gradient_checkpointing": [None, False, True],
    "beta": [None, 0.0, 0.04],
    "optim": [None, "adamw_torch", "adamw_torch_fused", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit",
              "paged_adamw_32bit", "adafactor", "sgd", "lion_8bit", "ademamix_8bit", "adamw_torch_4bit",
              "rmsprop_bnb"],
    "per_device_train_batch_size": [None, 1, 2, 4, 8],
    "gradient_accumulation_steps": [None, 1, 2, 4],
    "steps_per_generation": [None, 1, 2, 3],
    "generation_batch_size": [None, 16],
    "num_generations": [None, 2, 8],
    "max_completion_length": [None, 64, 256, 1024],
    "max_prompt_tokens": [None, 100, 512],
    "expandable_segments": [None, True, False],
    "use_vllm": [None, True],
    "vllm_mode": [None, "colocate", "server"],
    "vllm_gpu_memory_utilization": [None, 0.5],
    "vllm_enable_sleep_mode": [None, True],
    "zero_stage": [None, 1, 2, 3],
    "offload_optimizer": [None, True],
    "offload_params": [None, True],
    "fsdp_offload": [None, True],
    "bf16": [None, True, False],
    "fp16": [None, True],
}
COEFFICIENTS: dict[str, Coefficients | None] = {
    "default": None,
    "gpu": Coefficients(),
    "sim": Coefficients.for_simulated(),
    "scaled": Coefficients(scale=1.137, c_act=0.913, k_logits=17.5, f_frag=0.13, m_ctx=700 * 2**20),
}


def _case(name: str, model: str, knobs: dict[str, Any], *, world_size: int = 1, prompt_tokens: int | None = None,
          simulated: bool = False, capacity: int | None = None, coefficients: str = "default") -> dict[str, Any]:
    return {"name": name, "model": model, "knobs": knobs, "world_size": world_size, "prompt_tokens": prompt_tokens,
            "simulated": simulated, "capacity": capacity, "coefficients": coefficients}


def make_cases() -> list[dict[str, Any]]:
    """One-factor cases (every value of every axis, on two models, GPU and simulated) and a seeded random sample of
    combinations over all axes, models and keyword arguments."""
    cases = []
    for model, simulated, base in (("qwen2.5-3b", False, {"lora_r": 16}), ("tiny-llama", True, {})):
        for knob, values in AXES.items():
            for v in values:
                if v is None:
                    continue
                k = {**base, knob: list(v) if isinstance(v, tuple) else v}
                cases.append(_case(f"{model}/{'sim' if simulated else 'gpu'}/{knob}={v}", model, k,
                                   simulated=simulated, capacity=80 * 2**30 if knob.startswith("vllm") else None))
    rng = random.Random(20261122)
    for n in range(240):
        model = rng.choice(sorted(MODELS))
        k: dict[str, Any] = {}
        for knob, values in AXES.items():
            if rng.random() < 0.45:
                v = rng.choice(values)
                if v is not None:
                    k[knob] = list(v) if isinstance(v, tuple) else v
        cases.append(_case(f"random-{n:03d}/{model}", model, k, world_size=rng.choice([1, 1, 2, 4]),
                           prompt_tokens=rng.choice([None, 32, 128, 300]), simulated=rng.random() < 0.35,
                           capacity=rng.choice([None, 24 * 2**30, 80 * 2**30]),
                           coefficients=rng.choice(sorted(COEFFICIENTS))))
    cases += [_case("error/prompt_tokens=0", "tiny-llama", {}, prompt_tokens=0),
              _case("error/dtype=int8", "tiny-llama", {"dtype": "int8"})]
    return cases


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """The estimate's full output for one case, or the error it raised, as JSON-ready data."""
    knobs = {k: tuple(v) if isinstance(v, list) else v for k, v in case["knobs"].items()}
    try:
        e = estimate(MODELS[case["model"]], Knobs(**knobs), world_size=case["world_size"],
                     prompt_tokens=case["prompt_tokens"], coefficients=COEFFICIENTS[case["coefficients"]],
                     simulated=case["simulated"], capacity=case["capacity"])
    except EstimateError as err:
        return {"error": str(err)}
    return e.to_dict()


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:24]


def summary(case: dict[str, Any]) -> dict[str, Any]:
    """What the fixture keeps of one case: digests of its inputs and output, and the headline figures in clear."""
    out = run_case(case)
    inputs = _digest({k: v for k, v in case.items() if k != "name"})
    if "error" in out:
        return {"in": inputs, "error": out["error"]}
    return {"in": inputs, "peak": out["peak_bytes"], "alloc": out["peak_alloc_bytes"], "phase": out["dominant_phase"],
            "out": _digest(out)}


@functools.cache
def _load() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_fixture_covers_the_grid():
    data = _load()
    assert data["models"] == {name: asdict(s) for name, s in MODELS.items()}
    assert list(data["cases"]) == [c["name"] for c in make_cases()]
    assert len(data["cases"]) > 300
    errors = sum("error" in c for c in data["cases"].values())
    assert 0 < errors < len(data["cases"]) // 4  # the grid also exercises the one-line errors, but mostly estimates
    assert {c.get("phase") for c in data["cases"].values()} >= {"generation", "scoring", "forward_backward"}


@pytest.mark.parametrize("case", make_cases(), ids=lambda c: c["name"])
def test_estimate_matches_saved_output_to_the_byte(case):
    expected = _load()["cases"][case["name"]]
    assert expected["in"] == summary(case)["in"], "the grid changed: regenerate the fixture from the unchanged model"
    assert summary(case) == expected


def write() -> None:
    cases = {c["name"]: summary(c) for c in make_cases()}
    models = json.dumps({name: asdict(s) for name, s in MODELS.items()}, sort_keys=True, separators=(",", ":"))
    lines = ",\n".join(f"{json.dumps(name)}:{json.dumps(c, separators=(',', ':'))}" for name, c in cases.items())
    FIXTURE.write_text(f'{{"models":{models},\n"cases":{{\n{lines}\n}}}}\n', encoding="utf-8")
    print(f"wrote {len(cases)} cases to {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_estimate_golden.py --write   (regenerates the saved outputs)")
    write()
