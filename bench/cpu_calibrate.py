"""Calibrate oomguard's memory model against real TRL GRPO steps on the simulated device (CPU only).

For each configuration of a small grid, a fresh subprocess builds a GRPOTrainer on a tiny random Llama or Qwen2
model (written to a temporary directory, with a word-level tokenizer made with ``tokenizers``), starts oomguard's
simulated device before any tensor exists, and trains two optimizer steps. Completions are forced to the worst case
with ``generation_kwargs={"min_new_tokens": C}`` and every prompt has exactly P tokens, so the shapes are
deterministic. The subprocess reports the simulated device's peak allocated bytes per phase (generation, scoring,
forward_backward, optimizer), and this script compares them with
``oomguard.memory.estimate.estimate(..., simulated=True)``.

    python bench/cpu_calibrate.py            # the full grid (about 6-8 minutes on 2 CPU cores)
    python bench/cpu_calibrate.py --quick    # a 4-configuration subset
    python bench/cpu_calibrate.py --only qwen-full-c128 --show-phases
    python bench/cpu_calibrate.py --python /work/venvs/trl-0.29.1/bin/python --json tests/fixtures/trl/cpu-rows-0.29.1.json
    python bench/cpu_calibrate.py --stack unsloth --python .venv-unsloth/bin/python \
        --json tests/fixtures/stacks/cpu-rows-unsloth.json   # Unsloth's loader, LoRA and CPU LM head

``--python`` measures under another environment's interpreter (one per tested TRL release, with oomguard installed
there: ``pip install --no-deps -e .``); each row records the TRL and transformers it ran under and the LM head the
training process found (``oomguard.child.trlcompat``), and the prediction models that head. The rows written by
``--json`` are the test fixtures of ``tests/test_trl_range.py`` (``tests/fixtures/trl/``). ``--stack unsloth`` runs its
own grid the way an Unsloth notebook builds the run: ``import unsloth`` first, ``FastLanguageModel.from_pretrained``
and ``get_peft_model`` with Unsloth's checkpointing, then TRL's GRPOTrainer, whose LM head Unsloth's CPU backend
replaces (the rows are ``tests/fixtures/stacks/``, checked by ``tests/test_unsloth_units.py``).

The table's "measured" column is the simulated device's ``peak`` (max allocated, the analogue of
``torch.cuda.max_memory_allocated``) over both steps; "predicted" is ``Estimate.peak_alloc_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from _phases import build_trainer, instrument_phases, select_grid

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tiny architectures: Llama-3.2-shaped (GQA 4:1, tied) with a 2k vocabulary, and Qwen2.5-shaped (qkv bias, tied)
# with a 40k vocabulary so that the chunked LM head runs over two 32768-wide vocabulary chunks.
ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=2048, hidden_size=256,
                  intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=2048,
                  hidden_act="silu", attention_bias=False, mlp_bias=False),
    "qwen": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=40000, hidden_size=128,
                 intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
                 hidden_act="silu"),
    # weights-heavy: one wide layer (48M parameters), so weights, gradients and optimizer state are ~90% of the peak
    "wide": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=2048, hidden_size=1792,
                 intermediate_size=7168, num_hidden_layers=1, num_attention_heads=14, num_key_value_heads=14,
                 head_dim=128, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=2048,
                 hidden_act="silu", attention_bias=False, mlp_bias=False),
}


@dataclass(frozen=True)
class Config:
    name: str
    arch: str = "llama"
    P: int = 32  # prompt tokens (every prompt has exactly this many)
    C: int = 128  # max_completion_length, forced with min_new_tokens
    B: int = 4  # per_device_train_batch_size
    G: int = 4  # num_generations
    GA: int = 1  # gradient_accumulation_steps (steps_per_generation follows it)
    gc: bool = True
    lora_r: int = 0
    optim: str = "adamw_torch"
    dtype: str = "float32"
    beta: float = 0.0
    bf16: bool = False  # mixed precision: TRL's default is True, which autocasts to bf16 on the CPU too
    load_in_4bit: bool = False
    stack: str = ""  # "unsloth": the model comes from Unsloth's loader (see worker)
    extra: dict[str, Any] = field(default_factory=dict)

    def knobs(self) -> Any:
        from oomguard.vocab.knobs import TRL_DEFAULTS

        return TRL_DEFAULTS.replace(
            max_completion_length=self.C, per_device_train_batch_size=self.B, num_generations=self.G,
            gradient_accumulation_steps=self.GA, gradient_checkpointing=self.gc, optim=self.optim, dtype=self.dtype,
            lora_r=self.lora_r, lora_target_modules="all-linear" if self.lora_r else None, beta=self.beta,
            bf16=self.bf16, fp16=False, load_in_4bit=self.load_in_4bit,
        )

    def label(self) -> str:
        parts = [self.arch, self.dtype[:4], f"P{self.P}", f"C{self.C}", f"B{self.B}", f"GA{self.GA}",
                 "gc" if self.gc else "nogc", f"lora{self.lora_r}" if self.lora_r else "full",
                 "8bit" if "8bit" in self.optim else "adamw"]
        if self.beta:
            parts.append(f"beta{self.beta}")
        if self.bf16:
            parts.append("autocast")
        if self.load_in_4bit:
            parts.append("4bit")
        return " ".join(parts)


BASE = Config("base")
GRID: list[Config] = [
    replace(BASE, name="llama-full-c64", C=64),
    replace(BASE, name="llama-full-c128"),
    replace(BASE, name="llama-full-c256", C=256),
    replace(BASE, name="llama-full-p96", P=96),
    replace(BASE, name="llama-full-b8", B=8, G=8),
    replace(BASE, name="llama-full-ga2", GA=2),
    replace(BASE, name="llama-full-nogc", gc=False),
    replace(BASE, name="llama-full-bf16", dtype="bfloat16"),
    replace(BASE, name="llama-full-8bit", optim="adamw_bnb_8bit"),
    replace(BASE, name="llama-full-beta", beta=0.04),
    replace(BASE, name="llama-lora16", lora_r=16),
    replace(BASE, name="llama-lora16-nogc", lora_r=16, gc=False),
    replace(BASE, name="llama-lora16-bf16", lora_r=16, dtype="bfloat16"),
    replace(BASE, name="llama-lora16-c512-b8", lora_r=16, C=512, B=8, G=8),  # N > 4096: two token chunks
    replace(BASE, name="qwen-full-c128", arch="qwen"),
    replace(BASE, name="qwen-full-nogc-b8", arch="qwen", gc=False, B=8, G=8, C=64),
    replace(BASE, name="qwen-lora16", arch="qwen", lora_r=16),
    replace(BASE, name="qwen-full-bf16-8bit", arch="qwen", dtype="bfloat16", optim="adamw_bnb_8bit"),
    # TRL's default bf16=True: float32 weights under bf16 autocast, as a script that keeps TRL's defaults runs on CPU
    replace(BASE, name="llama-full-autocast", bf16=True),
    replace(BASE, name="llama-full-autocast-b8", bf16=True, B=8, G=8, P=56, C=96),
    replace(BASE, name="llama-full-autocast-nogc", bf16=True, gc=False),
    replace(BASE, name="llama-lora16-autocast", bf16=True, lora_r=16),
    replace(BASE, name="llama-lora16-autocast-nogc", bf16=True, lora_r=16, gc=False),
    replace(BASE, name="llama-full-autocast-8bit", bf16=True, optim="adamw_bnb_8bit"),
    replace(BASE, name="qwen-full-autocast", arch="qwen", bf16=True),
    replace(BASE, name="qwen-lora16-autocast", arch="qwen", bf16=True, lora_r=16),
    # a full fine-tune whose memory is mostly weights, gradients and optimizer state
    replace(BASE, name="wide-full-c64", arch="wide", C=64),
    replace(BASE, name="wide-full-8bit-c64", arch="wide", C=64, optim="adamw_bnb_8bit"),
]
QUICK = ["llama-full-c128", "llama-full-nogc", "llama-lora16", "qwen-full-c128"]
# Unsloth's CPU backend (no native bf16 here: fp32 weights, no autocast): LoRA as its notebooks set it up, the head
# its backend routes to (one row chunk below 16Mi/V rows, several above: the qwen rows' 40k vocabulary)
UNSLOTH = replace(BASE, name="unsloth", stack="unsloth", lora_r=16)
UNSLOTH_GRID: list[Config] = [
    replace(UNSLOTH, name="unsloth-llama-lora16"),
    replace(UNSLOTH, name="unsloth-llama-lora16-c256", C=256),
    replace(UNSLOTH, name="unsloth-llama-lora16-b8", B=8, G=8, C=64),
    replace(UNSLOTH, name="unsloth-llama-lora8-nogc", lora_r=8, gc=False),
    replace(UNSLOTH, name="unsloth-llama-lora16-4bit", load_in_4bit=True),
    replace(UNSLOTH, name="unsloth-qwen-lora16", arch="qwen"),
    replace(UNSLOTH, name="unsloth-qwen-lora16-c512-b8", arch="qwen", C=512, B=8, G=8),
    replace(UNSLOTH, name="unsloth-llama-full", lora_r=0),
]


# -------------------------------------------------------------------------------------------------------------------
# The tiny model (built once per architecture, in the parent, without the simulated device)


def make_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over ``vocab_size`` ids (``<pad>``, ``<unk>``, ``<eos>``, then ``w3``, ``w4``, ...):
    every prompt of P words is exactly P tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def build_model(path: Path, arch: dict[str, Any], dtype: str = "float32", device: str = "cpu") -> None:
    """Write a random-weight model of the architecture ``arch`` (an ``ARCHS`` entry; initialised on ``device``,
    saved in ``dtype``) and a word-level tokenizer over its whole vocabulary. gpu_calibrate.py builds with this too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(arch)
    tokenizer = make_tokenizer(spec["vocab_size"])
    spec.update(pad_token_id=0, eos_token_id=2, bos_token_id=2, torch_dtype=dtype)
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


# -------------------------------------------------------------------------------------------------------------------
# The worker (one subprocess per configuration)


class PhaseTracker:
    """Split the peak of allocated memory by phase: reset the peak at every boundary, record it at the next."""

    def __init__(self, peak: Any, reset: Any) -> None:
        self.peak, self.reset = peak, reset
        self.current = "setup"
        self.step = 0
        self.records: list[dict[str, int]] = [{}]

    def switch(self, phase: str) -> None:
        rec = self.records[-1]
        rec[self.current] = max(rec.get(self.current, 0), int(self.peak()))
        self.reset()
        self.current = phase

    def next_step(self) -> None:
        self.switch(self.current)
        self.records.append({})


def train_measured(trainer: Any, dev: Any) -> tuple[dict[str, int], list[dict[str, int]], int, float]:
    """Train on the simulated device ``dev`` with the trainer's weights adopted: the peak per phase over the steps,
    each step's, the resident bytes before training, and the training's seconds."""
    dev.adopt(list(trainer.model.parameters()) + list(trainer.model.buffers()))
    resident = dev.model.allocated
    dev.reset_peak()
    tracker = PhaseTracker(lambda: dev.peak, dev.reset_peak)
    instrument_phases(trainer, tracker.switch, tracker.next_step)
    t0 = time.time()
    trainer.train()
    tracker.switch("end")
    steps = [r for r in tracker.records if r]
    phases: dict[str, int] = {}
    for rec in steps:
        for k, v in rec.items():
            phases[k] = max(phases.get(k, 0), v)
    return phases, steps, resident, round(time.time() - t0, 1)


def unsloth_model(cfg: Config, model_dir: str) -> Any:
    """The model as an Unsloth notebook builds it: ``FastLanguageModel.from_pretrained``, then ``get_peft_model``
    on the seven projections with Unsloth's checkpointing (a full fine-tune: ``full_finetuning=True``)."""
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(model_dir, max_seq_length=cfg.P + cfg.C,
                                                 load_in_4bit=cfg.load_in_4bit, full_finetuning=not cfg.lora_r)
    if not cfg.lora_r:
        return model
    return FastLanguageModel.get_peft_model(
        model, r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, lora_dropout=0.0, random_state=0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth" if cfg.gc else False)


def worker(cfg: Config, model_dir: str, out_dir: str) -> dict[str, Any]:
    if cfg.stack == "unsloth":
        import unsloth  # noqa: F401  (first, as its notebooks do: it patches TRL and transformers)
    from oomguard.child import simulate

    dev = simulate.start(64 * 2**30, expandable=False)
    model = unsloth_model(cfg, model_dir) if cfg.stack == "unsloth" else None
    trainer = build_trainer(cfg, model_dir, ARCHS[cfg.arch]["vocab_size"], out_dir, rows=64,
                            model_init_kwargs={"dtype": cfg.dtype}, bf16=cfg.bf16, use_cpu=True, model=model)
    phases, steps, resident, seconds = train_measured(trainer, dev)
    import transformers

    from oomguard.child import trlcompat

    trl = trlcompat.read()
    head = trl.head
    if cfg.stack:
        import importlib

        head = importlib.import_module(f"oomguard.child.stacks.{cfg.stack}").facts().get("trl_head", head)
    return {"peak": max(phases.values()), "phases": phases, "steps": steps, "resident": resident,
            "train_seconds": seconds, "trainable": sum(p.numel() for p in trainer.model.parameters()
                                                       if p.requires_grad),
            "trl": trl.version, "trl_head": head, "transformers": transformers.__version__,
            "bf16": bool(trainer.args.bf16), "optim": str(trainer.args.optim)}


# -------------------------------------------------------------------------------------------------------------------
# The parent


def predict(cfg: Config, coefficients: Any = None, head: str | None = None) -> Any:
    """The prediction for ``cfg``, modelling the LM head ``head`` (the one the row's TRL has; None: the newest)."""
    from oomguard.memory.estimate import Coefficients, ModelSpec, estimate

    spec = ModelSpec.from_config(ARCHS[cfg.arch])
    coefficients = coefficients or Coefficients.for_simulated()
    # Unsloth's loader keeps the dtype asked under a 4-bit load (RunFacts.load_takes_4bit)
    return estimate(spec, cfg.knobs(), prompt_tokens=cfg.P, coefficients=coefficients, simulated=True, head=head,
                    keeps_dtype_4bit=getattr(cfg, "stack", None) == "unsloth")


def run_one(cfg: Config, model_dirs: dict[str, Path], timeout: float, python: str = sys.executable) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="oomguard-cal-") as out:
        cmd = [python, __file__, "--worker", json.dumps(cfg.__dict__), "--model-dir",
               str(model_dirs[cfg.arch]), "--out-dir", out]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
        env.pop("OOMGUARD_PLAN", None)
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                res["seconds"] = round(time.time() - t0, 1)
                return res
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def table(results: list[tuple[Config, dict[str, Any]]], coefficients: Any, show_phases: bool) -> list[float]:
    from oomguard.vocab.sizes import MiB

    errors = []
    print(f"{'config':<22} {'shape':<50} {'predicted':>10} {'measured':>10} {'error':>8}")
    for cfg, res in results:
        if "error" in res:
            print(f"{cfg.name:<22} {cfg.label():<50} {'':>10} {'FAILED':>10}  {res['error'][:300]}")
            continue
        est = predict(cfg, coefficients, res.get("trl_head"))
        err = 100.0 * (est.peak_alloc_bytes - res["peak"]) / res["peak"]
        errors.append(err)
        print(f"{cfg.name:<22} {cfg.label():<50} {est.peak_alloc_bytes / MiB:>8.1f}Mi {res['peak'] / MiB:>8.1f}Mi "
              f"{err:>+7.1f}%")
        if show_phases:
            for ph in ("generation", "scoring", "forward_backward", "optimizer"):
                m = res["phases"].get(ph)
                p = est.phases.get(ph)
                if m is None and not p:
                    continue
                m_txt = f"{m / MiB:8.1f}Mi" if m is not None else "       -  "
                print(f"{'':<24}{ph:<48} {p / MiB:>8.1f}Mi {m_txt}")
    if errors:
        abs_err = [abs(e) for e in errors]
        print(f"\n{len(errors)} configurations: median |error| {statistics.median(abs_err):.1f}%, "
              f"max |error| {max(abs_err):.1f}%, mean error {statistics.mean(errors):+.1f}%")
    return errors


def fit(results: list[tuple[Config, dict[str, Any]]]) -> Any:
    """Grid-search ``c_act`` and ``k_logits`` for the smallest worst-case error (ties: smallest median)."""
    from oomguard.memory.estimate import Coefficients

    ok = [(c, r) for c, r in results if "error" not in r]
    best = None
    for c_act in [x / 100 for x in range(70, 131, 2)]:
        for k_logits in range(16, 41, 1):
            co = replace(Coefficients.for_simulated(), c_act=c_act, k_logits=float(k_logits))
            errs = sorted(abs(predict(c, co, r.get("trl_head")).peak_alloc_bytes - r["peak"]) / r["peak"]
                          for c, r in ok)
            key = (round(errs[-1], 3), statistics.median(errs))
            if best is None or key < best[0]:
                best = (key, co)
    assert best is not None
    print(f"fit: c_act={best[1].c_act} k_logits={best[1].k_logits}: max |error| {100 * best[0][0]:.1f}%, "
          f"median {100 * best[0][1]:.1f}%")
    return best[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="run a 4-configuration subset")
    p.add_argument("--only", action="append", default=[], help="run only the named configuration(s)")
    p.add_argument("--jobs", "-j", type=int, default=2, help="configurations measured in parallel (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    p.add_argument("--show-phases", action="store_true", help="also print predicted vs measured per phase")
    p.add_argument("--json", metavar="PATH", help="write the raw measurements to PATH")
    p.add_argument("--from-json", metavar="PATH", help="re-use measurements written by --json instead of measuring")
    p.add_argument("--fit", action="store_true", help="also grid-search c_act and k_logits on these measurements")
    p.add_argument("--python", default=sys.executable, metavar="PATH",
                   help="measure under this interpreter (another environment's TRL; oomguard installed there)")
    p.add_argument("--stack", choices=["unsloth"], help="measure a stack's own grid (its python: --python)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.worker:
        res = worker(Config(**json.loads(a.worker)), a.model_dir, a.out_dir)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    grid = select_grid(UNSLOTH_GRID if a.stack == "unsloth" else GRID, a.only or (QUICK if a.quick else None), p)
    t0 = time.time()
    if a.from_json:
        saved = {r["config"]["name"]: r for r in json.loads(Path(a.from_json).read_text())}
        grid = [c for c in grid if c.name in saved]
        measured = [saved[c.name] for c in grid]
    else:
        with tempfile.TemporaryDirectory(prefix="oomguard-tiny-") as tmp:
            model_dirs = {}
            for arch in sorted({c.arch for c in grid}):
                model_dirs[arch] = Path(tmp) / arch
                build_model(model_dirs[arch], ARCHS[arch])
            with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
                measured = list(pool.map(lambda c: run_one(c, model_dirs, a.timeout, a.python), grid))
    results = list(zip(grid, measured, strict=True))
    if a.json:
        Path(a.json).write_text(json.dumps([{"config": c.__dict__, **r} for c, r in results], indent=1))
    from oomguard.memory.estimate import Coefficients

    coefficients = fit(results) if a.fit else Coefficients.for_simulated()
    print(f"coefficients: {coefficients}\n")
    table(results, coefficients, a.show_phases)
    print(f"\nwall time {time.time() - t0:.0f} s; command: python bench/cpu_calibrate.py "
          + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
