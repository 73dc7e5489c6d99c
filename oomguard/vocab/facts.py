"""RunFacts: what the training process reported about the run, beyond the knobs (remedies read these to decide)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


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
    # profile run and one of the run's sequences), as the memory model judges it (Judge.vllm_floor); None: not known
    vllm_min_utilization: float | None = None
    stack: str | None = None  # the front-end around TRL the run trains with ("swift", "unsloth"), None: TRL itself
    # what of the stack's memory no measurement covers (Unsloth's generated trainer): judged like an untested TRL
    stack_untested: str | None = None
    # the script's own loader takes load_in_4bit and prepares the model for the LoRA it adds after (Unsloth's
    # FastLanguageModel): a 4-bit load reaches a script that passes its own PEFT model
    load_takes_4bit: bool = False
    # why the script's loader loads no 4-bit weights on this machine (Unsloth's CPU backend where bitsandbytes' CPU
    # 4-bit does not run: it loads 16-bit weights instead), reported when the stack is imported: the 4-bit rung is not
    # offered; None: it can, or nothing says otherwise
    cannot_load_4bit: str | None = None
    # why an 8-bit optimizer never reaches the training here (Unsloth's CPU backend replaces it with torch's AdamW):
    # the 8-bit optimizer rung is not offered; None: it can, or nothing says otherwise
    cannot_optim_8bit: str | None = None
    # the training process computes on a CUDA device with Triton importable: GPU kernels such as Liger's can run
    # (None: not known; False on the CPU and on the simulated device)
    gpu_kernels: bool | None = None

    # a vision-language model's images, read from the training dataset's ``image``/``images`` column as GRPOTrainer
    # reads it: the most images in one prompt (0: none), the largest image's size in pixels before the processor
    # resizes it (None: not known), and whether ``prompt_tokens_max`` counts the image tokens already (measured on the
    # processor's output, so the memory model must not add them again)
    images_per_prompt: int | None = None
    image_height: int | None = None
    image_width: int | None = None
    # with several images per prompt, the heaviest prompt's own images, each ``(height, width)`` (the prompt whose
    # images hold the most pixels together): the memory model counts these, not the most images times the largest
    prompt_image_sizes: tuple[tuple[int, int], ...] = ()
    prompt_tokens_images: bool = False
    # the least ``max_pixels`` the run's image processor takes (Qwen2-VL/2.5-VL: its min_pixels; Gemma 3: one
    # 896x896 image, no pan-and-scan crop); None: its processor has no pixel budget oomguard knows how to set
    pixel_budget_floor: int | None = None
    image_processor: str | None = None  # its class, for messages
    # what the user's own config says beyond the knobs, passed to the memory model: a full fine-tune whose vision
    # tower is frozen (its parameters' requires_grad off, or a PEFT target list that leaves it out), PEFT's
    # ``target_parameters`` (experts adapted as parameters), gpt-oss's experts kept in MXFP4 (loaded without
    # dequantising)
    freeze_vision: bool = False
    lora_target_parameters: tuple[str, ...] = ()
    # the dropout of the user's own LoRA (PEFT's ``lora_dropout``; TRL's ModelConfig and ms-swift default to 0.05,
    # Unsloth to 0): each adapted module keeps its own dropped copy of its input for backward
    lora_dropout: float = 0.0
    keep_mxfp4: bool = False
    # what the run does that the memory model does not count (the keys of memory/estimate/unmodelled.py's
    # NOT_MODELLED: Unsloth's standby, offloaded checkpointing and chunked loss, padding-free batches), reported by a
    # stack's adapter or told `oomguard plan`: said in one line each, and the verdict is never "sure"
    unmodelled: tuple[str, ...] = ()

    # what generates the completions, as the training process found it (child/engine.py): ``generate`` (TRL's default,
    # transformers' padded generate), ``continuous_batching`` (transformers' paged cache), ``vllm_colocate``,
    # ``vllm_server``, ``unsloth_fast_inference`` (Unsloth's own vLLM), ``rollout_func`` (the script's own); None: not
    # known yet
    generation_engine: str | None = None
    # what oomguard could not observe of this run, one line each (a dataset it cannot read, an engine it does not
    # model, tools it cannot render): the memory model is never sure of such a run (a probe first), and each is said
    unobserved: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("missing_packages", "trl_lacks", "lora_target_parameters", "unmodelled", "unobserved"):
            if not isinstance(getattr(self, name), tuple):  # JSON gives a list
                object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        if self.prompt_image_sizes and not all(isinstance(hw, tuple) for hw in self.prompt_image_sizes):
            object.__setattr__(self, "prompt_image_sizes", tuple((int(h), int(w)) for h, w in self.prompt_image_sizes))

    def replace(self, **changes: Any) -> RunFacts:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RunFacts:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(d or {}).items() if k in known})


__all__ = ["RunFacts"]
