"""GRPO with vLLM generating beside the trainer, as TRL's documentation writes it (``use_vllm=True``,
``vllm_mode="colocate"``), on a local model and prompts made in code: the vLLM end-to-end tests' script.

    python tests/scripts/grpo_vllm.py --model DIR [--util 0.9] [--max-model-length 256] [--steps 2] ...

Nothing in it knows about oomguard, and no environment variable is needed: under ``oomguard run --simulate-gpu``
oomguard's own adapter (oomguard/child/stacks/vllm.py) makes vLLM size itself against the simulated device.
"""

import argparse

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--output-dir", default="grpo-vllm-out")
p.add_argument("--util", type=float, default=0.9)
p.add_argument("--max-model-length", type=int, default=256, help="0: unset (vLLM takes the model's whole window)")
p.add_argument("--max-completion-length", type=int, default=32)
p.add_argument("--num-generations", type=int, default=4)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--sleep", action="store_true")
a = p.parse_args()

prompts = [f"alpha beta gamma delta {i}" for i in range(16)]


def reward_len(completions, **kwargs):
    return [-abs(10 - len(c)) / 10 for c in completions]


args = GRPOConfig(
    output_dir=a.output_dir,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=a.util,
    vllm_max_model_length=a.max_model_length or None,
    vllm_enable_sleep_mode=a.sleep,
    num_generations=a.num_generations,
    max_completion_length=a.max_completion_length,
    per_device_train_batch_size=a.batch_size,
    max_steps=a.steps,
    logging_steps=1,
    use_cpu=True,
    report_to="none",
    save_strategy="no",
)
trainer = GRPOTrainer(model=a.model, reward_funcs=reward_len, args=args,
                      train_dataset=Dataset.from_dict({"prompt": prompts}))
trainer.train()
