"""Phase boundaries of a TRL 1.16 GRPO step, for the calibration benchmarks (shared by the CPU and GPU scripts)."""

from __future__ import annotations

from collections.abc import Callable
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
