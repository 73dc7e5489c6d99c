"""The cost of `oomguard run -- python S` over `python S` when nothing goes wrong (target: <= 2%).

S is the example GRPO script on its tiny offline model (a real TRL run on CPU). Each variant runs --runs times,
alternating, and the table gives the median wall time. The probe (on by default) is reported separately: it is a
deliberate extra of a few training steps, paid once, not supervision overhead.

    python bench/overhead.py [--runs 3] [--max-steps 6]
    python bench/overhead.py --fixed [--pairs 15]

``--fixed`` measures the supervisor's fixed cost alone (target: <= 0.25 s): alternating pairs of a Python script that
does nothing, bare and under ``oomguard run --no-probe``, and the median of the pairs' differences. That script still
starts oomguard's bootstrap in its process (what every training process pays), so the figure is an upper bound of
what a real run pays once; a GRPO run's own time varies by more than this between runs, which is why the pairs use a
script that does nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "grpo_gsm8k.py")


def timed(cmd: list[str], cwd: str) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def fixed(pairs: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "nothing.py"
        script.write_text("pass\n")
        og = [sys.executable, "-m", "oomguard", "run", "--quiet", "--report", f"{d}/r.json", "--lock", f"{d}/l.json",
              "--workdir", f"{d}/wd", "--no-probe", "--", sys.executable, str(script)]
        timed(og, d)  # warm: bytecode written, files cached
        bare, under = [], []
        for _ in range(pairs):
            bare.append(timed([sys.executable, str(script)], d))
            under.append(timed(og, d))
    diffs = [u - b for u, b in zip(under, bare, strict=True)]
    print(f"{'variant':<44} {'median':>8}")
    print(f"{'python nothing.py':<44} {statistics.median(bare):>7.3f}s")
    print(f"{'oomguard run --no-probe -- python nothing.py':<44} {statistics.median(under):>7.3f}s")
    print(f"{'fixed cost (median of paired differences)':<44} {statistics.median(diffs):>7.3f}s   target <= 0.250s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--fixed", action="store_true", help="measure the fixed cost on a script that does nothing")
    p.add_argument("--pairs", type=int, default=15)
    a = p.parse_args()
    if a.fixed:
        fixed(a.pairs)
        return
    with tempfile.TemporaryDirectory() as d:
        args = [SCRIPT, "--max-steps", str(a.max_steps), "--output-dir", f"{d}/out", "--save-steps", "1000"]
        subprocess.run([sys.executable, *args, "--max-steps", "1"], cwd=d, check=True, capture_output=True)  # warm
        og = [sys.executable, "-m", "oomguard", "run", "--quiet", "--report", f"{d}/r.json", "--lock", f"{d}/l.json",
              "--workdir", f"{d}/wd"]
        variants = {
            "python S": [sys.executable, *args],
            "oomguard run --no-probe -- python S": [*og, "--no-probe", "--", sys.executable, *args],
            "oomguard run -- python S (with probe)": [*og, "--", sys.executable, *args],
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.runs):
            for name, cmd in variants.items():
                times[name].append(timed(cmd, d))
    base = statistics.median(times["python S"])
    print(f"{'variant':<40} {'median':>8} {'overhead':>9}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<40} {m:>7.2f}s {100 * (m - base) / base:>+8.1f}%")


if __name__ == "__main__":
    main()
