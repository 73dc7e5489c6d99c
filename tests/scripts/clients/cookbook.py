"""A cookbook-style GRPO notebook as a script: it loads its own model (with from_pretrained's default dtype), gives
GRPOTrainer a LoRA config, and trains a few steps.

    python cookbook.py MODEL_DIR OUTPUT_DIR
"""

import sys

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}? Think, then answer."}]} for i in range(64)]


def reward_len(completions, **kwargs):
    return [len(c[0]["content"]) / 100 for c in completions]


model = AutoModelForCausalLM.from_pretrained(model_dir)
args = GRPOConfig(output_dir=output_dir, max_steps=2, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=48, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                  logging_steps=1, learning_rate=1e-5)
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=AutoTokenizer.from_pretrained(model_dir),
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.1, task_type="CAUSAL_LM"))
trainer.train()
print("trained", trainer.state.global_step, "steps with", trainer.args.per_device_train_batch_size, "x",
      trainer.args.gradient_accumulation_steps, "rows and", trainer.num_generations, "generations")
