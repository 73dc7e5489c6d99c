"""`@oomguard.guard` on a real CUDA OOM: a plain PyTorch training step that runs out of memory under a per-process cap.

The guarded function (style (b): it takes ``knobs`` and reads the batch geometry, the sequence length, checkpointing
and the optimizer from it) builds a stack of MLP blocks (dim 512, depth 8, fp32, AdamW) and trains two optimizer
steps on (batch 32 x 1024 tokens) inputs. Its activations need about 5 GiB, so under the default 4 GiB cap the first
call really runs out of memory on the GPU; guard releases memory, climbs the ``quality-first`` ladder (the micro-batch
split: batch 16 x 2 accumulation steps, same effective batch) and the next call fits (about 2.8 GiB).

The cap: ``guard()`` has no real-GPU cap of its own (its parameters: ladder, knobs, max_attempts, simulate_gpu,
report, isolate, predict, verbose; ``simulate_gpu`` is the CPU rehearsal device). So this script caps the process
itself with ``torch.cuda.set_per_process_memory_fraction(cap / total)`` before the first call, as `oomguard run
--gpu-memory` does in its children, and says so. (Were a ``gpu_memory`` parameter added to guard, the script would
pass the cap through it instead.) guard runs with ``predict=True`` (its default); for a style-(b) function the memory
model does not judge rungs (it knows only GRPO models), so the climb is one rung per OOM.

Printed: each attempt (outcome, batch x accumulation, peak, the live bytes before the call and after guard's release:
``record.memory``; the 2026-11-22 run left 65 MiB of cuBLAS workspaces live after release), the diagnosis of each OOM,
what this process held when each call started (torch's allocated and reserved bytes), and the final diff. Writes
OUT/guard-report.json (guard's RunReport) and OUT/guard-summary.json.

    python3 bench/gpu_guard.py --out $OUT                          # about 30 s on an H100
    python3 bench/gpu_guard.py --out /tmp/g --simulate-gpu 20MiB --dim 64 --depth 4 --batch 32 --seq 64   # CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The installed oomguard (the wheel carried to the GPU machine) wins over the checkout.
if importlib.util.find_spec("oomguard") is None:
    sys.path.append(str(ROOT))

MiB = 1024**2
GiB = 1024**3


# ---------------------------------------------------------------------------------------------------------------
# Pure parts (tests/test_gpu_scripts.py)


def params(dim: int, depth: int) -> int:
    """Parameters of the model: ``depth`` blocks of LayerNorm + Linear(d, 4d) + Linear(4d, d), and a Linear(d, 1) head.

    >>> params(512, 8)
    16806401
    """
    block = 2 * dim + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim)
    return depth * block + dim + 1


def need_bytes(dim: int, depth: int, batch: int, seq: int, checkpointing: bool = False) -> int:
    """A rough peak of one call: fp32 weights, gradients and AdamW state (16 bytes a parameter) plus the saved
    activations of one micro-batch: per token and block, the LayerNorm input and output (d each), the GELU input and
    output (4d each), 10d floats; with checkpointing, only each block's input (d) plus one block's 10d.

    >>> round(need_bytes(512, 8, 32, 1024) / 2**30, 2), round(need_bytes(512, 8, 16, 1024) / 2**30, 2)
    (5.25, 2.75)
    """
    acts_per_token = (depth + 10) * dim if checkpointing else depth * 10 * dim
    return 16 * params(dim, depth) + 4 * batch * seq * acts_per_token


def no_cuda_message(torch_version: str | None) -> str:
    """The one line to stop on when there is no CUDA device.

    >>> no_cuda_message("2.13.0+cpu")
    'gpu_guard: no CUDA device is available (torch 2.13.0+cpu); this benchmark needs an NVIDIA GPU: run it on the device machine (--simulate-gpu SIZE rehearses it on CPU)'
    """
    where = f" (torch {torch_version})" if torch_version else ""
    return (f"gpu_guard: no CUDA device is available{where}; this benchmark needs an NVIDIA GPU: run it on the device "
            "machine (--simulate-gpu SIZE rehearses it on CPU)")


def _mib(n: Any) -> str:
    return f"{n / MiB:.1f} MiB" if isinstance(n, (int, float)) else "?"


def attempt_rows(report: Mapping[str, Any], entry: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """One row per attempt of a guard RunReport: outcome, batch geometry, peak, the live bytes around guard's release,
    the OOM's diagnosis, and (``entry``, measured by the function at its start) what the process held then.

    >>> rep = {"attempts": [{"index": 1, "outcome": "oom", "seconds": 1.5, "peak_bytes": 4 * GiB,
    ...     "knobs": {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 1, "max_completion_length": 1024},
    ...     "memory": {"live_before": 0, "live_after_release": 0}, "climbed": "micro_batch",
    ...     "oom": {"kind": "shortfall", "phase": "forward", "requested_bytes": 64 * MiB}},
    ...     {"index": 2, "outcome": "ok", "seconds": 1.0, "peak_bytes": 3 * GiB, "memory": None,
    ...     "knobs": {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "max_completion_length": 1024}}]}
    >>> [(r["attempt"], r["outcome"], r["batch"], r["after_release"], r["oom"]) for r in attempt_rows(rep)]
    [(1, 'oom', '32 x 1', '0.0 MiB', 'shortfall in forward, 64.0 MiB requested; climbed micro_batch'), (2, 'ok', '16 x 2', '', '')]
    """
    rows = []
    for n, a in enumerate(x for x in report.get("attempts") or [] if isinstance(x, Mapping)):
        k = a.get("knobs") or {}
        mem = a.get("memory") or {}
        oom = a.get("oom") or {}
        e = entry[n] if n < len(entry) else {}
        diag = ""
        if a.get("outcome") == "oom":
            diag = f"{oom.get('kind', '?')}"
            if oom.get("phase") not in (None, "unknown"):
                diag += f" in {oom['phase']}"
            if oom.get("requested_bytes"):
                diag += f", {_mib(oom['requested_bytes'])} requested"
            if a.get("climbed"):
                diag += f"; climbed {a['climbed']}"
        rows.append({
            "attempt": a.get("index", n + 1),
            "outcome": a.get("outcome"),
            "batch": f"{k.get('per_device_train_batch_size')} x {k.get('gradient_accumulation_steps')}",
            "seq": k.get("max_completion_length"),
            "seconds": a.get("seconds"),
            "peak": _mib(a.get("peak_bytes")) if a.get("peak_bytes") is not None else "",
            "live_before": _mib(mem.get("live_before")) if mem else "",
            "after_release": _mib(mem.get("live_after_release")) if mem else "",
            "entry": (f"{_mib(e.get('allocated'))} / {_mib(e.get('reserved'))}" if e else ""),
            "oom": diag,
        })
    return rows


COLUMNS = (("attempt", "attempt"), ("outcome", "outcome"), ("batch x GA", "batch"), ("seq", "seq"),
           ("seconds", "seconds"), ("peak (allocated)", "peak"), ("live before", "live_before"),
           ("live after release", "after_release"), ("at call start: allocated / reserved", "entry"),
           ("OOM", "oom"))


def format_attempts(rows: Sequence[Mapping[str, Any]]) -> str:
    """The attempts as a markdown table.

    >>> print(format_attempts([{"attempt": 1, "outcome": "ok", "batch": "8 x 1", "seq": 64, "seconds": 0.25}]))
    | attempt | outcome | batch x GA | seq | seconds | peak (allocated) | live before | live after release | at call start: allocated / reserved | OOM |
    |---|---|---|---|---|---|---|---|---|---|
    | 1 | ok | 8 x 1 | 64 | 0.2 |  |  |  |  |  |
    """
    def cell(key: str, v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.1f}" if key == "seconds" and isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(k, r.get(k)) for _, k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def format_diff(report: Mapping[str, Any]) -> str:
    """The final diff, ``knob: from -> to (remedy)`` per line.

    >>> print(format_diff({"diff": [{"knob": "per_device_train_batch_size", "from": 32, "to": 16, "remedy": "micro_batch"}]}))
    per_device_train_batch_size: 32 -> 16 (micro_batch)
    """
    rows = [r for r in report.get("diff") or [] if isinstance(r, Mapping)]
    if not rows:
        return "(no change)"
    return "\n".join(f"{r.get('knob')}: {r.get('from')} -> {r.get('to')} ({r.get('remedy')})" for r in rows)


def guard_function() -> Any:
    """``oomguard.guard``, the function (an older oomguard bound the name to a callable submodule of that name)."""
    import oomguard

    fn = oomguard.guard
    return getattr(fn, "guard", fn)


def exhausted_type() -> type[BaseException]:
    """``OOMGuardExhausted``, wherever this oomguard defines it.

    >>> exhausted_type().__name__
    'OOMGuardExhausted'
    """
    return importlib.import_module(guard_function().__module__).OOMGuardExhausted


def guard_takes_gpu_memory() -> bool:
    """Whether ``oomguard.guard`` can cap a real GPU itself (a ``gpu_memory`` parameter); it could not when this
    script was written, so the script caps the process.

    >>> guard_takes_gpu_memory() in (True, False)
    True
    """
    return "gpu_memory" in inspect.signature(guard_function()).parameters


# ---------------------------------------------------------------------------------------------------------------
# The guarded training step


def make_train(torch: Any, device: str, entry: list[dict[str, Any]]) -> Any:
    """The function guard retries: one model, optimizer and ``steps`` optimizer steps per call, all from ``knobs``."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: Any) -> Any:
            return x + self.mlp(self.norm(x))

    class Model(nn.Module):
        def __init__(self, dim: int, depth: int, ckpt: bool) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
            self.head = nn.Linear(dim, 1)
            self.ckpt = ckpt

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
            return self.head(x).squeeze(-1)

    def train(knobs: Any, dim: int, depth: int, steps: int) -> float:
        if device == "cuda":  # what the previous attempt and guard's release left in this process
            entry.append({"allocated": int(torch.cuda.memory_allocated()),
                          "reserved": int(torch.cuda.memory_reserved())})
        torch.manual_seed(0)
        model = Model(dim, depth, bool(knobs.gradient_checkpointing)).to(device)
        if "8bit" in str(knobs.optim):
            import bitsandbytes as bnb

            opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        bs, ga, seq = knobs.per_device_train_batch_size, knobs.gradient_accumulation_steps, knobs.max_completion_length
        total = 0.0
        for _ in range(steps):
            for _ in range(ga):
                x = torch.randn(bs, seq, dim, device=device)
                loss = model(x).pow(2).mean() / ga
                loss.backward()
                total += loss.detach().item()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return total / steps

    return train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-guard-out", help="where guard-report.json and guard-summary.json go ($OUT)")
    p.add_argument("--gpu-memory", default="4GiB", help="the per-process cap on the real GPU (default 4GiB)")
    p.add_argument("--simulate-gpu", metavar="SIZE", help="rehearse on CPU with oomguard's simulated device instead")
    p.add_argument("--ladder", default="quality-first", help="guard's ladder (default quality-first: micro-batch first)")
    p.add_argument("--max-attempts", type=int, default=6)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="per_device_train_batch_size the function starts from")
    p.add_argument("--seq", type=int, default=1024, help="tokens per row (read as max_completion_length)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per call")
    a = p.parse_args(argv)
    from oomguard.vocab.sizes import SizeError, parse_size

    try:
        cap = parse_size(a.simulate_gpu or a.gpu_memory)
    except SizeError as e:
        print(f"gpu_guard: {'--simulate-gpu' if a.simulate_gpu else '--gpu-memory'}: {e}", file=sys.stderr)
        return 2
    import torch

    if not a.simulate_gpu and not torch.cuda.is_available():
        print(no_cuda_message(torch.__version__), file=sys.stderr)
        return 2
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "guard-report.json"
    device = "cpu" if a.simulate_gpu else "cuda"
    kwargs: dict[str, Any] = {}
    how = ""
    if a.simulate_gpu:
        kwargs["simulate_gpu"] = cap
        how = f"oomguard's simulated device, {a.simulate_gpu} (CPU rehearsal)"
    elif guard_takes_gpu_memory():
        kwargs["gpu_memory"] = cap
        how = f"guard(gpu_memory={a.gpu_memory})"
    else:
        total = int(torch.cuda.get_device_properties(0).total_memory)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        how = (f"guard has no real-GPU cap (no gpu_memory parameter), so this script set "
               f"torch.cuda.set_per_process_memory_fraction({cap / total:.4f}) = {a.gpu_memory} of "
               f"{total / GiB:.1f} GiB before the first call")
    if device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    print(f"cap: {how}", flush=True)
    knobs = {"per_device_train_batch_size": a.batch, "gradient_accumulation_steps": 1, "max_completion_length": a.seq,
             "gradient_checkpointing": False, "optim": "adamw_torch"}
    print(f"the function's own need, roughly: {need_bytes(a.dim, a.depth, a.batch, a.seq) / GiB:.2f} GiB at batch "
          f"{a.batch} (cap {cap / GiB:.2f} GiB); {need_bytes(a.dim, a.depth, max(1, a.batch // 2), a.seq) / GiB:.2f} "
          "GiB at half the batch", flush=True)
    entry: list[dict[str, Any]] = []
    guarded = guard_function()(make_train(torch, device, entry), ladder=a.ladder, knobs=knobs,
                               max_attempts=a.max_attempts, report=report_path, predict=True, **kwargs)
    t0 = time.monotonic()
    error = None
    try:
        loss = guarded(dim=a.dim, depth=a.depth, steps=a.steps)
        print(f"returned: mean loss {loss:.4f}", flush=True)
    except exhausted_type() as e:
        error = str(e).splitlines()[0][:300]
        print(f"exhausted: {error}", flush=True)
    wall = time.monotonic() - t0
    report = guarded.report.to_dict() if guarded.report is not None else {}
    after = ({"allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved())}
             if device == "cuda" else None)
    rows = attempt_rows(report, entry)
    print()
    print(format_attempts(rows))
    print(f"\nstatus: {report.get('status')} after {len(rows)} attempt(s), {wall:.1f} s; final diff:")
    print(format_diff(report))
    if after is not None:
        print(f"after the call returned: {_mib(after['allocated'])} allocated, {_mib(after['reserved'])} reserved")
    ooms = [r for r in report.get("attempts") or [] if r.get("outcome") == "oom"]
    for r in ooms:
        msg = (r.get("oom") or {}).get("message")
        if msg:
            print(f"attempt {r['index']} OOM message: {msg[:400]}")
    summary = {"cap": how, "cap_bytes": cap, "device": device, "ladder": a.ladder, "shape": vars(a), "wall": round(wall, 2),
               "status": report.get("status"), "error": error, "rows": rows, "entry": entry, "after": after,
               "report": str(report_path)}
    (out / "guard-summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nwrote {report_path} and {out / 'guard-summary.json'}")
    return 0 if report.get("status") == "stable" else 1


if __name__ == "__main__":
    sys.exit(main())
