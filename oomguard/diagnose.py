"""Work out why memory ran out: the kind of OOM from the figures, the phase from the traceback, and evidence.

The kinds call for different remedies. Fragmentation is fixed by the allocator's settings, and shrinking the model
would be wasted on it. A neighbour holding the GPU is not fixed by anything oomguard changes in this process. A
request larger than the whole device points at a shape, not a budget.

>>> from oomguard.oom import parse_oom
>>> d = diagnose(parse_oom("CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total capacity of 15.73 GiB "
...     "of which 1.28 GiB is free. Including non-PyTorch memory, this process has 14.43 GiB memory in use. Of the "
...     "allocated memory 11.82 GiB is allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but unallocated."))
>>> d.kind
'fragmentation'
>>> d.evidence[0]
'2.41 GiB was reserved by PyTorch but unallocated, more than the 1.90 GiB requested: the memory is there but split into pieces too small for one block.'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .oom import Frame, OOMReport
from .sizes import MiB, format_size

KINDS = (
    "fragmentation",
    "neighbour",
    "non-pytorch",
    "impossible",
    "shortfall",
    "small-allocations",
    "host-ram",
    "vllm-reservation",
    "driver",
    "unknown",
)
PHASES = ("load", "generation", "scoring", "forward", "backward", "optimizer", "unknown")

# Requests at or below this are the allocator's rounded small blocks (2 MiB, 20 MiB): memory died of a thousand
# cuts, not of one big tensor.
SMALL_REQUEST = 20 * MiB
# A request this many times the device is an overflowed shape, not a budget problem.
OVERFLOW_FACTOR = 64
_OVERFLOWED = 2**50  # a petabyte: no device holds it, whatever the message says about capacity


@dataclass(frozen=True)
class Diagnosis:
    """Why an OOM happened: ``kind``, ``phase`` and evidence sentences with the numbers."""

    kind: str
    phase: str
    evidence: tuple[str, ...]
    report: OOMReport
    frame: Frame | None = None  # the frame that decided the phase

    @property
    def shortfall(self) -> int | None:
        """Bytes the request lacked beyond what was free (``None`` without figures)."""
        r = self.report
        if r.requested is None or r.free is None:
            return None
        return max(0, r.requested - r.free)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "phase": self.phase, "evidence": list(self.evidence)}


# --------------------------------------------------------------------------------------------------------------
# Phase from frames (TRL 1.16 names, research/trl-grpo-memory.md §3, and the generic PyTorch/transformers ones).

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
# Log-prob helpers run in scoring too; the scoring rule (checked first) claims them under _generate_and_score_completions.
_FORWARD_NAMES = {"_compute_loss", "compute_loss", "_fused_forward", "training_step", "compute_liger_loss",
                  "_get_per_token_logps_and_entropies", "_get_per_token_logps", "selective_log_softmax"}
_LOAD_NAMES = {
    "from_pretrained", "_load_pretrained_model", "create_model_from_path", "get_peft_model", "load_state_dict",
    "_move_model_to_device", "dispatch_model", "prepare_model_for_kbit_training", "_load_state_dict_into_meta_model",
    "load_shard_file", "_materialize_copy", "convert_and_load_state_dict_in_model",
}


def _is_optimizer(f: Frame) -> bool:
    path = f.filename.replace("\\", "/")
    if f.name in _OPTIMIZER_NAMES:
        return True
    return f.name in ("step", "_step", "update_step") and (
        "/torch/optim/" in path or "/bitsandbytes/optim" in path or path.endswith("accelerate/optimizer.py")
    )


def _is_backward(f: Frame) -> bool:
    path = f.filename.replace("\\", "/")
    if f.name in _BACKWARD_NAMES:
        return True
    return f.name == "backward" and (
        "/torch/" in path or "accelerate/" in path or "/trl/" in path or "deepspeed" in path
    )


_RULES: tuple[tuple[str, Any], ...] = (
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


def phase_from_frames(frames: Sequence[Frame]) -> tuple[str, Frame | None]:
    """The phase the traceback was in, and the frame that shows it.

    Rules are tried in order of specificity: an optimizer frame beats a backward frame, which beats generation
    (generation also runs model forwards), scoring, training forward and model load.

    >>> phase_from_frames([Frame("trl/trainer/grpo_trainer.py", 2400, "_generate_and_score_completions"),
    ...                    Frame("trl/trainer/grpo_trainer.py", 1873, "_generate_single_turn"),
    ...                    Frame("transformers/models/qwen2/modeling_qwen2.py", 50, "forward")])[0]
    'generation'
    """
    for phase, rule in _RULES:
        for f in reversed(frames):
            if rule(f):
                return phase, f
    return "unknown", None


# --------------------------------------------------------------------------------------------------------------


def diagnose(report: OOMReport, frames: Iterable[Frame] = (), *, phase: str | None = None) -> Diagnosis:
    """Classify an OOM and explain it with the figures it gives.

    ``phase`` overrides the phase read from ``frames`` (the training process knows it better at times).
    """
    frames = tuple(frames)
    found_phase, frame = phase_from_frames(frames)
    if phase is None or phase == "unknown":
        phase = found_phase
    else:
        frame = None
    kind, evidence = _classify(report)
    if phase != "unknown":
        where = f" in `{frame.name}` ({_short(frame.filename)}:{frame.line})" if frame else ""
        evidence.append(f"It happened during {_PHASE_WORDS[phase]}{where}.")
    return Diagnosis(kind=kind, phase=phase, evidence=tuple(evidence), report=report, frame=frame)


_PHASE_WORDS = {
    "load": "model loading",
    "generation": "generation",
    "scoring": "scoring (rewards or no-grad log-probs)",
    "forward": "the training forward pass",
    "backward": "the backward pass",
    "optimizer": "the optimizer step",
}


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _f(n: int | None) -> str:
    return format_size(n)


def _classify(r: OOMReport) -> tuple[str, list[str]]:
    ev: list[str] = []
    if r.backend == "host" or r.origin == "cpu-allocator":
        return "host-ram", _host_evidence(r)
    if r.backend == "vllm":
        return "vllm-reservation", _vllm_evidence(r)

    limit = r.allowed if r.allowed is not None else r.capacity
    req = r.requested
    ru = r.reserved_unallocated
    r = _self_among_others(r, ev)
    others = r.others_total
    non_torch = None
    if r.process is not None and r.allocated is not None:
        non_torch = max(0, r.process - r.allocated - (ru or 0))

    # The standing facts first, then the verdict.
    if r.capacity is not None:
        dev = f"{r.backend.upper()} device {r.device}" if r.device is not None else f"the {r.backend.upper()} device"
        free = f", {_f(r.free)} free" if r.free is not None else ""
        allowed = f" (this process may use {_f(r.allowed)})" if r.allowed is not None and r.allowed != r.capacity else ""
        ev.append(f"{dev[0].upper()}{dev[1:]} has {_f(r.capacity)} in total{free}{allowed}.")
    if r.process is not None:
        live = f", of which {_f(r.allocated)} are live PyTorch tensors" if r.allocated is not None else ""
        ev.append(f"This process holds {_f(r.process)}{live}.")
    elif r.allocated is not None:
        ev.append(f"PyTorch had {_f(r.allocated)} allocated in live tensors.")

    if req is not None and (req >= _OVERFLOWED or (limit and req > limit)):
        if r.allowed is not None and r.capacity is not None and r.allowed < r.capacity:
            what = f"this process's allowed share ({_f(r.allowed)} of {_f(r.capacity)}, set by a memory fraction)"
        elif limit:
            what = f"the whole device ({_f(limit)})"
        else:
            what = "any device"
        overflowed = req >= _OVERFLOWED or (limit and req > OVERFLOW_FACTOR * limit)
        verdict = (f"The single request of {_f(req)} is larger than {what}"
                   + (": that is an overflowed shape, not a memory budget." if overflowed
                      else ": only smaller shapes (shorter sequences, fewer rows per step) can make it fit."))
        return "impossible", [verdict, *ev]
    if req is not None and ru is not None and req > 0 and ru >= req:
        ev.insert(0, f"{_f(ru)} was reserved by PyTorch but unallocated, more than the {_f(req)} requested: the memory "
                     "is there but split into pieces too small for one block.")
        if others:
            ev.append(_others_sentence(r))
        return "fragmentation", ev
    if others and limit and (others >= 0.25 * limit or (req is not None and others >= req)):
        ev.insert(0, _others_sentence(r) + " That memory belongs to another job, a vLLM server or other ranks of this "
                     "run, and nothing changed in this process frees it.")
        return "neighbour", ev
    if non_torch is not None and limit and non_torch >= 0.25 * limit and (req is None or non_torch >= req):
        where = ("Metal allocations outside PyTorch's MPS allocator" if r.backend == "mps"
                 else "a colocated vLLM engine, NCCL buffers, the CUDA context")
        ev.insert(0, f"{_f(non_torch)} of this process's memory is outside PyTorch's allocator ({where}).")
        return "non-pytorch", ev
    if r.origin in ("runtime", "driver", "library", "nccl", "level-zero"):
        what = {"runtime": "the CUDA/HIP runtime", "driver": "the CUDA driver", "library": "a math library (cuBLAS, cuDNN, ...)",
                "nccl": "NCCL while allocating communication buffers", "level-zero": "the Level Zero runtime"}[r.origin]
        ev.insert(0, f"Memory ran out in {what}, outside PyTorch's caching allocator: the device was already full, "
                     "and a CUDA context that failed this way may be unusable until the process restarts.")
        return "driver", ev
    if req is None:
        ev.insert(0, "The message gives no figures to work with.")
        return "unknown", ev
    if req <= SMALL_REQUEST:
        ev.insert(0, f"The failing request was only {_f(req)}, one of the allocator's small blocks: memory filled up "
                     "with many allocations rather than one large tensor, so the long-lived state is what to shrink.")
        return "small-allocations", ev
    if r.free is not None and r.free >= req:
        cap = (f"this process's allowed share of {_f(r.allowed)} (a memory fraction)" if r.allowed is not None
               else "what the allocator could use")
        ev.insert(0, f"The device still had {_f(r.free)} free, but the request of {_f(req)} did not fit in {cap}.")
    elif r.free is not None:
        ev.insert(0, f"The request of {_f(req)} did not fit in the {_f(r.free)} free; {_f(req - r.free)} more would "
                     "have been needed.")
    else:
        ev.insert(0, f"The request of {_f(req)} did not fit.")
    if ru:
        ev.append(f"Only {_f(ru)} was reserved but unallocated, so fragmentation is not the cause.")
    return "shortfall", ev


def _self_among_others(r: OOMReport, ev: list[str]) -> OOMReport:
    """Inside containers NVML cannot match PIDs, so this process shows up as "Process N has X memory in use".

    One listed process, no "this process has" sentence, and at least PyTorch's own reserved memory: that is us.
    """
    if r.process is not None or len(r.other_processes) != 1 or r.allocated is None:
        return r
    only = r.other_processes[0]
    if only.bytes is None or only.bytes < r.allocated + (r.reserved_unallocated or 0):
        return r
    ev.append(f"Process {only.pid} holds at least what PyTorch reserved here, so it is this process (NVML inside a "
              "container cannot match process IDs).")
    return replace(r, process=only.bytes, other_processes=())


def _others_sentence(r: OOMReport) -> str:
    parts = ", ".join(f"pid {p.pid}: {_f(p.bytes)}" for p in r.other_processes[:4])
    more = f" and {len(r.other_processes) - 4} more" if len(r.other_processes) > 4 else ""
    return f"Other processes hold {_f(r.others_total)} of the device ({parts}{more})."


def _host_evidence(r: OOMReport) -> list[str]:
    if r.origin in ("oom-killer", "shell"):
        who = f"process {r.pid}" if r.pid else "the process"
        rss = f" while it held {_f(r.process)} of RAM" if r.process else ""
        return [f"The kernel's OOM killer ended {who}{rss}: the host ran out of RAM, not the GPU."]
    if r.origin == "slurm":
        return ["Slurm's cgroup reported an OOM kill: the job exceeded its host-RAM allocation (--mem)."]
    if r.origin == "cpu-allocator":
        req = f" of {_f(r.requested)}" if r.requested is not None else ""
        return [f"PyTorch's CPU allocator could not get a block{req}: the host ran out of RAM (or hit a ulimit)."]
    req = f" ({_f(r.requested)} requested)" if r.requested is not None else ""
    return [f"Python raised MemoryError{req}: the host ran out of RAM."]


def _vllm_evidence(r: OOMReport) -> list[str]:
    if r.origin == "vllm-startup" and r.free is not None and r.requested is not None:
        return [f"vLLM wanted {_f(r.requested)} at start-up (gpu_memory_utilization × total) but only {_f(r.free)} of "
                f"{_f(r.capacity)} was free: the training side already holds the rest."]
    if r.origin == "vllm-kv":
        need = f" ({_f(r.requested)} needed, {_f(r.free)} available)" if r.requested is not None else ""
        return [f"vLLM has no room for the KV cache of one full-length sequence{need}: raise "
                "vllm_gpu_memory_utilization or lower vllm_max_model_length."]
    if r.origin == "vllm-cumem":
        return ["vLLM's memory pool could not wake up (cumem allocator): training left too little free memory for "
                "its weights and KV cache."]
    return ["vLLM ran out of memory while starting up or reserving its KV cache."]
