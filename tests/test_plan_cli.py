"""`oomguard plan`: the JSON contract, suggestions in the ladder's order, and one-line errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.decide.judge import Judge
from oomguard.decide.plan import make_plan
from oomguard.memory.estimate import ModelSpec
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
from oomguard.vocab.oomreport import OOMReport

MODELS = Path(__file__).resolve().parent / "fixtures" / "models"
LLAMA = str(MODELS / "llama-3.2-1b")
KEYS = {"peak_bytes", "capacity_bytes", "fits", "trainable_params", "breakdown", "suggest"}
BREAKDOWN = {"weights", "reference", "gradients", "optimizer", "activations", "logits", "kv_cache", "vllm", "overhead"}


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomguard", "plan", *args], capture_output=True, text=True)


def test_json_contract_for_a_config_that_does_not_fit():
    out = plan("--model", LLAMA, "--gpu", "15.73GiB", "max_completion_length=786", "--json")
    assert out.returncode == 3, out.stderr  # does not fit: `oomguard plan ... && python train.py` stops here
    d = json.loads(out.stdout)
    assert set(d) >= KEYS and set(d["breakdown"]) == BREAKDOWN
    assert d["capacity_bytes"] == round(15.73 * 2**30) and d["fits"] is False
    assert d["trainable_params"] == 1_235_814_400
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    assert d["suggest"] and d["fits_after"] is True
    # at TRL's learning rate (1e-6) bf16 weights would not learn, so the cheapest config that still trains is LoRA
    # (its float32 adapters learn); the completions and generations stay
    assert "dtype" not in d["suggest"] and d["suggest"]["lora_r"] == 16, d["suggest"]
    # at a learning rate bf16 keeps, the default ladder chooses what costs the experiment least: bf16 weights
    # (precision), the completions, the generations and a full fine-tune stay; LoRA, which changes what is trained,
    # is shown as an alternative
    d = json.loads(plan("--model", LLAMA, "--gpu", "15.73GiB", "max_completion_length=786", "learning_rate=1e-4",
                        "--json").stdout)
    assert d["suggest"] == {"dtype": "bfloat16"}, d["suggest"]
    assert any("lora_r" in a["overrides"] and a["avoids"] == ["precision"] for a in d["alternatives"])
    assert d["warnings"] == []
    bf16 = json.loads(plan("--model", LLAMA, "--gpu", "80GiB", "dtype=bfloat16", "--json").stdout)
    assert bf16["warnings"] and "below bfloat16's resolution at learning rate 1e-06" in bf16["warnings"][0]
    # the fastest ladder (the earlier default) shortens the completions instead: the halving to 393 is relaxed to the
    # longest grid length predicted to fit with the model's error as headroom, as `oomguard run` would choose
    d = json.loads(plan("--model", LLAMA, "--gpu", "16.5GiB", "--ladder", "fastest", "max_completion_length=786",
                        "--json").stdout)
    c = d["suggest"]["max_completion_length"]
    assert 393 < c < 786 and c % 32 == 0 and "lora_r" not in d["suggest"]
    assert d["peak_bytes_after"] * 1.05 <= 16.5 * 2**30  # run's headroom, not a coin flip at the device's edge
    longer = plan("--model", LLAMA, "--gpu", "16.5GiB", "--ladder", "fastest", "max_completion_length=786",
                  f"max_completion_length={c + 32}", "optim=adamw_bnb_8bit", "expandable_segments=true", "--json")
    assert json.loads(longer.stdout)["peak_bytes"] * 1.05 > 16.5 * 2**30  # 32 tokens more would leave no headroom


def test_a_config_that_fits_has_no_suggestion_and_a_table():
    out = plan("--model", LLAMA, "--gpu", "80GB", "dtype=bfloat16", "lora_r=16", "--json")
    d = json.loads(out.stdout)
    assert d["fits"] is True and d["suggest"] == {} and d["headroom_bytes"] > 0
    assert out.returncode == 0
    text = plan("--model", LLAMA, "--gpu", "80GB", "dtype=bfloat16").stdout
    assert "fits" in text and "weights" in text and "to spare" in text


def test_lora_count_of_qwen_3b_in_plan():
    d = json.loads(plan("--model", str(MODELS / "qwen2.5-3b" / "config.json"), "--gpu", "24GiB", "lora_r=32",
                        "dtype=bfloat16", "--json").stdout)
    assert d["trainable_params"] == 59_867_136


@pytest.mark.parametrize("args, problem", [
    (["--model", "/nonexistent/model", "--gpu", "24GiB"], "/nonexistent/model"),
    (["--model", LLAMA, "--gpu", "lots"], "not a size"),
    (["--model", LLAMA, "--gpu", "0"], "more than 0"),
    (["--model", LLAMA, "--gpu", "24GiB", "max_prompt_length=512"], "unknown knob 'max_prompt_length'"),
    (["--model", LLAMA, "--gpu", "24GiB", "num_generations"], "expected KNOB=VALUE"),
    (["--model", LLAMA, "--gpu", "24GiB", "num_generations=many"], "takes an integer"),
    (["--model", LLAMA, "--gpu", "24GiB", "num_generations=3"], "divisible by num_generations"),
    (["--model", LLAMA, "--gpu", "8"], "--gpu 8 means 8 bytes; did you mean 8GiB?"),
    (["--model", LLAMA, "--gpu", "24GiB", "optim=fastest"], "optim names no optimizer"),
    (["--model", LLAMA, "--gpu", "24GiB", "--trl-version", "0.12"], "--trl-version takes a TRL release from 0.14.0"),
])
def test_bad_inputs_get_one_line(args, problem):
    out = plan(*args)
    assert out.returncode == 2, out.stdout
    assert problem in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_garbled_and_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    out = plan("--model", str(tmp_path / "empty"), "--gpu", "24GiB")
    assert out.returncode == 2 and "config.json" in out.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    out = plan("--model", str(bad), "--gpu", "24GiB")
    assert out.returncode == 2 and str(bad) in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_make_plan_keeps_the_ladder_order():
    spec = ModelSpec.from_config(json.loads((MODELS / "llama-3.2-1b" / "config.json").read_text()))
    p = make_plan(spec, TRL_DEFAULTS, 16 * 2**30)
    names = [s.remedy.name for s in p.steps]
    from oomguard.decide.ladder import load_ladder

    order = [r.name for r in load_ladder("default").rungs]
    assert names == sorted(names, key=order.index)


def test_guide_learns_from_an_oom_it_did_not_predict():
    spec_cfg = json.loads((MODELS / "llama-3.2-1b" / "config.json").read_text())
    facts = RunFacts(model_config=spec_cfg)
    g = Judge(24 * 2**30)
    k = TRL_DEFAULTS.replace(dtype="bfloat16")
    assert g.predict(facts, k).fits(24 * 2**30)  # about 14 GiB predicted
    g.learn(facts, k, "oom", None, OOMReport("cuda", "allocator", "x", requested=2 * 2**30, allocated=20 * 2**30))
    assert not g.predict(facts, k).fits(24 * 2**30)  # now more conservative
    before = g.coefficients.scale
    g.learn(facts, k, "ok", int(g.predict(facts, k).peak_alloc_bytes * 0.9), None)
    assert g.coefficients.scale < before  # and a measured success pulls it back
    assert g.fits(RunFacts()) is None  # without a model config there is nothing to judge with


def test_a_plan_that_does_not_fit_exits_3_in_text_too():
    out = plan("--model", LLAMA, "--gpu", "4GiB")
    assert out.returncode == 3 and "does not fit" in out.stdout
    assert "3 when it does not" in plan("--help").stdout


def test_knobs_lists_every_knob_and_plan_points_at_it():
    from oomguard.vocab.knobs import KNOB_NAMES, REACH, TRL_DEFAULTS

    out = subprocess.run([sys.executable, "-m", "oomguard", "knobs", "--json"], capture_output=True, text=True)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert out.returncode == 0 and set(rows) == KNOB_NAMES
    assert all(r["type"] and r["meaning"] and r["reaches"] for r in rows.values())
    assert rows["lora_r"]["reaches"] == ["GRPOTrainer"] and rows["lora_r"]["default"] == TRL_DEFAULTS.lora_r == 0
    assert rows["dtype"]["reaches"] == ["GRPOTrainer", "from_pretrained"] and "dtype" in REACH["model"]
    assert rows["optim"]["type"] == "str" and rows["optim"]["default"] == "adamw_torch_fused"
    text = subprocess.run([sys.executable, "-m", "oomguard", "knobs"], capture_output=True, text=True).stdout
    assert "max_completion_length" in text and "GRPOConfig" in text
    helptext = plan("--help").stdout
    assert "oomguard knobs" in helptext and "oomguard ladders" not in helptext


def test_trl_version_fills_what_the_config_leaves_out_with_that_release_s_defaults():
    """trl#3678's config: Qwen3-0.6B on a 20 GB card, the script's own max_completion_length=256, TRL's defaults for
    the rest. Under the installed TRL (checkpointing, the fused LM head) it fits; under TRL 0.19, as the report ran it
    (no checkpointing, the [B, C, V] logits materialised), it does not, as the report found."""
    args = ("--model", str(MODELS / "qwen3-0.6b"), "--gpu", "20GiB", "--prompt-tokens", "168",
            "max_completion_length=256", "--json")
    now = json.loads(plan(*args).stdout)
    out = plan(*args, "--trl-version", "0.19")
    then = json.loads(out.stdout)
    assert now["fits"] and now["trl"]["head"] == "fused"
    assert out.returncode == 3 and not then["fits"] and then["trl"]["head"] == "logits"
    assert "the defaults of 0.19.0 (2025-06-20)" in then["trl"]["lines"][0]
    assert then["breakdown"]["logits"] > 2**30 and then["run"]["first"] != "run"
    text = plan(*args[:-1], "--trl-version", "0.14", "num_generations=4").stdout
    assert "TRL 0.14.0 counts per_device_train_batch_size in prompts: 1 prompt(s) x num_generations 4 = 4" in text


def test_what_plan_does_not_model_is_said_and_never_sure():
    """A vLLM server's own GPU, padding-free batches, a vision tower on a GPU, Unsloth's trainer: one line each, and
    `oomguard run` would probe first, however far under the card the prediction is."""
    vl = str(MODELS / "qwen2.5-vl-3b-instruct")
    out = plan("--model", vl, "--gpu", "80GiB", "--images-per-prompt", "1", "use_vllm=true", "vllm_mode=server",
               "--padding-free")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("not modelled: ")]
    assert [line.split(":")[1].strip() for line in lines] == [
        "a vLLM server's own GPU (vllm_mode=server)", "packed or padding-free batches (no padded rows)",
        "a vision tower on a GPU"]
    assert "oomguard run: a short worst-case probe first" in out.stdout
    text = plan("--model", vl, "--gpu", "80GiB", "--images-per-prompt", "0").stdout  # text only: measured on a GPU
    assert "not modelled" not in text and "one launch, the real run" in text
    d = json.loads(plan("--model", LLAMA, "--gpu", "80GiB", "--stack", "unsloth", "use_vllm=true", "--json").stdout)
    assert d["run"]["first"] == "probe" and len(d["not_modelled"]) == 3
    assert d["not_modelled"][0].startswith("Unsloth's vLLM standby mode")
