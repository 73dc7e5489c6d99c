"""The phase an OOM happened in, read from its traceback frames, and vLLM's own start-up told apart.

TRL 1.16's names (research/trl-grpo-memory.md §3) and the generic PyTorch and transformers ones. The rules are tried
in order of specificity: an evaluation frame outranks everything (GRPO generates, scores and computes its loss inside
``prediction_step``), then a checkpoint save, the optimizer, backward, generation (which also runs model forwards),
scoring, the training forward and model loading.

>>> phase_from_frames([Frame("trl/trainer/grpo_trainer.py", 2400, "_generate_and_score_completions"),
...                    Frame("trl/trainer/grpo_trainer.py", 1873, "_generate_single_turn"),
...                    Frame("transformers/models/qwen2/modeling_qwen2.py", 50, "forward")])[0]
'generation'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..vocab.oomreport import Frame

_OPTIMIZER_NAMES = {
    "_multi_tensor_adamw", "_single_tensor_adamw", "_fused_adamw", "_fused_adam", "_multi_tensor_adam",
    "_single_tensor_adam", "adamw", "adam", "_init_group", "optimizer_step", "init_state", "_init_state",
}
_BACKWARD_NAMES = {"_engine_run_backward", "run_backward", "_backward"}
_GENERATION_NAMES = {
    "_generate_single_turn", "_generate", "generate", "generate_batch", "_sample", "_beam_search",
    "_assisted_decoding", "sync_weights", "wake_up", "load_weights", "_generate_with_continuous_batching",
    "generate_batch_outputs", "_prefill",
}
_SCORING_NAMES = {"_calculate_rewards", "_generate_and_score_completions", "_compute_ref_per_token_logps"}
# Log-prob helpers run in scoring too; the scoring rule (checked first) claims them under
# _generate_and_score_completions.
_FORWARD_NAMES = {"_compute_loss", "compute_loss", "_fused_forward", "training_step", "compute_liger_loss",
                  "_get_per_token_logps_and_entropies", "_get_per_token_logps", "selective_log_softmax"}
_LOAD_NAMES = {
    "from_pretrained", "_load_pretrained_model", "create_model_from_path", "get_peft_model", "load_state_dict",
    "_move_model_to_device", "dispatch_model", "prepare_model_for_kbit_training", "_load_state_dict_into_meta_model",
    "load_shard_file", "_materialize_copy", "convert_and_load_state_dict_in_model",
}


def _path(f: Frame) -> str:
    return f.filename.replace("\\", "/")


def _is_optimizer(f: Frame) -> bool:
    if f.name in _OPTIMIZER_NAMES:
        return True
    path = _path(f)
    return f.name in ("step", "_step", "update_step") and (
        "/torch/optim/" in path or "/bitsandbytes/optim" in path or path.endswith("accelerate/optimizer.py")
    )


def _is_backward(f: Frame) -> bool:
    if f.name in _BACKWARD_NAMES:
        return True
    path = _path(f)
    return f.name == "backward" and (
        "/torch/" in path or "accelerate/" in path or "/trl/" in path or "deepspeed" in path
    )


# transformers' Trainer evaluates through these; GRPO generates, scores and computes its loss inside prediction_step,
# so an evaluation frame outranks every other: what ran out is the evaluation pass, whatever it was doing.
_EVALUATION_NAMES = {"evaluation_loop", "prediction_step", "prediction_loop"}


def _is_evaluation(f: Frame) -> bool:
    if f.name in _EVALUATION_NAMES:
        return True
    path = _path(f)
    return f.name in ("evaluate", "_evaluate") and ("transformers/" in path or "/trl/" in path)


# Trainer's checkpoint save: the state dicts gathered and serialised (ZeRO-3 gathers 16-bit weights for it).
_SAVE_NAMES = {"_save_checkpoint", "save_model", "_save_optimizer_and_scheduler", "_save_rng_state"}

_RULES: tuple[tuple[str, Callable[[Frame], bool]], ...] = (
    ("evaluation", _is_evaluation),
    ("save", lambda f: f.name in _SAVE_NAMES),
    ("optimizer", _is_optimizer),
    ("backward", _is_backward),
    ("generation", lambda f: f.name in _GENERATION_NAMES),
    ("scoring", lambda f: f.name in _SCORING_NAMES),
    ("forward", lambda f: f.name in _FORWARD_NAMES),
    ("load", lambda f: f.name in _LOAD_NAMES),
    # Last resorts for plain PyTorch loops: a backward() call or a module's forward.
    ("backward", lambda f: f.name == "backward"),
    ("forward", lambda f: f.name in ("forward", "_call_impl", "_wrapped_call_impl")),
)

# Each phase in a sentence ("It happened during ...").
PHASE_WORDS = {
    "load": "model loading",
    "evaluation": "an evaluation pass (its generation, scoring and no-grad loss, with per_device_eval_batch_size rows)",
    "generation": "generation",
    "scoring": "scoring (rewards or no-grad log-probs)",
    "forward": "the training forward pass",
    "backward": "the backward pass",
    "optimizer": "the optimizer step",
    "save": "a checkpoint save",
}


def phase_from_frames(frames: Sequence[Frame]) -> tuple[str, Frame | None]:
    """The phase the traceback was in, and the frame that shows it (``("unknown", None)`` when no rule matches).

    >>> phase_from_frames([Frame("train.py", 9, "main"), Frame("torch/optim/adamw.py", 5, "_multi_tensor_adamw")])
    ('optimizer', Frame(filename='torch/optim/adamw.py', line=5, name='_multi_tensor_adamw'))
    """
    for phase, rule in _RULES:
        for f in reversed(frames):
            if rule(f):
                return phase, f
    return "unknown", None


# vLLM's own start-up, inside TRL's GRPOTrainer.__init__: its weights, the profile run and the sampler's warm-up that
# size its KV cache, and the KV cache itself (vllm/v1/worker/*, vllm 0.x); what each is, for the evidence.
VLLM_STARTUP = {
    "allocate_kv_cache": "its KV cache", "_allocate_kv_cache_tensors": "its KV cache",
    "initialize_kv_cache_tensors": "its KV cache", "initialize_kv_cache": "its KV cache",
    "_dummy_sampler_run": "the sampler's warm-up", "profile_run": "its profile run", "_dummy_run": "its profile run",
    "determine_available_memory": "its profile run", "warming_up_model": "its warm-up",
    "compile_or_warm_up_model": "its warm-up", "load_weights": "its weights", "load_model": "its weights",
}


def vllm_startup_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame of vLLM's own start-up in a traceback (:data:`VLLM_STARTUP` names what it does), or None.

    >>> vllm_startup_frame([Frame("trl/trainer/grpo_trainer.py", 1107, "__init__"),
    ...                     Frame("vllm/v1/worker/utils.py", 596, "allocate_kv_cache")]).name
    'allocate_kv_cache'
    """
    for f in reversed(frames):
        if "vllm/" in _path(f) and f.name in VLLM_STARTUP:
            return f
    return None
