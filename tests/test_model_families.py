"""The memory model on the families beyond Llama/Qwen2: mixture-of-experts (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss,
DeepSeek V2/V3), vision-language models (Qwen2.5-VL, Gemma 3) and the newer dense decoders (Qwen3, Gemma 3, Llama 3.1,
Phi-4).

- every parameter of the published configs (``tests/fixtures/models/``) counted exactly as transformers 5.24's real
  class builds it (instantiated on the meta device), and the same from the config the training process reports;
- LoRA counted as PEFT 0.21 creates it on tiny models of each family, for all-linear, lists and target_parameters;
- the measured rows of ``bench/family_calibrate.py`` (``tests/fixtures/families/cpu-rows.json``): each prediction within
  5% of the simulated device's measured peak, the median within 2%;
- ``oomguard plan`` and ``--fit`` answer for the five configs of issue 41.
"""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard.memory.estimate import Coefficients, EstimateError, ModelSpec, estimate, load_model_spec
from oomguard.memory.estimate.model import lora_targets, lora_trainable_params
from oomguard.memory.estimate.readconfig import CLASS_DEFAULTS
from oomguard.memory.estimate.terms import kv_cache_bytes
from oomguard.memory.estimate.vision import Images, image_tokens, load_pixel_budget, vision_patches
from oomguard.vocab.knobs import TRL_DEFAULTS

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = FIXTURES / "models"
ROWS = FIXTURES / "families" / "cpu-rows.json"
BENCH = Path(__file__).resolve().parent.parent / "bench"
NEW = ["qwen3-8b", "llama-3.1-8b", "phi-4", "gemma-3-1b-it", "gemma-3-4b-it", "qwen2.5-vl-3b-instruct",
       "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite", "deepseek-v3", "mixtral-8x7b", "qwen1.5-moe-a2.7b"]
ISSUE_41 = ["qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite", "qwen2.5-vl-3b-instruct", "gemma-3-4b-it"]


def _real_model(config: Any) -> Any:
    """The real class of a config, instantiated on the meta device (no memory)."""
    import torch
    import transformers

    with torch.device("meta"):
        return getattr(transformers, config.architectures[0])(config)


def _auto_config(path: Path) -> tuple[Any, dict[str, Any]]:
    """The config transformers reads from ``path``, and what the training process reports of it."""
    from transformers import AutoConfig

    from oomguard.child.load import model_config_dict

    cfg = AutoConfig.from_pretrained(path)
    reported = model_config_dict(cfg)
    if getattr(cfg, "quantization_config", None) is not None:  # gpt-oss's MXFP4: counted as the dequantised model
        del cfg.quantization_config
    return cfg, reported


# -- parameter counts --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*NEW, "llama-3.2-1b", "qwen2.5-3b"])
def test_every_parameter_of_the_published_config_is_counted(name):
    """ModelSpec.params against the real class's ``sum(p.numel())``: exact (the issue asks within 1%), and the same
    when the model is read from the config the training process reports (``load.model_config_dict``)."""
    spec = load_model_spec(MODELS / name)
    cfg, reported_config = _auto_config(MODELS / name)
    real = sum(p.numel() for p in _real_model(cfg).parameters())
    assert spec.params == real, (name, spec.params - real)
    assert sum(spec.param_tensors()) == spec.params
    reported = ModelSpec.from_config(reported_config)
    assert reported.params == real and reported.moe == spec.moe and reported.vision == spec.vision


def test_the_families_are_read_from_what_the_config_declares():
    moe = load_model_spec(MODELS / "qwen3-30b-a3b")
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.expert_intermediate, moe.moe_layers) == (128, 8, 768, 48)
    assert moe.qk_norm and not moe.tie_word_embeddings and moe.moe.peft_pattern == "qwen2_moe"
    oss = load_model_spec(MODELS / "gpt-oss-20b")
    assert oss.moe.expert_bias and oss.moe.router_bias and oss.attn_sinks and oss.eager_attention and oss.moe.mxfp4
    assert (oss.sliding_window, oss.sliding_layers, oss.moe.peft_pattern) == (128, 12, None)
    ds = load_model_spec(MODELS / "deepseek-v2-lite")
    assert ds.mla.kv_lora_rank == 512 and ds.mla.q_lora_rank is None and ds.dense_layers == 1
    assert ds.moe.shared_intermediate == 2 * 1408 and ds.moe.num_experts == 64
    v3 = load_model_spec(MODELS / "deepseek-v3")
    assert v3.mla.q_lora_rank == 1536 and v3.dense_layers == 3
    gemma = load_model_spec(MODELS / "gemma-3-4b-it")  # text_config leaves vocabulary and heads to its class
    assert (gemma.vocab_size, gemma.num_heads, gemma.num_kv_heads, gemma.head_dim) == (262208, 8, 4, 256)
    assert gemma.norms_per_layer == 4 and gemma.tie_word_embeddings and gemma.sliding_layers == 29
    assert gemma.vision.kind == "siglip" and gemma.vision_params == 419_816_304
    qvl = load_model_spec(MODELS / "qwen2.5-vl-3b-instruct")
    assert qvl.vision.kind == "merger" and qvl.vision_params == 668_684_288 and qvl.sliding_layers == 0
    phi = load_model_spec(MODELS / "phi-4")
    assert phi.fused_qkv and phi.fused_gate_up and "qkv_proj" in phi.projections()


def test_class_defaults_are_transformers_defaults():
    """The defaults a published config leaves to its class are the class's (transformers 5.24)."""
    import transformers

    classes = {"gemma3_text": transformers.Gemma3TextConfig, "siglip_vision_model": transformers.SiglipVisionConfig,
               "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
               "deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config,
               "gpt_oss": transformers.GptOssConfig, "mixtral": transformers.MixtralConfig}
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    classes["qwen2_5_vl_vision"] = Qwen2_5_VLVisionConfig
    for model_type, defaults in CLASS_DEFAULTS.items():
        cfg = classes[model_type]()
        for key, value in defaults.items():
            real = getattr(cfg, key)
            assert (list(real) if isinstance(real, tuple) else real) == value, (model_type, key, real)


@pytest.mark.parametrize("config,match", [
    ({"model_type": "jamba", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2}, "num_experts: the mixture-of-experts"),
    ({"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128, "num_experts": 8}, "num_experts_per_tok"),
    ({"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128, "layer_types": ["linear_attention", "full_attention"]},
     "layer_types declares linear_attention"),
    ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
      "text_config": {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "intermediate_size": 128},
      "vision_config": {"model_type": "clip_vision_model"}}, "vision_config"),
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"},
      "vision_config": {"model_type": "siglip_vision_model"}}, "vision_use_head"),
])
def test_what_cannot_be_counted_is_refused_in_one_line(config, match):
    with pytest.raises(EstimateError, match=match) as info:
        ModelSpec.from_config(config, source="cfg.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("cfg.json: ")


# -- LoRA as PEFT adapts it --------------------------------------------------------------------------------------------

def _tiny() -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(BENCH))
    from family_calibrate import ARCHS

    out = {k: copy.deepcopy(v) for k, v in ARCHS.items()}
    out["qwen2_moe"] = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=512,
                            hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    out["mixtral"] = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=512, hidden_size=64,
                          intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    out["phi3"] = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    out["gemma3-vl"] = dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                            mm_tokens_per_image=16, boi_token_index=500, eoi_token_index=501, image_token_index=502,
                            text_config=dict(model_type="gemma3_text", vocab_size=512, hidden_size=64,
                                             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, sliding_window=8),
                            vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2, image_size=224,
                                               patch_size=14, vision_use_head=False))
    return out


LORA_CASES = [("all-linear", None), (("q_proj", "v_proj"), None),
              (("q_proj", "k_proj", "v_proj", "o_proj"), ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
              (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), None),
              ("all-linear", ("1.mlp.experts.gate_up_proj",)), (("qkv_proj", "gate_up_proj"), None)]


@pytest.mark.parametrize("family", sorted(_tiny()))
def test_lora_counts_are_peft_counts(family):
    """lora_trainable_params against PEFT's trainable parameters on a tiny model of each family: all-linear (on a
    Qwen3-MoE, DeepSeek or Mixtral it adapts the fused experts and the router, not the dense MLPs; on gpt-oss only
    the attention), attention lists, user-named expert parameters, Phi-3's fused names, the vision tower's Linears."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    arch = _tiny()[family]
    spec = ModelSpec.from_config(arch)
    d = copy.deepcopy(arch)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    for targets, params in LORA_CASES:
        if params and spec.moe is None:
            continue
        torch.manual_seed(0)
        model = getattr(transformers, arch["architectures"][0])(cfg)
        assert sum(p.numel() for p in model.parameters()) == spec.params
        try:
            kw = {"target_parameters": list(params)} if params else {}
            peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets if isinstance(targets, str)
                                                          else list(targets), task_type="CAUSAL_LM", **kw))
            real = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        except ValueError:  # PEFT finds none of the names in this model
            real = 0
        assert lora_trainable_params(spec, 4, targets, params) == real, (family, targets, params)


def test_lora_targets_explain_what_peft_adapts():
    moe = load_model_spec(MODELS / "qwen3-30b-a3b")
    rows = {t.name: t for t in lora_targets(moe, 16)}
    assert set(rows) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_up_proj", "down_proj"}
    assert rows["gate_up_proj"].rank == 32 and rows["down_proj"].rank == 16 and rows["gate"].kind == "param2"
    attn = lora_trainable_params(moe, 16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert attn == 48 * 16 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))
    oss = load_model_spec(MODELS / "gpt-oss-20b")
    assert {t.where for t in lora_targets(oss, 8)} == {"attention"}  # the recipe then names expert layers:
    layers = lora_targets(oss, 8, "all-linear", ("7.mlp.experts.gate_up_proj", "15.mlp.experts.gate_up_proj"))
    assert [(t.name, t.count) for t in layers if t.where == "experts"] == [("gate_up_proj", 2)]
    with pytest.raises(EstimateError, match="gate_proj and up_proj"):
        lora_trainable_params(moe, 8, ("gate_proj",))


# -- terms ------------------------------------------------------------------------------------------------------------

def test_kv_cache_of_sliding_windows_and_latent_attention():
    gemma = load_model_spec(MODELS / "gemma-3-1b-it")  # 26 layers, every 6th global, window 512
    per_token = 2 * gemma.kv_dim * 2  # keys and values, bf16
    assert kv_cache_bytes(gemma, 1, 4096) == per_token * (4 * 4096 + 22 * 511)
    ds = load_model_spec(MODELS / "deepseek-v2-lite")  # the compressed latent: 512 + 64 per token per layer
    assert kv_cache_bytes(ds, 2, 1000) == 2 * 27 * 1000 * (512 + 64) * 2


def test_moe_terms_follow_the_experts():
    """The experts' weights, gradients and optimizer state are all there (fused: every expert has a gradient and
    AdamW state, measured on CPU); LoRA on the experts materialises one layer's adapted experts in each forward."""
    moe = load_model_spec(MODELS / "qwen3-30b-a3b")
    k = TRL_DEFAULTS.replace(dtype="bfloat16", per_device_train_batch_size=4, max_completion_length=256)
    full = estimate(moe, k, prompt_tokens=128)
    assert full.trainable_params == moe.params and full.breakdown["weights"] >= 2 * moe.params
    attn = estimate(moe, k.replace(lora_r=16, lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
                    prompt_tokens=128)
    experts = estimate(moe, k.replace(lora_r=16), prompt_tokens=128)
    assert experts.peak_bytes - attn.peak_bytes > 2 * 604_766_208  # at least one layer's experts, copied in bf16
    mxfp4 = load_model_spec(MODELS / "gpt-oss-20b")
    from oomguard.memory.estimate import load_bytes

    kept = load_bytes(mxfp4, TRL_DEFAULTS.replace(dtype="bfloat16"), simulated=True, keep_mxfp4=True)
    dequantised = load_bytes(mxfp4, TRL_DEFAULTS.replace(dtype="bfloat16"), simulated=True)
    # 13.8 GB kept quantised, 41.8 in bf16 (as the simulated device's allocator places it: 0.4% more)
    assert 2 * mxfp4.params <= dequantised < 1.005 * 2 * mxfp4.params and 13e9 < kept < 14.5e9
    with pytest.raises(EstimateError, match="MXFP4"):
        estimate(mxfp4, TRL_DEFAULTS.replace(dtype="bfloat16"), keep_mxfp4=True)


def test_image_tokens_and_the_pixel_budget(tmp_path):
    qvl = load_model_spec(MODELS / "qwen2.5-vl-3b-instruct").vision
    assert image_tokens(qvl, Images(height=1080, width=1920, max_pixels=12845056)) == 39 * 69 + 2  # 1092x1932
    assert image_tokens(qvl, Images(height=1080, width=1920)) == 26 * 47 + 2  # the class's budget: 728x1316
    assert image_tokens(qvl, Images(max_pixels=401408)) == 512 + 2
    assert vision_patches(qvl, Images(max_pixels=401408)) == 2048
    gemma = load_model_spec(MODELS / "gemma-3-4b-it").vision
    assert image_tokens(gemma, Images(height=4000, width=3000)) == 256 + 4 and vision_patches(gemma, Images()) == 4096
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 12845056, "min_pixels": 3136}))
    assert load_pixel_budget(tmp_path) == (3136, 12845056)
    assert load_pixel_budget(tmp_path / "nowhere") == (None, None)
    spec = load_model_spec(MODELS / "qwen2.5-vl-3b-instruct")
    k = TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=16)
    text = estimate(spec, k, prompt_tokens=200)
    small = estimate(spec, k, prompt_tokens=200, images=Images(max_pixels=200_704))
    large = estimate(spec, k, prompt_tokens=200, images=Images(max_pixels=1_003_520))
    assert text.peak_bytes < small.peak_bytes < large.peak_bytes  # a smaller pixel budget is a real remedy
    counted = estimate(spec, k, prompt_tokens=200 + 258, images=Images(max_pixels=200_704, in_prompt_tokens=True))
    assert counted.peak_bytes == small.peak_bytes


# -- measured rows ----------------------------------------------------------------------------------------------------

# Each fixture: TRL's release, its rows, the error each row's prediction stays within (over, under), the bound of the
# median error, and the rows that cannot train. The bounds are the measured figures the docs give (docs/concepts/
# memory-model.md, docs/limitations.md, docs/benchmarks.md), rounded up to the next half point: a regression past
# them fails here before the docs are wrong. TRL 1.16 with transformers 5.24, which the model follows: at worst -2.2%
# (+0.4% over), median 0.8%: held to 2.5% and 1%. TRL 0.29.1 with transformers 5.3.0 (the logits LM head, and 5.3's own
# modeling code: its DeepSeek caches the expanded keys and values, not the latent): +7.5% / -6.7%, median 1.6%: held
# to +7.5% / -7% and 2%; three rows cannot train there.
FAMILY_ROWS = {"1.16": (ROWS, 0.025, 0.025, 0.01, ()),
               "0.29.1": (FIXTURES / "families" / "cpu-rows-trl-0.29.1.json", 0.075, 0.07, 0.02,
                          ("moe-mixed-full-c256", "deepseek-lora16", "moe-mixed-nogc-b8"))}


@pytest.mark.parametrize("release", list(FAMILY_ROWS))
def test_measured_rows_of_each_family(release):
    """``python bench/family_calibrate.py --json tests/fixtures/families/cpu-rows.json`` (TRL 1.16, transformers
    5.24, the simulated device), and the same under TRL 0.29.1 in tests/compat.sh's environment (``--json
    tests/fixtures/families/cpu-rows-trl-0.29.1.json``): each prediction within the release's bounds of the measured
    peak (``FAMILY_ROWS``), and the median; the rows that cannot train under a release are the ones named."""
    sys.path.insert(0, str(BENCH))
    from cpu_calibrate import Config
    from family_calibrate import images, knobs

    path, over, under, median, failing = FAMILY_ROWS[release]
    rows = json.loads(path.read_text())
    assert {r["arch"]["model_type"] for r in rows} >= {"qwen3", "qwen3_moe", "gpt_oss", "gemma3_text",
                                                       "qwen2_5_vl", "deepseek_v3"}
    assert sorted(r["config"]["name"] for r in rows if "error" in r) == sorted(failing)
    errors = {}
    for r in rows:
        if "error" in r:
            continue
        assert r["trl"].startswith(release), r["trl"]
        cfg = Config(**r["config"])
        spec = ModelSpec.from_config(r["arch"])
        text = cfg.P + (5 if spec.vision is not None else 0)
        est = estimate(spec, knobs(cfg), prompt_tokens=text, coefficients=Coefficients.for_simulated(),
                       simulated=True, head=r["trl_head"], images=images(cfg))
        assert est.trainable_params == r["trainable"], cfg.name
        if spec.vision is not None and r["prompt_tokens"]:
            assert r["prompt_tokens"] == [est_prompt := text + image_tokens(spec.vision, images(cfg))], est_prompt
        errors[cfg.name] = (est.peak_alloc_bytes - r["peak"]) / r["peak"]
    assert all(-under <= e <= over for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) <= median, errors


# -- plan -------------------------------------------------------------------------------------------------------------

def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomguard", "plan", *args], capture_output=True, text=True)


@pytest.mark.parametrize("name", ISSUE_41)
def test_plan_answers_for_the_new_families(name):
    """Every family of issue 41 was measured on the simulated device only (docs/limitations.md): on a card the memory
    model is never sure of it, so `oomguard run` probes it first and `plan` says so (verdict probe, exit 4), with the
    reason; each card of --fit gets the verdict a plan of that card alone gets."""
    from oomguard.decide.plan import make_plan
    from oomguard.vocab.knobs import RunFacts

    out = _plan("--model", str(MODELS / name), "--gpu", "80GiB", "dtype=bfloat16", "lora_r=16", "--json")
    d = json.loads(out.stdout)
    spec = load_model_spec(MODELS / name)
    assert out.returncode == 4 and d["verdict"]["decision"] == "probe", out.stderr
    assert d["verdict"]["reasons"] == [f"not modelled: {line}" for line in d["not_modelled"]] != []
    assert d["total_params"] - d["trainable_params"] == spec.params
    assert d["peak_bytes"] > 2 * spec.params and sum(d["breakdown"].values()) == d["peak_bytes"]
    fit = _plan("--model", str(MODELS / name), "--gpu", "80GiB,40GiB", "dtype=bfloat16", "lora_r=16",
                "--fit", "max_completion_length", "--json")
    cards = json.loads(fit.stdout)["cards"]
    assert [c["gpu"] for c in cards] == ["80GiB", "40GiB"]
    assert fit.returncode == (0 if all(c["fit_value"] is not None for c in cards) else 3), fit.stderr
    from importlib.metadata import version

    from oomguard.decide.plan import plan_images
    from oomguard.vocab.trlrange import head_of

    trl = version("trl")  # plan judges for the installed TRL, and a vision model with an image per prompt by default
    images, k = plan_images(spec, TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=16), MODELS / name, None, None)
    alone = [make_plan(spec, k, size * 2**30, facts=RunFacts(trl_version=trl, trl_head=head_of(trl), **images))
             .verdict.decision for size in (80, 40)]
    assert [c["verdict"] for c in cards] == alone
