"""How long one GRPO optimizer step takes, relative to another config: what a speed trade costs ("about +12% time").

A roofline, pure Python: each pass over the model takes the larger of its FLOPs over the device's compute rate and
the bytes it must read over its memory bandwidth, plus a fixed cost per kernel launch. The rates are those of an
H100-class GPU in bf16 (989 TFLOP/s dense, 3.35 TB/s, about 5 µs per kernel); only their ratios matter for a relative
answer, which is all oomguard says ("predicted", not measured). Per optimizer step and device:

- **generation**: per generation round, a prefill of ``rows x P`` tokens, then ``C`` decode steps, each reading every
  weight once and computing ``2·N`` FLOPs per row (memory-bound for the batch sizes GRPO generates with; a
  micro-batch split keeps the generation batch, so it costs nothing here);
- **scoring**: forward passes of ``2·N`` FLOPs per token in micro-batches of ``per_device_train_batch_size`` rows:
  the reference model when ``beta > 0`` (not under LoRA, whose base is the reference);
- **training**: per micro-step, a forward and a backward: ``6·N`` FLOPs per token for a full fine-tune, ``4·N`` under
  LoRA (no weight gradients), plus ``2·N`` with checkpointing (each layer's forward again); the weights are read
  three times (four with checkpointing). A micro-step of few tokens is bound by these reads, which is what a
  micro-batch split costs;
- **optimizer**: weights, gradients and two moments read and written once (memory-bound).

Not modelled: vLLM, ZeRO and offload traffic, dataloaders, rewards. Such configs get no figure
(``step_seconds`` returns None only for knobs it cannot read).

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> spec = ModelSpec(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
...                  intermediate_size=8192, tie_word_embeddings=True)
>>> user = TRL_DEFAULTS.replace(dtype="bfloat16", per_device_train_batch_size=8, max_completion_length=512,
...                             gradient_checkpointing=False)
>>> split = user.replace(per_device_train_batch_size=1, gradient_accumulation_steps=8)
>>> f"{slowdown(spec, user, split, prompt_tokens=128):+.1%}", f"{slowdown(spec, user, split.replace(max_completion_length=64), prompt_tokens=128):+.1%}"
('+2.2%', '-82.2%')

Generation dominates a step of this 1B model (512 decode steps of the whole batch), so splitting its training
batch in eight costs about 2%, where halving the completions would make the step much faster.
"""

from __future__ import annotations

from ..vocab.knobs import Knobs
from .estimate.model import ModelSpec, lora_trainable_params

FLOPS = 989e12  # bf16 dense FLOP/s of the reference device
FLOPS_FP32 = 495e12  # TF32, for matmuls not under bf16/fp16 autocast
BANDWIDTH = 3.35e12  # bytes/s
LAUNCH = 5e-6  # seconds per kernel launch
KERNELS_PER_LAYER = 12  # a decoder layer's forward: norms, projections, attention, MLP, residuals

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_seconds(spec: ModelSpec, knobs: Knobs, *, prompt_tokens: int | None = None,
                 world_size: int = 1) -> float | None:
    """Seconds of one optimizer step on the reference device (see the module's docstring), or None when the knobs
    cannot be read (an unknown dtype).

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> spec = ModelSpec(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=32,
    ...                  intermediate_size=1024, tie_word_embeddings=True)
    >>> step_seconds(spec, TRL_DEFAULTS) > 0
    True
    """
    k = knobs
    dtype = str(k.dtype or "float32")
    if dtype not in _BYTES:
        return None
    n = spec.active_params  # what a token's matmuls read (a MoE's routed experts only); the weights are all read
    weight_bytes = spec.params * (0.55 if k.load_in_4bit else _BYTES[dtype])
    autocast = bool(k.bf16 is not False or k.fp16)
    flops = FLOPS if autocast or dtype != "float32" else FLOPS_FP32
    bs, ga, spg = k.geometry(world_size)
    prompt = int(prompt_tokens or 128)
    completion = int(k.max_completion_length or 256)
    tokens = prompt + completion
    launches = spec.num_layers * KERNELS_PER_LAYER * LAUNCH

    def pass_time(rows: int, seq: int, flops_per_token: float, reads: float, kernels: float = 1.0) -> float:
        return max(rows * seq * flops_per_token / flops, reads * weight_bytes / BANDWIDTH) + kernels * launches

    rows_round = bs * spg
    rounds = max(1, ga // max(1, spg)) if ga >= spg else 1
    generation = rounds * (pass_time(rows_round, prompt, 2 * n, 1)
                           + completion * pass_time(rows_round, 1, 2 * n, 1))
    lora = bool(k.lora_r)
    micro_steps = max(1, ga)
    scoring = 0.0
    if float(k.beta or 0.0) > 0 and not lora:
        scoring = micro_steps * pass_time(bs, tokens, 2 * n, 1)
    ckpt = bool(k.gradient_checkpointing)
    train_flops = (4 if lora else 6) * n + (2 * n if ckpt else 0)
    training = micro_steps * pass_time(bs, tokens, train_flops, 4 if ckpt else 3, 3 + (1 if ckpt else 0))
    trainable = lora_trainable_params(spec, int(k.lora_r or 0)) if lora else spec.params
    optimizer = trainable * 4 * 4 * 2 / BANDWIDTH  # fp32 weight, gradient and two moments, read and written
    return generation + scoring + training + optimizer


def slowdown(spec: ModelSpec, before: Knobs, after: Knobs, *, prompt_tokens: int | None = None,
             world_size: int = 1) -> float | None:
    """How much longer a step of ``after`` takes than one of ``before`` (0.12 for 12% longer; negative when faster),
    or None when either cannot be read."""
    a = step_seconds(spec, before, prompt_tokens=prompt_tokens, world_size=world_size)
    b = step_seconds(spec, after, prompt_tokens=prompt_tokens, world_size=world_size)
    if not a or b is None:
        return None
    return b / a - 1


__all__ = ["slowdown", "step_seconds"]
