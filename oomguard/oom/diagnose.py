"""Work out why memory ran out: the kind of OOM from the figures, the phase from the traceback, and evidence.

The kinds call for different remedies. Fragmentation is fixed by the allocator's settings, and shrinking the model
would be wasted on it. A neighbour holding the GPU is not fixed by anything oomguard changes in this process. A
request larger than the whole device points at a shape, not a budget.

>>> from oomguard.oom.parse import parse_oom
>>> d = diagnose(parse_oom("CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total capacity of 15.73 GiB "
...     "of which 1.28 GiB is free. Including non-PyTorch memory, this process has 14.43 GiB memory in use. Of the "
...     "allocated memory 11.82 GiB is allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but unallocated."))
>>> d.kind
'fragmentation'
>>> d.evidence[0]
'2.41 GiB was reserved by PyTorch but unallocated, more than the 1.90 GiB requested: the memory is there but split into pieces too small for one block.'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from ..vocab.diagnosis import OVERFLOW_FACTOR, Diagnosis
from ..vocab.oomreport import Frame, OOMReport
from ..vocab.sizes import MiB, format_size
from .phase import PHASE_WORDS, VLLM_STARTUP, phase_from_frames, vllm_startup_frame

# Requests at or below this are the allocator's rounded small blocks (2 MiB, 20 MiB): memory died of a thousand
# cuts, not of one big tensor.
SMALL_REQUEST = 20 * MiB
_OVERFLOWED = 2**50  # a petabyte: no device holds it, whatever the message says about capacity
# Fragmentation is the verdict only when live tensors plus the request leave at least this share of the memory the
# process may use (its allowance, or the device less other processes) free. Closer to the limit, a defragmented cache
# would get this one request through and the next allocation of the step would fail: the process is short of memory.
FRAGMENTATION_HEADROOM = 0.10

# phase_from_frames and vllm_startup_frame live in oom/phase.py; they are named here too for the callers that import
# them with diagnose.
__all__ = ["FRAGMENTATION_HEADROOM", "SMALL_REQUEST", "diagnose", "phase_from_frames", "vllm_startup_frame"]

SMALLER_SHAPES = ": only smaller shapes (shorter sequences, fewer rows per step) can make it fit."
SMALLER_LOAD = ": only loading the weights smaller (4-bit, or 16-bit instead of float32) can make it fit."


def diagnose(report: OOMReport, frames: Iterable[Frame] = (), *, phase: str | None = None,
             buffers: Mapping[str, int] | None = None) -> Diagnosis:
    """Classify an OOM and explain it with the figures it gives.

    ``phase`` overrides the phase read from ``frames`` (the training process knows it better at times).
    ``buffers`` names the framework buffers the run allocates in one piece (``{description: bytes}``, from
    ``vocab.distributed.deepspeed_buckets``): a request of one's size is that buffer, whose size a config decides.

    >>> d = diagnose(OOMReport("cuda", "allocator", "x", requested=2_000_000_000, capacity=1 << 30, free=1 << 29),
    ...              buffers={"DeepSpeed's gradient reduce bucket": 2_000_000_000})
    >>> d.kind, d.buffer
    ('impossible', "DeepSpeed's gradient reduce bucket")
    """
    frames = tuple(frames)
    found_phase, frame = phase_from_frames(frames)
    if phase is None or phase == "unknown":
        phase = found_phase
    else:
        frame = None
    kind, evidence, report = _classify(report)
    started = vllm_startup_frame(frames) if kind not in ("host-ram", "vllm-reservation", "impossible") else None
    if started is not None:  # vLLM's reservation, taken beside what the trainer already holds
        kind, report = "vllm-reservation", replace(report, origin="vllm-startup")
        evidence = [_vllm_startup_sentence(report, VLLM_STARTUP[started.name]), *evidence[1:]]
        phase, frame = "load", started
    buffer = _framework_buffer(report, frames, buffers or {}) if kind not in ("host-ram", "vllm-reservation") \
        else None
    if buffer is not None:
        if kind == "impossible" and evidence and evidence[0].endswith(SMALLER_SHAPES):
            evidence.pop(0)
        evidence.insert(0, _buffer_sentence(report, buffer, kind == "impossible"))
    elif kind == "impossible" and phase == "load" and evidence and evidence[0].endswith(SMALLER_SHAPES):
        evidence[0] = evidence[0][: -len(SMALLER_SHAPES)] + SMALLER_LOAD  # a weight tensor: only its size can change
    if phase != "unknown":
        where = f" in `{frame.name}` ({_short(frame.filename)}:{frame.line})" if frame else ""
        evidence.append(f"It happened during {PHASE_WORDS[phase]}{where}.")
    return Diagnosis(kind=kind, phase=phase, evidence=tuple(evidence), report=report, frame=frame, buffer=buffer)


# DeepSpeed's default reduce bucket (500,000,000 elements) in 32- and 16-bit gradients, and the function of
# deepspeed/runtime/zero/stage_1_and_2.py that allocates the bucket at a backward's first gradient.
_DS_DEFAULT_BUCKETS = {"in float32": 2_000_000_000, "in 16-bit": 1_000_000_000}
_DS_BUCKET_FRAMES = {"setup_buckets"}
_MATCH = 0.005  # a message prints sizes to 2 decimals ("1.86 GiB"): within half a percent is the same request


def _framework_buffer(r: OOMReport, frames: Sequence[Frame], buffers: Mapping[str, int]) -> str | None:
    """Which framework buffer the failing request is: one of ``buffers`` by its size, else DeepSpeed's reduce bucket
    by the frame that allocates it, or by its default size in a traceback through DeepSpeed."""
    req = r.requested
    if req:
        for name, size in buffers.items():
            if size and abs(req - size) <= _MATCH * size:
                return name
    in_deepspeed = [f for f in frames if "deepspeed" in f.filename.replace("\\", "/").lower()]
    if any(f.name in _DS_BUCKET_FRAMES for f in in_deepspeed):
        return "DeepSpeed's gradient reduce bucket (reduce_bucket_size)"
    if req and in_deepspeed:
        for how, size in _DS_DEFAULT_BUCKETS.items():
            if abs(req - size) <= _MATCH * size:
                return (f"DeepSpeed's gradient reduce bucket (reduce_bucket_size: 500,000,000 elements, DeepSpeed's "
                        f"default where the config leaves it out, {how})")
    return None


def _buffer_sentence(r: OOMReport, buffer: str, whole: bool) -> str:
    size = f"The request of {_f(r.requested)}" if r.requested else "The failing request"
    size += " (more than the whole device)" if whole else ""
    return (f"{size} is {buffer}, allocated on every rank whatever the model's size: its size comes from the "
            "DeepSpeed config, not from the step's shapes, so shorter sequences or fewer rows do not change it. Size "
            "it to the model: \"reduce_bucket_size\": \"auto\" in the DeepSpeed config (transformers fills in "
            "hidden_size²), or a number of elements.")


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _f(n: int | None) -> str:
    return format_size(n)


def _classify(r: OOMReport) -> tuple[str, list[str], OOMReport]:
    """The kind, the evidence, and the report as diagnosed (this process told apart from its neighbours)."""
    ev: list[str] = []
    if r.backend == "host" or r.origin == "cpu-allocator":
        return "host-ram", _host_evidence(r), r
    if r.backend == "vllm":
        return "vllm-reservation", _vllm_evidence(r), r

    r = _self_among_others(r, ev)
    limit = r.allowed if r.allowed is not None else r.capacity
    req = r.requested
    ru = r.reserved_unallocated
    alloc = r.allocated
    others = r.others_total
    non_torch = None
    if r.process is not None and alloc is not None:
        non_torch = max(0, r.process - alloc - (ru or 0))
    # The device still had room for the request, so the process's own allowance refused it, not the device.
    own_cap = (r.allowed is not None and (r.capacity is None or r.allowed < r.capacity) and req is not None
               and r.free is not None and r.free >= req)
    usable = _usable(r, others, non_torch)

    # The standing facts first, then the verdict.
    if r.capacity is not None:
        dev = f"{r.backend.upper()} device {r.device}" if r.device is not None else f"the {r.backend.upper()} device"
        free = f", {_f(r.free)} free" if r.free is not None else ""
        allowed = (f" (this process may use only {_allowance(r)}: a per-process allowance, set with "
                   "torch.cuda.set_per_process_memory_fraction or oomguard's --gpu-memory)"
                   if r.allowed is not None and r.allowed < r.capacity else "")
        ev.append(f"{dev[0].upper()}{dev[1:]} has {_f(r.capacity)} in total{free}{allowed}.")
    if r.process is not None:
        live = f", of which {_f(alloc)} are live PyTorch tensors" if alloc is not None else ""
        ev.append(f"This process holds {_f(r.process)}{live}.")
    elif alloc is not None:
        ev.append(f"PyTorch had {_f(alloc)} allocated in live tensors.")

    if req is not None and (req >= _OVERFLOWED or (limit and req > limit)):
        if r.allowed is not None and r.capacity is not None and r.allowed < r.capacity:
            what = f"this process's allowed share ({_allowance(r)} of {_f(r.capacity)}, set by a memory fraction)"
        elif limit:
            what = f"the whole device ({_f(limit)})"
        else:
            what = "any device"
        overflowed = req >= _OVERFLOWED or (limit and req > OVERFLOW_FACTOR * limit)
        verdict = (f"The single request of {_f(req)} is larger than {what}"
                   + (": that is an overflowed shape, not a memory budget." if overflowed else SMALLER_SHAPES))
        return "impossible", [verdict, *ev], r

    not_fragmentation = None
    if req is not None and ru is not None and req > 0 and ru >= req:
        pieces = (f"{_f(ru)} was reserved by PyTorch but unallocated, more than the {_f(req)} requested")
        if alloc is None or usable is None:
            ev.insert(0, pieces + ": the memory is there but split into pieces too small for one block.")
            if others:
                ev.append(_others_sentence(r))
            return "fragmentation", ev, r
        need = alloc + req
        headroom = usable - need
        room, of_room = _room_words(r, usable)
        rule = (f"oomguard calls it fragmentation only when live tensors plus the request leave at least "
                f"{FRAGMENTATION_HEADROOM:.0%} of the {room} free")
        share = headroom / usable if usable else -1.0
        if usable and headroom >= FRAGMENTATION_HEADROOM * usable:
            ev.insert(0, pieces + ": the memory is there but split into pieces too small for one block.")
            ev.insert(1, f"Live tensors ({_f(alloc)}) plus the request need {_f(need)} of {of_room}, "
                         f"leaving {_f(headroom)} ({share:.0%}); {rule}, and they do.")
            if others:
                ev.append(_others_sentence(r))
            return "fragmentation", ev, r
        left = (f"leaving only {_f(headroom)} ({share:.1%})" if headroom >= 0
                else f"{_f(-headroom)} more than it holds")
        not_fragmentation = (f"{pieces}, yet this is not fragmentation: live tensors ({_f(alloc)}) plus the request "
                             f"need {_f(need)} of {of_room}, {left}; {rule}. Defragmenting would not "
                             "make the step fit.")
    device_full = r.free is None or req is None or r.free < req
    share_of = r.capacity or limit
    if (others and share_of and device_full
            and (others >= 0.25 * share_of or (req is not None and others >= req))):
        ev.insert(0, _others_sentence(r) + " That memory belongs to another job, a vLLM server or other ranks of this "
                     "run, and nothing changed in this process frees it.")
        return "neighbour", _noted(ev, not_fragmentation), r
    if (non_torch is not None and limit and not own_cap and non_torch >= 0.25 * limit
            and (req is None or non_torch >= req)):
        where = ("Metal allocations outside PyTorch's MPS allocator" if r.backend == "mps"
                 else "a colocated vLLM engine, NCCL buffers, the CUDA context")
        ev.insert(0, f"{_f(non_torch)} of this process's memory is outside PyTorch's allocator ({where}).")
        return "non-pytorch", _noted(ev, not_fragmentation), r
    if r.origin in ("runtime", "driver", "library", "nccl", "level-zero"):
        what = {"runtime": "the CUDA/HIP runtime", "driver": "the CUDA driver", "library": "a math library (cuBLAS, cuDNN, ...)",
                "nccl": "NCCL while allocating communication buffers", "level-zero": "the Level Zero runtime"}[r.origin]
        size = f" ({_f(req)} requested)" if req is not None else ""
        ev.insert(0, f"Memory ran out in {what}{size}, outside PyTorch's caching allocator: the device was already "
                     "full, and a CUDA context that failed this way may be unusable until the process restarts.")
        return "driver", ev, r
    if req is None:
        if r.origin == "async-allocator":
            ev.insert(0, "PyTorch's cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) refused "
                         "an allocation. This build cuts its message short after \"Allocation on device\" (the device "
                         "index is printed as a raw byte), so it gives no figures: run once without "
                         "backend:cudaMallocAsync to see them.")
        else:
            ev.insert(0, "The message gives no figures to work with.")
        return "unknown", ev, r
    cap_sentence = (_own_cap_sentence(r, req, None if not_fragmentation or r.allowed_min is not None else alloc)
                    if own_cap else None)
    if r.origin == "async-allocator" and r.capacity is not None and alloc is not None and r.free is not None:
        hidden = max(0, r.capacity - alloc - r.free)
        ev.append(f"The cudaMallocAsync backend does not report what its pool caches: {_f(hidden)} of the device is "
                  "neither live tensors nor free (kept in CUDA's memory pool, or held by other processes). PyTorch's "
                  "native allocator (drop backend:cudaMallocAsync) reports its cache and can release it.")
    if req <= SMALL_REQUEST:
        ev.insert(0, f"The failing request was only {_f(req)}, one of the allocator's small blocks: memory filled up "
                     "with many allocations rather than one large tensor, so the long-lived state is what to shrink.")
        if cap_sentence:
            ev.insert(1, cap_sentence)
        return "small-allocations", _noted(ev, not_fragmentation), r
    if cap_sentence:
        ev.insert(0, cap_sentence)
    elif r.free is not None and r.free >= req:
        cap = (f"this process's allowed share of {_f(r.allowed)} (a memory fraction)" if r.allowed is not None
               else "what the allocator could use")
        ev.insert(0, f"The device still had {_f(r.free)} free, but the request of {_f(req)} did not fit in {cap}.")
    elif r.free is not None:
        ev.insert(0, f"The request of {_f(req)} did not fit in the {_f(r.free)} free; {_f(req - r.free)} more would "
                     "have been needed.")
    else:
        ev.insert(0, f"The request of {_f(req)} did not fit.")
    if not_fragmentation:
        ev.append(not_fragmentation)
    elif ru:
        ev.append(f"Only {_f(ru)} was reserved but unallocated, so fragmentation is not the cause.")
    return "shortfall", ev, r


def _noted(ev: list[str], note: str | None) -> list[str]:
    if note:
        ev.append(note)
    return ev


def _usable(r: OOMReport, others: int, non_torch: int | None) -> int | None:
    """The memory this process's tensors could occupy: the allowance where the process has one (it bounds what the
    allocator reserves; the CUDA context and other processes do not count against it), else the device less what
    other processes and this process's non-PyTorch memory hold. MPS counts its other Metal allocations against the
    limit too."""
    on_device = None
    if r.capacity is not None:
        on_device = max(0, r.capacity - others - (non_torch or 0))
    if r.allowed is None:
        return on_device
    # An inferred allowance is known only as a range: take its low end, so that fragmentation is never claimed on
    # room that may not exist.
    allowed = r.allowed if r.allowed_min is None else r.allowed_min
    if r.backend == "mps":
        allowed -= non_torch or 0
    return max(0, allowed if on_device is None else min(allowed, on_device))


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


def _own_cap_sentence(r: OOMReport, req: int, alloc: int | None) -> str:
    assert r.allowed is not None and r.free is not None
    s = (f"This process hit its own allowance of {_allowance(r)}, not the device's limit: the device still had "
         f"{_f(r.free)} free, more than the {_f(req)} requested.")
    if alloc is not None:
        need = alloc + req
        if need > r.allowed:
            s += (f" Live tensors ({_f(alloc)}) plus the request need {_f(need)}, {_f(need - r.allowed)} more than the "
                  "allowance.")
        else:
            s += (f" Live tensors ({_f(alloc)}) plus the request need {_f(need)}, leaving {_f(r.allowed - need)} of "
                  "it.")
    return s + " Give the process a larger allowance (--gpu-memory) or make the run smaller."


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
    if r.origin == "ray" and r.workers_killed is not None:  # the raylet's summary (oom/parse/cluster.py)
        node = f" on node {r.node}" if r.node else ""
        return [f"Ray's raylet reports {r.workers_killed} worker(s) (tasks or actors) killed by its memory monitor"
                f"{node}: the node's RAM, not the GPU, ran out. Ray retries such tasks; fewer workers per node or less "
                "host memory per worker is the fix (RAY_memory_usage_threshold only moves the line)."]
    if r.origin == "ray":
        who = f"the task (pid {r.pid}" + (f", using {_f(r.process)})" if r.process else ")") if r.pid else "a task"
        if r.capacity is not None and r.free is not None:
            used = r.capacity - r.free
            limit = (f", past its kill threshold of {r.allowed / r.capacity:.0%} ({_f(r.allowed)})"
                     if r.allowed and r.capacity else "")
            node = f" because the node's RAM use reached {_f(used)} of {_f(r.capacity)}{limit}"
        else:
            node = " because the node ran low on RAM"
        return [f"Ray's memory monitor killed {who}{node}: the host ran out of RAM, not the GPU. Ray retries such "
                "tasks; fewer workers per node or less host memory per worker is the fix (RAY_memory_usage_threshold "
                "only moves the line)."]
    if r.origin == "cpu-allocator":
        req = f" of {_f(r.requested)}" if r.requested is not None else ""
        return [f"PyTorch's CPU allocator could not get a block{req}: the host ran out of RAM (or hit a ulimit)."]
    req = f" ({_f(r.requested)} requested)" if r.requested is not None else ""
    return [f"Python raised MemoryError{req}: the host ran out of RAM."]


def _vllm_startup_sentence(r: OOMReport, what: str) -> str:
    asked = f" asked for {_f(r.requested)}" if r.requested is not None else " ran out"
    free = f" with {_f(r.free)} of {_f(r.capacity)} free" if r.free is not None and r.capacity else ""
    return (f"vLLM ran out of memory starting up: {what}{asked}{free}, beside what the trainer already holds. Its "
            "reservation (vllm_gpu_memory_utilization × the device) does not fit with training: a smaller one leaves "
            "both room.")


def _vllm_evidence(r: OOMReport) -> list[str]:
    if r.origin == "vllm-startup" and r.free is not None and r.requested is not None:
        return [f"vLLM wanted {_f(r.requested)} at start-up (gpu_memory_utilization × total) but only {_f(r.free)} of "
                f"{_f(r.capacity)} was free: the training side already holds the rest."]
    if r.origin == "vllm-kv" and r.max_seq_len is not None and r.kv_cache_tokens is not None and r.requested is None:
        return [f"vLLM refused to start: its KV cache holds {r.kv_cache_tokens:,} tokens, fewer than the model's max seq "
                f"len of {r.max_seq_len:,}, so one full-length sequence does not fit. Raise "
                f"vllm_gpu_memory_utilization or set vllm_max_model_length to at most {r.kv_cache_tokens:,}."]
    if r.origin == "vllm-kv":
        need = f" ({_f(r.requested)} needed, {_f(r.free)} available)" if r.requested is not None else ""
        return [f"vLLM has no room for the KV cache of one full-length sequence{need}: raise "
                "vllm_gpu_memory_utilization or lower vllm_max_model_length."]
    if r.origin == "vllm-cumem":
        return ["vLLM's memory pool could not wake up (cumem allocator): training left too little free memory for "
                "its weights and KV cache."]
    return ["vLLM ran out of memory while starting up or reserving its KV cache."]
