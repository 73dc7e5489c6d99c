"""The memory model on the model families beyond Llama/Qwen2, measured on the simulated device (CPU only).

The same measurement as ``bench/cpu_calibrate.py`` (read it first): a fresh subprocess per configuration builds a
GRPOTrainer with real TRL on a tiny random model, starts oomguard's simulated device before any tensor exists, trains
two optimizer steps with every prompt exactly P tokens and completions forced to C tokens, and reports the peak of
allocated bytes per phase; the parent compares it with ``estimate(..., simulated=True)``. The tiny models are built
from transformers' real classes with small configs (no hub): Qwen3 (q/k norms), Qwen3-MoE (fused experts, top-2, a
dense layer between MoE layers, the router's auxiliary loss), gpt-oss (biased experts, attention sinks, eager
attention, sliding-window layers; bf16/fp32 weights, not MXFP4, which needs a GPU), DeepSeek-V3 (latent attention,
shared experts, a first dense layer), Gemma 3 text (four norms per layer, a large vocabulary, sliding windows) and
Qwen2.5-VL with one image per prompt (its vision tower and image tokens).

    python bench/family_calibrate.py                   # every row (about 10 minutes on 2 CPU cores)
    python bench/family_calibrate.py --only moe-full --show-phases
    python bench/family_calibrate.py --json tests/fixtures/families/cpu-rows.json   # the test fixture

The rows written by ``--json`` are checked by ``tests/test_model_families.py`` (each prediction within 5% of the
measured peak, the median within 2%).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from _phases import build_trainer, select_grid
from cpu_calibrate import Config, make_tokenizer, train_measured

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tiny configs of each family. Sizes are multiples of 16 bytes where the experts' grouped matmul needs it.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=2048, hidden_size=256,
                  intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=True, max_position_embeddings=2048),
    "moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=2048, hidden_size=256,
                intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                tie_word_embeddings=False, max_position_embeddings=2048),
    # a dense layer between MoE layers, and the auxiliary load-balancing loss
    "moe-mixed": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=2048, hidden_size=256,
                      intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, mlp_only_layers=[1],
                      output_router_logits=True, router_aux_loss_coef=0.01, tie_word_embeddings=False,
                      max_position_embeddings=2048),
    "gpt-oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=2048, hidden_size=256,
                    intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=64,
                    layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                    tie_word_embeddings=False, max_position_embeddings=2048),
    "deepseek": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=2048,
                     hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64,
                     qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1,
                     tie_word_embeddings=False, max_position_embeddings=2048),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=16384, hidden_size=256,
                   intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, sliding_window=64, sliding_window_pattern=2, tie_word_embeddings=True,
                   max_position_embeddings=2048),
    # Qwen2.5-VL: one 224 x 224 image per prompt (16 x 16 patches of 14 pixels, merged 2 x 2 into 64 tokens)
    "vlm": dict(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], vocab_size=2048,
                hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=2048,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, image_token_id=2046,
                video_token_id=2047, vision_start_token_id=2044, vision_end_token_id=2045,
                vision_config=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_chans=3,
                                   out_hidden_size=256, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                   window_size=112, fullatt_block_indexes=[3])),
}
# The VLM's image and its processor's pixel budget; its chat template renders a prompt of P words as
# "<|im_start|> user <|vision_start|> <|image_pad|>... <|vision_end|> w... <|im_end|> <|im_start|> assistant":
# P + 5 text tokens, and the image's tokens with their two framing tokens (``vision.image_tokens``).
IMAGE = 224
VLM_SPECIALS = ["<|im_start|>", "<|im_end|>", "user", "assistant", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
VLM_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> {% else %}{{ c['text'] }} "
                "{% endif %}{% endfor %}<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
                "{% endif %}")


def images(cfg: Config) -> Any:
    """The images of the row's prompts, as ``estimate`` takes them (None for a text model)."""
    from oomguard.memory.estimate.vision import Images

    if cfg.arch != "vlm":
        return None
    return Images(per_prompt=1, height=IMAGE, width=IMAGE, max_pixels=IMAGE * IMAGE, min_pixels=56 * 56)


def vlm_processor(vocab_size: int, max_pixels: int = IMAGE * IMAGE) -> Any:
    """Qwen2.5-VL's processor over a word-level tokenizer whose last ids are the chat and vision tokens, with a pixel
    budget of ``max_pixels`` per image."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor

    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:  # transformers before 5.4 (TRL 0.29.1's): the PIL processor has the class's own name
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials)}
    words = vocab_size - len(specials) - len(VLM_SPECIALS)
    vocab.update({f"w{i}": i for i in range(len(specials), len(specials) + words)})
    for t in VLM_SPECIALS:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                        additional_special_tokens=VLM_SPECIALS[4:])
    tokenizer.chat_template = VLM_TEMPLATE
    ip = ImageProcessor(min_pixels=56 * 56, max_pixels=max_pixels)

    class ImageOnly(Qwen2_5_VLProcessor):  # no video processor: its class needs torchvision
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None

    return ImageOnly(image_processor=ip, tokenizer=tokenizer, chat_template=VLM_TEMPLATE)


def build_vlm_trainer(cfg: Config, model_dir: str, out_dir: str, rows: int, image: int = IMAGE,
                      max_pixels: int = IMAGE * IMAGE, in_messages: bool = False, **config: Any) -> Any:
    """The calibration run of ``_phases.build_trainer`` for the VLM: conversational prompts of exactly P words, one
    random RGB image of ``image`` x ``image`` pixels each (the dataset's ``image`` column, or with ``in_messages`` an
    ``{"type": "image", "image": ...}`` content part of the prompt's message, as chat datasets hold them), Qwen2.5-VL's
    processor with a budget of ``max_pixels`` (:func:`vlm_processor`)."""
    import random

    import numpy as np
    import torch
    from datasets import Dataset
    from PIL import Image  # the VLM row needs Pillow (pip install pillow)
    from trl import GRPOConfig, GRPOTrainer

    random.seed(0)
    torch.manual_seed(0)
    processor = vlm_processor(ARCHS["vlm"]["vocab_size"], max_pixels)
    rng = random.Random(0)
    nrng = np.random.default_rng(0)
    words = ARCHS["vlm"]["vocab_size"] - 3 - len(VLM_SPECIALS)
    data = [{"prompt": [{"role": "user", "content": " ".join(f"w{rng.randrange(3, 3 + words)}" for _ in range(cfg.P))}],
             "image": Image.fromarray(nrng.integers(0, 255, (image, image, 3), dtype=np.uint8))} for _ in range(rows)]
    features = None
    if in_messages:
        from datasets import Features, List, Value
        from datasets import Image as ImageFeature

        part = {"type": Value("string"), "image": ImageFeature(), "text": Value("string")}
        features = Features({"prompt": List({"role": Value("string"), "content": List(part)})})
        data = [{"prompt": [{"role": "user", "content": [{"type": "image", "image": d["image"], "text": None},
                                                         {"type": "text", "image": None,
                                                          "text": d["prompt"][0]["content"]}]}]} for d in data]

    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=cfg.B, num_generations=cfg.G,
        gradient_accumulation_steps=cfg.GA, max_completion_length=cfg.C, max_steps=2,
        gradient_checkpointing=cfg.gc, optim=cfg.optim, beta=cfg.beta, model_init_kwargs={"dtype": cfg.dtype},
        generation_kwargs={"min_new_tokens": cfg.C}, logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, seed=0, remove_unused_columns=False, **config,
    )
    peft_config = None
    if cfg.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, target_modules=_targets(cfg),
                                 lora_dropout=0.0, task_type="CAUSAL_LM")

    def reward(completions: list[Any], **kw: Any) -> list[float]:
        return [rng.random() for _ in completions]

    return GRPOTrainer(model=model_dir, reward_funcs=[reward], args=args,
                       train_dataset=Dataset.from_list(data, features=features), processing_class=processor,
                       peft_config=peft_config)


def build_model(path: Path, arch: dict[str, Any], dtype: str = "float32") -> None:
    """A random-weight model of ``arch`` from transformers' own class, and a word-level tokenizer over its vocabulary
    (the tiny models of ``cpu_calibrate.build_model``, for any family)."""
    import torch
    import transformers
    from transformers import AutoConfig

    spec = copy.deepcopy(arch)
    tokenizer = vlm_processor(spec["vocab_size"]) if "vision_config" in spec else make_tokenizer(spec["vocab_size"])
    spec.update(pad_token_id=0, eos_token_id=2, bos_token_id=2, torch_dtype=dtype)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = getattr(transformers, arch["architectures"][0])(config).to(getattr(torch, dtype))
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    getattr(tokenizer, "tokenizer", tokenizer).save_pretrained(path)  # the VLM's processor is rebuilt by the worker


BASE = Config("base", arch="qwen3")
GRID: list[Config] = [
    replace(BASE, name="qwen3-full"),
    replace(BASE, name="qwen3-lora16", lora_r=16),
    replace(BASE, name="moe-full", arch="moe"),
    replace(BASE, name="moe-full-nogc", arch="moe", gc=False),
    replace(BASE, name="moe-lora16", arch="moe", lora_r=16),  # all-linear: PEFT adapts the experts and the router
    replace(BASE, name="moe-lora16-attn", arch="moe", lora_r=16, extra={"targets": "attention"}),
    replace(BASE, name="moe-mixed-full-c256", arch="moe-mixed", C=256),
    replace(BASE, name="moe-autocast", arch="moe", bf16=True),
    replace(BASE, name="gpt-oss-full", arch="gpt-oss"),
    replace(BASE, name="gpt-oss-lora16", arch="gpt-oss", lora_r=16),
    replace(BASE, name="deepseek-full", arch="deepseek"),
    replace(BASE, name="deepseek-lora16", arch="deepseek", lora_r=16),
    replace(BASE, name="gemma3-full", arch="gemma3"),
    replace(BASE, name="gemma3-lora16-b8", arch="gemma3", lora_r=16, B=8, G=8, C=64),
    # without checkpointing, where each family's own activations (experts, sinks and eager attention, latent
    # attention, q/k norms, four norms) are most of the peak
    replace(BASE, name="qwen3-nogc-c256", gc=False, C=256),
    replace(BASE, name="moe-mixed-nogc-b8", arch="moe-mixed", gc=False, B=8, G=8),
    replace(BASE, name="moe-lora16-nogc", arch="moe", lora_r=16, gc=False, C=256),
    replace(BASE, name="gpt-oss-nogc-c256", arch="gpt-oss", gc=False, C=256),
    replace(BASE, name="deepseek-nogc-c256", arch="deepseek", gc=False, C=256),
    replace(BASE, name="gemma3-lora16-nogc", arch="gemma3", lora_r=16, gc=False),
    # a vision-language model with one image per prompt: its tower (trained, or adapted by all-linear LoRA)
    replace(BASE, name="vlm-full", arch="vlm"),
    replace(BASE, name="vlm-full-nogc", arch="vlm", gc=False),
    replace(BASE, name="vlm-lora16", arch="vlm", lora_r=16),
    # the same images as content parts of the prompt's message (as chat datasets hold them), not an image column
    replace(BASE, name="vlm-msgs-full", arch="vlm", extra={"in_messages": True}),
]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _targets(cfg: Config) -> Any:
    return ATTENTION if cfg.extra.get("targets") == "attention" else "all-linear"


def knobs(cfg: Config) -> Any:
    k = cfg.knobs()
    return k.replace(lora_target_modules=tuple(_targets(cfg))) if cfg.lora_r and cfg.extra.get("targets") else k


def worker(cfg: Config, model_dir: str, out_dir: str) -> dict[str, Any]:
    from oomguard.child import simulate

    dev = simulate.start(64 * 2**30, expandable=False)
    extra = {k: v for k, v in cfg.extra.items() if k not in ("targets", "in_messages")}
    if cfg.arch == "vlm":
        trainer = build_vlm_trainer(cfg, model_dir, out_dir, rows=64, bf16=cfg.bf16, use_cpu=True,
                                    in_messages=bool(cfg.extra.get("in_messages")), **extra)
    else:
        trainer = build_trainer(replace(cfg, extra=extra), model_dir, ARCHS[cfg.arch]["vocab_size"], out_dir,
                                rows=64, model_init_kwargs={"dtype": cfg.dtype}, bf16=cfg.bf16, use_cpu=True,
                                target_modules=_targets(cfg))
    prompt_lengths: list[int] = []
    if cfg.arch == "vlm":  # the prompt's length as the processor made it (text, template and image tokens)
        tokenize = trainer._tokenize_prompts

        def measured(prompts: list[Any]) -> Any:
            out = tokenize(prompts)
            prompt_lengths.extend(len(ids) for ids in out[0])
            return out

        trainer._tokenize_prompts = measured
    phases, steps, resident, seconds = train_measured(trainer, dev)
    import transformers

    from oomguard.child import trlcompat

    trl = trlcompat.read()
    return {"peak": max(phases.values()), "phases": phases, "steps": steps, "resident": resident,
            "train_seconds": seconds,
            "params": sum(p.numel() for p in trainer.model.parameters()),
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "trl": trl.version, "trl_head": trl.head, "transformers": transformers.__version__,
            "bf16": bool(trainer.args.bf16), "prompt_tokens": sorted(set(prompt_lengths))}


def predict(cfg: Config, coefficients: Any = None, head: str | None = None) -> Any:
    from oomguard.memory.estimate import Coefficients, ModelSpec, estimate

    spec = ModelSpec.from_config(ARCHS[cfg.arch])
    text = cfg.P + (5 if cfg.arch == "vlm" else 0)  # the VLM's chat template adds five text tokens
    return estimate(spec, knobs(cfg), prompt_tokens=text, coefficients=coefficients or Coefficients.for_simulated(),
                    simulated=True, head=head, images=images(cfg))


def run_one(cfg: Config, model_dirs: dict[str, Path], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="oomguard-fam-") as out:
        cmd = [sys.executable, __file__, "--worker", json.dumps(cfg.__dict__), "--model-dir", str(model_dirs[cfg.arch]),
               "--out-dir", out]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
        env.pop("OOMGUARD_PLAN", None)
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                res["seconds"] = round(time.time() - t0, 1)
                return res
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def table(results: list[tuple[Config, dict[str, Any]]], show_phases: bool) -> list[float]:
    from oomguard.vocab.sizes import MiB

    errors = []
    print(f"{'config':<22} {'shape':<52} {'predicted':>10} {'measured':>10} {'error':>8}")
    for cfg, res in results:
        if "error" in res:
            print(f"{cfg.name:<22} {cfg.label():<52} {'':>10} {'FAILED':>10}  {res['error'][:400]}")
            continue
        est = predict(cfg, head=res.get("trl_head"))
        err = 100.0 * (est.peak_alloc_bytes - res["peak"]) / res["peak"]
        errors.append(err)
        label = f"{cfg.arch} " + cfg.label().split(" ", 1)[1] + (" attn" if cfg.extra.get("targets") else "")
        print(f"{cfg.name:<22} {label:<52} {est.peak_alloc_bytes / MiB:>8.1f}Mi {res['peak'] / MiB:>8.1f}Mi "
              f"{err:>+7.1f}%")
        if show_phases:
            for ph in ("generation", "scoring", "forward_backward", "optimizer"):
                m = res["phases"].get(ph)
                p = est.phases.get(ph)
                if m is None and not p:
                    continue
                m_txt = f"{m / MiB:8.1f}Mi" if m is not None else "       -  "
                print(f"{'':<24}{ph:<50} {p / MiB:>8.1f}Mi {m_txt}")
    if errors:
        abs_err = [abs(e) for e in errors]
        print(f"\n{len(errors)} configurations: median |error| {statistics.median(abs_err):.1f}%, "
              f"max |error| {max(abs_err):.1f}%, mean error {statistics.mean(errors):+.1f}%")
    return errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], help="run only the named configuration(s)")
    p.add_argument("--jobs", "-j", type=int, default=2, help="configurations measured in parallel (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    p.add_argument("--show-phases", action="store_true", help="also print predicted vs measured per phase")
    p.add_argument("--json", metavar="PATH", help="write the measurements to PATH")
    p.add_argument("--from-json", metavar="PATH", help="re-use measurements written by --json instead of measuring")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.worker:
        res = worker(Config(**json.loads(a.worker)), a.model_dir, a.out_dir)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    grid = select_grid(GRID, a.only or None, p)
    t0 = time.time()
    if a.from_json:
        saved = {r["config"]["name"]: r for r in json.loads(Path(a.from_json).read_text())}
        grid = [c for c in grid if c.name in saved]
        measured = [saved[c.name] for c in grid]
    else:
        with tempfile.TemporaryDirectory(prefix="oomguard-tiny-") as tmp:
            model_dirs = {}
            for arch in sorted({c.arch for c in grid}):
                model_dirs[arch] = Path(tmp) / arch
                build_model(model_dirs[arch], ARCHS[arch])
            with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
                measured = list(pool.map(lambda c: run_one(c, model_dirs, a.timeout), grid))
    results = list(zip(grid, measured, strict=True))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps([{"config": c.__dict__, "arch": ARCHS[c.arch], **r} for c, r in results],
                                           indent=1))
    table(results, a.show_phases)
    print(f"\nwall time {time.time() - t0:.0f} s; command: python bench/family_calibrate.py "
          + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
