"""An Unsloth GRPO notebook as its Qwen2.5 GRPO notebooks write it, shrunk for a CPU (tests/test_unsloth.py).

    python tests/scripts/grpo_unsloth.py MODEL_DIR [--load-in-4bit] [--completion 16] [--generations 4] [--bs 4]
                                         [--steps 2] [--r 8] [--generated-trainer]

What differs from the notebooks, each forced by this machine: a local random model (no hub), fast_inference=False
(vLLM's Unsloth path needs a GPU), no max_prompt_length (TRL 1.15's GRPOConfig has none) and warmup_steps=0.1 for
warmup_ratio (transformers 5 dropped it). ``--generated-trainer`` imports ``unsloth.models`` first, whose import
generates ``UnslothGRPOTrainer`` and binds it to ``trl.GRPOTrainer``, as ``import unsloth`` does on a GPU.
"""

# ruff: noqa: I001  (Unsloth is imported first, as its notebooks do: it patches TRL and transformers)
from unsloth import FastLanguageModel

import argparse
import json
import sys

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--load-in-4bit", action="store_true")
p.add_argument("--completion", type=int, default=16)
p.add_argument("--generations", type=int, default=4)
p.add_argument("--bs", type=int, default=4)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--r", type=int, default=8)
p.add_argument("--output-dir", default="outputs")
p.add_argument("--generated-trainer", action="store_true")
a = p.parse_args()
if a.generated_trainer:
    import unsloth.models  # noqa: F401  (its import runs PatchFastRL: trl.GRPOTrainer becomes UnslothGRPOTrainer)

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=a.model,
    max_seq_length=256,
    load_in_4bit=a.load_in_4bit,
    fast_inference=False,
    max_lora_rank=a.r,
    gpu_memory_utilization=0.6,
)
model = FastLanguageModel.get_peft_model(
    model,
    r=a.r,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha=a.r,
    use_gradient_checkpointing="unsloth",
    random_state=3407,
)

from datasets import Dataset  # noqa: E402

SYSTEM_PROMPT = "Respond in the format: reasoning then answer"
dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                         {"role": "user", "content": f"what is {i} plus {i + 7}"}],
                              "answer": str(2 * i + 7)} for i in range(16)])


def length_reward_func(completions, **kwargs):
    return [-len(c[0]["content"]) / 100.0 for c in completions]


def correctness_reward_func(prompts, completions, answer, **kwargs):
    return [2.0 if x in c[0]["content"] else 0.0 for c, x in zip(completions, answer, strict=True)]


from trl import GRPOConfig, GRPOTrainer  # noqa: E402

training_args = GRPOConfig(
    learning_rate=5e-6,
    adam_beta1=0.9,
    adam_beta2=0.99,
    weight_decay=0.1,
    warmup_steps=0.1,
    lr_scheduler_type="cosine",
    optim="adamw_8bit",
    logging_steps=1,
    per_device_train_batch_size=a.bs,
    gradient_accumulation_steps=1,
    num_generations=a.generations,
    max_completion_length=a.completion,
    max_steps=a.steps,
    save_steps=10_000,
    max_grad_norm=0.1,
    report_to="none",
    output_dir=a.output_dir,
)
trainer = GRPOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=[length_reward_func, correctness_reward_func],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
print("TRAINER " + json.dumps({"class": f"{type(trainer).__module__}.{type(trainer).__name__}"}))
sys.stdout.flush()
