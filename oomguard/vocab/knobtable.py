"""The knob table: every value oomguard may change, declared once, with what oomguard knows about it.

Each field of :class:`KnobFields` (the fields of ``Knobs``) is declared with :func:`knob`, which carries its facts as
the field's metadata: its meaning, TRL 1.16's default, the construction points through which it reaches the training
process, whether ``GRPOConfig`` has a field of the same name (or which fields and trainer arguments take it), the
values it takes, the optional package it needs, and what moving it from the user's value costs (``speed_cost``,
``signal_cost``: ``oomguard.vocab.knobcost``). Its type is the field's own annotation (``typing.get_type_hints``).
Everything else is derived from this one table: ``TRL_DEFAULTS``, ``REACH``, the type and range checks of
``Knobs.validate``, ``check_values`` and ``parse_knob``, ``CONFIG_KNOBS`` (the knobs the training process reads from
and sets on ``GRPOConfig`` by name), ``OPTIONAL_PACKAGES``, what the installed TRL lacks (``child/trlcompat.py``), the
choice's costs (``decide/cheapest.py``), ``oomguard knobs`` and its reference page. How a stack around TRL spells a
knob is the stack's own table (``oomguard.vocab.stacks``). Adding a knob is one field here; a knob with a rung adds the
remedy, the memory model's term and its place in the default ladder (``docs/contributing/layout.md``, "Adding a knob
with a rung").

>>> TABLE["max_completion_length"].trl, TABLE["max_completion_length"].reaches, TABLE["lora_r"].kind
(512, ('config',), <class 'int'>)
>>> TABLE["num_generations"].problem(1), TABLE["zero_stage"].problem(4)
('num_generations must be at least 2, not 1', 'zero_stage must be one of 0, 1, 2, 3, not 4')
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType, NoneType
from typing import Any

from .knobcost import Cost, cut, halving, off, on, stages

# Optimizer names that transformers 5.x accepts and what they are (training_args.py OptimizerNames).
EIGHT_BIT_OPTIMIZERS = {
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "paged_lion_8bit", "ademamix_8bit",
    "paged_ademamix_8bit", "rmsprop_bnb_8bit", "adamw_torch_8bit", "adamw_torch_4bit", "galore_adamw_8bit",
}
DTYPES = ("float32", "bfloat16", "float16")
EVAL_STRATEGIES = ("no", "steps", "epoch")
VLLM_MODES = ("colocate", "server")
POINTS = ("env", "config", "trainer", "model")  # the construction points, in the order a run passes them
# Every optimizer name transformers 5.23 accepts (``training_args.OptimizerNames``), kept here so that a lock file or
# a plan is checked without importing transformers (the supervisor never imports torch).
OPTIMIZER_NAMES = frozenset({
    "adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused", "adafactor", "adamw_anyprecision",
    "adamw_torch_4bit", "adamw_torch_8bit", "ademamix", "sgd", "adagrad", "adamw_bnb_8bit", "adamw_8bit",
    "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit", "paged_adamw_8bit", "paged_ademamix_32bit",
    "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit", "rmsprop", "rmsprop_bnb", "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit", "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise", "lomo", "adalomo", "grokadamw",
    "schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd", "apollo_adamw", "apollo_adamw_layerwise",
    "stable_adamw",
})
_NOUNS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list of names"}
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", tuple: "list of str"}


@dataclass(frozen=True)
class KnobInfo:
    """What oomguard knows about one knob. ``name``, ``kind`` (the annotation's type less ``None`` and the words in
    ``also``: bool, int, float, str, or tuple for a list of names) and ``hint`` (the annotation) are filled from the
    field.

    The values it takes: ``minimum`` and ``maximum`` (included), ``above`` (excluded), ``allowed`` (the only values),
    ``also`` (words taken besides the type's values: ``"auto"``, ``"all-linear"``); ``known`` is a catalogue checked
    only where a value is read from outside (a lock, ``KNOB=VALUE``), with ``unknown`` the sentence that refuses a
    name not in it (a newer library may know more names than the catalogue). ``takes`` says in words what it takes
    where the type does not (DeepSpeed's sizes), ``note`` why its range is what it is.

    How it reaches TRL where not as a ``GRPOConfig`` field of its own name: ``trl_fields`` (the GRPOConfig fields
    that take it, any one: a TRL with none of them lacks it), ``trainer_args`` (what of ``GRPOTrainer.__init__``, or
    GRPOConfig, takes a knob that reaches the trainer); ``package`` the optional package its values need in the
    training environment. ``speed_cost`` and ``signal_cost``: what moving it from the user's value costs within that
    cost class (:mod:`oomguard.vocab.knobcost`), declared for every knob a rung of that class writes."""

    meaning: str
    trl: Any = None  # TRL 1.16's default (GRPOConfig's, TrainingArguments', or how TRL loads a model from a string)
    reaches: tuple[str, ...] = ()  # the construction points through which it reaches the training process (POINTS)
    grpo_field: bool = False  # GRPOConfig has a field of this name: the training process reads and sets it there
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    allowed: tuple[Any, ...] = ()
    known: Collection[str] = ()
    unknown: str = ""
    also: tuple[str, ...] = ()
    takes: str = ""
    note: str = ""
    unit: str = ""  # "elements": one of DeepSpeed's buffer sizes (DS_SIZE_KNOBS)
    stack_only: bool = False  # no TRL release takes it, only a stack around TRL (STACK_ONLY)
    trl_fields: tuple[str, ...] = ()
    trainer_args: tuple[str, ...] = ()
    package: str = ""
    speed_cost: Cost | None = None
    signal_cost: Cost | None = None
    name: str = ""
    kind: type = object
    hint: Any = None

    # -- in words ----------------------------------------------------------------------------------------------
    def type_text(self) -> str:
        """The type as ``oomguard knobs`` prints it: ``int``, ``list of str, or all-linear``, ``int, or auto``."""
        return ", or ".join([_TYPE_NAMES[self.kind], *self.also])

    def takes_text(self) -> str:
        """What it takes, in words: ``an integer``, ``a number of elements or "auto"``."""
        return self.takes or " or ".join([_NOUNS[self.kind], *(f'"{a}"' for a in self.also)])

    def range_text(self) -> str:
        """Its range in words (empty when it has none): ``a positive integer``, ``in (0, 1]``, ``one of no, steps,
        epoch``."""
        if self.allowed:
            return "one of " + ", ".join(map(str, self.allowed)) if len(self.allowed) > 2 else " or ".join(
                map(str, self.allowed))
        note = f" ({self.note})" if self.note else ""
        if self.above is not None and self.maximum is not None:
            return f"in ({self.above:g}, {self.maximum:g}]{note}"
        if self.above is not None:
            return f"more than {self.above:g}{note}"
        if self.minimum is None:
            return ""
        if self.kind is int and self.minimum == 1:
            return f"a positive integer{note}"
        return f"{self.minimum:g} or more{note}" if self.minimum == 0 else f"at least {self.minimum:g}{note}"

    # -- checks ------------------------------------------------------------------------------------------------
    def type_problem(self, v: Any) -> str | None:
        """Why ``v`` (not None) is not of this knob's type, or None."""
        if isinstance(v, str) and (v in self.also or self.kind is tuple):  # a string of names is a pattern (PEFT)
            return None
        if self.kind is tuple:
            ok = isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
        elif self.kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:
            ok = isinstance(v, self.kind) and (self.kind is bool or not isinstance(v, bool))
        return None if ok else f"{self.name} must be {self.takes_text()}, not {v!r}"

    def problem(self, v: Any, *, catalogue: bool = False) -> str | None:
        """Why ``v`` (not None) is out of this knob's range, or None; ``catalogue``: check ``known`` too. A value of
        the wrong type for a numeric range is refused with the range's words (``a positive integer``)."""
        if isinstance(v, str) and v in self.also:
            return None
        if self.allowed:
            return None if v in self.allowed else f"{self.name} must be {self.range_text()}, not {v!r}"
        if catalogue and self.known and v not in self.known:
            return f"{self.name} {self.unknown.format(value=v)}"
        if self.minimum is None and self.above is None and self.maximum is None:
            return None
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and (self.kind is float or isinstance(v, int))
        if not number:  # an integer's positive range says it is an integer
            words = self.range_text() if self.kind is int and self.minimum == 1 and not self.takes else \
                self.takes_text()
        elif ((self.minimum is not None and v < self.minimum) or (self.above is not None and v <= self.above)
              or (self.maximum is not None and v > self.maximum)):
            words = self.takes or self.range_text()
        else:
            return None
        return f"{self.name} must be {words}, not {v!r}"

    def parse(self, text: str) -> Any:
        """``KNOB=VALUE`` text from the command line in this knob's type (None for ``none``), or ValueError."""
        t = text.strip()
        if t.lower() in ("none", "null", ""):
            return None
        if t.lower() in self.also:
            return t.lower()
        if self.kind is tuple:
            return tuple(p.strip() for p in t.split(",") if p.strip())
        try:
            if self.kind is bool:
                return {"1": True, "true": True, "yes": True, "on": True,
                        "0": False, "false": False, "no": False, "off": False}[t.lower()]
            if self.kind is int:  # a size in elements may be written 5e7
                return int(float(t)) if self.unit == "elements" else int(t)
            if self.kind is float:
                return float(t)
        except (KeyError, ValueError):
            raise ValueError(f"{self.name} takes {self.takes_text()}, not {text!r}") from None
        return t


def knob(meaning: str, *, trl: Any = None, reaches: str | tuple[str, ...] = (), grpo_field: bool = False,
         **facts: Any) -> Any:
    """A field of ``Knobs`` with its facts (:class:`KnobInfo`); unset (None) by default: TRL's default or the user's
    value applies. ``reaches`` is one construction point or a tuple of them."""
    points = (reaches,) if isinstance(reaches, str) else tuple(reaches)
    unknown_points = set(points) - set(POINTS)
    if unknown_points:
        raise ValueError(f"unknown construction point(s): {', '.join(sorted(unknown_points))}")
    return dataclasses.field(default=None, metadata={"knob": KnobInfo(meaning, trl=trl, reaches=points,
                                                                      grpo_field=grpo_field, **facts)})


def _grpo(meaning: str, **facts: Any) -> Any:
    """A GRPOConfig field of the same name."""
    return knob(meaning, reaches="config", grpo_field=True, **facts)


def _ds(meaning: str, **facts: Any) -> Any:
    """A knob in the DeepSpeed config oomguard generates for GRPOConfig (its ``deepspeed`` field)."""
    return knob(meaning, reaches="config", trl_fields=("deepspeed",), package="deepspeed", **facts)


# DeepSpeed's buffers sized to the model: more, smaller collectives; one change however many sizes are set
_BUFFERS = on(0.01, group="deepspeed_buffers", what="more, smaller collectives, once for all of DeepSpeed's sizes")


def _ds_size(meaning: str) -> Any:
    """One of DeepSpeed's buffer sizes: elements, or "auto" (transformers sizes it from the model's hidden size);
    unset: the config leaves it to DeepSpeed's default."""
    return _ds(meaning, minimum=0, also=("auto",), takes='a number of elements or "auto"', unit="elements",
               speed_cost=_BUFFERS)


_OFFLOAD = "every step goes through host memory"
_PEFT: dict[str, Any] = {"trainer_args": ("peft_config",), "package": "peft"}


_POSITIVE: dict[str, Any] = {"minimum": 1}


@dataclass(frozen=True)
class KnobFields:
    """Every value oomguard may change: the fields of ``Knobs``, each declared once with what oomguard knows of it.

    Field names follow ``GRPOConfig`` where one exists; the others are oomguard's own. ``bf16``/``fp16``,
    ``learning_rate`` and ``loss_type`` are read, never changed: the memory model and the judgement of what a change
    does to training read them.
    """

    expandable_segments: bool | None = knob(
        "PyTorch allocator: grow segments in place instead of caching new blocks (fragmentation)", trl=False,
        reaches="env")
    max_split_size_mb: int | None = knob(
        "PyTorch allocator: cached blocks larger than this are never split, so they stay whole", reaches="env",
        above=20, note="PyTorch's minimum")
    torch_empty_cache_steps: int | None = _grpo("empty the device cache every N steps", **_POSITIVE)
    max_completion_length: int | None = _grpo("longest completion generated, in tokens", trl=512, **_POSITIVE,
                                              signal_cost=cut(1.0, what="of the completion length"))
    max_prompt_tokens: int | None = knob(
        "prompts longer than this many tokens leave the dataset (oomguard's own; TRL 1.16 has none)",
        reaches="trainer", trainer_args=("train_dataset",), **_POSITIVE,
        signal_cost=on(0.05, what="set at the prompts' 95th percentile: at most a twentieth of them leave"))
    num_generations: int | None = _grpo("completions generated per prompt (the GRPO group)", trl=8, minimum=2,
                                        signal_cost=cut(1.0, unset=8, what="of the generations per prompt"))
    per_device_train_batch_size: int | None = _grpo("completions per device in one micro-step", trl=8, **_POSITIVE)
    gradient_accumulation_steps: int | None = _grpo("micro-steps per optimizer step", trl=1, **_POSITIVE)
    steps_per_generation: int | None = _grpo("micro-steps served by one generation round", **_POSITIVE)
    generation_batch_size: int | None = _grpo("completions generated per round, over all devices", **_POSITIVE)
    per_device_eval_batch_size: int | None = _grpo(
        "rows an evaluation pass generates and scores at once on each device", trl=8, **_POSITIVE)  # TrainingArguments'
    num_generations_eval: int | None = _grpo(
        "completions per prompt at evaluation (unset: num_generations)", **_POSITIVE)  # None: num_generations
    eval_strategy: str | None = _grpo("when the run evaluates (no, steps, epoch); read, never changed", trl="no",
                                      allowed=EVAL_STRATEGIES)
    gradient_checkpointing: bool | None = knob(
        "recompute activations in the backward instead of keeping them (transformers 5: activation_checkpointing)",
        trl=True, reaches="config", trl_fields=("activation_checkpointing", "gradient_checkpointing"),  # 5.23's name
        speed_cost=on(0.10, what="a third more training compute, in a step that generation dominates"))
    optim: str | None = _grpo(
        "the optimizer, one of transformers' OptimizerNames (e.g. adamw_torch_fused, adamw_bnb_8bit)",
        trl="adamw_torch_fused", known=OPTIMIZER_NAMES,
        unknown="names no optimizer transformers knows: {value!r} (e.g. adamw_torch_fused, adamw_bnb_8bit)")
    # fp32 when TRL loads the model from a string
    dtype: str | None = knob("the dtype the model is loaded in: float32, bfloat16, float16 or auto", trl="float32",
                             reaches=("trainer", "model"), allowed=(*DTYPES, "auto"))
    # TRL 1.16 turns bf16 autocast on unless fp16 is set (GRPOConfig.__post_init__), on CPU too
    bf16: bool | None = _grpo("bf16 mixed precision (autocast), GPU or CPU; TRL turns it on unless fp16 is set",
                              trl=True)
    fp16: bool | None = _grpo("fp16 mixed precision (autocast)", trl=False)
    lora_r: int | None = knob("LoRA rank; 0 trains every weight (LoRA is injected as peft_config)", trl=0,
                              reaches="trainer", minimum=0, **_PEFT)
    lora_alpha: int | None = knob("LoRA scaling alpha", reaches="trainer", **_POSITIVE, **_PEFT)
    lora_target_modules: tuple[str, ...] | str | None = knob(
        "the modules LoRA adapts: names (q_proj,v_proj) or all-linear", reaches="trainer", also=("all-linear",),
        takes='a list of module names or "all-linear"', **_PEFT)
    # TRL 1.10 on takes a BitsAndBytesConfig as the trainer's quantization_config, before through model_init_kwargs
    load_in_4bit: bool | None = knob("load the base model in NF4 4-bit (QLoRA); needs LoRA", trl=False,
                                     reaches=("trainer", "model"), package="bitsandbytes",
                                     trainer_args=("quantization_config", "model_init_kwargs"))
    max_pixels: int | None = knob(
        "a vision-language model's pixel budget per image: the image processor resizes each image to at most this "
        "many pixels, and fewer pixels are fewer image tokens (Qwen2-VL/2.5-VL's max_pixels, the image processor's "
        "size longest_edge; Gemma 3's 896x896 image times 1 + its pan-and-scan crops); unset: the processor's own",
        reaches="trainer", minimum=1,
        signal_cost=cut(0.5, capped=True, what="of the pixels the largest image got: half, as a user gives up "
                                               "resolution before reasoning"))
    beta: float | None = _grpo("KL coefficient; above 0 a reference model is kept in memory", trl=0.0, minimum=0)
    use_vllm: bool | None = _grpo("generate with vLLM", trl=False)
    vllm_mode: str | None = _grpo("vLLM in the training process (colocate) or a separate server", trl="colocate",
                                  allowed=VLLM_MODES)
    vllm_gpu_memory_utilization: float | None = _grpo(
        "the share of the GPU vLLM reserves in colocate mode", trl=0.3, above=0, maximum=1,
        speed_cost=cut(1.0, what="of vLLM's reservation: a smaller KV cache batches fewer sequences at once"))
    vllm_enable_sleep_mode: bool | None = _grpo(
        "vLLM gives its memory back between generation rounds", trl=False,
        speed_cost=on(0.05, what="vLLM's weights reloaded for each generation round: a few percent of a step"))
    vllm_max_model_length: int | None = _grpo(
        "vLLM's context length, which sizes its KV cache", **_POSITIVE,
        speed_cost=Cost("free", what="never below the run's longest sequence: nothing generated changes"))
    use_transformers_continuous_batching: bool | None = _grpo(
        "generate with transformers' continuous batching and its paged cache (TRL 0.29: use_transformers_paged); "
        "read, never changed", trl=False, trl_fields=("use_transformers_continuous_batching", "use_transformers_paged"))
    cb_max_memory_percent: float | None = knob(
        "continuous batching: the share of the device memory free when generation starts that transformers' paged "
        "cache takes (transformers_continuous_batching_config's max_memory_percent, TRL 1.10 on); a smaller share "
        "generates fewer sequences at once", trl=0.5, reaches="config", above=0, maximum=1,
        trl_fields=("transformers_continuous_batching_config",),  # TRL 1.10 on
        speed_cost=halving(0.05, unset=0.5, what="fewer sequences at once: more forward passes in a round"))
    cb_max_batch_tokens: int | None = knob(
        "continuous batching: the most tokens one forward of a generation round computes (transformers_continuous_"
        "batching_config's max_batch_tokens; unset: transformers' 8192); read, never changed", reaches="config",
        trl_fields=("transformers_continuous_batching_config",), **_POSITIVE)
    offload_during_generation: bool | None = knob(
        "the trainer's weights and optimizer state wait in host RAM while a colocated vLLM generates (ms-swift's "
        "--offload_model --offload_optimizer; TRL has no such option)", trl=False, reaches="config", stack_only=True,
        speed_cost=on(0.3, what="the weights and optimizer state moved out and back once a step"))
    # GRPO's batches are prompts: loading them costs no measurable time in a step that generates and trains
    dataloader_num_workers: int | None = _grpo("data-loading worker processes (host RAM)", trl=0, minimum=0,
                                               speed_cost=Cost("free", what="the batches are prompts"))
    dataloader_prefetch_factor: int | None = _grpo("batches each data-loading worker prepares ahead (host RAM)",
                                                   speed_cost=Cost("free", what="the batches are prompts"),
                                                   **_POSITIVE)
    zero_stage: int | None = _ds(
        "DeepSpeed ZeRO stage 0-3, through a generated DeepSpeed config", allowed=(0, 1, 2, 3),
        speed_cost=stages({2: 0.05, 3: 0.30}, unset=0, what="ZeRO-2: a reduce-scatter and an all-gather, about "
                                                           "DDP's all-reduce; ZeRO-3: parameters gathered in every "
                                                           "forward and generation step"))
    offload_optimizer: bool | None = _ds("DeepSpeed: keep the optimizer state in host RAM", trl=False,
                                         speed_cost=on(0.5, what=_OFFLOAD))
    offload_params: bool | None = _ds("DeepSpeed: keep the parameters in host RAM", trl=False,
                                      speed_cost=on(1.0, what=_OFFLOAD))
    reduce_bucket_size: int | str | None = _ds_size(
        "DeepSpeed: elements per gradient reduce bucket, or auto (hidden_size²); unset: DeepSpeed's 500,000,000 on "
        "every rank")
    stage3_prefetch_bucket_size: int | str | None = _ds_size(
        "DeepSpeed ZeRO-3: parameter elements fetched ahead, or auto (0.9 × hidden_size²)")
    stage3_param_persistence_threshold: int | str | None = _ds_size(
        "DeepSpeed ZeRO-3: parameters smaller than this stay whole on every rank, or auto (10 × hidden_size)")
    overlap_comm: bool | None = _ds(
        "DeepSpeed: overlap gradient reduction with the backward (ZeRO-1/2: two reduce buckets)")
    ds3_gather_for_generation: bool | None = _grpo(
        "ZeRO-3: gather the whole model on every rank to generate (True, TRL's default) or gather it layer by layer "
        "(False: slower generation; DeepSpeed's prefetch still holds part of the model)", trl=True,
        speed_cost=off(0.3, what="each decode step gathers every layer again"))
    use_liger_kernel: bool | None = _grpo(
        "TRL 0.29 to 1.14: Liger's chunked GRPO loss instead of the [batch, completion, vocab] logits", trl=False,
        package="liger_kernel",
        speed_cost=on(0.01, what="the LM head and loss in chunks, at most about half again their own time, and they "
                                 "are a tenth of the training passes in a step that generation dominates"))
    fsdp_offload: bool | None = knob("FSDP: offload parameters and gradients to the CPU", trl=False, reaches="config",
                                     trl_fields=("fsdp",), speed_cost=on(1.0, what=_OFFLOAD))
    checkpoint_every: int | None = knob(
        "oomguard's own checkpoint cadence: a checkpoint every N steps besides the script's own saves, so that a "
        "restart after a late OOM loses at most N steps (a leak's restarts, --checkpoint-every); an adaptation in the "
        "diff and the lock, never a rung; the checkpoints it adds are deleted again, all but the newest",
        reaches="trainer", **_POSITIVE)
    use_cpu: bool | None = _grpo(
        "train on the CPU even where a GPU backend is found; oomguard sets it only so that DeepSpeed's ranks run on a "
        "CPU-only machine (an adaptation in the diff and the lock, never a rung)", trl=False)
    learning_rate: float | None = _grpo(
        "the optimizer's learning rate; read, never changed: bf16 weights are judged by whether an update of this "
        "size survives their rounding", trl=1e-6, above=0)
    loss_type: str | None = _grpo(
        "GRPO's loss normalisation (dapo, grpo, dr_grpo, bnpo, ...); read, never changed: it decides whether a "
        "micro-batch split keeps the gradients", trl="dapo")


def _kind(hint: Any, also: tuple[str, ...]) -> type:
    """The one type a knob's values have, from its annotation: ``int | str | None`` with ``also=("auto",)`` -> int."""
    arms = [a for a in typing.get_args(hint) if a is not NoneType] or [hint]
    if also and len(arms) > 1:
        arms = [a for a in arms if a is not str]
    if len(arms) != 1:
        raise TypeError(f"a knob has one type besides None and its words ({hint})")
    kind: type = typing.get_origin(arms[0]) or arms[0]
    return kind


def _table() -> dict[str, KnobInfo]:
    hints = typing.get_type_hints(KnobFields)
    out = {}
    for f in dataclasses.fields(KnobFields):
        info: KnobInfo = f.metadata["knob"]
        out[f.name] = dataclasses.replace(info, name=f.name, hint=hints[f.name], kind=_kind(hints[f.name], info.also))
    return out


TABLE: Mapping[str, KnobInfo] = MappingProxyType(_table())
KNOB_NAMES = frozenset(TABLE)
# which knobs reach the training process through which construction point (`oomguard run`): a rung whose knobs reach
# nothing the command built cannot help it, and a script without GRPOConfig only feels the allocator settings
REACH: Mapping[str, frozenset[str]] = MappingProxyType(
    {p: frozenset(n for n, i in TABLE.items() if p in i.reaches) for p in POINTS})
# GRPOConfig fields that are knobs of the same name (the training process reads and sets them there)
CONFIG_KNOBS: tuple[str, ...] = tuple(n for n, i in TABLE.items() if i.grpo_field)
# DeepSpeed's buffer sizes: a number of elements, or "auto" (transformers fills it from the model's hidden size)
DS_SIZE_KNOBS: tuple[str, ...] = tuple(n for n, i in TABLE.items() if i.unit == "elements")
# Knobs that only a front-end around TRL takes (ms-swift's offload while vLLM generates): every TRL release lacks them,
# and a stack adapter that takes them leaves them out of what it reports it lacks (child/stacks/swift.py).
STACK_ONLY: frozenset[str] = frozenset(n for n, i in TABLE.items() if i.stack_only)
# the optional packages some knobs need (LoRA: peft; 4-bit: bitsandbytes; ZeRO: deepspeed; Liger's loss:
# liger_kernel), checked in the training environment (child/patching.py) without importing them
OPTIONAL_PACKAGES: tuple[str, ...] = tuple(dict.fromkeys(i.package for i in TABLE.values() if i.package))
# one line per knob, for `oomguard knobs` and the reference page
KNOB_MEANINGS: Mapping[str, str] = MappingProxyType({n: i.meaning for n, i in TABLE.items()})
# the construction points in words
POINT_WORDS = {"env": "environment (allocator config)", "config": "GRPOConfig", "trainer": "GRPOTrainer",
               "model": "from_pretrained"}


def describe() -> list[dict[str, Any]]:
    """Every knob: name, type, TRL 1.16's default, the construction points it reaches, and what it means (``oomguard
    knobs``, and its reference page).

    >>> row = next(r for r in describe() if r["name"] == "lora_r")
    >>> row["type"], row["default"], row["reaches"]
    ('int', 0, ['GRPOTrainer'])
    """
    return [{"name": name, "type": info.type_text(),
             "default": list(info.trl) if isinstance(info.trl, tuple) else info.trl,
             "reaches": [POINT_WORDS[p] for p in POINTS if p in info.reaches], "meaning": info.meaning}
            for name, info in TABLE.items()]


__all__ = ["CONFIG_KNOBS", "DS_SIZE_KNOBS", "DTYPES", "EIGHT_BIT_OPTIMIZERS", "EVAL_STRATEGIES",
           "KNOB_MEANINGS", "KNOB_NAMES", "OPTIMIZER_NAMES", "OPTIONAL_PACKAGES", "POINTS", "POINT_WORDS", "REACH",
           "STACK_ONLY", "TABLE", "VLLM_MODES", "KnobFields", "KnobInfo", "describe", "knob"]
