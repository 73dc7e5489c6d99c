"""Build the tests' local model: a small Llama with random weights and a BPE tokenizer trained on the spot.

    python tests/scripts/build_tiny_model.py DIR [--hidden 256 --layers 4 --intermediate 1024 --vocab 1024]
    python tests/scripts/build_tiny_model.py DIR --variant wide

Variants (``VARIANTS``, ``build(path, **VARIANTS[name])``): ``tiny`` is the tests' default model (4 layers, hidden
256, ~4M parameters, activations a large share of its GRPO peak); ``wide`` is 1 layer of hidden 1024 with a 4096
MLP (~16M parameters), so weights, gradients and AdamW state are ~95% of its peak: bench/scenarios.py's
weights-heavy scenario, where the optimizer and LoRA rungs matter and shorter sequences barely do; ``deep`` is 16
thin layers (~11M parameters), where ZeRO-3's whole-model gather for generation is what a rank runs out of; ``long`` is
``tiny`` with a 64k context window, as released models have (tests/test_vllm.py: vLLM holds one sequence of it);
``kv`` is 16 layers of hidden 128 without GQA, whose generation batch is what runs out; ``qwen_wide`` a Qwen2 of hidden
512 whose ms-swift and Unsloth GRPO peaks are tens of MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "wide": {"hidden": 1024, "layers": 1, "intermediate": 4096},
    # many thin layers (16 of hidden 256, a 512 MLP, 4 heads without GQA): under ZeRO-3, DeepSpeed's prefetcher holds
    # about half of it at once when generation gathers per submodule, all of it when TRL gathers the whole model for
    # generation (tests/test_deepspeed.py, bench/zero_calibrate.py)
    "deep": {"layers": 16, "intermediate": 512, "heads": 4, "kv_heads": 4},
    # the context window of a released model (64k): a vLLM that holds one sequence of it by default needs 64 MiB of
    # KV cache (tests/test_vllm.py)
    "long": {"positions": 65536},
    # a Qwen2 with ChatML specials, as ms-swift's `qwen` template writes prompts, and a vocabulary padded to 16k as
    # released models pad theirs: its logits, not its weights, make its GRPO peak (tests/test_swift.py)
    "qwen": {"arch": "qwen2", "padded_vocab": 16384},
    # a Qwen2 twice as wide (hidden 512, a 1536 MLP) with its own small vocabulary: 12.7M parameters, so ms-swift's and
    # Unsloth's GRPO peaks on it are 60 to 100 MiB, and half of one is a budget of tens of MiB (issue 49), not the few
    # MiB above the weights where the allocator's blocks decide (tests/test_swift.py, tests/test_unsloth.py)
    "qwen_wide": {"arch": "qwen2", "hidden": 512, "intermediate": 1536},
    # many layers of few parameters without GQA: its KV cache per token is large against its weights, so the rows it
    # generates at once, not its training micro-batch, make its GRPO peak (tests/test_generation_rounds.py)
    "kv": {"hidden": 128, "layers": 16, "intermediate": 256, "heads": 4, "kv_heads": 4},
}

# Written last into a finished build: what it was built from. A directory whose stamp differs is not reused.
STAMP = "oomguard-build.json"


class ForeignModelDir(RuntimeError):
    """The target directory holds something this builder did not make; it is never reused nor overwritten."""


def build_key(**params: int) -> str:
    """What a build is made from: this file's content, the shape, and the versions that write and initialise it.

    The end-to-end tests' memory budgets are byte-exact for one model, so a cached build is reused only when this
    key matches the one stamped next to it.

    >>> build_key(hidden=256) == build_key(hidden=256) != build_key(hidden=512)
    True
    """
    versions = {}
    for dist in ("torch", "transformers", "tokenizers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    blob = json.dumps({"params": params, "versions": versions}, sort_keys=True).encode() + Path(__file__).read_bytes()
    return hashlib.sha256(blob).hexdigest()


def key_of(**shape: int) -> str:
    """``build_key`` of what ``build(path, **shape)`` builds (the defaults filled in): names a cache directory.

    >>> key_of(**VARIANTS["tiny"]) == key_of(hidden=256, heads=8) != key_of(**VARIANTS["wide"])
    True
    """
    defaults = {k: p.default for k, p in inspect.signature(build).parameters.items() if k != "path"}
    full = {**defaults, **shape}
    if full["positions"] == 2048:  # a build of the default context window keeps the key it always had
        del full["positions"]
    if full["arch"] == "llama":
        del full["arch"]
    if not full["padded_vocab"]:
        del full["padded_vocab"]
    return build_key(**full)


def stamp_of(path: Path) -> dict | None:
    """The stamp of a finished build in ``path``, or None (no build, or a directory this builder did not make)."""
    try:
        data = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build(path: Path, hidden: int = 256, layers: int = 4, intermediate: int = 1024, vocab: int = 1024,
          heads: int = 8, kv_heads: int = 2, positions: int = 2048, arch: str = "llama", padded_vocab: int = 0) -> Path:
    """Build the model in ``path``, or reuse the build there if its stamp matches these parameters exactly.

    A build of ours with another key (older builder, other shape or versions) is replaced; a directory without our
    stamp is left alone and ``ForeignModelDir`` is raised.
    """
    path = Path(path)
    params = {"hidden": hidden, "layers": layers, "intermediate": intermediate, "vocab": vocab, "heads": heads,
              "kv_heads": kv_heads}
    if positions != 2048:  # a build of the default context window keeps the key it always had
        params["positions"] = positions
    if arch != "llama":
        params["arch"] = arch
    if padded_vocab:
        params["padded_vocab"] = padded_vocab
    key = build_key(**params)
    found = stamp_of(path)
    if found is not None and found.get("key") == key:
        return path
    if found is None and path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ForeignModelDir(f"{path} holds something build_tiny_model.py did not build (no {STAMP}): "
                              "choose an empty or new directory")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "answer", "user", "assistant"]
    texts = [" ".join(words[i % len(words):] + words[: i % len(words)]) + f" {i}" for i in range(400)]
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]
    if arch == "qwen2":  # ChatML, as ms-swift's `qwen` template writes prompts
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if arch == "qwen2":
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                            additional_special_tokens=["<|im_start|>", "<|im_end|>"])
        tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                                   "{% endif %}")
        cfg = Qwen2Config(vocab_size=max(len(tokenizer), padded_vocab), hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=positions, tie_word_embeddings=True, bos_token_id=None,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        cfg.architectures = ["Qwen2ForCausalLM"]
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                            pad_token="<pad>")
        tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")
        cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=positions, tie_word_embeddings=True,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({"key": key, "params": params}, indent=1))
    old = None
    if found is not None:  # an outdated build of ours: moved aside, then removed once the new one is in place
        old = Path(tempfile.mkdtemp(prefix=".old-", dir=path.parent)) / "model"
        try:
            os.rename(path, old)
        except OSError:
            old = None
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
        if (stamp_of(path) or {}).get("key") != key:
            raise
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--variant", choices=sorted(VARIANTS), default=None,
                   help="a named shape (overrides --hidden/--layers/--intermediate)")
    a = p.parse_args()
    shape = {"hidden": a.hidden, "layers": a.layers, "intermediate": a.intermediate, "vocab": a.vocab}
    if a.variant:
        shape.update(VARIANTS[a.variant])
    try:
        print(build(Path(a.dir), **shape))
    except ForeignModelDir as e:
        sys.exit(f"build_tiny_model: {e}")
