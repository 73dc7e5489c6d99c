"""A tool-calling GRPO script, written as TRL documents it: typed, docstring'd functions passed as
``GRPOTrainer(tools=[...])``, a system prompt in the data, and a chat template that renders the tools' JSON schemas
(Qwen3's, as TRL ships it: TRL recognises it, adds its response parser, and trains with its prefix-preserving
version). The tests' tiny local model, real TRL on the CPU.

  python tests/scripts/grpo_tools.py --model DIR --output-dir OUT [--print-prompt-tokens]

``--print-prompt-tokens`` prints the longest prompt as GRPOTrainer itself tokenizes it (``_tokenize_prompts``), for a
test to compare with what oomguard measured.
"""

from __future__ import annotations

import argparse


def get_weather(city: str, unit: str = "celsius") -> str:
    """
    Get the current weather in a city.

    Args:
        city: The name of the city, for example "Paris" or "Tokyo".
        unit: The temperature unit to report, either "celsius" or "fahrenheit".

    Returns:
        A short description of the weather with its temperature.
    """
    return f"sunny, 21 degrees {unit} in {city}"


def convert_currency(amount: float, source: str, target: str) -> float:
    """
    Convert an amount of money from one currency into another at today's rate.

    Args:
        amount: How much money to convert.
        source: The ISO 4217 code of the currency the amount is in, such as "EUR".
        target: The ISO 4217 code of the currency to convert it into, such as "JPY".

    Returns:
        The converted amount.
    """
    return round(amount * 1.1, 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--print-prompt-tokens", action="store_true")
    a = p.parse_args()
    rows_count, completion = 32, 32

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_chat_template

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.chat_template = qwen3_chat_template  # a released model's template, which renders the tools
    system = "You are a travel assistant. Call a tool whenever it can answer better than you can."
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth"]
    rows = [{"prompt": [{"role": "system", "content": system},
                        {"role": "user", "content": f"What is the weather in {cities[i % 8]}, and what do "
                                                    f"{10 * (i + 1)} euros make in yen?" + " Thanks." * (i % 3)}]}
            for i in range(rows_count)]

    def reward_brevity(completions, **kw):
        return [1.0 / (1 + len(c[-1]["content"] if isinstance(c, list) else c)) for c in completions]

    args = GRPOConfig(
        output_dir=a.output_dir, max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=completion, learning_rate=1e-5, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", generation_kwargs={"min_new_tokens": completion}, optim="adamw_torch",
    )
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_brevity], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, tools=[get_weather, convert_currency])
    if a.print_prompt_tokens:
        longest = max(len(trainer._tokenize_prompts([r["prompt"]])[0][0]) for r in rows)
        print(f"trainer prompt tokens {longest}", flush=True)
    trainer.train()
    print(f"trained {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
