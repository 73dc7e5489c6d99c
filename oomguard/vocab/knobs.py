"""Knobs: every value oomguard may change, immutable, checked against GRPO's batch rules, with a diff.

A run has three layers of knobs. TRL's defaults, then what the user's script set (recorded by the training process
when it builds its ``GRPOConfig``), then oomguard's overrides. ``effective = defaults | observed | overrides``, and
the diff compares ``defaults | observed`` (the user's own config) with the effective knobs, so it shows exactly
what oomguard changed.

>>> k = TRL_DEFAULTS.replace(per_device_train_batch_size=4, gradient_accumulation_steps=2)
>>> k.rows_per_device(), k.validate()
(8, [])
>>> [r.knob for r in k.diff(k.replace(max_completion_length=256))]
['max_completion_length']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Optimizer names that transformers 5.x accepts and what they are (training_args.py OptimizerNames).
EIGHT_BIT_OPTIMIZERS = {
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "paged_lion_8bit", "ademamix_8bit",
    "paged_ademamix_8bit", "rmsprop_bnb_8bit", "adamw_torch_8bit", "adamw_torch_4bit", "galore_adamw_8bit",
}
DTYPES = ("float32", "bfloat16", "float16")
EVAL_STRATEGIES = ("no", "steps", "epoch")


@dataclass(frozen=True)
class Knobs:
    """Every value oomguard may change. ``None`` means "not set": TRL's default (or the user's value) applies.

    Field names follow ``GRPOConfig`` where one exists; the others are oomguard's own: ``expandable_segments`` and
    ``max_split_size_mb`` (the allocator config), ``max_prompt_tokens`` (prompts longer than this are dropped from the
    dataset, since TRL 1.16 has no ``max_prompt_length``), ``dtype`` (the load dtype), ``lora_*`` and
    ``load_in_4bit`` (adapters and quantisation injected at the trainer), ``zero_stage``/``offload_*`` (DeepSpeed
    through accelerate), the DeepSpeed buffer sizes ``reduce_bucket_size``, ``stage3_prefetch_bucket_size``,
    ``stage3_param_persistence_threshold`` (elements, or ``"auto"``: transformers sizes them from the model's hidden
    size; ``None``: the config leaves them to DeepSpeed's defaults) and ``overlap_comm``, ``fsdp_offload``;
    ``offload_during_generation`` (the trainer's weights and optimizer state wait in host RAM while a colocated vLLM
    generates: ms-swift's ``--offload_model --offload_optimizer``; TRL has no such option); ``use_liger_kernel``
    (TRL 0.29 to 1.14: Liger's chunked GRPO loss instead of the materialised logits). ``bf16``/``fp16`` (mixed
    precision: autocast) are read from the script for the memory model; no rung changes them. Nor does any rung
    change ``learning_rate`` and ``loss_type``: they are read to tell what a change does to training (whether bf16
    weights still move at this learning rate, whether a micro-batch split keeps the gradients).
    """

    expandable_segments: bool | None = None
    max_split_size_mb: int | None = None
    torch_empty_cache_steps: int | None = None
    max_completion_length: int | None = None
    max_prompt_tokens: int | None = None
    num_generations: int | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    per_device_eval_batch_size: int | None = None
    num_generations_eval: int | None = None
    eval_strategy: str | None = None
    gradient_checkpointing: bool | None = None
    optim: str | None = None
    dtype: str | None = None
    bf16: bool | None = None
    fp16: bool | None = None
    lora_r: int | None = None
    lora_alpha: int | None = None
    lora_target_modules: tuple[str, ...] | str | None = None
    load_in_4bit: bool | None = None
    beta: float | None = None
    use_vllm: bool | None = None
    vllm_mode: str | None = None
    vllm_gpu_memory_utilization: float | None = None
    vllm_enable_sleep_mode: bool | None = None
    vllm_max_model_length: int | None = None
    offload_during_generation: bool | None = None
    dataloader_num_workers: int | None = None
    dataloader_prefetch_factor: int | None = None
    zero_stage: int | None = None
    offload_optimizer: bool | None = None
    offload_params: bool | None = None
    reduce_bucket_size: int | str | None = None
    stage3_prefetch_bucket_size: int | str | None = None
    stage3_param_persistence_threshold: int | str | None = None
    overlap_comm: bool | None = None
    ds3_gather_for_generation: bool | None = None
    use_liger_kernel: bool | None = None
    fsdp_offload: bool | None = None
    use_cpu: bool | None = None
    learning_rate: float | None = None
    loss_type: str | None = None

    # -- construction ----------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> Knobs:
        unknown = set(changes) - KNOB_NAMES
        if unknown:
            raise KeyError(f"unknown knob(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def merged(self, top: Knobs | Mapping[str, Any]) -> Knobs:
        """This layer with ``top``'s set (non-None) values on top."""
        items = top.to_dict(only_set=True) if isinstance(top, Knobs) else dict(top)
        return self.replace(**{k: _normalise(k, v) for k, v in items.items() if v is not None})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Knobs:
        d = dict(d or {})
        unknown = set(d) - KNOB_NAMES
        if unknown:
            raise KeyError(f"unknown knob(s): {', '.join(sorted(unknown))}")
        return cls(**{k: _normalise(k, v) for k, v in d.items()})

    def to_dict(self, *, only_set: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if only_set and v is None:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    # -- GRPO batch geometry (GRPOConfig.__post_init__, TRL 1.16) ----------------------------------------------
    def geometry(self, world_size: int = 1) -> tuple[int, int, int]:
        """``(per_device_train_batch_size, gradient_accumulation_steps, steps_per_generation)`` as TRL resolves them."""
        bs = self.per_device_train_batch_size or 8
        ga = self.gradient_accumulation_steps or 1
        if self.steps_per_generation is not None:
            spg = self.steps_per_generation
        elif self.generation_batch_size is not None:
            spg = max(1, self.generation_batch_size // max(1, bs * world_size))
        else:
            spg = ga
        return bs, ga, spg

    def rows_per_device(self, world_size: int = 1) -> int:
        """Completions generated per device per generation round: what sets generation memory."""
        bs, _, spg = self.geometry(world_size)
        return bs * spg

    def prompts_per_step(self, world_size: int = 1) -> float:
        """Prompts per optimizer step, the effective batch GRPO learns from: the completions of one step
        (micro-batch x accumulation x ranks) over the completions per prompt. A micro-batch split keeps it.

        >>> k = Knobs(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=8)
        >>> k.prompts_per_step(), k.replace(per_device_train_batch_size=4, gradient_accumulation_steps=4).prompts_per_step()
        (2.0, 2.0)
        """
        bs, ga, _ = self.geometry(world_size)
        return bs * ga * world_size / max(1, self.num_generations or 8)

    def evaluates(self) -> bool:
        """Whether the run evaluates (``eval_strategy`` other than ``"no"``): TRL then generates and scores
        ``per_device_eval_batch_size`` rows per device at each evaluation.

        >>> Knobs().evaluates(), Knobs(eval_strategy="steps").evaluates()
        (False, True)
        """
        return (self.eval_strategy or "no") != "no"

    def eval_geometry(self) -> tuple[int, int]:
        """``(per_device_eval_batch_size, num_generations_eval)`` as TRL resolves them (8, and num_generations).

        >>> Knobs(num_generations=4).eval_geometry()
        (8, 4)
        """
        return self.per_device_eval_batch_size or 8, self.num_generations_eval or self.num_generations or 8

    def with_geometry(self, bs: int, ga: int, spg: int, world_size: int = 1) -> Knobs:
        """Set the batch geometry, written in the form the user used (generation_batch_size or steps_per_generation)."""
        changes: dict[str, Any] = {"per_device_train_batch_size": bs, "gradient_accumulation_steps": ga}
        if self.generation_batch_size is not None:
            changes["generation_batch_size"] = bs * world_size * spg
        elif self.steps_per_generation is not None or spg != ga:
            changes["steps_per_generation"] = spg
        return self.replace(**changes)

    def validate(self, world_size: int = 1) -> list[str]:
        """Problems with these knobs under TRL 1.16's rules; an empty list means GRPOConfig will accept them."""
        problems: list[str] = []
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                     "generation_batch_size", "max_completion_length", "max_prompt_tokens", "torch_empty_cache_steps",
                     "lora_r", "max_split_size_mb", "per_device_eval_batch_size", "num_generations_eval"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "lora_r" else 1)):
                problems.append(f"{name} must be a positive integer, not {v!r}")
        if problems:
            return problems
        g = self.num_generations if self.num_generations is not None else 8
        if g < 2:
            problems.append(f"num_generations must be at least 2 (got {g})")
        bs = self.per_device_train_batch_size or 8
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            problems.append("generation_batch_size and steps_per_generation cannot both be set")
        if self.generation_batch_size is not None and self.generation_batch_size % (bs * world_size):
            problems.append(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch "
                            f"size ({bs} x {world_size})")
        gbs = self.rows_per_device(world_size) * world_size
        if g >= 2 and gbs % g:
            problems.append(f"generation_batch_size ({gbs}) must be divisible by num_generations ({g})")
        if self.evaluates():
            be, ge = self.eval_geometry()
            if (be * world_size) % ge:
                problems.append(f"the global eval batch size ({be} x {world_size}) must be divisible by "
                                f"num_generations_eval ({ge})")
        if self.eval_strategy is not None and self.eval_strategy not in EVAL_STRATEGIES:
            problems.append(f"eval_strategy must be one of {', '.join(EVAL_STRATEGIES)}, not {self.eval_strategy!r}")
        if self.dtype is not None and self.dtype not in (*DTYPES, "auto"):
            problems.append(f"dtype must be one of {', '.join(DTYPES)} or auto, not {self.dtype!r}")
        if self.load_in_4bit and not self.lora_r:
            problems.append("load_in_4bit needs LoRA (lora_r > 0): a purely quantised model cannot be trained")
        u = self.vllm_gpu_memory_utilization
        if u is not None and not (0 < u <= 1):
            problems.append(f"vllm_gpu_memory_utilization must be in (0, 1], not {u}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage must be 0, 1, 2 or 3, not {self.zero_stage}")
        for name in DS_SIZE_KNOBS:
            v = getattr(self, name)
            if v is not None and v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                problems.append(f"{name} must be a number of elements or \"auto\", not {v!r}")
        if self.max_split_size_mb is not None and self.max_split_size_mb <= 20:
            problems.append(f"max_split_size_mb must be more than 20 (PyTorch's minimum), not {self.max_split_size_mb}")
        if self.beta is not None and self.beta < 0:
            problems.append(f"beta must be >= 0, not {self.beta}")
        if self.learning_rate is not None and not self.learning_rate > 0:
            problems.append(f"learning_rate must be more than 0, not {self.learning_rate}")
        return problems

    # -- diff --------------------------------------------------------------------------------------------------
    def diff(self, other: Knobs) -> list[DiffRow]:
        """Rows for every knob whose value differs between ``self`` (before) and ``other`` (after)."""
        rows = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                rows.append(DiffRow(f.name, a, b))
        return rows


@dataclass(frozen=True)
class DiffRow:
    knob: str
    before: Any
    after: Any
    remedy: str | None = None

    def to_dict(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            return list(v) if isinstance(v, tuple) else v

        return {"knob": self.knob, "from": plain(self.before), "to": plain(self.after), "remedy": self.remedy}


KNOB_NAMES = frozenset(f.name for f in fields(Knobs))
# DeepSpeed's buffer sizes: a number of elements, or "auto" (transformers fills it from the model's hidden size)
DS_SIZE_KNOBS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

_BOOL_KNOBS = {f.name for f in fields(Knobs) if "bool" in str(f.type)}
_INT_KNOBS = {f.name for f in fields(Knobs) if str(f.type).startswith("int")} - set(DS_SIZE_KNOBS)
_FLOAT_KNOBS = {f.name for f in fields(Knobs) if str(f.type).startswith("float")}


def _normalise(name: str, value: Any) -> Any:
    if name == "lora_target_modules" and isinstance(value, list):
        return tuple(value)
    return value


def parse_knob(name: str, text: str) -> Any:
    """Read ``KNOB=VALUE`` text from the command line into the knob's type, with a one-line error if it cannot.

    >>> parse_knob("gradient_checkpointing", "off"), parse_knob("lora_target_modules", "q_proj,v_proj")
    (False, ('q_proj', 'v_proj'))
    """
    if name not in KNOB_NAMES:
        raise KeyError(f"unknown knob {name!r}; known knobs: {', '.join(sorted(KNOB_NAMES))}")
    t = text.strip()
    if t.lower() in ("none", "null", ""):
        return None
    if name in _BOOL_KNOBS:
        low = t.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} takes true or false, not {text!r}")
    if name in _INT_KNOBS:
        try:
            return int(t)
        except ValueError:
            raise ValueError(f"{name} takes an integer, not {text!r}")
    if name in _FLOAT_KNOBS:
        try:
            return float(t)
        except ValueError:
            raise ValueError(f"{name} takes a number, not {text!r}")
    if name == "lora_target_modules":
        return t if t == "all-linear" else tuple(p.strip() for p in t.split(",") if p.strip())
    if name in DS_SIZE_KNOBS:
        if t.lower() == "auto":
            return "auto"
        try:
            return int(float(t))
        except ValueError:
            raise ValueError(f"{name} takes a number of elements (5e7) or auto, not {text!r}")
    return t


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
VLLM_MODES = ("colocate", "server")
_STR_KNOBS = {f.name for f in fields(Knobs) if str(f.type).startswith("str")}
_NON_NEGATIVE = {"lora_r", "dataloader_num_workers"}


def _type_problem(name: str, v: Any) -> str | None:
    if name in _BOOL_KNOBS and not isinstance(v, bool):
        return f"{name} must be true or false, not {v!r}"
    if name in _INT_KNOBS and (isinstance(v, bool) or not isinstance(v, int)):
        return f"{name} must be an integer, not {v!r}"
    if name in _FLOAT_KNOBS and (isinstance(v, bool) or not isinstance(v, (int, float))):
        return f"{name} must be a number, not {v!r}"
    if name in _STR_KNOBS and not isinstance(v, str):
        return f"{name} must be a string, not {v!r}"
    if name in DS_SIZE_KNOBS and v != "auto" and (isinstance(v, bool) or not isinstance(v, int)):
        return f"{name} must be a number of elements or \"auto\", not {v!r}"
    if name == "lora_target_modules" and not (
            isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))):
        return f"lora_target_modules must be a list of module names or \"all-linear\", not {v!r}"
    return None


def check_values(values: Mapping[str, Any], world_size: int = 1, base: Knobs | None = None) -> list[str]:
    """Problems with knob values read from outside (a lock file, ``plan``'s KNOB=VALUE): unknown names, wrong types,
    out-of-range values, unknown optimizer names, then GRPO's batch rules (``Knobs.validate``) for ``base`` (TRL's
    defaults unless given) with the values on top. An empty list means the values can be used.

    >>> check_values({"num_generations": 4, "optim": "adamw_bnb_8bit"})
    []
    >>> check_values({"num_generations": -5, "optim": "fast"})  # doctest: +NORMALIZE_WHITESPACE
    ["optim names no optimizer transformers knows: 'fast' (e.g. adamw_torch_fused, adamw_bnb_8bit)",
     'num_generations must be at least 2 (got -5)']
    """
    unknown = sorted(set(values) - KNOB_NAMES)
    if unknown:
        return [f"unknown knob(s): {', '.join(unknown)}; `oomguard knobs` lists them"]
    problems = [p for p in (_type_problem(k, v) for k, v in values.items() if v is not None) if p]
    if problems:
        return problems
    for name in _NON_NEGATIVE:
        v = values.get(name)
        if v is not None and v < 0:
            problems.append(f"{name} must be 0 or more, not {v}")
    for name in ("lora_alpha", "vllm_max_model_length", "dataloader_prefetch_factor"):
        v = values.get(name)
        if v is not None and v < 1:
            problems.append(f"{name} must be a positive integer, not {v}")
    optim = values.get("optim")
    if optim is not None and optim not in OPTIMIZER_NAMES:
        problems.append(f"optim names no optimizer transformers knows: {optim!r} (e.g. adamw_torch_fused, "
                        "adamw_bnb_8bit)")
    mode = values.get("vllm_mode")
    if mode is not None and mode not in VLLM_MODES:
        problems.append(f"vllm_mode must be colocate or server, not {mode!r}")
    k = (base if base is not None else TRL_DEFAULTS).merged(values)
    return problems + [p for p in k.validate(world_size) if p not in problems]


# TRL 1.16 GRPOConfig defaults for the knobs (research/trl-grpo-memory.md §1), plus the allocator and dtype facts:
# no allocator config, and fp32 when TRL loads the model from a string.
TRL_DEFAULTS = Knobs(
    expandable_segments=False,
    max_split_size_mb=None,
    torch_empty_cache_steps=None,
    max_completion_length=512,
    max_prompt_tokens=None,
    num_generations=8,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    steps_per_generation=None,
    generation_batch_size=None,
    per_device_eval_batch_size=8,  # TrainingArguments' default
    num_generations_eval=None,  # None: num_generations (GRPOTrainer.num_generations_eval)
    eval_strategy="no",
    gradient_checkpointing=True,
    optim="adamw_torch_fused",
    dtype="float32",
    bf16=True,  # TRL 1.16 turns bf16 autocast on unless fp16 is set (GRPOConfig.__post_init__), on CPU too
    fp16=False,
    lora_r=0,
    lora_alpha=None,
    lora_target_modules=None,
    load_in_4bit=False,
    beta=0.0,
    use_vllm=False,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.3,
    vllm_enable_sleep_mode=False,
    vllm_max_model_length=None,
    offload_during_generation=False,
    dataloader_num_workers=0,
    dataloader_prefetch_factor=None,
    zero_stage=None,
    offload_optimizer=False,
    offload_params=False,
    reduce_bucket_size=None,
    stage3_prefetch_bucket_size=None,
    stage3_param_persistence_threshold=None,
    overlap_comm=None,
    ds3_gather_for_generation=True,
    use_liger_kernel=False,
    fsdp_offload=False,
    use_cpu=False,
    learning_rate=1e-6,
    loss_type="dapo",
)


# Which knobs reach the training process through which construction point (`oomguard run`). A rung whose knobs
# reach nothing the command built cannot help it: a script without GRPOConfig only feels the allocator settings.
REACH: dict[str, frozenset[str]] = {
    "env": frozenset({"expandable_segments", "max_split_size_mb"}),
    "config": frozenset({
        "max_completion_length", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
        "steps_per_generation", "generation_batch_size", "per_device_eval_batch_size", "num_generations_eval",
        "eval_strategy", "beta", "optim", "torch_empty_cache_steps", "use_vllm",
        "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_max_model_length",
        "offload_during_generation", "dataloader_num_workers", "dataloader_prefetch_factor", "gradient_checkpointing",
        "zero_stage",
        "offload_optimizer", "offload_params", "fsdp_offload", "bf16", "fp16", *DS_SIZE_KNOBS, "overlap_comm",
        "ds3_gather_for_generation", "use_liger_kernel", "use_cpu",
        "learning_rate", "loss_type",
    }),
    "trainer": frozenset({"lora_r", "lora_alpha", "lora_target_modules", "max_prompt_tokens", "dtype", "load_in_4bit"}),
    "model": frozenset({"dtype", "load_in_4bit"}),
}


# Knobs that only a front-end around TRL takes (ms-swift's offload while vLLM generates): every TRL release lacks them,
# and a stack adapter that takes them leaves them out of what it reports it lacks (child/stacks/swift.py).
STACK_ONLY: frozenset[str] = frozenset({"offload_during_generation"})


def reachable(points: frozenset[str] | set[str]) -> frozenset[str]:
    """The knobs that reach a process which passed through ``points`` (``config``, ``trainer``, ``model``)."""
    out = set(REACH["env"])
    for p in points:
        out |= REACH.get(p, frozenset())
    return frozenset(out)


@dataclass(frozen=True)
class RunFacts:
    """What the training process reported about the run, beyond the knobs: remedies read these to decide.

    ``model_source``: ``"string"`` (TRL loads it, so dtype/4-bit can be injected), ``"from_pretrained"`` (the
    script loaded it), ``"instance"`` (built otherwise: no load-time remedy applies), or ``None`` (not known yet).
    """

    world_size: int = 1
    model_source: str | None = None
    user_peft: bool = False  # the script passes a model already wrapped by PEFT (a peft_config alone is not this)
    alloc_conf_locked: str | None = None  # the user's own expandable_segments:False, which oomguard respects
    prompt_tokens_max: int | None = None
    prompt_tokens_p95: int | None = None
    dataset_rows: int | None = None
    model_config: dict[str, Any] | None = None
    launcher: str | None = None
    checkpoints: bool | None = None
    fsdp: bool = False  # the run uses FSDP (GRPOConfig.fsdp)
    deepspeed: str | None = None  # where the run's DeepSpeed config comes from: "GRPOConfig", "accelerate", or None
    missing_packages: tuple[str, ...] = ()  # optional packages the training process cannot import (peft, ...)
    # The installed TRL, as the training process found it (oomguard.child.trlcompat): its version, its LM head
    # ("fused" from TRL 1.15, "logits" before: what the memory model counts), and the knobs it has no way to take.
    trl_version: str | None = None
    trl_head: str | None = None
    trl_lacks: tuple[str, ...] = ()
    # Measured on the loaded weights at the run's learning rate (oomguard.child.precision): the share of the weights
    # that one AdamW step moves when they are stored in bfloat16 without a float32 master copy (None: not measured).
    bf16_moving: float | None = None
    bf16_supported: bool | None = None  # the device computes in bfloat16 (None: not known; CPUs do)
    device_total: int | None = None  # the device's size as the training process sees it (torch.cuda.mem_get_info)
    # vLLM beside the trainer, as the training process found it before vLLM started (child/stacks/vllm.py): whether
    # its platform has sleep mode, and which platform it is ("cuda", "cpu": the CPU build has no bitsandbytes)
    vllm_sleep: bool | None = None
    vllm_platform: str | None = None
    # the least vllm_gpu_memory_utilization with which vLLM starts on this device (its engine, the activations of its
    # profile run and one of the run's sequences), as the memory model judges it (Guide.vllm_floor); None: not known
    vllm_min_utilization: float | None = None
    stack: str | None = None  # the front-end around TRL the run trains with ("swift", "unsloth"), None: TRL itself
    # what of the stack's memory no measurement covers (Unsloth's generated trainer): judged like an untested TRL
    stack_untested: str | None = None
    # the script's own loader takes load_in_4bit and prepares the model for the LoRA it adds after (Unsloth's
    # FastLanguageModel): a 4-bit load reaches a script that passes its own PEFT model
    load_takes_4bit: bool = False
    # the training process computes on a CUDA device with Triton importable: GPU kernels such as Liger's can run
    # (None: not known; False on the CPU and on the simulated device)
    gpu_kernels: bool | None = None

    def __post_init__(self) -> None:
        for name in ("missing_packages", "trl_lacks"):
            if not isinstance(getattr(self, name), tuple):  # JSON gives a list
                object.__setattr__(self, name, tuple(getattr(self, name) or ()))

    def replace(self, **changes: Any) -> RunFacts:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RunFacts:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(d or {}).items() if k in known})
