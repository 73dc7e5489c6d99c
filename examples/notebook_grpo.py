# %% [markdown]
# # GRPO in a notebook, guarded
#
# Each cell below is what you would type in Jupyter. The training function builds its own `GRPOTrainer` and takes no
# `knobs`: `@oomguard.guard` installs the same patches as `oomguard run` (GRPOConfig, GRPOTrainer, from_pretrained)
# for each call and removes them afterwards, so the retry changes the config without editing the function.
#
# Run it as a script too: `python examples/notebook_grpo.py` (CPU, the tiny offline model, a simulated 260 MiB GPU).
# Each OOM and each rung climbed is one line on the `oomguard` logger; what it writes goes to examples/.cache/.

# %%
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

import oomguard
from oomguard.vocab.records import climbed_labels  # the rungs as the log lines write them: "x + y (again)"

from grpo_gsm8k import (
    checkpointing,
    correctness_reward_func,
    example_cache,
    load_questions,
    quiet_trl_deprecations,
    resolve_model,
    soft_format_reward_func,
)

quiet_trl_deprecations()  # TRL 1.16's own calls of transformers 5's deprecated checkpointing methods

MODEL = resolve_model("tiny-llama")  # or "meta-llama/Llama-3.2-1B-Instruct" where the hub is reachable
dataset = load_questions("bundled")

# %%
@oomguard.guard(simulate_gpu=None if torch.cuda.is_available() else "260MiB", max_attempts=6)
def train_grpo() -> float:
    args = GRPOConfig(
        output_dir=str(example_cache() / "outputs" / "notebook-grpo"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_generations=8,
        max_completion_length=256,
        max_steps=1,
        logging_steps=1,
        report_to=[],
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        **checkpointing(True),  # TRL's default, named as the installed transformers wants (no FutureWarning)
    )
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    trainer = GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(MODEL),
                          reward_funcs=[soft_format_reward_func, correctness_reward_func], args=args,
                          train_dataset=dataset)
    return trainer.train().training_loss

# %%
loss = train_grpo()
print("training loss", loss)

# %%
attempts = train_grpo.report.attempts
for a, climbed in zip(attempts, climbed_labels([a.climbed for a in attempts]), strict=True):
    oom = f" ({a.oom['kind']} during {a.oom['phase']})" if a.oom else ""
    print(f"attempt {a.index}: {a.outcome}{oom}" + (f" -> {climbed}" if climbed else ""))
for row in train_grpo.report.diff:
    print(f"{row['knob']}: {row['from']} -> {row['to']}  [{row['remedy']}]")
