"""The largest value of one knob that fits, at the user's other settings: "how long can my completions be on a 16 GB
card", "how many generations fit on 24 GB" (``oomguard plan --fit KNOB``).

Memory grows with each of these knobs, so the largest fitting value is found by bisection over the values GRPO
accepts at the other settings (``num_generations`` must divide the generation batch, ...), judged by the same judge
as ``oomguard run`` (``Judge.fits``: the model's error kept free).

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> largest(lambda k: k.max_completion_length <= 700, TRL_DEFAULTS, "max_completion_length", upper=4096)
700
>>> largest(lambda k: k.num_generations <= 5, TRL_DEFAULTS, "num_generations")  # those that divide the batch of 8
4
>>> largest(lambda k: False, TRL_DEFAULTS, "num_generations") is None
True
>>> largest(lambda k: k.evaluates() and k.per_device_eval_batch_size <= 30, TRL_DEFAULTS, "per_device_eval_batch_size")
24
"""

from __future__ import annotations

from collections.abc import Callable

from ..vocab.knobs import Knobs

# knob -> (least value, default greatest value searched); memory grows with each
FIT_KNOBS: dict[str, tuple[int, int]] = {
    "max_completion_length": (1, 32768),
    "num_generations": (2, 256),
    "per_device_train_batch_size": (1, 1024),
    "generation_batch_size": (1, 4096),
    "lora_r": (1, 1024),
    "per_device_eval_batch_size": (1, 1024),
}
# the colocated split, answered by ``decide/split.py``: vLLM's share of the card, and its context at a share
SPLIT_KNOBS = ("vllm_gpu_memory_utilization", "vllm_max_model_length")


def _searched(knobs: Knobs, knob: str) -> Knobs:
    """The knobs the search varies ``knob`` in: a generation batch searched by itself (no steps_per_generation), an
    evaluation batch in a run that evaluates (the question presumes it does)."""
    if knob == "generation_batch_size":
        return knobs.replace(steps_per_generation=None)
    if knob == "per_device_eval_batch_size" and not knobs.evaluates():
        return knobs.replace(eval_strategy="steps")
    return knobs


class FitError(ValueError):
    """A knob ``--fit`` cannot search (one line, naming those it can)."""


def check_knob(knob: str, knobs: Knobs | None = None) -> None:
    """Raise :class:`FitError` unless ``knob`` can be searched (with ``knobs``: at these settings; vLLM's share and
    context only where vLLM generates beside the trainer, colocated).

    >>> check_knob("optim")
    Traceback (most recent call last):
    ...
    oomguard.decide.fit.FitError: --fit takes one of max_completion_length, num_generations, per_device_train_batch_size, generation_batch_size, lora_r, per_device_eval_batch_size, vllm_gpu_memory_utilization, vllm_max_model_length, not 'optim'
    """
    if knob not in FIT_KNOBS and knob not in SPLIT_KNOBS:
        raise FitError(f"--fit takes one of {', '.join((*FIT_KNOBS, *SPLIT_KNOBS))}, not {knob!r}")
    if knob in SPLIT_KNOBS and knobs is not None and not (knobs.use_vllm and (knobs.vllm_mode or "colocate")
                                                           == "colocate"):
        said = "vllm_mode=colocate" if knobs.use_vllm else "use_vllm=true vllm_mode=colocate"
        raise FitError(f"--fit {knob} answers vLLM beside the trainer: give {said} (TRL's default mode from 1.0; "
                       f"before it, server); a vLLM server has a card of its own")


def candidates(knobs: Knobs, knob: str, *, world_size: int = 1, upper: int | None = None) -> list[int]:
    """The values of ``knob`` GRPO accepts with the other knobs as they are, in increasing order.

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> candidates(TRL_DEFAULTS.replace(per_device_train_batch_size=6), "num_generations", upper=16)
    [2, 3, 6]
    """
    check_knob(knob)
    lo, hi = FIT_KNOBS[knob]
    hi = upper or hi
    knobs = _searched(knobs, knob)
    if knob in ("max_completion_length", "lora_r"):  # any positive value is accepted where the others are
        return list(range(lo, hi + 1)) if not knobs.replace(**{knob: lo}).validate(world_size) else []
    return [v for v in range(lo, hi + 1) if not knobs.replace(**{knob: v}).validate(world_size)]


def largest(fits: Callable[[Knobs], bool], knobs: Knobs, knob: str, *, world_size: int = 1,
            upper: int | None = None) -> int | None:
    """The largest accepted value of ``knob`` whose config ``fits``, or None when not even the least one does."""
    values = candidates(knobs, knob, world_size=world_size, upper=upper)
    knobs = _searched(knobs, knob)
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(knobs.replace(**{knob: values[mid]})):
            best, lo = values[mid], mid + 1
        else:
            hi = mid - 1
    return best


__all__ = ["FIT_KNOBS", "SPLIT_KNOBS", "FitError", "candidates", "check_knob", "largest"]
