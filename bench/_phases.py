"""What the CPU and GPU calibration benchmarks share: the calibration trainer, and the phase boundaries of a TRL 1.16
GRPO step."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any


def instrument_phases(trainer: Any, switch: Callable[[str], None], step_end: Callable[[], None]) -> None:
    """Call ``switch(phase)`` at each boundary: generation, scoring, forward_backward, optimizer."""
    from transformers import TrainerCallback

    gen_and_score, generate = trainer._generate_and_score_completions, trainer._generate

    def wrapped_gen_and_score(*a: Any, **kw: Any) -> Any:
        switch("generation")
        out = gen_and_score(*a, **kw)
        switch("forward_backward")
        return out

    def wrapped_generate(*a: Any, **kw: Any) -> Any:
        out = generate(*a, **kw)
        switch("scoring")
        return out

    trainer._generate_and_score_completions = wrapped_gen_and_score
    trainer._generate = wrapped_generate

    class Phases(TrainerCallback):
        def on_pre_optimizer_step(self, *a: Any, **kw: Any) -> None:
            switch("optimizer")

        def on_optimizer_step(self, *a: Any, **kw: Any) -> None:
            switch("optimizer")  # zero_grad and logging count as the optimizer phase

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            step_end()

    trainer.add_callback(Phases())


def build_trainer(cfg: Any, model_dir: str, vocab_size: int, out_dir: str, *, rows: int,
                  model_init_kwargs: dict[str, Any], trainer_kwargs: dict[str, Any] | None = None,
                  model: Any = None, target_modules: Any = "all-linear", **config: Any) -> Any:
    """The calibration run: ``rows`` random prompts of exactly ``cfg.P`` words, completions forced to ``cfg.C`` tokens,
    a random reward, two steps, LoRA on ``target_modules`` (all linear layers) when ``cfg.lora_r``. ``config`` adds
    GRPOConfig fields.
    ``model``: a model instance built by the caller (a stack's loader, already adapted), instead of ``model_dir``."""
    import random

    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    random.seed(0)
    torch.manual_seed(0)
    # not AutoTokenizer: transformers 5 maps model_type qwen2 to Qwen2Tokenizer, which cannot read a word-level vocab
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    rng = random.Random(0)
    data = [{"prompt": " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(cfg.P))} for _ in range(rows)]
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=cfg.B, num_generations=cfg.G,
        gradient_accumulation_steps=cfg.GA, max_completion_length=cfg.C, max_steps=2,
        gradient_checkpointing=cfg.gc, optim=cfg.optim, beta=cfg.beta, model_init_kwargs=model_init_kwargs,
        generation_kwargs={"min_new_tokens": cfg.C}, logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, seed=0, **config, **cfg.extra,
    )
    peft_config = None
    if cfg.lora_r and model is None:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, target_modules=target_modules,
                                 lora_dropout=0.0, task_type="CAUSAL_LM")

    def reward(completions: list[str], **kw: Any) -> list[float]:
        return [rng.random() for _ in completions]

    return GRPOTrainer(model=model if model is not None else model_dir, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(data),
                       processing_class=tokenizer, peft_config=peft_config, **(trainer_kwargs or {}))


def select_grid(grid: Sequence[Any], names: Sequence[str] | None, parser: argparse.ArgumentParser) -> list[Any]:
    """The configurations of ``grid`` named in ``names`` (all when None); a usage error when none is left."""
    chosen = [c for c in grid if names is None or c.name in names]
    if not chosen:
        parser.error("no configuration selected; names: " + ", ".join(c.name for c in grid))
    return chosen


def run_args(description: str, timeout: float) -> argparse.ArgumentParser:
    """The options of the benchmarks that measure named configurations under oomguard (``--only``, ``--timeout``,
    ``--json``, ``--from-json``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--only", action="append", default=[], help="run only the named configuration(s)")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per configuration")
    p.add_argument("--json", metavar="PATH", help="write the measurements to PATH")
    p.add_argument("--from-json", metavar="PATH", help="re-use measurements written by --json instead of measuring")
    return p
