"""How long `oomguard --help` takes (target: 0.3 s), against a bare Python start, and that it never imports torch.

    python bench/startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(cmd: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=15)
    a = p.parse_args()
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("oomguard --help", [sys.executable, "-m", "oomguard", "--help"]),
        ("oomguard run --help", [sys.executable, "-m", "oomguard", "run", "--help"]),
        ("oomguard ladders", [sys.executable, "-m", "oomguard", "ladders"]),
    ]
    print(f"{'command':<22} {'median':>8} {'min':>8} {'max':>8}")
    for name, cmd in rows:
        t = timed(cmd, a.runs)
        print(f"{name:<22} {statistics.median(t):>7.3f}s {min(t):>7.3f}s {max(t):>7.3f}s")
    torch = subprocess.run([sys.executable, "-c", "import sys, oomguard.cli, oomguard.run.supervisor; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True).stdout.strip()
    print(f"torch imported by the supervisor: {torch}")


if __name__ == "__main__":
    main()
