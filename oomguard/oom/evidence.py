"""The evidence of a diagnosis: its sentences, each with the numbers, written from the verdict in this one place.

:mod:`oomguard.oom.diagnose` decides (a :class:`~oomguard.vocab.diagnosis.Verdict`: the kind, the phase, the report as
diagnosed and the facts they rest on); this module only writes. No sentence is read back: a decision that needs a fact
finds it in the verdict, and rewording a sentence changes no verdict.

>>> from oomguard.vocab.oomreport import OOMReport
>>> sentences(Verdict("host-ram", OOMReport("host", "python", "MemoryError"), phase="save"))
('Python raised MemoryError: the host ran out of RAM.', 'It happened during a checkpoint save.')
"""

from __future__ import annotations

from ..vocab.diagnosis import FRAGMENTATION_HEADROOM, Facts, Room, Verdict
from ..vocab.oomreport import OOMReport
from ..vocab.sizes import format_size
from .phase import PHASE_WORDS

SMALLER_SHAPES = ": only smaller shapes (shorter sequences, fewer rows per step) can make it fit."
SMALLER_LOAD = ": only loading the weights smaller (4-bit, or 16-bit instead of float32) can make it fit."
ENGINE_SENTENCE = ("It happened in vLLM's own engine process ({process}), not in the trainer: a vLLM server (TRL's "
                   "vllm_mode=\"server\") or an engine started in a process of its own, whose memory the trainer's "
                   "config does not set. Change that engine's gpu_memory_utilization and max_model_len (trl "
                   "vllm-serve --gpu_memory_utilization, --max_model_len; vllm serve --gpu-memory-utilization, "
                   "--max-model-len).")


def sentences(v: Verdict) -> tuple[str, ...]:
    """The evidence of a verdict, each item a sentence with the numbers: the caller's reason first, then the
    verdict's own sentence (or the framework buffer's, or vLLM's start-up), the standing facts and notes, the phase,
    and what the caller saw."""
    r, f = v.report, v.facts
    out = [f"{f.reason}."] if f.reason else []
    late = list(f.late)
    if late and v.kind != f.by_figures:  # the trace decided the kind: its sentence, then the figures alone
        out.append(late.pop(0))
        out += [_host_sentence(r)] if r.backend == "host" else _details(r, f)
    elif f.vllm_startup is not None:
        out += [_vllm_startup_sentence(r, f.vllm_startup), *_details(r, f)]
    elif v.kind == "host-ram":
        out.append(_host_sentence(r))
    elif v.kind == "vllm-reservation":
        out.append(_vllm_sentence(r))
    elif v.buffer is not None:
        whole = v.kind == "impossible"
        out.append(_buffer_sentence(r, v.buffer, whole))
        if not whole or f.overflowed:  # a bucket larger than the device: its size, not the shapes, is what changes
            out.append(_headline(v))
        out += _details(r, f)
    else:
        out += [_headline(v), *_details(r, f)]
    if v.phase != "unknown":
        where = f" in `{v.frame.name}` ({_short(v.frame.filename)}:{v.frame.line})" if v.frame else ""
        out.append(f"It happened during {PHASE_WORDS[v.phase]}{where}.")
    out += (s[:1].upper() + s[1:] + "." for s in f.host_signs)
    if f.engine is not None:
        out.append(ENGINE_SENTENCE.format(process=f.engine))
    if late:  # a long sample at the step that ran out, beside the figures' own verdict (a terminal shows the first few)
        first = 1 + bool(f.reason)
        out[first:first] = late
    return tuple(out)


# The layers outside PyTorch's caching allocator that report an OOM of their own (the origins of the kind "driver"),
# in words.
OUTSIDE_ALLOCATOR = {"runtime": "the CUDA/HIP runtime", "driver": "the CUDA driver",
                     "library": "a math library (cuBLAS, cuDNN, ...)",
                     "nccl": "NCCL while allocating communication buffers", "level-zero": "the Level Zero runtime"}


def _headline(v: Verdict) -> str:
    """The sentence that states the figures' verdict."""
    r, f, req = v.report, v.facts, v.report.requested
    if v.kind == "impossible":
        return _impossible_sentence(r, f.overflowed, load=v.phase == "load")
    if v.kind == "fragmentation":
        return _pieces(r) + ": the memory is there but split into pieces too small for one block."
    if v.kind == "neighbour":
        return (_others_sentence(r) + " That memory belongs to another job, a vLLM server or other ranks of this "
                "run, and nothing changed in this process frees it.")
    if v.kind == "non-pytorch":
        where = ("Metal allocations outside PyTorch's MPS allocator" if r.backend == "mps"
                 else "a colocated vLLM engine, NCCL buffers, the CUDA context")
        return f"{_f(f.outside_torch)} of this process's memory is outside PyTorch's allocator ({where})."
    if v.kind == "driver":
        size = f" ({_f(req)} requested)" if req is not None else ""
        return (f"Memory ran out in {OUTSIDE_ALLOCATOR[r.origin]}{size}, outside PyTorch's caching allocator: the "
                "device was already full, and a CUDA context that failed this way may be unusable until the process "
                "restarts.")
    if v.kind == "unknown":
        if r.origin == "async-allocator":
            return ("PyTorch's cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) refused an "
                    "allocation. This build cuts its message short after \"Allocation on device\" (the device index "
                    "is printed as a raw byte), so it gives no figures: run once without backend:cudaMallocAsync to "
                    "see them.")
        return "The message gives no figures to work with."
    assert req is not None
    if v.kind == "small-allocations":
        held = (f" (the long-lived state held {_f(f.live.state)} of the {_f(f.live.total)} live)"
                if f.live is not None and f.short_of else "")
        return (f"The failing request was only {_f(req)}, one of the allocator's small blocks: memory filled up with "
                f"many allocations rather than one large tensor, so the long-lived state is what to shrink{held}.")
    if f.own_cap:
        return _own_cap_sentence(r, f)
    if r.free is not None and r.free >= req:
        cap = (f"this process's allowed share of {_f(r.allowed)} (a memory fraction)" if r.allowed is not None
               else "what the allocator could use")
        return f"The device still had {_f(r.free)} free, but the request of {_f(req)} did not fit in {cap}."
    if r.free is not None:
        return (f"The request of {_f(req)} did not fit in the {_f(r.free)} free; {_f(req - r.free)} more would have "
                "been needed.")
    return f"The request of {_f(req)} did not fit."


def _details(r: OOMReport, f: Facts) -> list[str]:
    """The sentences after the verdict's own: the standing facts of the device and the process, then the notes."""
    kind = f.by_figures
    out = [_live_sentence(f, r.requested)] if f.live is not None and f.short_of else []
    if kind == "fragmentation" and f.room is not None:
        out.append(_room_sentence(r, f.room, fits=True))
    if kind == "small-allocations" and f.own_cap:
        out.append(_own_cap_sentence(r, f))
    if f.nvml_self is not None:
        out.append(f"Process {f.nvml_self} holds at least what PyTorch reserved here, so it is this process (NVML "
                   "inside a container cannot match process IDs).")
    if r.capacity is not None:
        dev = f"{r.backend.upper()} device {r.device}" if r.device is not None else f"the {r.backend.upper()} device"
        free = f", {_f(r.free)} free" if r.free is not None else ""
        allowed = (f" (this process may use only {_allowance(r)}: a per-process allowance, set with "
                   "torch.cuda.set_per_process_memory_fraction or oomguard's --gpu-memory)"
                   if r.allowed is not None and r.allowed < r.capacity else "")
        out.append(f"{dev[0].upper()}{dev[1:]} has {_f(r.capacity)} in total{free}{allowed}.")
    if r.process is not None:
        live = f", of which {_f(r.allocated)} are live PyTorch tensors" if r.allocated is not None else ""
        out.append(f"This process holds {_f(r.process)}{live}.")
    elif r.allocated is not None:
        out.append(f"PyTorch had {_f(r.allocated)} allocated in live tensors.")
    if kind == "fragmentation" and r.others_total:
        out.append(_others_sentence(r))
    if f.pool_hidden is not None:
        out.append(f"The cudaMallocAsync backend does not report what its pool caches: {_f(f.pool_hidden)} of the "
                   "device is neither live tensors nor free (kept in CUDA's memory pool, or held by other processes). "
                   "PyTorch's native allocator (drop backend:cudaMallocAsync) reports its cache and can release it.")
    if f.not_fragmentation and f.room is not None and kind != "driver":  # a driver's failure is beside the cache
        out.append(_room_sentence(r, f.room, fits=False))
    elif kind == "shortfall" and r.reserved_unallocated:
        out.append(f"Only {_f(r.reserved_unallocated)} was reserved but unallocated, so fragmentation is not the "
                   "cause.")
    return out


# What to shrink where a shortfall is short of each (``Facts.short_of``).
_SHRINK = {"long-lived state": "the long-lived state is what to shrink (LoRA, an 8-bit optimizer, 16-bit weights)",
           "activations": "the step's shapes are what to shrink (rows per micro-batch, sequence length), not the "
                          "long-lived state",
           "generation buffers": "what generation holds at once is what to shrink (rows generated at once, completion "
                                 "length), not the long-lived state"}


def _live_sentence(f: Facts, requested: int | None) -> str:
    """What the step needed at the OOM (what was live, and the failing request), by what holds it, and what that
    makes the thing to shrink.

    >>> from oomguard.vocab.diagnosis import Live
    >>> _live_sentence(Facts(live=Live(3 << 20, 2 << 20, 2 << 20, 300 << 20), short_of="activations"), 16 << 20)
    "Of the 307.00 MiB live at the OOM and the 16.00 MiB requested, the long-lived state held 7.00 MiB (parameters 3.00 MiB, gradients 2.00 MiB, optimizer state 2.00 MiB) and the step's activations and buffers 316.00 MiB: the step's shapes are what to shrink (rows per micro-batch, sequence length), not the long-lived state."
    """
    live = f.live
    assert live is not None and f.short_of is not None
    rest = "generation's buffers and activations" if f.short_of == "generation buffers" else \
        "the step's activations and buffers"
    if live.source == "trace":
        parts = " (what the step before kept, from the memory trace)"
    else:
        parts = (f" (parameters {_f(live.parameters)}, gradients {_f(live.gradients)}, optimizer state "
                 f"{_f(live.optimizer)})")
    asked = f" and the {_f(requested)} requested" if requested else ""
    return (f"Of the {_f(live.total)} live at the OOM{asked}, the long-lived state held {_f(live.state)}{parts} and "
            f"{rest} {_f(live.other + (requested or 0))}: {_SHRINK[f.short_of]}.")


def _impossible_sentence(r: OOMReport, overflowed: bool, *, load: bool) -> str:
    limit = r.allowed if r.allowed is not None else r.capacity
    if r.allowed is not None and r.capacity is not None and r.allowed < r.capacity:
        what = f"this process's allowed share ({_allowance(r)} of {_f(r.capacity)}, set by a memory fraction)"
    elif limit:
        what = f"the whole device ({_f(limit)})"
    else:
        what = "any device"
    if overflowed:
        end = ": that is an overflowed shape, not a memory budget."
    else:  # a weight tensor while loading: only its size can change
        end = SMALLER_LOAD if load else SMALLER_SHAPES
    return f"The single request of {_f(r.requested)} is larger than {what}{end}"


def _pieces(r: OOMReport) -> str:
    return (f"{_f(r.reserved_unallocated)} was reserved by PyTorch but unallocated, more than the {_f(r.requested)} "
            "requested")


def _room_sentence(r: OOMReport, room: Room, *, fits: bool) -> str:
    """The fragmentation test, with its figures: passed (``fits``), or the note that it is not fragmentation."""
    room_noun, of_room = _room_words(r, room.usable)
    rule = (f"oomguard calls it fragmentation only when live tensors plus the request leave at least "
            f"{FRAGMENTATION_HEADROOM:.0%} of the {room_noun} free")
    if fits:
        return (f"Live tensors ({_f(room.live)}) plus the request need {_f(room.need)} of {of_room}, leaving "
                f"{_f(room.left)} ({room.share:.0%}); {rule}, and they do.")
    left = (f"leaving only {_f(room.left)} ({room.share:.1%})" if room.left >= 0
            else f"{_f(-room.left)} more than it holds")
    return (f"{_pieces(r)}, yet this is not fragmentation: live tensors ({_f(room.live)}) plus the request need "
            f"{_f(room.need)} of {of_room}, {left}; {rule}. Defragmenting would not make the step fit.")


def _allowance(r: OOMReport) -> str:
    if r.allowed_min is not None and r.allowed is not None and r.allowed_min < r.allowed:
        return f"at least {_f(r.allowed_min)} and below {_f(r.allowed)} (inferred)"
    return _f(r.allowed)


def _room_words(r: OOMReport, usable: int) -> tuple[str, str]:
    """What ``usable`` is, as a noun and as "the N ..." for the sentences on fragmentation."""
    if r.allowed is not None and usable >= (r.allowed if r.allowed_min is None else r.allowed_min) - 1:
        if r.allowed_min is not None:
            return "allowance", f"the allowance (at least {_f(usable)})"
        return "allowance", f"the {_f(usable)} allowance"
    return "device memory this process could use", f"the {_f(usable)} of device memory this process could use"


def _own_cap_sentence(r: OOMReport, f: Facts) -> str:
    assert r.allowed is not None and r.free is not None and r.requested is not None
    req = r.requested
    s = (f"This process hit its own allowance of {_allowance(r)}, not the device's limit: the device still had "
         f"{_f(r.free)} free, more than the {_f(req)} requested.")
    # Live tensors against the allowance, where the fragmentation test has not already set them against the room
    # (and where the allowance is printed, not inferred as a range).
    if r.allocated is not None and not f.not_fragmentation and r.allowed_min is None:
        need = r.allocated + req
        if need > r.allowed:
            s += (f" Live tensors ({_f(r.allocated)}) plus the request need {_f(need)}, {_f(need - r.allowed)} more "
                  "than the allowance.")
        else:
            s += (f" Live tensors ({_f(r.allocated)}) plus the request need {_f(need)}, leaving "
                  f"{_f(r.allowed - need)} of it.")
    return s + " Give the process a larger allowance (--gpu-memory) or make the run smaller."


def _others_sentence(r: OOMReport) -> str:
    parts = ", ".join(f"pid {p.pid}: {_f(p.bytes)}" for p in r.other_processes[:4])
    more = f" and {len(r.other_processes) - 4} more" if len(r.other_processes) > 4 else ""
    return f"Other processes hold {_f(r.others_total)} of the device ({parts}{more})."


def _buffer_sentence(r: OOMReport, buffer: str, whole: bool) -> str:
    size = f"The request of {_f(r.requested)}" if r.requested else "The failing request"
    size += " (more than the whole device)" if whole else ""
    return (f"{size} is {buffer}, allocated on every rank whatever the model's size: its size comes from the "
            "DeepSpeed config, not from the step's shapes, so shorter sequences or fewer rows do not change it. Size "
            "it to the model: \"reduce_bucket_size\": \"auto\" in the DeepSpeed config (transformers fills in "
            "hidden_size²), or a number of elements.")


def _host_sentence(r: OOMReport) -> str:
    if r.origin in ("oom-killer", "shell"):
        who = f"process {r.pid}" if r.pid else "the process"
        rss = f" while it held {_f(r.process)} of RAM" if r.process else ""
        return f"The kernel's OOM killer ended {who}{rss}: the host ran out of RAM, not the GPU."
    if r.origin == "slurm":
        return "Slurm's cgroup reported an OOM kill: the job exceeded its host-RAM allocation (--mem)."
    if r.origin == "ray" and r.workers_killed is not None:
        node = f" on node {r.node}" if r.node else ""
        return (f"Ray's raylet reports {r.workers_killed} worker(s) (tasks or actors) killed by its memory monitor"
                f"{node}: the node's RAM, not the GPU, ran out. Ray retries such tasks; fewer workers per node or less "
                "host memory per worker is the fix (RAY_memory_usage_threshold only moves the line).")
    if r.origin == "ray":
        who = f"the task (pid {r.pid}" + (f", using {_f(r.process)})" if r.process else ")") if r.pid else "a task"
        if r.capacity is not None and r.free is not None:
            used = r.capacity - r.free
            limit = (f", past its kill threshold of {r.allowed / r.capacity:.0%} ({_f(r.allowed)})"
                     if r.allowed and r.capacity else "")
            node = f" because the node's RAM use reached {_f(used)} of {_f(r.capacity)}{limit}"
        else:
            node = " because the node ran low on RAM"
        return (f"Ray's memory monitor killed {who}{node}: the host ran out of RAM, not the GPU. Ray retries such "
                "tasks; fewer workers per node or less host memory per worker is the fix (RAY_memory_usage_threshold "
                "only moves the line).")
    if r.origin == "cpu-allocator":
        req = f" of {_f(r.requested)}" if r.requested is not None else ""
        return f"PyTorch's CPU allocator could not get a block{req}: the host ran out of RAM (or hit a ulimit)."
    req = f" ({_f(r.requested)} requested)" if r.requested is not None else ""
    return f"Python raised MemoryError{req}: the host ran out of RAM."


def _vllm_startup_sentence(r: OOMReport, what: str) -> str:
    asked = f" asked for {_f(r.requested)}" if r.requested is not None else " ran out"
    free = f" with {_f(r.free)} of {_f(r.capacity)} free" if r.free is not None and r.capacity else ""
    return (f"vLLM ran out of memory starting up: {what}{asked}{free}, beside what the trainer already holds. Its "
            "reservation (vllm_gpu_memory_utilization × the device) does not fit with training: a smaller one leaves "
            "both room.")


def _vllm_sentence(r: OOMReport) -> str:
    if r.origin == "vllm-startup" and r.free is not None and r.requested is not None:
        return (f"vLLM wanted {_f(r.requested)} at start-up (gpu_memory_utilization × total) but only {_f(r.free)} of "
                f"{_f(r.capacity)} was free: the training side already holds the rest.")
    if r.origin == "vllm-kv" and r.max_seq_len is not None and r.kv_cache_tokens is not None and r.requested is None:
        return (f"vLLM refused to start: its KV cache holds {r.kv_cache_tokens:,} tokens, fewer than the model's max "
                f"seq len of {r.max_seq_len:,}, so one full-length sequence does not fit. Raise "
                f"vllm_gpu_memory_utilization or set vllm_max_model_length to at most {r.kv_cache_tokens:,}.")
    if r.origin == "vllm-kv":
        need = f" ({_f(r.requested)} needed, {_f(r.free)} available)" if r.requested is not None else ""
        return (f"vLLM has no room for the KV cache of one full-length sequence{need}: raise "
                "vllm_gpu_memory_utilization or lower vllm_max_model_length.")
    if r.origin == "vllm-cumem":
        return ("vLLM's memory pool could not wake up (cumem allocator): training left too little free memory for its "
                "weights and KV cache.")
    return "vLLM ran out of memory while starting up or reserving its KV cache."


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _f(n: int | None) -> str:
    return format_size(n)
