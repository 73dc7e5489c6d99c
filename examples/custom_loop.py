"""A plain PyTorch training loop under ``@oomguard.guard``: no TRL, no subprocess.

The function takes a ``knobs`` argument and reads its batch geometry, sequence length, checkpointing and optimizer
from it. oomguard records which fields it reads, so only rungs that change those fields are tried. The
``quality-first`` ladder splits the micro-batch and accumulates gradients, so the effective batch stays the same.

On a machine without a GPU it rehearses on the simulated device (a 128 MiB budget that raises real OOMs):

    python examples/custom_loop.py

Each OOM and each rung climbed is one line on the ``oomguard`` logger; the RunReport goes to
``examples/.cache/custom-loop-report.json`` (ignored by git).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import oomguard
from oomguard.vocab.records import climbed_labels


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, dim: int = 256, depth: int = 6, checkpointing: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x).squeeze(-1)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if "8bit" in name:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


SIMULATE = None if torch.cuda.is_available() else "128MiB"


@oomguard.guard(
    ladder="quality-first",
    simulate_gpu=SIMULATE,
    knobs={"per_device_train_batch_size": 32, "max_completion_length": 128, "gradient_checkpointing": False,
           "optim": "adamw_torch"},
    report=Path(__file__).resolve().parent / ".cache" / "custom-loop-report.json",
)
def train(knobs, steps: int = 3) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Model(checkpointing=bool(knobs.gradient_checkpointing)).to(device)
    opt = make_optimizer(knobs.optim, model.parameters())
    bs, ga, seq = knobs.per_device_train_batch_size, knobs.gradient_accumulation_steps, knobs.max_completion_length
    loss_value = 0.0
    for _ in range(steps):
        for _ in range(ga):
            x = torch.randn(bs, seq, 256, device=device)
            loss = model(x).pow(2).mean() / ga
            loss.backward()
            loss_value += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss_value / steps


if __name__ == "__main__":
    print(f"mean loss {train():.4f}")
    report = train.report
    print(f"{report.status} after {len(report.attempts)} attempt(s)")
    for a, climbed in zip(report.attempts, climbed_labels([a.climbed for a in report.attempts]), strict=True):
        print(f"  attempt {a.index}: {a.outcome:4} batch {a.knobs['per_device_train_batch_size']:>3} x "
              f"{a.knobs['gradient_accumulation_steps']} accumulation" + (f", then {climbed}" if climbed else ""))
    print(f"report: {train.report_path}")
    for row in report.diff:
        print(f"  {row['knob']}: {row['from']} -> {row['to']} ({row['remedy']})")
