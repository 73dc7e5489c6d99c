"""Patches at the construction points every TRL script passes through: GRPOConfig, GRPOTrainer, from_pretrained.

Each patch first records what the script set (so the diff starts from the user's own config), then applies the
knobs. The user's code is never edited; ``remove()`` restores the originals (the decorator uses this). One module per
construction point: ``config`` (GRPOConfig), ``trainer`` (GRPOTrainer), ``load`` (from_pretrained), with what they
share in ``patching`` (the mechanism), ``datasets`` (prompt lengths) and ``probe`` (the worst-case probe); this module
names the three patches the bootstrap installs.
"""

from __future__ import annotations

from .config import patch_grpo_config
from .load import patch_from_pretrained
from .patching import remove
from .trainer import patch_grpo_trainer

__all__ = ["patch_from_pretrained", "patch_grpo_config", "patch_grpo_trainer", "remove"]
