"""An open-r1-style GRPO script: `TrlParser` reads a YAML recipe into script, training and model arguments.

As open-r1's `grpo.py` does: the recipe (`openr1.yaml`) sets the batch geometry, the generations and the completion
length; the model is loaded by the script with the recipe's dtype; rewards check a format and an answer. Offline:
the dataset is made in code, and the model is a local directory.

    python openr1.py --config openr1.yaml --model_name_or_path MODEL_DIR --output_dir OUTPUT_DIR
"""

import re
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config

SYSTEM_PROMPT = ("A conversation between User and Assistant. The assistant first thinks about the reasoning process "
                 "and then provides the answer, in <think> </think> and <answer> </answer> tags.")


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy", "format"])


def accuracy_reward(completions, solution, **kwargs):
    contents = [c[0]["content"] for c in completions]
    return [1.0 if f"<answer>{s}</answer>" in c else 0.0 for c, s in zip(contents, solution, strict=True)]


def format_reward(completions, **kwargs):
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c[0]["content"], re.DOTALL) else 0.0 for c in completions]


def main(script_args, training_args, model_args):
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": f"What is {i} plus {i % 7}?"}], "solution": str(i + i % 7)}
            for i in range(64)]
    rewards = {"accuracy": accuracy_reward, "format": format_reward}
    trainer = GRPOTrainer(model=model, reward_funcs=[rewards[f] for f in script_args.reward_funcs],
                          args=training_args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          peft_config=get_peft_config(model_args))
    trainer.train()


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
