"""GRPO on GSM8K with Llama-3.2-1B-Instruct: the seed script, ported to TRL 1.x (it runs on TRL 0.29 to 1.x).

It trains a model to answer grade-school maths in a ``<reasoning>...</reasoning><answer>...</answer>`` format, with
rewards for the format and for the right answer (the widely shared GRPO GSM8K demo).

Offline by default, so it runs anywhere, CPU included:

- the model is a tiny Llama-3.2-shaped network built on first use (random weights, a tokenizer trained on the
  bundled data), cached under ``examples/.cache/``;
- the data is ``examples/data/gsm8k_mini.jsonl``, GSM8K-format problems made from templates.

Where the hub can be reached, ``--model meta-llama/Llama-3.2-1B-Instruct --dataset openai/gsm8k`` runs the real thing.
Checkpoints of the tiny model go to ``examples/.cache/outputs/`` (ignored by git); a real model's go to
``outputs/grpo-gsm8k`` unless ``--output-dir`` says otherwise.

    python examples/grpo_gsm8k.py                                    # plain run
    oomguard run --simulate-gpu 300MiB examples/grpo_gsm8k.py         # the CPU OOM-recovery demo
    oomguard run examples/grpo_gsm8k.py --model meta-llama/Llama-3.2-1B-Instruct --dataset openai/gsm8k
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TINY = "tiny-llama"
SYSTEM_PROMPT = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""


# ---------------------------------------------------------------------------------------------------------------
# Data


def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    return answer.split("</answer>")[0].strip()


def extract_hash_answer(text: str) -> str | None:
    return text.split("####")[1].strip() if "####" in text else None


def load_questions(name: str, split: str = "train"):
    from datasets import Dataset, load_dataset

    if name == "bundled":
        rows = [json.loads(line) for line in (HERE / "data" / "gsm8k_mini.jsonl").read_text().splitlines() if line]
        data = Dataset.from_list(rows)
    else:
        data = load_dataset(name, "main")[split]
    return data.map(lambda x: {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": x["question"]}],
        "answer": extract_hash_answer(x["answer"]),
    })


# ---------------------------------------------------------------------------------------------------------------
# Rewards (the seed's five)


def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [c[0]["content"] for c in completions]
    return [2.0 if extract_xml_answer(r) == a else 0.0 for r, a in zip(responses, answer, strict=True)]


def int_reward_func(completions, **kwargs) -> list[float]:
    return [0.5 if extract_xml_answer(c[0]["content"]).isdigit() else 0.0 for c in completions]


def strict_format_reward_func(completions, **kwargs) -> list[float]:
    pattern = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
    return [0.5 if re.match(pattern, c[0]["content"], flags=re.DOTALL) else 0.0 for c in completions]


def soft_format_reward_func(completions, **kwargs) -> list[float]:
    pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
    return [0.5 if re.match(pattern, c[0]["content"], flags=re.DOTALL) else 0.0 for c in completions]


def count_xml(text: str) -> float:
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def xmlcount_reward_func(completions, **kwargs) -> list[float]:
    return [count_xml(c[0]["content"]) for c in completions]


# ---------------------------------------------------------------------------------------------------------------
# The tiny offline model


def build_tiny_model(path: Path) -> None:
    """A Llama-3.2-shaped model with random weights and a byte-level BPE tokenizer trained on the bundled data."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [SYSTEM_PROMPT, "<reasoning>\n</reasoning>\n<answer>\n</answer>\n"]
    for line in (HERE / "data" / "gsm8k_mini.jsonl").read_text().splitlines():
        row = json.loads(line)
        texts += [row["question"], row["answer"]]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2048, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                        pad_token="<|pad|>")
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    # Llama-3.2-1B's shape (GQA 4:1, SwiGLU, tied embeddings, rope theta), scaled down to run on a CPU.
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=500000.0,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=path.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: a concurrent build loses the race harmlessly
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def example_cache() -> Path:
    """Where the examples keep what they make (the tiny model, their outputs): ``examples/.cache``, ignored by git."""
    return Path(os.environ.get("OOMGUARD_EXAMPLE_CACHE", HERE / ".cache"))


def quiet_trl_deprecations() -> None:
    """Hide the three FutureWarnings TRL 1.16 itself causes on every run: its generation helper
    (``trl/models/utils.py``) still calls transformers 5's deprecated ``is_gradient_checkpointing``,
    ``gradient_checkpointing_disable`` and ``gradient_checkpointing_enable``. Nothing in this script can change that;
    the script's own arguments use the current names (``activation_checkpointing``)."""
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`(is_gradient_checkpointing|gradient_checkpointing_(enable|disable))` is deprecated")


def resolve_model(name: str) -> str:
    if name != TINY:
        return name
    cache = example_cache()
    path = cache / "tiny-llama-3.2"
    if not (path / "config.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"building the tiny offline model in {path} (first use only)")
        build_tiny_model(path)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------


def checkpointing(on: bool) -> dict:
    """Activation checkpointing named as the installed transformers names it: ``activation_checkpointing`` from
    transformers 5.23 on (``gradient_checkpointing`` is then its deprecated mirror), ``gradient_checkpointing`` before.
    The same switch either way; oomguard supports transformers 5.3 to 5.x."""
    from transformers import TrainingArguments

    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": on}


def config_kwargs(args: argparse.Namespace, cuda: bool, bf16: bool) -> dict:
    """The seed's GRPOConfig arguments, in the names the installed TRL and transformers use (no deprecation
    warnings)."""
    tiny = args.model == TINY
    output_dir = args.output_dir or str(example_cache() / "outputs" / "grpo-gsm8k" if tiny else "outputs/grpo-gsm8k")
    return dict(
        output_dir=output_dir,
        learning_rate=5e-6,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        warmup_steps=0.1,  # a ratio of the run (transformers 5 folded warmup_ratio into warmup_steps)
        lr_scheduler_type="cosine",
        logging_steps=1,
        bf16=bf16,
        use_cpu=not cuda,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length or (256 if tiny else 786),
        num_train_epochs=1,
        max_steps=args.max_steps or (2 if tiny else -1),
        save_steps=args.save_steps,
        max_grad_norm=0.1,
        report_to=args.report_to,
        log_on_each_node=False,
        **checkpointing(not args.no_gradient_checkpointing),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=TINY, help="a model id or path, or 'tiny-llama' (default, offline)")
    p.add_argument("--dataset", default="bundled", help="'bundled' (default, offline) or a hub id such as openai/gsm8k")
    p.add_argument("--output-dir", default=None,
                   help="default: examples/.cache/outputs/grpo-gsm8k for the tiny model, else outputs/grpo-gsm8k")
    p.add_argument("--max-steps", type=int, default=None, help="default: 2 for the tiny model, else one epoch")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--per-device-train-batch-size", type=int, default=8)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--max-completion-length", type=int, default=None, help="default: 256 for the tiny model, else 786")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="load dtype; auto = bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--use-peft", action="store_true", help="train LoRA adapters (r=16) as the seed's commented option")
    p.add_argument("--report-to", default="none")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_trl_deprecations()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model_name = resolve_model(args.model)
    cuda = torch.cuda.is_available()
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    training_args = GRPOConfig(**config_kwargs(args, cuda=cuda, bf16=cuda and torch.cuda.is_bf16_supported()))
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=64, target_modules="all-linear", task_type="CAUSAL_LM",
                                 lora_dropout=0.05)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[xmlcount_reward_func, soft_format_reward_func, strict_format_reward_func, int_reward_func,
                      correctness_reward_func],
        args=training_args,
        train_dataset=load_questions(args.dataset),
        peft_config=peft_config,
    )
    trainer.train()
    print(f"done: {trainer.state.global_step} steps")


if __name__ == "__main__":
    main()
