"""The README's main job (the CPU demo of an OOM recovery), timed attempt by attempt.

    python bench/demo.py [--simulate-gpu 300MiB] [-- extra args for examples/grpo_gsm8k.py]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--simulate-gpu", default="300MiB")
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "oomguard", "run", "--quiet", "--simulate-gpu", a.simulate_gpu,
                        str(ROOT / "examples" / "grpo_gsm8k.py"), "--output-dir", f"{d}/out", *a.extra],
                       cwd=d, capture_output=True)
        wall = time.perf_counter() - t
        rep = json.loads(Path(d, "oomguard-report.json").read_text())
    print(f"{'attempt':>7} {'kind':<6} {'outcome':<8} {'seconds':>8} {'peak':>11}  then")
    for at in rep["attempts"]:
        peak = f"{at['peak_bytes'] / 2**20:.1f} MiB" if at["peak_bytes"] else "—"
        oom = f"{at['oom']['kind']} during {at['oom']['phase']}: " if at.get("oom") else ""
        print(f"{at['index']:>7} {at['kind']:<6} {at['outcome']:<8} {at['seconds']:>7.1f}s {peak:>11}  "
              f"{oom}{at.get('climbed') or ''}")
    print(f"status {rep['status']}, {len(rep['attempts'])} attempts, {wall:.1f}s in all "
          f"(mean {wall / len(rep['attempts']):.1f}s per attempt, model imports included)")


if __name__ == "__main__":
    main()
