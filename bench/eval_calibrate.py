"""The memory model's evaluation phase against what the simulated device measures in a real evaluation pass.

Each configuration is a real TRL GRPO run of tests/scripts/grpo_tiny.py (one training step, then one evaluation
pass of one batch) under oomguard on the simulated device with a budget it cannot reach. The measured figure is the
evaluation pass's own peak allocated bytes: the process's peak at the ``evaluated`` event, where it is above the
training step's (the ``step`` event's); a pass that stays under its step's peak is reported as such. The prediction
is ``estimate(...).phases["evaluation"]`` for the knobs and prompt length the run reported.

    python bench/eval_calibrate.py                 # every configuration (about 3 min on 2 busy CPU cores)
    python bench/eval_calibrate.py --only rows16 --json rows.json
"""

from __future__ import annotations

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

from _phases import run_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
for p in (ROOT, SCRIPTS):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


@dataclass(frozen=True)
class Config:
    name: str
    args: tuple[str, ...] = ()


CONFIGS = [
    Config("rows8", ("--per-device-eval-batch-size", "8")),
    Config("rows16", ("--per-device-eval-batch-size", "16")),
    Config("rows32", ("--per-device-eval-batch-size", "32")),
    Config("rows16-c96", ("--per-device-eval-batch-size", "16", "--max-completion-length", "96")),
    Config("rows16-bf16", ("--per-device-eval-batch-size", "16", "--trl-precision")),
    Config("rows16-lora", ("--per-device-eval-batch-size", "16", "--lora-r", "8")),
    Config("rows16-g2", ("--per-device-eval-batch-size", "16", "--num-generations-eval", "2")),
]


def measure(cfg: Config, model: str, work: Path, timeout: float) -> dict[str, Any]:
    """One run under oomguard (no probe, no prediction, no pre-flight: the config runs as it is)."""
    tmp = work / cfg.name
    tmp.mkdir(parents=True)
    cmd = [sys.executable, "-m", "oomguard", "run", "--simulate-gpu", "8GiB", "--simulate-context", "0",
           "--no-probe", "--no-predict", "--no-preflight", "--max-attempts", "1", "--report", str(tmp / "report.json"),
           "--workdir", str(tmp / "wd"), "--lock", str(tmp / "lock.json"), "--", sys.executable,
           str(SCRIPTS / "grpo_tiny.py"), "--model", model, "--output-dir", str(tmp / "out"), "--max-steps", "1",
           "--eval-steps", "1", "--eval-rows", "32", *cfg.args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    rep = json.loads((tmp / "report.json").read_text()) if (tmp / "report.json").exists() else None
    if rep is None or rep["status"] not in ("fits", "stable"):
        raise SystemExit(f"{cfg.name}: the run did not fit ({rep and rep['status']}):\n{out.stderr[-3000:]}")
    events = [json.loads(line) for line in next((tmp / "wd").glob("runs/*/attempt-1/events.jsonl")).read_text()
              .splitlines() if line.strip()]
    step = max((e["peak"] for e in events if e.get("event") == "step" and e.get("peak")), default=0)
    evaluated = max((e["peak"] for e in events if e.get("event") == "evaluated" and e.get("peak")), default=0)
    return {"name": cfg.name, "knobs": rep["attempts"][0]["knobs"], "facts": rep.get("facts") or {},
            "step_peak": step, "eval_peak": evaluated, "seconds": round(time.monotonic() - t0, 1),
            "config": json.loads((Path(model) / "config.json").read_text())}


def predict(row: dict[str, Any]) -> dict[str, int]:
    from oomguard.memory.estimate import ModelSpec, estimate
    from oomguard.vocab.knobs import Knobs

    e = estimate(ModelSpec.from_config(row["config"]), Knobs(**row["knobs"]),
                 prompt_tokens=row["facts"].get("prompt_tokens_max"), simulated=True,
                 head=row["facts"].get("trl_head"))
    return e.phases


def main(argv: list[str] | None = None) -> int:
    a = run_args(__doc__.split("\n\n")[0], 600.0).parse_args(argv)
    if a.from_json:
        rows = json.loads(Path(a.from_json).read_text())
    else:
        from build_tiny_model import VARIANTS, build

        chosen = [c for c in CONFIGS if not a.only or c.name in a.only]
        work = Path(tempfile.mkdtemp(prefix="oomguard-eval-"))
        try:
            model = str(build(work / "models" / "tiny", **VARIANTS["tiny"]))
            rows = []
            for c in chosen:
                rows.append(measure(c, model, work / "runs", a.timeout))
                print(f"measured {c.name}: evaluation {rows[-1]['eval_peak'] / 2**20:.1f} MiB, step "
                      f"{rows[-1]['step_peak'] / 2**20:.1f} MiB, in {rows[-1]['seconds']} s", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    errors = []
    print("\n| config | eval rows | measured evaluation | predicted evaluation | error | measured step | predicted step |"
          "\n|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        phases = predict(row)
        pred_eval = phases["evaluation"]
        pred_step = max(v for ph, v in phases.items() if ph != "evaluation")
        over = row["eval_peak"] > row["step_peak"]
        measured = f"{row['eval_peak'] / 2**20:.1f} MiB" if over else f"under the step's ({row['step_peak'] / 2**20:.1f})"
        err = pred_eval / row["eval_peak"] - 1 if over else None
        if err is not None:
            errors.append(abs(err))
        print(f"| {row['name']} | {row['knobs'].get('per_device_eval_batch_size')} | {measured} | "
              f"{pred_eval / 2**20:.1f} MiB | {'' if err is None else f'{err:+.1%}'} | "
              f"{row['step_peak'] / 2**20:.1f} MiB | {pred_step / 2**20:.1f} MiB |")
    if errors:
        print(f"\nmedian |error| {sorted(errors)[len(errors) // 2]:.1%}, max {max(errors):.1%} ({len(errors)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
