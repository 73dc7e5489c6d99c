"""End to end, real TRL on CPU with the simulated device: tiny random models of the newer families train GRPO under
`oomguard run` (issue 41's done-when): Qwen3, Qwen3-MoE, gpt-oss, Gemma 3 and Qwen2.5-VL with an image per prompt,
built locally from transformers' real classes with bench/family_calibrate.py's configs (no hub), trained by
tests/scripts/grpo_family.py (the bench's own run: prompts of exactly 32 tokens, 128-token completions, 4 x 4 rows).

- at half its own peak each ends stable with at most 1 real OOM, its generations, completion length and rows per step
  kept (a cheaper change fits each of them), and its last attempt is predicted within 5% of what it measured, from
  what the training process reported (the model's config, the prompt lengths, the dataset's images and the
  processor's budget); the median within 2% is the bench's rows' (tests/test_model_families.py);
- a vision-language model whose user ranks only signal changes gives up resolution first: the ``smaller_images``
  rung lowers the processor's ``max_pixels`` in the training process, and completions and generations are kept.

Slow (about ten minutes on two cores): the parts are the default run's (tests/test_images.py: the rung, the facts,
the processor's budget; tests/test_model_families.py: the same rows measured by the bench).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import PYTHON, SCRIPTS, run_oomguard, trl_head

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS = Path(__file__).resolve().parent / "fixtures" / "families" / "cpu-rows.json"
# each family's row of the committed fixture: the same config, measured by the bench (TRL 1.16)
FAMILIES = {"qwen3": "qwen3-full", "moe": "moe-full", "gpt-oss": "gpt-oss-full", "gemma3": "gemma3-full",
            "vlm": "vlm-full"}
DEVICE = 64 * 2**30


def grpo(tmp: Path, model: str, arch: str, budget: str, *args: str, extra: tuple[str, ...] = ()):
    tmp.mkdir(parents=True, exist_ok=True)
    out, rep = run_oomguard(tmp, "--simulate-gpu", budget, *extra, "--", PYTHON, str(SCRIPTS / "grpo_family.py"),
                            "--arch", arch, "--model", model, "--output-dir", str(tmp / "out"), *args)
    assert rep is not None, out.stderr[-3000:]
    return out, rep


def prediction_error(rep: dict) -> float:
    """The run's own prediction of its attempt (the judge, from the facts the training process reported) against
    the simulated device's measured peak."""
    from oomguard.decide.judge import Judge
    from oomguard.vocab.facts import RunFacts
    from oomguard.vocab.knobs import Knobs

    attempt = rep["attempts"][-1]
    est = Judge(DEVICE, simulated=True).predict(RunFacts.from_dict(rep["facts"]), Knobs.from_dict(attempt["knobs"]))
    assert est is not None, rep["facts"]
    return (est.peak_alloc_bytes - attempt["peak_bytes"]) / attempt["peak_bytes"]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_at_half_its_own_peak_each_family_ends_stable_keeping_the_experiment(tmp_path, family_model, arch):
    """Half the peak the bench measured for the same config (the fixture's row, TRL 1.16's fused LM head): stable,
    at most one real OOM, the experiment kept, and the run's own prediction of its last attempt (the judge's, from
    the facts the training process reported: a vision model's images and its processor's budget included) within 5%
    of what that attempt measured."""
    if trl_head() != "fused":
        pytest.skip("the rows' peaks are TRL 1.16's (its fused LM head)")
    row = next(r for r in json.loads(ROWS.read_text()) if r["config"]["name"] == FAMILIES[arch])
    budget = f"{row['peak'] / 2 / 2**20:.2f}MiB"
    out, rep = grpo(tmp_path, family_model(arch), arch, budget)
    attempts = rep["attempts"]
    assert rep["status"] == "stable", (arch, rep["message"], out.stderr[-3000:])
    assert sum(a["outcome"] == "oom" for a in attempts) <= 1, [(a["kind"], a["outcome"]) for a in attempts]
    kept = rep["experiment"]["kept"]
    assert {"4 generations per prompt", "128-token completions", "1 prompt per step"} <= set(kept), (kept, rep["diff"])
    assert abs(prediction_error(rep)) <= 0.05, (arch, prediction_error(rep), attempts[-1]["knobs"])
    if arch == "vlm":  # the dataset's images and the processor's budget, as GRPOTrainer reads them
        f = rep["facts"]
        assert (f["images_per_prompt"], f["image_height"], f["image_width"]) == (1, 224, 224)
        assert f["pixel_budget_floor"] == 56 * 56


def test_a_vision_language_model_gives_up_resolution_before_completions(tmp_path, family_model):
    """448 x 448 images (256 tokens each) with 32-token completions, on a device of 80% of the run's peak, ranked by
    a ladder of signal changes only: the choice lowers the processor's pixel budget alone (the training process sets
    it on the processor GRPOTrainer holds, and the probe measures less), and keeps the completions and generations."""
    ladder = tmp_path / "signal.toml"
    ladder.write_text('name = "signal"\ndescription = "signal changes only"\nchoose_by = "cost"\n'
                      + "".join(f'\n[[rung]]\nremedy = "{r}"\n'
                                for r in ("smaller_images", "fewer_generations", "shorter_sequences")))
    args = ("--image-size", "448", "--max-pixels", str(448 * 448), "--max-completion-length", "32")
    model = family_model("vlm")
    _, full = grpo(tmp_path / "full", model, "vlm", "64GiB", *args)
    peak = full["attempts"][0]["peak_bytes"]
    out, rep = grpo(tmp_path / "tight", model, "vlm", f"{0.8 * peak / 2**20:.2f}MiB", *args,
                    extra=("--ladder", str(ladder)))
    assert rep["status"] == "stable", (rep["message"], out.stderr[-3000:])
    assert not any(a["outcome"] == "oom" for a in rep["attempts"])
    assert [d["knob"] for d in rep["diff"]] == ["max_pixels"] and rep["diff"][0]["remedy"] == "smaller_images"
    final = rep["attempts"][-1]
    assert final["knobs"]["max_pixels"] < 448 * 448 and final["peak_bytes"] < 0.8 * peak
    assert "changed: fewer image tokens: images of at most" in out.stderr
    assert {"4 generations per prompt", "32-token completions"} <= set(rep["experiment"]["kept"])


def test_a_vlm_at_a_budget_its_images_cannot_fit_gets_its_answer_without_a_chain_of_stops(tmp_path, family_model):
    """Issue 46: 448 x 448 images on a 30 MiB device. The pre-flight stops the script's config; every config the
    ladder reaches (4-bit, LoRA, the images at the rung's floor, fewer generations, shorter completions) is predicted
    beyond what the pre-flight lets run, so none is launched: the answer after one launch (at most two), where the
    climb used to make 8, every one a pre-flight stop, one rung at a time."""
    out, rep = grpo(tmp_path, family_model("vlm"), "vlm", "30MiB", "--image-size", "448", "--max-pixels",
                    str(448 * 448))
    attempts = rep["attempts"]
    assert len(attempts) <= 2 and attempts[0]["outcome"] == "predicted", [(a["kind"], a["outcome"]) for a in attempts]
    assert not any(a["outcome"] == "oom" for a in attempts)
    assert rep["status"] == "exhausted", (rep["message"], out.stderr[-3000:])
    assert rep["message"].startswith("every config the ladder reaches is predicted over the device"), rep["message"]
    assert "smaller_images" in rep["message"] and "still ran out of memory" not in rep["message"]
