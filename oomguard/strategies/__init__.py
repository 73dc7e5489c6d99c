"""oomguard's remedies and ladders.

Each module holds one family of remedies (small, pure transforms of Knobs); each ``*.toml`` file here is a ladder
that names remedies in order. Installed as ``oomguard.strategies``. With ``oomguard.vocab``, the shared vocabulary.

May import: ``oomguard.vocab`` (Knobs, Diagnosis, sizes). Never another part.

>>> from oomguard.strategies import REGISTRY
>>> sorted(REGISTRY)[:3]
['bf16_load', 'checkpointing', 'deepspeed_buffers']
"""

from __future__ import annotations

from pathlib import Path

from . import (  # noqa: F401
    adapters,
    allocator,
    batch,
    checkpointing,
    distributed,
    evaluation,
    host,
    images,
    kernels,
    paged,
    precision,
    sequences,
    vllm,
)
from .base import COST_CLASSES, REGISTRY, WEIGHED, Advice, Context, Remedy, cost_rank

LADDER_DIR = Path(__file__).resolve().parent

__all__ = ["COST_CLASSES", "LADDER_DIR", "REGISTRY", "WEIGHED", "Advice", "Context", "Remedy", "cost_rank",
           "make_remedy"]


def make_remedy(name: str, **params: object) -> Remedy:
    """A remedy by name, with the parameters a ladder gives it."""
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown remedy {name!r}; known remedies: {', '.join(sorted(REGISTRY))}") from None
    return cls(**params)
