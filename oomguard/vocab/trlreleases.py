"""TRL's GRPO defaults release by release (0.14 to 1.16): what a config that leaves a knob out gets, for `oomguard
plan --trl-version`.

A config means different things under different TRL releases: before 0.22 gradient checkpointing was off by default,
before 0.19 ``beta`` was 0.04 (a second, full reference model) and mixed precision off, before 0.18 TRL generated
once per micro-step, and in 0.14 ``per_device_train_batch_size`` counted prompts, each run ``num_generations`` times.
``oomguard plan`` predicts for the installed TRL unless ``--trl-version`` names another release; this table says
what that release fills in (:func:`defaults`) and how its config reads in the installed TRL's terms
(:func:`in_current_terms`). The facts are TRL's own ``GRPOConfig`` field defaults at each release's tag, collected in
``tests/fixtures/reports/trl-defaults.json`` (with the PR of each change); ``tests/test_trl_releases.py`` checks this
table against that file. Only what changes memory is kept, in oomguard's knob names. Which LM head a release has is
``trlrange.head_of``.

>>> defaults("0.17.0")["beta"], defaults("0.17.0")["gradient_checkpointing"], defaults("1.16.0")["beta"]
(0.04, False, 0.0)
>>> release("1.16.2").version, release("0.19.1").version, release("2.0.0").version, release("0.13.0")
('1.16.0', '0.19.0', '1.16.0', None)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The oldest release with a GRPOTrainer: nothing older has defaults to fill in.
OLDEST = "0.14.0"


@dataclass(frozen=True)
class Release:
    """One TRL release: its version, its date, the knob defaults that changed with it (oomguard's names) and what the
    change was, in a few words."""

    version: str
    date: str
    changes: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""


# TRL 0.14.0's defaults for every knob the table tracks; each later release lists what it changed.
# max_prompt_tokens stands for GRPOConfig.max_prompt_length while TRL truncated prompts to it (before 0.26: the padded
# prompt never exceeds it, as under oomguard's prompt limit); steps_per_generation 1 for the releases before 0.18,
# which generated for each micro-step (the knob did not exist); vllm_mode "server" for vLLM on a GPU of its own
# (0.14-0.15 ran it inside the trainer on the next GPU, 0.16-0.17 had only the server).
_BASE = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "num_generations": 8,
         "steps_per_generation": 1, "max_prompt_tokens": 512, "max_completion_length": 256, "beta": 0.04,
         "loss_type": "grpo", "gradient_checkpointing": False, "bf16": False, "use_vllm": False,
         "vllm_mode": "server", "vllm_gpu_memory_utilization": 0.9, "vllm_enable_sleep_mode": False,
         "learning_rate": 1e-06, "use_liger_kernel": False, "dtype": "float32"}

RELEASES: tuple[Release, ...] = (
    Release("0.14.0", "2025-01-29", _BASE, "the first GRPOTrainer; per_device_train_batch_size counts prompts"),
    Release("0.15.0", "2025-02-13", {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
            "per_device_train_batch_size counts completions (PR #2776)"),
    Release("0.16.0", "2025-03-22", {}, "vLLM only as a server (trl vllm-serve)"),
    Release("0.17.0", "2025-04-24", {"loss_type": "bnpo"}),
    Release("0.18.0", "2025-05-27", {"steps_per_generation": None, "vllm_gpu_memory_utilization": 0.3},
            "vllm_mode colocate; one generation serves steps_per_generation micro-steps"),
    Release("0.19.0", "2025-06-20", {"beta": 0.0, "bf16": True}, "no reference model, bf16 by default (PRs #3516, "
            "#3515)"),
    Release("0.20.0", "2025-07-28"),
    Release("0.21.0", "2025-08-05"),
    Release("0.22.0", "2025-08-29", {"gradient_checkpointing": True, "loss_type": "dapo"},
            "gradient checkpointing by default (PR #3510)"),
    Release("0.23.0", "2025-09-09"),
    Release("0.24.0", "2025-10-15"),
    Release("0.25.0", "2025-11-05"),
    Release("0.26.0", "2025-12-09", {"max_prompt_tokens": None, "dtype": "auto"},
            "prompts no longer truncated by default; a model given by name loads in its checkpoint's dtype"),
    Release("0.27.0", "2026-01-15", {"dtype": "float32"}, "a model given by name loads in float32 (PR #4778)"),
    Release("0.28.0", "2026-02-10", {}, "max_prompt_length removed (PR #4847)"),
    Release("0.29.0", "2026-02-25"),
    Release("1.0.0", "2026-03-30", {"vllm_mode": "colocate"}, "vLLM colocated by default (PR #5255)"),
    *(Release(f"1.{m}.0", d) for m, d in ((1, "2026-04-11"), (2, "2026-04-16"), (3, "2026-04-26"), (4, "2026-05-08"),
                                          (5, "2026-05-25"), (6, "2026-06-11"), (7, "2026-06-25"), (8, "2026-07-09"),
                                          (9, "2026-07-21"))),
    Release("1.10.0", "2026-08-13", {"max_completion_length": 512}, "max_completion_length 512 (PR #6264)"),
    *(Release(f"1.{m}.0", d) for m, d in ((11, "2026-08-26"), (12, "2026-08-26"), (13, "2026-09-10"),
                                          (14, "2026-09-25"))),
    Release("1.15.0", "2026-10-08", {}, "a fused, chunked LM head: the logits are never materialised"),
    Release("1.16.0", "2026-10-15"),
)
# The releases whose per_device_train_batch_size counts prompts (each run num_generations times on the device).
BATCH_OF_PROMPTS = ("0.14.0",)
# The releases whose colocated vLLM takes max_prompt_length + max_completion_length as its context when
# vllm_max_model_length is not set (0.18-0.25; from 0.26 vLLM's own, the model's).
VLLM_CONTEXT_FROM_LENGTHS = ("0.18.0", "0.25.0")


def _key(version: str) -> tuple[int, int] | None:
    parts = version.strip().lstrip("v").split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def _listed(version: str) -> tuple[int, int]:
    """The key of a version this module lists (always readable)."""
    key = _key(version)
    assert key is not None, version
    return key


def release(version: str | None) -> Release | None:
    """The release whose defaults ``version`` has: its minor release (``1.16.2`` is 1.16.0's), the newest in the table
    for a newer one, None for a version older than 0.14 or one that cannot be read."""
    key = _key(version) if version else None
    if key is None or key < _listed(OLDEST):
        return None
    return [r for r in RELEASES if _listed(r.version) <= key][-1]


def defaults(version: str) -> dict[str, Any]:
    """The knob defaults of ``version``'s release, in oomguard's knob names (``KeyError`` when it has none).

    >>> d = defaults("0.14.0")
    >>> d["per_device_train_batch_size"], d["gradient_accumulation_steps"], d["max_prompt_tokens"]
    (1, 8, 512)
    """
    r = release(version)
    if r is None:
        raise KeyError(f"TRL {version}: no GRPOTrainer defaults known before {OLDEST}")
    out: dict[str, Any] = {}
    for rel in RELEASES:
        out.update(rel.changes)
        if rel is r:
            return out
    raise AssertionError("unreachable")  # pragma: no cover


def in_current_terms(values: Mapping[str, Any], version: str) -> tuple[dict[str, Any], list[str]]:
    """``values`` (the release's defaults with the config on top) as the installed TRL's knobs mean them, and a line
    for each translation: TRL 0.14's batch of prompts becomes that many times ``num_generations`` completions, and a
    colocated vLLM of 0.18-0.25 without a context length takes the prompt and completion lengths.

    >>> in_current_terms({"per_device_train_batch_size": 2, "num_generations": 4}, "0.14.0")[0]
    {'per_device_train_batch_size': 8, 'num_generations': 4}
    """
    r = release(version)
    out, lines = dict(values), list[str]()
    if r is None:
        return out, lines
    if r.version in BATCH_OF_PROMPTS:
        bs, g = int(out.get("per_device_train_batch_size") or 1), int(out.get("num_generations") or 8)
        out["per_device_train_batch_size"] = bs * g
        lines.append(f"TRL {r.version} counts per_device_train_batch_size in prompts: {bs} prompt(s) x "
                     f"num_generations {g} = {bs * g} completions per device")
    lo, hi = (_listed(v) for v in VLLM_CONTEXT_FROM_LENGTHS)
    if (lo <= _listed(r.version) <= hi and out.get("use_vllm")
            and out.get("vllm_mode") == "colocate" and not out.get("vllm_max_model_length")
            and out.get("max_prompt_tokens") and out.get("max_completion_length")):
        out["vllm_max_model_length"] = int(out["max_prompt_tokens"]) + int(out["max_completion_length"])
    return out, lines


__all__ = ["BATCH_OF_PROMPTS", "OLDEST", "RELEASES", "Release", "defaults", "in_current_terms", "release"]
