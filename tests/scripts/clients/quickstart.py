"""TRL's GRPO quick start (the TRL docs' `GRPOTrainer` example), offline: a client script as users write it.

The model is given by name (a local directory instead of a hub id, so TRL loads it in float32), the dataset is made
in code instead of downloaded, and the docs' reward counts unique letters. Every GRPOConfig value is TRL's default
(8 generations, 8 rows per device, 512-token completions) but what a short CPU run needs:

    python quickstart.py MODEL_DIR OUTPUT_DIR
"""

import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model, output_dir = sys.argv[1], sys.argv[2]
words = ["river", "stone", "cloud", "ember", "frost", "grove", "harbor", "lantern", "meadow", "orbit"]
dataset = Dataset.from_list([{"prompt": f"Summarise this post: {' '.join(words[(i + j) % 10] for j in range(12))}"}
                             for i in range(64)])


# Dummy reward function: count the number of unique characters in the completions
def reward_num_unique_chars(completions, **kwargs):
    return [len(set(c)) for c in completions]


training_args = GRPOConfig(output_dir=output_dir, max_steps=2, use_cpu=True, report_to=[], save_strategy="no",
                           logging_steps=1)
trainer = GRPOTrainer(model=model, reward_funcs=reward_num_unique_chars, args=training_args, train_dataset=dataset)
trainer.train()
