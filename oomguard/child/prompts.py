"""The prompts as the trainer builds them: the memory model's prompt length is the length GRPOTrainer feeds.

GRPOTrainer turns a conversational prompt into tokens with one call (``_tokenize_prompts``, TRL 0.29 to 1.16 alike):
``processing_class.apply_chat_template(conversation=prompts, tools=..., chat_template=..., add_generation_prompt=True,
tokenize=True, return_dict=True, **chat_template_kwargs)``. Its inputs are the trainer's own: the tools it was given
(whose JSON schemas the chat template renders: often more tokens than the question), a training chat template when
the tokenizer's own is not prefix-preserving and tools are used (``get_training_chat_template``), the config's
``chat_template_kwargs``, the system prompt and every message of the row. A plain-text prompt is
``processing_class(text=prompts)``. A vision-language model's images are left out here: their tokens are the memory
model's (``memory.estimate.vision.image_tokens``, from the images' sizes and the pixel budget in force), so that a
smaller budget is judged without measuring again.

Measured twice, from the same inputs:

- before GRPOTrainer is built (:meth:`Construction.from_arguments`: the pre-flight, the probe's decision and
  ``max_prompt_tokens`` need the lengths before TRL loads the model), with the trainer's arguments: its
  ``processing_class`` (or the processor TRL will load for a model given by name), ``tools``, the config's
  ``chat_template_kwargs``, and the chat template TRL will choose by the same rule, with TRL's own functions;
- once it is built (:func:`check_built`), with the trainer's own method and attributes; a difference is reported as
  the corrected length and as something oomguard could not observe before the trainer existed.

Only the longest rows are measured this way (:data:`CANDIDATES` of them, picked by the cheap length of
``datasets.prompt_lengths``); the other rows' lengths are their cheap lengths plus the largest difference seen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

CANDIDATES = 16  # the rows measured through the trainer's construction, longest first by the cheap measure


def text_only(prompt: Any, blocks: bool) -> Any:
    """A conversational prompt without its images (their tokens are the memory model's); ``blocks``: every message's
    content as content blocks (``trl.data_utils.prepare_multimodal_messages`` without images: what a processor's
    chat template expects). Anything else as it is.

    >>> p = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "hi"}]}]
    >>> text_only(p, blocks=True)
    [{'role': 'user', 'content': [{'type': 'text', 'text': 'hi'}]}]
    >>> text_only([{"role": "user", "content": "hi"}], blocks=True)
    [{'role': 'user', 'content': [{'type': 'text', 'text': 'hi'}]}]
    >>> text_only([{"role": "user", "content": "hi"}], blocks=False)
    [{'role': 'user', 'content': 'hi'}]
    """
    if not isinstance(prompt, list):
        return prompt
    out = []
    for m in prompt:
        if not isinstance(m, dict):
            out.append(m)
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = [c for c in content if not (isinstance(c, dict) and c.get("type") == "image")]
        elif isinstance(content, str) and blocks:
            content = [{"type": "text", "text": content}]
        out.append({**m, "content": content})
    return out


def is_processor(pc: Any) -> bool:
    """A multimodal processor (a tokenizer and an image processor), not a tokenizer."""
    return hasattr(pc, "image_processor") and hasattr(pc, "tokenizer")


@dataclass
class Construction:
    """GRPOTrainer's prompt construction: what it tokenizes with and the inputs it passes.

    ``tools``: the trainer's tools (functions whose schemas the template renders); ``chat_template``: the template the
    trainer passes (None: the processing class's own); ``kwargs``: ``chat_template_kwargs``; ``trainer``: the built
    trainer, whose own ``_tokenize_prompts`` measures (:meth:`from_trainer`)."""

    processing_class: Any
    tools: list[Any] | None = None
    chat_template: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    trainer: Any = None

    @classmethod
    def from_arguments(cls, a: dict[str, Any], args: Any, model: Any) -> tuple[Construction | None, str | None]:
        """The construction GRPOTrainer will use, from its bound arguments ``a`` and config ``args`` before it is
        built; None and why where it cannot be known."""
        pc = a.get("processing_class")
        if pc is None:
            pc, why = _load_processor(model)
            if pc is None:
                return None, why
        tools = list(a.get("tools") or [])
        template = None
        if tools:
            try:
                from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

                if not is_chat_template_prefix_preserving(pc):
                    template = get_training_chat_template(pc)
            except Exception as e:  # TRL raises the same when the trainer is built: nothing to measure then
                return None, f"the chat template TRL would train with ({error_line(e)})"
        return cls(pc, tools or _no_tools(), template, dict(getattr(args, "chat_template_kwargs", None) or {})), None

    @classmethod
    def from_trainer(cls, trainer: Any) -> Construction:
        """The built trainer's construction: its processing class, tools, chat template and kwargs."""
        return cls(getattr(trainer, "processing_class", None), list(getattr(trainer, "tools", None) or []) or None,
                   getattr(trainer, "chat_template", None), dict(getattr(trainer, "chat_template_kwargs", None) or {}),
                   trainer)

    def lengths(self, prompts: list[Any]) -> list[int]:
        """The length in tokens of each prompt as the trainer feeds it (images left out); raises what the
        construction raises."""
        if not prompts:
            return []
        conversational = isinstance(prompts[0], list)
        processor = is_processor(self.processing_class)
        if not conversational:
            return [len(ids) for ids in self.processing_class(text=list(prompts))["input_ids"]]
        texts = [text_only(copy.copy(p), processor) for p in prompts]
        if self.trainer is not None and hasattr(self.trainer, "_tokenize_prompts"):
            # what the trainer itself calls, one prompt at a time (a processor pads a batch in some releases)
            return [len(self.trainer._tokenize_prompts([p])[0][0]) for p in texts]
        return [len(self._tokenized(p)) for p in texts]

    def _tokenized(self, prompt: Any) -> list[int]:
        out = self.processing_class.apply_chat_template(
            conversation=[prompt], tools=self.tools, chat_template=self.chat_template,
            add_generation_prompt=True, tokenize=True, return_dict=True, **self.kwargs)
        return list(out["input_ids"][0])


def _no_tools() -> list[Any] | None:
    """What the installed GRPOTrainer passes as ``tools`` when it has none, read from its ``_tokenize_prompts``: TRL
    1.x passes None (``self.tools or None``: Llama's template renders its tool boilerplate for an empty list), TRL 0.29
    the empty list."""
    try:
        import inspect

        from trl.trainer.grpo_trainer import GRPOTrainer

        source = inspect.getsource(GRPOTrainer._tokenize_prompts)
    except Exception:  # no source to read: TRL 1.x's
        return None
    return None if "self.tools or None" in source else []


def _load_processor(model: Any) -> tuple[Any, str | None]:
    """The processor TRL loads for a model given by name (``AutoProcessor``, as GRPOTrainer does), or None and why."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return None, "the trainer's tokenizer (no processing_class, and the model names no checkpoint)"
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(name, truncation_side="left", padding_side="left"), None
    except Exception as e:
        return None, f"the tokenizer of {name!r} ({error_line(e)})"


def error_line(e: BaseException) -> str:
    """An error in one line, for the reason a fact could not be observed: its type and the first line of its
    message (at most 160 characters).

    >>> error_line(ValueError("no chat template\\nmore"))
    'ValueError: no chat template'
    """
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"{type(e).__name__}{': ' + first if first else ''}"


@dataclass
class Measured:
    """The longest rows, measured through the trainer's construction: their indices (of the rows measured cheaply),
    prompts, exact lengths, and the largest difference from the cheap measure (added to every other row)."""

    rows: list[int]
    prompts: list[Any]
    exact: list[int]
    offset: int
    construction: Construction | None = None

    @property
    def longest(self) -> int:
        """The index of the longest row."""
        return self.rows[max(range(len(self.exact)), key=lambda i: self.exact[i])]

    @property
    def most(self) -> int:
        return max(self.exact)


def measure_longest(prompts: list[Any], cheap: list[int], construction: Construction | None) -> Measured | None:
    """The :data:`CANDIDATES` longest of ``prompts`` by their ``cheap`` lengths, measured through ``construction``;
    None without a construction. Raises what the construction raises."""
    if construction is None or not prompts:
        return None
    rows = sorted(range(len(cheap)), key=lambda i: -cheap[i])[:CANDIDATES]
    picked = [prompts[i] for i in rows]
    exact = construction.lengths(picked)
    offset = max(e - cheap[i] for e, i in zip(exact, rows, strict=True))
    return Measured(rows, picked, exact, offset, construction)


def check_built(rt: Any, trainer: Any) -> None:
    """Once GRPOTrainer is built: measure the longest prompts again with the trainer's own construction; where that
    differs from the length measured before it was built, report the trainer's (event ``dataset``) and say that the
    construction could not be observed before the trainer existed."""
    from ..vocab.events import DatasetSeen

    before = rt.prompts
    if not isinstance(before, Measured):
        return
    try:
        exact = Construction.from_trainer(trainer).lengths(before.prompts)
    except Exception as e:
        rt.cannot_observe(f"the prompts as the built trainer tokenizes them ({error_line(e)}): their length is the one "
                          "measured before it was built")
        return
    if max(exact) == before.most:
        return
    delta = max(exact) - before.most
    facts = rt.facts()
    p95 = facts.get("prompt_tokens_p95")
    rt.emit(DatasetSeen(prompt_tokens_max=max(exact), prompt_tokens_p95=max(1, int(p95) + delta) if p95 else None))
    rt.cannot_observe(f"the prompts as GRPOTrainer builds them ({max(exact)} tokens, {before.most} as measured "
                      "before it was built): the trainer's length is used from now on")


def construction_for(rt: Any, a: dict[str, Any], args: Any, model: Any) -> Construction | None:
    """The construction GRPOTrainer will use (:meth:`Construction.from_arguments`), or None; what cannot be known
    before the trainer is built is said (``Runtime.cannot_observe``)."""
    construction, why = Construction.from_arguments(a, args, model)
    if why is not None:
        rt.cannot_observe(f"the prompts as GRPOTrainer builds them: {why}; their length is measured with the "
                          "tokenizer's chat template alone")
    if a.get("environment_factory") is not None:
        rt.cannot_observe("the tools of environment_factory's environments (TRL makes them inside GRPOTrainer): the "
                          "prompts are measured without their schemas until the trainer is built")
        if a.get("train_dataset") is None:
            rt.cannot_observe("the prompts' length: the environments make the prompts (no train_dataset), which the "
                              "memory model does not see (it assumes 256 tokens)")
    return construction
