"""What generates the completions, as the training process finds it, and the knob of transformers' continuous batching.

GRPOTrainer generates with one of: TRL's default, transformers' padded ``generate``; transformers' continuous
batching (``use_transformers_continuous_batching``, TRL 0.29's ``use_transformers_paged``), whose paged cache takes a
share of the device memory free when generation starts (``transformers_continuous_batching_config``'s
``max_memory_percent``, TRL's default 0.5: the ``cb_max_memory_percent`` knob); vLLM beside the trainer (colocate) or
in a server; Unsloth's own vLLM (``fast_inference``); or the script's ``rollout_func``. The engine is reported as a
fact (``RunFacts.generation_engine``); one the memory model does not model is said, and the model is unsure of the run
(``Runtime.cannot_observe``).

>>> from types import SimpleNamespace
>>> observe(SimpleNamespace(use_transformers_continuous_batching=True,
...                         transformers_continuous_batching_config={"max_memory_percent": 0.3}))
{'use_transformers_continuous_batching': True, 'cb_max_memory_percent': 0.3}
>>> observe(SimpleNamespace(use_transformers_paged=True))   # TRL 0.29
{'use_transformers_continuous_batching': True}
>>> engine_of(SimpleNamespace(use_vllm=True, vllm_mode="server", use_transformers_continuous_batching=False))
'vllm_server'
"""

from __future__ import annotations

import json
from typing import Any

from .runtime import Runtime

CB_CONFIG = "transformers_continuous_batching_config"  # TRL 1.10 on


def _cb_config(cfg: Any) -> dict[str, Any]:
    """``transformers_continuous_batching_config`` as a dict (GRPOConfig takes a dict or its JSON)."""
    raw = getattr(cfg, CB_CONFIG, None)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return dict(raw) if isinstance(raw, dict) else {}


def continuous_batching(cfg: Any) -> bool:
    """Whether the config generates with transformers' continuous batching (either TRL spelling)."""
    return bool(getattr(cfg, "use_transformers_continuous_batching", False)
                or getattr(cfg, "use_transformers_paged", False))


def observe(cfg: Any) -> dict[str, Any]:
    """The script's own engine knobs on a GRPOConfig, before ``__post_init__``."""
    out: dict[str, Any] = {"use_transformers_continuous_batching": continuous_batching(cfg)}
    cb = _cb_config(cfg)
    percent, tokens = cb.get("max_memory_percent"), cb.get("max_batch_tokens")
    if isinstance(percent, (int, float)) and not isinstance(percent, bool):
        out["cb_max_memory_percent"] = float(percent)
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        out["cb_max_batch_tokens"] = tokens
    return out


def apply(rt: Runtime, cfg: Any) -> None:
    """oomguard's ``cb_max_memory_percent`` into the config's ``transformers_continuous_batching_config`` (the rest
    of the user's settings kept)."""
    v = rt.overrides.cb_max_memory_percent
    if v is None or not hasattr(cfg, CB_CONFIG):
        return
    setattr(cfg, CB_CONFIG, {**_cb_config(cfg), "max_memory_percent": float(v)})


def engine_of(cfg: Any, *, rollout_func: Any = None, stack: str | None = None) -> str:
    """The engine a GRPOConfig (and the trainer's ``rollout_func``, the stack around TRL) generates with."""
    if rollout_func is not None:
        return "rollout_func"
    if getattr(cfg, "use_vllm", False):
        if stack == "unsloth":
            return "unsloth_fast_inference"
        return "vllm_server" if getattr(cfg, "vllm_mode", "colocate") == "server" else "vllm_colocate"
    return "continuous_batching" if continuous_batching(cfg) else "generate"


def paged_cache_modelled() -> str | None:
    """None where the memory model's paged cache is the installed transformers' (``PagedAttentionMemoryHandler``'s
    sizing of transformers 5.24: a share of the free memory, less its reservations); else why not."""
    try:
        from transformers.generation.continuous_batching import cache
    except Exception as e:
        return f"transformers' continuous batching cannot be imported ({type(e).__name__})"
    handler = getattr(cache, "PagedAttentionMemoryHandler", None)
    if handler is None or not hasattr(handler, "bytes_per_cache_sector"):
        import transformers

        return (f"transformers {transformers.__version__} sizes its paged cache otherwise than the 5.24 oomguard "
                "models")
    return None


def report(rt: Runtime, cfg: Any, *, rollout_func: Any = None) -> dict[str, Any]:
    """The ``generation_engine`` fact; an engine (or a part of one) the memory model does not model is said."""
    engine = engine_of(cfg, rollout_func=rollout_func)
    if engine == "rollout_func":
        rt.cannot_observe("the generation engine: the script's rollout_func generates, with memory of its own that "
                          "the memory model does not model")
    elif engine == "continuous_batching":
        why = paged_cache_modelled()
        if why is None and not hasattr(cfg, CB_CONFIG):
            why = ("TRL's use_transformers_paged passes no transformers_continuous_batching_config: the paged cache "
                   "takes transformers' own share of the device")
        if why is not None:
            rt.cannot_observe(f"transformers' continuous batching: {why}; its paged cache is not modelled")
        if getattr(cfg, "bf16", False) or getattr(cfg, "fp16", False):
            rt.cannot_observe("transformers' continuous batching with bf16/fp16: TRL casts the trained model to the "
                              "half precision before it generates and leaves it so, which the memory model does not "
                              "model")
    return {"generation_engine": engine}

