"""How long the test suite's default run takes (target: 300 s on 2 cores), and where the time goes.

    python bench/suite_time.py [--stage default|slow] [--top 10] [--imports 3]

Runs the stage as CI does (`python -m pytest -q`, or `-m slow`), on pytest-xdist's workers, and prints its wall time
against the target, the time of its end-to-end tests (each launches real TRL one to three times) apart from the
rest, the longest tests, and what one launch costs on this machine before it trains (importing TRL's GRPOTrainer
in a fresh interpreter, the median of --imports runs): the figure that tells a slow machine from a slow suite.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = {"default": 300.0, "slow": None}
DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(r"(\d+ (?:passed|failed).*?) in ([\d.]+)s")


def stage_args(stage: str) -> list[str]:
    return ["-m", "slow"] if stage == "slow" else []


def end_to_end_ids(stage: str) -> set[str]:
    """The node ids of the stage's end-to-end tests (marker `e2e`), from a collection in this process."""
    expr = "e2e and slow" if stage == "slow" else "e2e and not slow"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", expr], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OOMGUARD_TEST_WORKERS": "0"})
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def import_seconds(runs: int) -> float | None:
    if runs <= 0:
        return None
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import trl.trainer.grpo_trainer"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=("default", "slow"), default="default")
    p.add_argument("--top", type=int, default=10, help="how many of the longest tests to list")
    p.add_argument("--imports", type=int, default=3, help="fresh imports of TRL's GRPOTrainer to time (0: none)")
    a = p.parse_args()

    e2e = end_to_end_ids(a.stage)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", *stage_args(a.stage), "--durations=0",
                              "--durations-min=0", "--basetemp", str(Path(tmp) / "t")], cwd=ROOT,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t
    per_test: dict[str, float] = {}
    called: set[str] = set()  # a skipped test has a setup and no call: it is not counted as run
    for line in run.stdout.splitlines():
        m = DURATION.match(line)
        if m:
            per_test[m.group(3)] = per_test.get(m.group(3), 0.0) + float(m.group(1))
            if m.group(2) == "call":
                called.add(m.group(3))
    per_test = {k: v for k, v in per_test.items() if k in called}
    summary = next((m.group(1) for m in map(SUMMARY.search, reversed(run.stdout.splitlines())) if m), "no summary")

    target = TARGET_S[a.stage]
    print(f"stage: {a.stage} ({' '.join(['python -m pytest -q', *stage_args(a.stage)])}), exit {run.returncode}")
    print(f"{'tests run':<28} {'tests':>6} {'test time':>10}")
    ends = {k: v for k, v in per_test.items() if k in e2e}
    rest = {k: v for k, v in per_test.items() if k not in e2e}
    print(f"{'end-to-end (marker e2e)':<28} {len(ends):>6} {sum(ends.values()):>9.1f}s")
    print(f"{'the others':<28} {len(rest):>6} {sum(rest.values()):>9.1f}s")
    verdict = "" if target is None else f" (target {target:.0f} s: {'met' if wall <= target else 'NOT met'})"
    print(f"{'wall time':<28} {'':>6} {wall:>9.1f}s{verdict}")
    print(f"pytest: {summary}")
    print(f"\nthe {a.top} longest tests:")
    for name, sec in sorted(per_test.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"{sec:>8.1f}s  {'e2e ' if name in e2e else '    '}{name}")
    imp = import_seconds(a.imports)
    if imp is not None:
        print(f"\none launch's fixed cost here: importing TRL's GRPOTrainer in a fresh interpreter, {imp:.1f} s "
              f"(median of {a.imports})")
    if run.returncode != 0:
        print(run.stdout[-3000:], file=sys.stderr)
        sys.exit(run.returncode)


if __name__ == "__main__":
    main()
