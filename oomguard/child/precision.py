"""What a low-precision weight does to an update, measured on the loaded weights.

A model trained with AdamW in bfloat16 without a float32 master copy rounds every update into the bf16 weight. AdamW
moves a weight by about the learning rate per step (its normalised step is at most 1), and bfloat16 keeps 8
significant bits, so an update smaller than half of a weight's last bit is lost: at GRPO's learning rates (TRL's
default is 1e-6) that is almost every weight of a pretrained model. The share of weights that one step of the
learning rate still moves is what the supervisor needs to tell whether bf16 weights keep a full fine-tune, and it
depends on the weights' own magnitudes, so it is measured here, on the model as loaded, from a strided sample of
every weight (a few thousand elements per tensor: milliseconds even for a large model).

>>> import torch
>>> w = torch.nn.Linear(256, 4096, bias=False)
>>> _ = torch.nn.init.normal_(w.weight, std=0.02)
>>> 0.0 < moving_share(w, 1e-6) < 0.05 < 0.8 < moving_share(w, 1e-4)
True
"""

from __future__ import annotations

from typing import Any

SAMPLE = 4096  # elements looked at per weight tensor


def moving_share(model: Any, lr: float, dtype: str = "bfloat16", sample: int = SAMPLE) -> float | None:
    """The share of ``model``'s trainable-in-a-full-fine-tune weights (every floating parameter but LoRA adapters)
    that a step of ``lr`` moves once they are stored in ``dtype``, weighted by tensor size; None when there are none
    to look at (sharded away, quantised)."""
    import torch

    target = getattr(torch, dtype)
    moved = total = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or not p.is_floating_point() or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // sample)
            w = flat[::step][:sample].to(torch.float32)
            stored = w.to(target)
            up = (stored.to(torch.float32) + lr).to(target) != stored
            down = (stored.to(torch.float32) - lr).to(target) != stored
            share = (up | down).to(torch.float32).mean().item()
            moved += share * p.numel()
            total += p.numel()
    return moved / total if total else None


def facts(model: Any, args: Any) -> dict[str, Any]:
    """The facts the supervisor reads once a trainer holds its model (``RunFacts.bf16_moving``, ``bf16_supported``,
    ``device_total``, the size of the device this process computes on as CUDA itself reports it, and
    ``gpu_kernels``, whether Triton kernels can run on it); never raises
    (a model this cannot read simply reports nothing)."""
    out: dict[str, Any] = {}
    try:
        import torch

        lr = float(getattr(args, "learning_rate", 0.0) or 0.0)
        if lr > 0:
            out["bf16_moving"] = moving_share(model, lr)
        if torch.cuda.is_available():
            out["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
            out["device_total"] = int(torch.cuda.mem_get_info()[1])
        import importlib.util

        out["gpu_kernels"] = bool(torch.cuda.is_available()) and importlib.util.find_spec("triton") is not None
    except Exception:  # a measurement, never a reason to fail the user's run
        pass
    return out
