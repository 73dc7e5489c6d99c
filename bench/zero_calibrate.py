"""The memory model's per-rank prediction under DeepSpeed ZeRO against what the simulated device measures per rank.

Each configuration is a real two-rank TRL GRPO run of tests/scripts/grpo_tiny.py under ``torchrun`` (gloo, CPU)
on the simulated device with a budget it cannot reach, so nothing runs out of memory: plain DDP (stage 0), ZeRO-2
and ZeRO-3 on the tests' tiny model (activations a large share of its peak) and on the wide one-layer model
(weights, gradients and AdamW state about 95% of it). The DeepSpeed config takes the forms users write: with its
buffer sizes left to transformers ("auto", the ``-z2``/``-z3`` rows), the stage alone so that DeepSpeed's own
defaults size its buffers (``-stage``: a 500,000,000-element reduce bucket, ZeRO-3's prefetch bucket and
persistence threshold), a JSON file with ``overlap_comm`` (two buckets), and the config accelerate's DeepSpeed
plugin builds from an ``accelerate launch --config_file`` YAML with ``distributed_type: DEEPSPEED`` and
``zero_stage`` (``-yaml``, the script without ``use_cpu`` as recipes are written). The measured figure is the larger
of the two ranks' peak allocated bytes (the ``train_end`` events); the prediction is ``estimate(..., world_size=2,
simulated=True)`` for the knobs and prompt length the run itself reported (its RunReport's attempt and facts).

    python bench/zero_calibrate.py               # every configuration (5 min 40 s on 2 busy CPU cores)
    python bench/zero_calibrate.py --only wide-z2 --only tiny-z3
    python bench/zero_calibrate.py --json rows.json

Needs DeepSpeed (``pip install --no-build-isolation deepspeed==0.19.8 einops``); its first start builds its
shared-memory communication op (about 30 s, then cached in ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
for p in (ROOT, SCRIPTS):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # a variant of tests/scripts/build_tiny_model.py
    stage: int  # 0: plain DDP
    args: tuple[str, ...] = ()
    form: str = "auto"  # auto: buffers "auto"; stage: the stage alone; overlap: JSON with overlap_comm; yaml


CONFIGS = [
    Config("tiny-ddp", "tiny", 0),
    Config("tiny-z2", "tiny", 2),
    Config("tiny-z3", "tiny", 3),
    Config("tiny-z2-c128", "tiny", 2, ("--max-completion-length", "128")),
    Config("wide-ddp", "wide", 0),
    Config("wide-z2", "wide", 2),
    Config("wide-z3", "wide", 3),
    Config("wide-z2-g8", "wide", 2, ("--num-generations", "8", "--per-device-train-batch-size", "8")),
    Config("tiny-z2-stage", "tiny", 2, form="stage"),
    Config("tiny-z3-stage", "tiny", 3, form="stage"),
    Config("wide-z2-stage", "wide", 2, form="stage"),
    Config("wide-z3-stage", "wide", 3, form="stage"),
    Config("tiny-z2-overlap", "tiny", 2, form="overlap"),
    Config("tiny-z2-yaml", "tiny", 2, form="yaml"),
    Config("tiny-z3-yaml", "tiny", 3, form="yaml"),
]

# accelerate's DeepSpeed YAML as TRL's examples/accelerate_configs and open-r1's recipes ship it (two processes)
YAML = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed" / "accelerate-deepspeed.yaml").read_text()


def launch(cfg: Config, tmp: Path, port: int) -> list[str]:
    """The launcher and the script's DeepSpeed arguments for ``cfg``'s form."""
    if cfg.form == "yaml":
        yaml = tmp / "accelerate.yaml"
        yaml.write_text(YAML.format(stage=cfg.stage, init=str(cfg.stage == 3).lower()))
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml), "--main_process_port",
                str(port), str(SCRIPTS / "grpo_tiny.py"), "--no-use-cpu"]
    ds: list[str] = []
    if cfg.stage and cfg.form == "auto":
        ds = ["--deepspeed", str(cfg.stage)]
    elif cfg.stage and cfg.form == "stage":
        ds = ["--deepspeed", f"stage{cfg.stage}"]
    elif cfg.stage and cfg.form == "overlap":
        path = tmp / "ds_overlap.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": cfg.stage, "overlap_comm": True},
                                    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                    "train_batch_size": "auto"}))
        ds = ["--deepspeed", str(path)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            str(SCRIPTS / "grpo_tiny.py"), *ds]


def measure(cfg: Config, model: str, work: Path, timeout: float) -> dict[str, Any]:
    """One run under oomguard (no probe, no prediction, no pre-flight: the config runs as it is)."""
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = work / cfg.name
    tmp.mkdir(parents=True)
    cmd = [sys.executable, "-m", "oomguard", "run", "--simulate-gpu", "8GiB", "--simulate-context", "0",
           "--no-probe", "--no-predict", "--no-preflight", "--max-attempts", "1", "--report", str(tmp / "report.json"),
           "--workdir", str(tmp / "wd"), "--lock", str(tmp / "lock.json"), "--", *launch(cfg, tmp, port),
           "--model", model, "--output-dir", str(tmp / "out"), "--max-steps", "2", "--max-completion-length", "64",
           *cfg.args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    rep = json.loads((tmp / "report.json").read_text()) if (tmp / "report.json").exists() else None
    if rep is None or rep["status"] not in ("fits", "stable"):
        raise SystemExit(f"{cfg.name}: the run did not fit ({rep and rep['status']}):\n{out.stderr[-3000:]}")
    events = next((tmp / "wd").glob("runs/*/attempt-1/events.jsonl"))
    peaks = [e["peak"] for e in map(json.loads, events.read_text().splitlines())
             if e.get("event") == "train_end" and e.get("peak")]
    return {"name": cfg.name, "stage": cfg.stage, "form": cfg.form, "knobs": rep["attempts"][0]["knobs"],
            "facts": rep.get("facts") or {},
            "peaks": peaks, "seconds": round(time.monotonic() - t0, 1), "config": _config(model)}


def _config(model: str) -> dict[str, Any]:
    return json.loads((Path(model) / "config.json").read_text())


def predict(row: dict[str, Any]) -> int:
    from oomguard.memory.estimate import ModelSpec, estimate
    from oomguard.vocab.knobs import Knobs

    spec = ModelSpec.from_config(row["config"])
    knobs = Knobs(**row["knobs"])
    prompt = row["facts"].get("prompt_tokens_max")
    return estimate(spec, knobs, world_size=2, prompt_tokens=prompt, simulated=True).peak_alloc_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], help="run only the named configuration(s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    p.add_argument("--json", metavar="PATH", help="write the measurements to PATH")
    p.add_argument("--from-json", metavar="PATH", help="re-use measurements written by --json instead of measuring")
    a = p.parse_args(argv)
    if a.from_json:
        rows = json.loads(Path(a.from_json).read_text())
    else:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            print("DeepSpeed is not installed: pip install --no-build-isolation deepspeed==0.19.8 einops")
            return 2
        from build_tiny_model import VARIANTS, build

        chosen = [c for c in CONFIGS if not a.only or c.name in a.only]
        work = Path(tempfile.mkdtemp(prefix="oomguard-zero-"))
        try:
            models = {v: str(build(work / "models" / v, **VARIANTS[v])) for v in sorted({c.model for c in chosen})}
            rows = []
            for c in chosen:
                rows.append(measure(c, models[c.model], work / "runs", a.timeout))
                print(f"measured {c.name}: {max(rows[-1]['peaks']) / 2**20:.1f} MiB in {rows[-1]['seconds']} s",
                      flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    errors = []
    print("\n| config | stage | measured (max rank) | predicted | error |\n|---|---:|---:|---:|---:|")
    for row in rows:
        measured, predicted = max(row["peaks"]), predict(row)
        err = predicted / measured - 1
        errors.append(abs(err))
        print(f"| {row['name']} | {row['stage']} | {measured / 2**20:.1f} MiB | {predicted / 2**20:.1f} MiB | "
              f"{err:+.1%} |")
    if errors:
        print(f"\nmedian |error| {sorted(errors)[len(errors) // 2]:.1%}, max {max(errors):.1%} ({len(errors)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
