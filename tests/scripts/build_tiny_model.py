"""Build the tests' local model: a small Llama with random weights and a BPE tokenizer trained on the spot.

    python tests/scripts/build_tiny_model.py DIR [--hidden 256 --layers 4 --intermediate 1024 --vocab 1024]
    python tests/scripts/build_tiny_model.py DIR --variant wide

Variants (``VARIANTS``, ``build(path, **VARIANTS[name])``): ``tiny`` is the tests' default model (4 layers, hidden
256, ~4M parameters, activations a large share of its GRPO peak); ``wide`` is 1 layer of hidden 1024 with a 4096
MLP (~16M parameters), so weights, gradients and AdamW state are ~95% of its peak: bench/scenarios.py's
weights-heavy scenario, where the optimizer and LoRA rungs matter and shorter sequences barely do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

VARIANTS: dict[str, dict[str, int]] = {
    "tiny": {},
    "wide": {"hidden": 1024, "layers": 1, "intermediate": 4096},
}


def build(path: Path, hidden: int = 256, layers: int = 4, intermediate: int = 1024, vocab: int = 1024,
          heads: int = 8, kv_heads: int = 2) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "answer", "user", "assistant"]
    texts = [" ".join(words[i % len(words):] + words[: i % len(words)]) + f" {i}" for i in range(400)]
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
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
    print(build(Path(a.dir), **shape))
