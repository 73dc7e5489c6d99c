"""The cost of `oomguard run -- python S` over `python S` when nothing goes wrong, with oomguard's default options.

S is the example GRPO script on its tiny offline model (a real TRL run on CPU). The variants run in alternating
pairs with `python S` (--runs pairs each), and the table gives each one's median and the median of its paired
overheads (target for the default options: within 15%):

- `oomguard run -- python S`: the default options as they run here. On a machine without an accelerator nothing is
  probed (a probe could run out of nothing), so this is one launch: the supervisor and the bootstrap.
- `oomguard run --simulate-gpu 4xPEAK -- python S`: the default options on a rehearsed device four times the
  script's own peak (measured first): the training process finds the memory model sure of the config and the launch
  is the real run, as on a GPU far from its edge. Its overhead includes the simulated device's own per-operation
  dispatch (`python bench/launch_cost.py` measures that apart), which a real GPU does not pay.
- `oomguard run --always-probe --simulate-gpu 4xPEAK -- python S`: the same with a probe first, oomguard's
  default before the memory model decided: two launches.

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
import json
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
        subprocess.run([*og, "--simulate-gpu", "64GiB", "--no-probe", "--", sys.executable, *args], cwd=d,
                       check=True, capture_output=True)
        peak = json.loads(Path(f"{d}/r.json").read_text())["attempts"][-1]["peak_bytes"]
        device = str(4 * int(peak))
        variants = {
            "oomguard run -- python S": [*og, "--", sys.executable, *args],
            "oomguard run --simulate-gpu 4xPEAK -- python S": [*og, "--simulate-gpu", device, "--", sys.executable,
                                                               *args],
            "  the same with --always-probe": [*og, "--always-probe", "--simulate-gpu", device, "--", sys.executable,
                                               *args],
        }
        bare: list[float] = []
        times: dict[str, list[float]] = {k: [] for k in variants}
        ratios: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.runs):
            for name, cmd in variants.items():
                b = timed([sys.executable, *args], d)
                t = timed(cmd, d)
                bare.append(b)
                times[name].append(t)
                ratios[name].append(t / b - 1)
    print(f"{'variant':<50} {'median':>8} {'overhead':>9}   (S: {a.max_steps} steps; peak {peak / 2**20:.0f} MiB)")
    print(f"{'python S':<50} {statistics.median(bare):>7.2f}s")
    for name, ts in times.items():
        print(f"{name:<50} {statistics.median(ts):>7.2f}s {100 * statistics.median(ratios[name]):>+8.1f}%")
    print("(overhead: the median of the paired overheads, each variant run right after a bare run; target for the "
          "default options: within 15%)")


if __name__ == "__main__":
    main()
