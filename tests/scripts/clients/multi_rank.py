"""A GRPO script for `accelerate launch --multi_gpu --num_processes 2` (two ranks; gloo on the CPU).

    accelerate launch --multi_gpu --num_processes 2 multi_rank.py MODEL_DIR OUTPUT_DIR
"""

import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
rows = [{"prompt": [{"role": "user", "content": f"Write a haiku about the number {i}."}]} for i in range(64)]


def reward_short(completions, **kwargs):
    return [-len(c[0]["content"]) / 100 for c in completions]


args = GRPOConfig(output_dir=output_dir, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=128, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                  logging_steps=1)
model = AutoModelForCausalLM.from_pretrained(model_dir)
trainer = GRPOTrainer(model=model, reward_funcs=reward_short, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=AutoTokenizer.from_pretrained(model_dir))
trainer.train()
