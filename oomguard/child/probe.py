"""The worst-case probe, in the training process: a config rewritten to a few steps of full-length completions, the
longest prompt repeated, one evaluation pass and one save where the run has them, all into oomguard's scratch
directory; and an attempt launched as a probe unless the memory model is sure of its config, settled where GRPOTrainer
is built (``settle_probe``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ..vocab.events import ProbeDataset
from ..vocab.protocol import ProbePlan
from .datasets import prompt_lengths, tokenizer_for
from .images import largest_image_row, with_images_of
from .load import checkpoint_config, model_config_dict, placed_elsewhere
from .patching import evaluates, saves, world
from .prompts import measure_longest
from .runtime import Runtime


def apply_probe(rt: Runtime, cfg: Any, probe: ProbePlan) -> None:
    """A short worst-case rehearsal: few steps, full-length completions, nothing reported. A config that evaluates
    runs one evaluation pass (of one batch, ``probe_eval_dataset``) and a config that saves writes one checkpoint,
    both after the last step, when the optimizer state exists: their peaks are measured with the steps'."""
    steps = probe.steps
    cfg.max_steps = steps
    will_save = saves(cfg)
    _assign(cfg, "save_strategy", "steps" if will_save else "no")
    if will_save:
        cfg.save_steps = steps
        if hasattr(cfg, "save_total_limit"):
            cfg.save_total_limit = None
        if hasattr(cfg, "hub_strategy"):
            cfg.hub_strategy = "end"
    # The supervisor's scratch directory, deleted when the probe ends; never the user's own output_dir.
    cfg.output_dir = probe.output_dir or os.path.join(rt.plan.crash_dir or tempfile.mkdtemp(), "probe-output")
    cfg.report_to = []
    cfg.push_to_hub = False
    if hasattr(cfg, "eval_strategy"):
        if evaluates(cfg):
            _assign(cfg, "eval_strategy", "steps")
            cfg.eval_steps = steps
            for name, value in (("eval_on_start", False), ("eval_delay", 0)):
                if hasattr(cfg, name):
                    setattr(cfg, name, value)
        else:
            _assign(cfg, "eval_strategy", "no")
    cfg.logging_steps = 1
    gk = dict(getattr(cfg, "generation_kwargs", None) or {})
    if getattr(cfg, "use_vllm", False):
        gk["min_tokens"] = cfg.max_completion_length
    else:
        gk["min_new_tokens"] = cfg.max_completion_length
    cfg.generation_kwargs = gk
    try:
        object.__setattr__(cfg, "_oomguard_probe", True)
    except (AttributeError, TypeError):
        pass

def _assign(cfg: Any, name: str, value: str) -> None:
    """Set a strategy field to ``value`` in the type it holds: after ``__post_init__`` an enum of transformers'
    (``IntervalStrategy``, ``SaveStrategy``), before it the string the script gave."""
    import enum

    current = getattr(cfg, name, None)
    if isinstance(current, enum.Enum):
        try:
            setattr(cfg, name, type(current)(value))
            return
        except ValueError:
            pass
    setattr(cfg, name, value)

def _probe_prompts(rt: Runtime, args: Any) -> int:
    """Distinct prompts the probe's steps consume: one generation batch of prompts per step (full groups)."""
    probe = rt.plan.probe or ProbePlan()
    try:
        per_round = int(args.generation_batch_size) // int(args.num_generations)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return probe.rows
    steps = probe.steps
    return max(1, per_round * steps)

def probe_eval_dataset(dataset: Any, tokenizer: Any, model: Any, args: Any) -> Any:
    """The probe's evaluation: one evaluation batch per device of the longest evaluation prompt (each of several
    evaluation datasets alike), so the probe's one evaluation pass is the worst an evaluation of the run holds."""
    if isinstance(dataset, dict):
        return {name: probe_eval_dataset(d, tokenizer, model, args) for name, d in dataset.items()}
    if not hasattr(dataset, "column_names") or "prompt" not in (dataset.column_names or []) or not len(dataset):
        return dataset
    lengths = prompt_lengths(list(dataset["prompt"]), tokenizer_for(tokenizer, model))
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    rows = int(getattr(args, "per_device_eval_batch_size", 8) or 8) * world()
    per_prompt = int(getattr(args, "num_generations_eval", None) or getattr(args, "num_generations", 8) or 8)
    picked = [longest] * max(1, rows // max(1, per_prompt))
    donor = largest_image_row(dataset)
    return dataset.select(picked) if donor is None else with_images_of(dataset, picked, donor)

def longest_prompt_only(dataset: Any, tok: Any, rt: Runtime, args: Any = None) -> Any:
    """The probe trains only on the longest prompt, repeated, so every micro-batch of every step is the worst case;
    with a vision-language model's images, each row carries the largest image (the images of its row).

    The worst case is a step after the first (the optimizer state exists from the first optimizer step on) whose
    micro-batch is padded to the longest prompt. The probe's first step has no optimizer state yet, so its later steps
    must hold the longest prompt too: with the several longest prompts instead, the sampler's shuffle gives a later
    step shorter ones, and a probe measured that way under-measures the run (by a third on a dataset whose prompts
    range from 18 to 56 tokens)."""
    prompts = list(dataset["prompt"])
    lengths = prompt_lengths(prompts, tok)
    if not lengths:
        return dataset
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    tokens = lengths[longest]
    try:  # the longest as the trainer builds it (its tools, template and arguments: child/prompts.py)
        measured = measure_longest(prompts, lengths, getattr(rt.prompts, "construction", None))
    except Exception:  # said when the dataset was measured
        measured = None
    if measured is not None:
        longest, tokens = measured.longest, measured.most
    rows = max(1, _probe_prompts(rt, args))
    # a vision-language model's worst case is the longest prompt with the largest image (the memory model's too):
    # every probe row holds the longest prompt and the images of the row with the largest one
    donor = largest_image_row(dataset)
    rt.emit(ProbeDataset(rows=rows, prompt_tokens=tokens, image_row=donor))
    if donor is None:
        return dataset.select([longest] * rows)
    return with_images_of(dataset, [longest] * rows, donor)

def settle_probe(rt: Runtime, a: dict[str, Any], model: Any, args: Any, mik: dict[str, Any]) -> None:
    """Probe or run, for an attempt launched as a probe unless the memory model is sure of its config
    (``preflight.decide_probe``); a probe's changes go on the config and datasets before GRPOTrainer reads them."""
    from . import preflight

    if isinstance(model, str):
        config = None if placed_elsewhere(mik) else checkpoint_config(model, mik)
    else:
        config = rt.model_config or model_config_dict(getattr(model, "config", None) or {}) or None
    if config is not None and placed_elsewhere(mik, config):
        config = None
    preflight.decide_probe(rt, config)
    if not rt.probing():
        return
    apply_probe(rt, args, rt.plan.probe or ProbePlan())
    probe_datasets(rt, a, model, args)


def probe_datasets(rt: Runtime, a: dict[str, Any], model: Any, args: Any) -> None:
    """A probe's datasets, in GRPOTrainer's bound arguments ``a``: the longest training prompt repeated
    (``longest_prompt_only``), and one evaluation batch of the longest evaluation prompt where the run evaluates."""
    tokenizer = a.get("processing_class")
    dataset = a.get("train_dataset")
    if dataset is not None and hasattr(dataset, "column_names") and "prompt" in (dataset.column_names or []):
        a["train_dataset"] = longest_prompt_only(dataset, tokenizer_for(tokenizer, model), rt, args)
    if a.get("eval_dataset") is not None and evaluates(args):
        a["eval_dataset"] = probe_eval_dataset(a["eval_dataset"], tokenizer, model, args)
