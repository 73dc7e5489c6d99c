"""Calibrate oomguard's memory model on a CUDA GPU with real TRL 1.16 GRPO steps.

Random-initialised models with the exact shapes of Llama-3.2-1B and Qwen2.5-0.5B/1.5B/3B (configs written inline,
nothing is downloaded; a word-level tokenizer covers the whole vocabulary so every prompt has exactly P tokens) are
trained for two GRPO steps per configuration, each configuration in a fresh process. Completions are forced to the
worst case with ``generation_kwargs={"min_new_tokens": C}``. A wrapper on ``_generate`` /
``_generate_and_score_completions`` and a TrainerCallback reset the peak statistics at the generation, scoring,
forward/backward and optimizer boundaries and record ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` per phase. The CUDA context (memory outside the caching allocator) is this process's NVML
figure minus ``memory_reserved`` (``context_source: "process"``); where NVML cannot see the process (some
containers) it falls back to device-used minus reserved (``"device"``), which counts every other process too.

The script then fits the uncertain coefficients of ``oomguard.memory.estimate.Coefficients``, each by the smallest
worst-case relative error (ties: the smaller median): ``c_act`` on the allocated peaks, ``f_frag`` /
``f_frag_expandable`` on the reserved peaks, ``k_logits`` only if the chunked LM head ran its torch fallback (no
Triton), and ``m_ctx`` (median) only from ``"process"`` contexts; then prints the table predicted vs measured with
the built-in coefficients and with the fitted ones. The measured table goes to ``--out`` (Markdown when it ends in
``.md``, else CSV); raw results go to ``--out`` + ``.jsonl`` as they arrive, so a cut-short run keeps what it
measured (``--resume``). ``--from-jsonl`` re-fits saved rows without a GPU.

    python bench/gpu_calibrate.py --out gpu-calibration.md             # the full grid (about 25-35 minutes)
    python bench/gpu_calibrate.py --quick --out quick.csv              # 4 configurations
    python bench/gpu_calibrate.py --arch q3b --jobs 4 --timeout 400 --out q3b.md   # the Qwen2.5-3B rows, ~7 min
    python bench/gpu_calibrate.py --only q05-bf16-full --only q3b-qlora32-c1024 --out some.md
    python bench/gpu_calibrate.py --from-jsonl tests/fixtures/h100/calibration.jsonl --out refit.md   # no GPU
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from _phases import build_trainer, instrument_phases, select_grid
from cpu_calibrate import Config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

# The published config.json shapes (rope scaling and other memory-neutral fields left out).
ARCHS: dict[str, dict[str, Any]] = {
    "llama1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                    max_position_embeddings=8192, hidden_act="silu", attention_bias=False, mlp_bias=False),
    "q05": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
                intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=8192,
                hidden_act="silu"),
    "q15": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=1536,
                intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=8192,
                hidden_act="silu"),
    "q3b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=2048,
                intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=8192,
                hidden_act="silu"),
}


@dataclass(frozen=True)
class GPUConfig(Config):
    """A CPU calibration Config with GPU-sized defaults, plus QLoRA and expandable segments."""

    arch: str = "q05"
    P: int = 128
    C: int = 256
    B: int = 8
    G: int = 8
    dtype: str = "bfloat16"  # "float32" is TRL's default when it loads the model (fp32 master + bf16 autocast)
    optim: str = "adamw_torch_fused"
    qlora: bool = False
    expandable: bool = False
    bf16: bool = True  # TRL's default: bf16 autocast (the H100 rows ran with it)

    def knobs(self) -> Any:
        return super().knobs().replace(load_in_4bit=self.qlora, expandable_segments=self.expandable)

    def label(self) -> str:
        kind = f"qlora{self.lora_r}" if self.qlora else f"lora{self.lora_r}" if self.lora_r else "full"
        parts = [self.arch, self.dtype[:4], f"P{self.P}", f"C{self.C}", f"B{self.B}", f"GA{self.GA}",
                 "gc" if self.gc else "nogc", kind, self.optim.replace("adamw_", "")]
        if self.beta:
            parts.append(f"beta{self.beta}")
        if self.expandable:
            parts.append("expandable")
        return " ".join(parts)


B0 = GPUConfig("base")
GRID: list[GPUConfig] = [
    replace(B0, name="q05-bf16-full"),
    replace(B0, name="q05-fp32-full", dtype="float32"),
    replace(B0, name="q05-bf16-full-nogc", gc=False),
    replace(B0, name="q05-bf16-full-c1024", C=1024),
    replace(B0, name="q05-bf16-full-foreach", optim="adamw_torch"),
    replace(B0, name="q05-bf16-full-8bit", optim="adamw_bnb_8bit"),
    replace(B0, name="q05-bf16-full-paged8bit", optim="paged_adamw_8bit"),
    replace(B0, name="q05-bf16-lora16", lora_r=16),
    replace(B0, name="q05-bf16-lora16-nogc", lora_r=16, gc=False),
    replace(B0, name="q05-qlora16", lora_r=16, qlora=True),
    replace(B0, name="q05-bf16-full-b16", B=16, G=16),
    replace(B0, name="q05-bf16-full-ga2", GA=2),
    replace(B0, name="q05-bf16-full-beta", beta=0.04),
    replace(B0, name="q05-bf16-full-expandable", expandable=True),
    replace(B0, name="llama1b-bf16-full", arch="llama1b"),
    replace(B0, name="llama1b-fp32-full-8bit", arch="llama1b", dtype="float32", optim="adamw_bnb_8bit"),
    replace(B0, name="llama1b-bf16-lora16-nogc-c1024", arch="llama1b", lora_r=16, gc=False, C=1024, B=4, G=4),
    replace(B0, name="q15-bf16-full", arch="q15"),
    replace(B0, name="q15-bf16-lora32", arch="q15", lora_r=32),
    replace(B0, name="q15-qlora32-c1024", arch="q15", lora_r=32, qlora=True, C=1024),
    replace(B0, name="q3b-bf16-lora32-c1024", arch="q3b", lora_r=32, C=1024),
    replace(B0, name="q3b-qlora32-c1024", arch="q3b", lora_r=32, qlora=True, C=1024),
    replace(B0, name="q3b-fp32-lora32", arch="q3b", dtype="float32", lora_r=32),
    replace(B0, name="q3b-bf16-full-8bit-expandable", arch="q3b", optim="adamw_bnb_8bit", expandable=True),
]
QUICK = ["q05-bf16-full", "q05-fp32-full", "q05-bf16-lora16", "llama1b-bf16-full"]


# -------------------------------------------------------------------------------------------------------------------
# Subprocess workers: probe, build, train


def probe() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False}
    try:
        import triton  # noqa: F401

        has_triton = True
    except ImportError:
        has_triton = False
    props = torch.cuda.get_device_properties(0)
    return {"cuda": True, "name": props.name, "total": props.total_memory, "triton": has_triton,
            "torch": torch.__version__}


def build(arch: str, path: str) -> None:
    """Random weights of ``ARCHS[arch]`` (initialised on the GPU, saved in bf16) and a word-level tokenizer."""
    from cpu_calibrate import build_model

    build_model(Path(path), ARCHS[arch], dtype="bfloat16", device="cuda")


class CudaPhases:
    """Peak allocated/reserved bytes per phase: reset the peak statistics at every boundary."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.current = "setup"
        self.records: list[dict[str, list[int]]] = [{}]

    def switch(self, phase: str) -> None:
        cuda = self.torch.cuda
        cuda.synchronize()
        rec = self.records[-1].setdefault(self.current, [0, 0])
        rec[0] = max(rec[0], int(cuda.max_memory_allocated()))
        rec[1] = max(rec[1], int(cuda.max_memory_reserved()))
        cuda.reset_peak_memory_stats()
        self.current = phase

    def next_step(self) -> None:
        self.switch(self.current)
        self.records.append({})


def process_bytes() -> int | None:
    """This process's device memory as NVML reports it (what torch's OOM message calls "this process has ... in
    use"), or None where NVML does not list this pid (no NVML, or a container with its own pid namespace)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(vis) if vis.isdigit() else 0)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return None


def context_bytes(torch: Any) -> tuple[int, str]:
    """Device memory this process uses outside torch's caching allocator (CUDA context, cuDNN, NCCL), and where it
    was read: ``"process"`` (NVML, this pid only) or ``"device"`` (device used minus reserved: every other process on
    the GPU counts too, so it is no measure of the context on a shared GPU)."""
    reserved = int(torch.cuda.memory_reserved())
    own = process_bytes()
    if own is not None:
        return own - reserved, "process"
    free, total = torch.cuda.mem_get_info()
    return int(total - free - reserved), "device"


def train(cfg: GPUConfig, model_dir: str, out_dir: str) -> dict[str, Any]:
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    ctx_start, ctx_source = context_bytes(torch)

    kwargs: dict[str, Any] = {}
    if cfg.qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True)
    trainer = build_trainer(cfg, model_dir, ARCHS[cfg.arch]["vocab_size"], out_dir, rows=256,
                            model_init_kwargs={"dtype": "bfloat16" if cfg.qlora else cfg.dtype},
                            trainer_kwargs=kwargs, bf16=cfg.bf16)
    torch.cuda.synchronize()
    resident = int(torch.cuda.memory_allocated())
    phases = CudaPhases(torch)
    phases.switch("setup")
    ctx_samples = [ctx_start]

    def step_end() -> None:
        ctx_samples.append(context_bytes(torch)[0])
        phases.next_step()

    instrument_phases(trainer, phases.switch, step_end)
    t0 = time.time()
    trainer.train()
    phases.switch("end")
    alloc: dict[str, int] = {}
    reserved: dict[str, int] = {}
    for rec in phases.records:
        for k, (a, r) in rec.items():
            if k in ("setup", "end"):
                continue
            alloc[k] = max(alloc.get(k, 0), a)
            reserved[k] = max(reserved.get(k, 0), r)
    from trl.kernels import chunked_logprob

    head_fallback = not chunked_logprob._TRITON_AVAILABLE  # the torch fallback: every position scored
    return {
        "peak_alloc": max(alloc.values()), "peak_reserved": max(reserved.values()), "phases_alloc": alloc,
        "phases_reserved": reserved, "context": int(statistics.median(ctx_samples)), "context_source": ctx_source,
        "resident": resident,
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "head_fallback": head_fallback, "train_seconds": round(time.time() - t0, 1),
    }


# -------------------------------------------------------------------------------------------------------------------
# The parent: run the grid, fit, report


def child(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    e = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
             PYTHONWARNINGS="ignore", **(env or {}))
    e.pop("OOMGUARD_PLAN", None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    return None, f"exit {proc.returncode}: " + " | ".join(t.strip() for t in tail)


def predict(cfg: GPUConfig, co: Any, capacity: int | None) -> Any:
    from oomguard.memory.estimate import ModelSpec, estimate

    return estimate(ModelSpec.from_config(ARCHS[cfg.arch]), cfg.knobs(), prompt_tokens=cfg.P, coefficients=co,
                    capacity=capacity)


def _minimax(errors: Any, grid: list[float]) -> tuple[float, float, float]:
    """The grid value with the smallest worst-case |error| (ties: the smallest median), and those two figures."""
    best = None
    for x in grid:
        errs = sorted(abs(e) for e in errors(x))
        key = (round(errs[-1], 4), statistics.median(errs))
        if best is None or key < best[0]:
            best = (key, x)
    assert best is not None
    return best[1], best[0][0], best[0][1]


def fit(rows: list[tuple[GPUConfig, dict[str, Any]]], capacity: int, base: Any = None) -> Any:
    """Fit the uncertain coefficients on the measured rows (see the module docstring); the others keep ``base``."""
    from oomguard.memory.estimate import Coefficients

    co = base or Coefficients()
    if not rows:
        return co

    def alloc_errors(trial: Any) -> list[float]:
        return [(predict(c, trial, capacity).peak_alloc_bytes - r["peak_alloc"]) / r["peak_alloc"] for c, r in rows]

    fallback = any(r.get("head_fallback") for _, r in rows)
    best = None
    for k_logits in (range(8, 41) if fallback else [co.k_logits]):
        c_act, worst, med = _minimax(lambda x, k=float(k_logits): alloc_errors(replace(co, c_act=x, k_logits=k)),
                                     [x / 100 for x in range(40, 161)])
        if best is None or (worst, med) < best[0]:
            best = ((worst, med), c_act, float(k_logits))
    assert best is not None
    co = replace(co, c_act=best[1], k_logits=best[2])

    # fragmentation: predicted reserved = predicted allocated peak x (1 + f), against the measured reserved peak
    def frag(expandable: bool, prior: float) -> float:
        sel = [(c, r) for c, r in rows if c.expandable == expandable]
        if not sel:
            return prior
        alloc = [(predict(c, co, capacity).peak_alloc_bytes, r["peak_reserved"]) for c, r in sel]
        return _minimax(lambda f: [(a * (1 + f) - res) / res for a, res in alloc], [x / 1000 for x in range(0, 501, 5)])[0]

    co = replace(co, f_frag=frag(False, co.f_frag), f_frag_expandable=frag(True, co.f_frag_expandable))
    clean = [r["context"] for _, r in rows if r.get("context_source") == "process"]
    if clean:
        co = replace(co, m_ctx=int(statistics.median(clean)))
    return co


def measured_device(r: dict[str, Any], co: Any) -> tuple[int, bool]:
    """The row's device use (reserved peak + context) and whether its own context was clean: a ``"device"``-sourced
    context counts other processes, so the model's ``m_ctx`` (fitted to clean figures) stands in for it."""
    clean = r.get("context_source") == "process"
    return r["peak_reserved"] + (r["context"] if clean else int(co.m_ctx)), clean


def errors(rows: list[tuple[GPUConfig, dict[str, Any]]], co: Any, capacity: int) -> dict[str, list[float]]:
    """Relative errors (%) of the allocated peak, the reserved peak (the device prediction without ``m_ctx``) and the
    device use, row by row."""
    out: dict[str, list[float]] = {"alloc": [], "reserved": [], "device": []}
    for c, r in rows:
        e = predict(c, co, capacity)
        dev, _ = measured_device(r, co)
        out["alloc"].append(100 * (e.peak_alloc_bytes - r["peak_alloc"]) / r["peak_alloc"])
        out["reserved"].append(100 * (e.peak_bytes - int(co.m_ctx) - r["peak_reserved"]) / r["peak_reserved"])
        out["device"].append(100 * (e.peak_bytes - dev) / dev)
    return out


def summary(errs: dict[str, list[float]]) -> str:
    """``alloc median/max |error| 0.8%/5.2%; reserved ...; device ...``."""
    return "; ".join(f"{k} median/max |error| {statistics.median(map(abs, v)):.1f}%/{max(map(abs, v)):.1f}%"
                     for k, v in errs.items() if v)


def render(rows: list[tuple[GPUConfig, dict[str, Any]]], co: Any, capacity: int, fmt: str) -> str:
    """The measured table with predictions (``fmt``: ``md``, ``csv`` or ``text``). A device figure marked ``*`` uses
    the model's ``m_ctx`` for the row's context (see :func:`measured_device`)."""
    from oomguard.vocab.sizes import GiB

    header = ["config", "shape", "measured_alloc_GiB", "predicted_alloc_GiB", "alloc_error_%",
              "measured_reserved_GiB", "predicted_reserved_GiB", "reserved_error_%", "measured_device_GiB",
              "predicted_device_GiB", "device_error_%", "gen_GiB", "score_GiB", "fwd_bwd_GiB", "opt_GiB",
              "context_GiB"]
    table = []
    errs = errors(rows, co, capacity)
    for n, (c, r) in enumerate(rows):
        e = predict(c, co, capacity)
        dev, clean = measured_device(r, co)
        pa = r["phases_alloc"]
        table.append([c.name, c.label(), r["peak_alloc"] / GiB, e.peak_alloc_bytes / GiB, errs["alloc"][n],
                      r["peak_reserved"] / GiB, (e.peak_bytes - int(co.m_ctx)) / GiB, errs["reserved"][n],
                      f"{dev / GiB:.3f}" + ("" if clean else "*"), e.peak_bytes / GiB, errs["device"][n],
                      *(pa.get(ph, 0) / GiB for ph in ("generation", "scoring", "forward_backward", "optimizer")),
                      f"{r['context'] / GiB:.3f}" + ("" if clean else " (shared)")])

    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(header)
        w.writerows([[cell(v) for v in row] for row in table])
        return buf.getvalue()
    if fmt == "md":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table]
        return "\n".join(lines) + "\n\n" + summary(errs) + "\n"
    lines = [f"{'config':<32} {'alloc':>7} {'pred':>7} {'err':>6}  {'reserved':>8} {'pred':>7} {'err':>6}  "
             f"{'device':>8} {'pred':>7} {'err':>6}"]
    for row in table:
        lines.append(f"{row[0]:<32} {row[2]:>6.2f}G {row[3]:>6.2f}G {row[4]:>+5.1f}%  {row[5]:>7.2f}G "
                     f"{row[6]:>6.2f}G {row[7]:>+5.1f}%  {row[8]:>7}G {row[9]:>6.2f}G {row[10]:>+5.1f}%")
    return "\n".join([*lines, summary(errs)])


def load_rows(path: Path) -> dict[str, dict[str, Any]]:
    """Rows of a JSONL file written by this script, by configuration name (the last one wins)."""
    done: dict[str, dict[str, Any]] = {}
    known = {f.name for f in fields(GPUConfig)}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            GPUConfig(**{k: v for k, v in rec["config"].items() if k in known})
        except (ValueError, KeyError, TypeError) as e:
            sys.exit(f"gpu_calibrate: {path}:{n}: not a calibration row ({e})")
        done[rec["config"]["name"]] = rec
    return done


def row_config(rec: dict[str, Any]) -> GPUConfig:
    """The configuration of a saved row (rows of configurations no longer in GRID keep working)."""
    known = {f.name for f in fields(GPUConfig)}
    return GPUConfig(**{k: v for k, v in rec["config"].items() if k in known})


def measure(grid: list[GPUConfig], a: argparse.Namespace, raw_path: Path,
            done: dict[str, dict[str, Any]]) -> None:
    """Build the random models, then train every configuration of ``grid`` not in ``done`` (``--jobs`` at once),
    appending each result to ``raw_path`` as it arrives."""
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="oomguard-gpu-cal-"))
    todo = [c for c in grid if c.name not in done]
    built = set()
    for arch in dict.fromkeys(c.arch for c in todo):
        model_dir = work / arch
        if not (model_dir / "config.json").exists():
            print(f"building random {arch} in {model_dir} ...", flush=True)
            res, why = child(["--build", arch, str(model_dir)], 1800)
            if res is None:
                print(f"  build failed: {why}", flush=True)
                continue
        built.add(arch)

    def one(cfg: GPUConfig) -> tuple[GPUConfig, dict[str, Any] | None, str, float]:
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if cfg.expandable else {}
        with tempfile.TemporaryDirectory(prefix="oomguard-gpu-run-") as run_dir:
            t1 = time.time()
            res, why = child(["--train", json.dumps(asdict(cfg)), "--model-dir", str(work / cfg.arch), "--out-dir",
                              run_dir], a.timeout, env)
        return cfg, res, why, time.time() - t1

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = [pool.submit(one, c) for c in todo if c.arch in built]
        for fut in as_completed(futures):  # each row is saved the moment it finishes
            cfg, res, why, seconds = fut.result()
            if res is None:
                print(f"{cfg.name:<32} FAILED {why[:400]}", flush=True)
                continue
            rec = {"config": asdict(cfg), **res, "seconds": round(seconds, 1), "jobs": a.jobs}
            done[cfg.name] = rec
            with raw_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{cfg.name:<32} alloc {res['peak_alloc'] / 2**30:7.2f} GiB  reserved "
                  f"{res['peak_reserved'] / 2**30:7.2f} GiB  context {res['context'] / 2**30:5.2f} GiB "
                  f"({res.get('context_source', '?')})  ({seconds:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-calibration.md",
                   help="measured table: .md for Markdown, else CSV; raw rows go to OUT.jsonl")
    p.add_argument("--quick", action="store_true", help="a 4-configuration subset")
    p.add_argument("--only", action="append", default=[], help="run only the named configuration(s)")
    p.add_argument("--arch", action="append", default=[], choices=sorted(ARCHS),
                   help="run only the configurations of this architecture (repeatable; adds to --only)")
    p.add_argument("--jobs", "-j", type=int, default=1,
                   help="configurations trained at once on the GPU (allocated/reserved peaks are per process; the "
                        "context is too where NVML sees this process)")
    p.add_argument("--resume", action="store_true", help="skip configurations already in OUT.jsonl")
    p.add_argument("--from-jsonl", metavar="PATH", help="re-fit rows saved by an earlier run; needs no GPU")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--workdir", default=None, help="where the random models are written (default: a temp dir)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build", nargs=2, metavar=("ARCH", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--train", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.probe:
        print("RESULT " + json.dumps(probe()), flush=True)
        return 0
    if a.build:
        build(*a.build)
        print("RESULT {}", flush=True)
        return 0
    if a.train:
        print("RESULT " + json.dumps(train(GPUConfig(**json.loads(a.train)), a.model_dir, a.out_dir)), flush=True)
        return 0

    names = list(a.only) + [c.name for c in GRID if c.arch in a.arch]
    selected = names or (QUICK if a.quick else None)
    out = Path(a.out)
    raw_path = Path(str(out) + ".jsonl")
    if not a.resume:
        for existing in (out, raw_path):
            if existing.exists() and not (a.from_jsonl and existing == raw_path):
                sys.exit(f"gpu_calibrate: {existing} exists; pass --resume to continue that run, or another --out")
    t0 = time.time()
    if a.from_jsonl:
        saved = load_rows(Path(a.from_jsonl))
        rows = [(row_config(r), r) for name, r in saved.items() if selected is None or name in selected]
        capacity = 80 * 2**30  # only a colocated vLLM depends on it, and no row uses one
        title = f"re-fit of {a.from_jsonl}"
    else:
        info, why = child(["--probe"], 300)
        if info is None:
            sys.exit(f"gpu_calibrate: cannot start torch to look for a GPU ({why})")
        if not info.get("cuda"):
            sys.exit("gpu_calibrate: no CUDA device is available; this calibration needs an NVIDIA GPU "
                     "(use bench/cpu_calibrate.py on a CPU, or --from-jsonl to re-fit saved rows)")
        capacity = int(info["total"])
        print(f"device: {info['name']}, {capacity / 2**30:.1f} GiB, torch {info['torch']}, "
              f"triton {'yes' if info['triton'] else 'NO: the chunked LM head runs its torch fallback'}", flush=True)
        grid = select_grid(GRID, selected, p)
        done = load_rows(raw_path) if (a.resume and raw_path.exists()) else {}
        measure(grid, a, raw_path, done)
        rows = [(c, done[c.name]) for c in grid if c.name in done]
        title = f"{info['name']}, torch {info['torch']}"
    if not rows:
        sys.exit("gpu_calibrate: no configuration completed")
    from oomguard.memory.estimate import Coefficients

    built_in = Coefficients()
    print(f"\nwith the built-in coefficients {built_in}:\n{render(rows, built_in, capacity, 'text')}")
    co = fit(rows, capacity)
    print(f"\nfitted: {co}\n{render(rows, co, capacity, 'text')}")
    fmt = "md" if out.suffix.lower() in (".md", ".markdown") else "csv"
    body = render(rows, co, capacity, fmt)
    if fmt == "md":
        body = (f"# GPU calibration ({title})\n\nBuilt-in coefficients: `{built_in}`\n\n"
                f"{render(rows, built_in, capacity, 'md')}\nFitted coefficients: `{co}`\n\n{body}")
    out.write_text(body)
    print(f"wrote {out}" + ("" if a.from_jsonl else f" and {raw_path}") + f"; wall time {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
