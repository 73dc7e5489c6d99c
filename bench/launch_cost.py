"""oomguard's own share of a launch: what its bootstrap adds to a Python process, and what the simulated device's
per-operation dispatch adds to training, each measured with and without oomguard on the same machine in one run.

    python bench/launch_cost.py [--runs 5] [--steps 4]

Every Python process of an `oomguard run` starts oomguard's bootstrap (``child/_boot/sitecustomize.py``): it reads
the plan and installs import hooks; the patches load with TRL and transformers, and while the script trains they
observe the config, measure the prompts, predict the memory and report each step. On CPU, the simulated device
(``--simulate-gpu``, the tests' and rehearsals' device) looks at the outputs of every tensor operation. This bench
runs, in alternating order so that the machine's drift falls on all variants alike, and prints medians:

- ``python -c pass``: an interpreter that does nothing, bare and with the bootstrap;
- ``import trl.trainer.grpo_trainer``: TRL's import, bare and with the patches installed as it loads;
- tests/scripts/grpo_tiny.py, --steps GRPO steps on the tests' tiny model: bare, with the bootstrap (the patches
  at work, no simulated device), and with the simulated device as well.

The bootstrap runs without a supervisor here (its plan names an events file and nothing else), so the figures are
oomguard's share inside the training process; the supervisor's own fixed cost is `python bench/overhead.py --fixed`.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOT = ROOT / "oomguard" / "child" / "_boot"
sys.path.insert(0, str(ROOT / "tests" / "scripts"))


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    from build_tiny_model import VARIANTS, build

    with tempfile.TemporaryDirectory() as d:
        model = str(build(Path(d) / "tiny", **VARIANTS["tiny"]))
        plans = {}
        for name, extra in (("boot", {}), ("sim", {"simulate_gpu": 2**30})):
            path = Path(d) / f"plan-{name}.json"
            path.write_text(json.dumps({"schema": "oomguard.plan/1", "attempt": 1, "events": f"{d}/events-{name}",
                                        "crash_dir": d, **extra}))
            plans[name] = str(path)
        base = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        base.pop("OOMGUARD_PLAN", None)
        envs = {"bare": base,
                "bootstrap": {**base, "PYTHONPATH": str(BOOT), "OOMGUARD_PLAN": plans["boot"]},
                "simulated": {**base, "PYTHONPATH": str(BOOT), "OOMGUARD_PLAN": plans["sim"]}}
        tiny = [sys.executable, str(ROOT / "tests" / "scripts" / "grpo_tiny.py"), "--model", model, "--output-dir",
                f"{d}/out", "--max-steps", str(a.steps)]
        rows = [("python -c pass", [sys.executable, "-c", "pass"], ("bare", "bootstrap")),
                ("import trl.trainer.grpo_trainer", [sys.executable, "-c", "import trl.trainer.grpo_trainer"],
                 ("bare", "bootstrap")),
                (f"grpo_tiny.py, {a.steps} GRPO steps", tiny, ("bare", "bootstrap", "simulated"))]
        for _, cmd, kinds in rows:  # warm: bytecode written, files cached
            for k in kinds:
                timed(cmd, envs[k])
        results: dict[str, dict[str, list[float]]] = {name: {k: [] for k in kinds} for name, _, kinds in rows}
        for _ in range(a.runs):
            for name, cmd, kinds in rows:
                for k in kinds:
                    results[name][k].append(timed(cmd, envs[k]))
    print(f"{'process':<34} {'bare':>8} {'bootstrap':>10} {'added':>8} {'simulated':>10} {'added':>8}")
    for name, _, _kinds in rows:
        med = {k: statistics.median(v) for k, v in results[name].items()}
        line = f"{name:<34} {med['bare']:>7.2f}s {med['bootstrap']:>9.2f}s {med['bootstrap'] - med['bare']:>+7.2f}s"
        if "simulated" in med:
            line += f" {med['simulated']:>9.2f}s {med['simulated'] - med['bootstrap']:>+7.2f}s"
        print(line)
    print(f"(medians of {a.runs} alternating runs; 'added' for the simulated device is over the bootstrap alone: the "
          "per-operation dispatch)")


if __name__ == "__main__":
    main()
