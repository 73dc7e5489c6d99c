"""Attempts and wall time to a stable config: the default ladder, quality-first, and the guided (memory-model) climb.

Each scenario is a real TRL GRPO run of tests/scripts/grpo_tiny.py on the simulated device, with the budgets of the
end-to-end tests (found with bench/min_budget.py). Probes are off for the first three strategies so they are compared
on the same footing (one attempt = one launch of the script). The fourth, guided with `--minimize`, needs probes: its
attempts count the probes and the minimize trials too, its OOMs only those of the climb.

    python bench/scenarios.py [--model DIR] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
TINY = str(ROOT / "tests" / "scripts" / "grpo_tiny.py")

SCENARIOS = {
    "long completions (118 MiB, C=128)": ("118MiB", ["--max-completion-length", "128"]),
    "many generations (84 MiB, C=64)": ("84MiB", ["--max-completion-length", "64"]),
    "tight (48 MiB, C=64)": ("48MiB", ["--max-completion-length", "64"]),
}
STRATEGIES = {
    "default": ["--no-probe", "--ladder", "default", "--no-predict"],
    "quality-first": ["--no-probe", "--ladder", "quality-first", "--no-predict"],
    "guided (default)": ["--no-probe", "--ladder", "default"],
    "guided --minimize": ["--ladder", "default", "--minimize", "--probe-steps", "1"],
}


def run(model: str, budget: str, args: list[str], strategy: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "oomguard", "run", "--quiet", "--simulate-gpu", budget, *strategy,
               "--report", f"{d}/r.json", "--lock", f"{d}/l.json", "--workdir", f"{d}/wd", "--",
               sys.executable, TINY, "--model", model, "--output-dir", f"{d}/out", *args]
        t = time.perf_counter()
        subprocess.run(cmd, cwd=d, capture_output=True)
        wall = time.perf_counter() - t
        rep = json.loads(Path(f"{d}/r.json").read_text())
    return {"status": rep["status"], "attempts": len(rep["attempts"]),
            "ooms": sum(a["outcome"] == "oom" and a.get("kind") != "minimize" for a in rep["attempts"]), "wall": wall,
            "changes": ", ".join(f"{r['knob']}={r['to']}" for r in rep["diff"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="the tests' tiny model dir (built in a temp dir if absent)")
    p.add_argument("--only", default=None)
    a = p.parse_args()
    from build_tiny_model import build

    model = a.model or str(build(Path(tempfile.mkdtemp()) / "tiny-llama"))
    print(f"{'scenario':<36} {'strategy':<17} {'status':<8} {'attempts':>8} {'OOMs':>5} {'wall':>7}  changes")
    for name, (budget, args) in SCENARIOS.items():
        if a.only and a.only not in name:
            continue
        for sname, strategy in STRATEGIES.items():
            r = run(model, budget, args, strategy)
            print(f"{name:<36} {sname:<17} {r['status']:<8} {r['attempts']:>8} {r['ooms']:>5} {r['wall']:>6.1f}s  "
                  f"{r['changes']}", flush=True)


if __name__ == "__main__":
    main()
