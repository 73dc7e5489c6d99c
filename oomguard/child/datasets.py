"""The script's datasets as the memory model needs them: prompt lengths in tokens (its tokenizer's, else words),
``max_prompt_tokens`` applied, and the ``dataset`` event; the probe's worst-case cut is ``probe``'s.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from ..vocab.events import DatasetSeen
from .runtime import Runtime

PROMPT_STATS_ROWS = 20000

def _prompt_texts(rows: list[Any], tokenizer: Any) -> list[str]:
    texts = []
    for p in rows:
        if isinstance(p, list) and tokenizer is not None and getattr(tokenizer, "chat_template", None):
            if is_processor(tokenizer):  # content as blocks, as GRPOTrainer gives a VLM's processor (no image here:
                p = [_blocks(m) for m in p]  # the memory model adds each image's tokens, memory.estimate.fed)
            texts.append(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True))
        elif isinstance(p, list):
            texts.append(" ".join(str(m.get("content", "")) for m in p if isinstance(m, dict)))
        else:
            texts.append(str(p))
    return texts

def prompt_lengths(rows: list[Any], tokenizer: Any) -> list[int]:
    texts = _prompt_texts(rows, tokenizer)
    if tokenizer is None:
        return [len(t.split()) for t in texts]
    if is_processor(tokenizer):  # a processor's first argument is its images: count with its tokenizer
        tokenizer = tokenizer.tokenizer
    enc = tokenizer(texts, add_special_tokens=False)
    return [len(ids) for ids in enc["input_ids"]]

def is_processor(tokenizer: Any) -> bool:
    """A multimodal processor (a tokenizer and an image processor), not a tokenizer."""
    return hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer")


def _blocks(message: Any) -> Any:
    """A chat message whose text content is a list of content blocks (``trl.data_utils.prepare_multimodal_messages``
    without images: what a VLM's chat template expects).

    >>> _blocks({"role": "user", "content": "hi"})
    {'role': 'user', 'content': [{'type': 'text', 'text': 'hi'}]}
    """
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return {**message, "content": [{"type": "text", "text": message["content"]}]}
    return message


def tokenizer_for(tokenizer: Any, model: Any) -> Any:
    if tokenizer is not None and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer
    if tokenizer is not None and hasattr(tokenizer, "tokenizer"):
        return tokenizer.tokenizer  # a processor
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as e:
        global TOKENIZER_WARNED_ONCE
        if not TOKENIZER_WARNED_ONCE:
            TOKENIZER_WARNED_ONCE = True
            why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            sys.stderr.write(f"oomguard: warning: could not load the tokenizer of {name!r} ({type(e).__name__}"
                             f"{': ' + why if why else ''}), so prompt lengths are counted in words, not tokens: "
                             "max_prompt_tokens and the memory model's prompt lengths are approximate; pass "
                             "processing_class= to GRPOTrainer\n")
        return None

TOKENIZER_WARNED_ONCE = False

def prepare_dataset(rt: Runtime, dataset: Any, tokenizer: Any, model: Any, args: Any = None,
                    construction: Any = None) -> Any:
    """Measure prompt lengths and apply max_prompt_tokens (a probe's cut to the longest prompt is
    ``probe.probe_train_dataset``'s). Every row is measured cheaply (:func:`prompt_lengths`), the longest of them
    through the trainer's own construction (``prompts.measure_longest``), whose largest difference from the cheap
    length is added to the rest; what cannot be measured is said (``Runtime.cannot_observe``)."""
    if isinstance(dataset, dict) or not hasattr(dataset, "column_names") or "prompt" not in (dataset.column_names or []):
        return dataset  # not GRPOTrainer's: a stack around TRL measures its own rows (``emit_prompt_stats``)
    tok = tokenizer_for(tokenizer, model)
    limit = rt.overrides.max_prompt_tokens
    n = len(dataset) if hasattr(dataset, "__len__") else None
    if n is None:  # IterableDataset: filter lazily, no statistics
        rt.cannot_observe("the prompts' length: the train_dataset is an IterableDataset, which cannot be measured "
                          "before training (the memory model assumes 256 tokens)")
        if limit:
            rt.emit(DatasetSeen(rows=None, dropped=None, max_prompt_tokens=limit))
            return dataset.filter(lambda row: prompt_lengths([row["prompt"]], tok)[0] <= limit)
        return dataset
    if n == 0:
        return dataset
    step = max(1, math.ceil(n / PROMPT_STATS_ROWS))
    sample_idx = list(range(0, n, step))
    sample = [dataset[i]["prompt"] for i in sample_idx]
    lengths = prompt_lengths(sample, tok)
    measured = _measured(rt, sample, lengths, construction)
    offset = measured.offset if measured is not None else 0
    exact = [length + offset for length in lengths]
    if measured is not None:
        for i, e in zip(measured.rows, measured.exact, strict=True):
            exact[i] = e
    ordered = sorted(exact)
    stats = _stats(n, ordered, step > 1)
    out = dataset
    if limit:
        all_len = exact if step == 1 else [length + offset for length in prompt_lengths(list(dataset["prompt"]), tok)]
        keep = [i for i, length in enumerate(all_len) if length <= limit]
        dropped = n - len(keep)
        if keep:
            out = dataset.select(keep)
        stats.update(dropped=dropped, max_prompt_tokens=limit)
        sys.stderr.write(f"oomguard: max_prompt_tokens={limit} dropped {dropped} of {n} prompts "
                         f"(longest was {ordered[-1]} tokens)\n")
    rt.emit(DatasetSeen(**stats))
    return out


def _measured(rt: Runtime, sample: list[Any], lengths: list[int], construction: Any) -> Any:
    """The longest rows of ``sample`` through the trainer's construction (kept for the check once the trainer is
    built), or None, said, where they cannot be."""
    from .prompts import error_line, measure_longest

    if construction is None:
        return None
    try:
        measured = measure_longest(sample, lengths, construction)
    except Exception as e:
        rt.cannot_observe(f"the prompts as GRPOTrainer builds them ({error_line(e)}): their length is measured with the "
                          "tokenizer's chat template alone, without the trainer's tools and template arguments")
        return None
    rt.prompts = measured
    return measured


def _stats(rows: int, ordered: list[int], sampled: bool) -> dict[str, Any]:
    return {"rows": rows, "prompt_tokens_max": ordered[-1],
            "prompt_tokens_p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "sampled": sampled}

def emit_prompt_stats(rt: Runtime, prompts: list[Any], tok: Any, lengths: list[int] | None = None) -> None:
    """The ``dataset`` event for prompts a stack's trainer holds in its own format (the memory model's prompt
    length): ``lengths`` where the stack measured them with its own template, else the tokenizer's chat template;
    nothing is filtered or reordered."""
    if not prompts:
        return
    rt.emit(DatasetSeen(**_stats(len(prompts), sorted(lengths or prompt_lengths(prompts, tok)), False)))
