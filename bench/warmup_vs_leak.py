"""Which warm-ups the memory trace calls a leak: the review's traces (2026-11-29, section 3.1) through the real
functions of ``oomguard.oom.trend``.

Kept memory ``base + A (1 - exp(-step / tau))``, the peak moving with it:

- ``assess`` on an 80 GiB device, A = 3 GiB: the trace lengths (in steps) at which the warm-up is called a leak;
- ``at_oom`` on a 24 GiB device, A = 3 GiB, a peak of 21.2-21.4 GiB before the warm-up (a config that is simply too
  tight): the step at which the peak crosses the device, and the verdicts at that OOM;
- the issue-42 client's trace (6 MiB kept a step on 112 MiB, out of memory at step 8), which must stay a leak.

    python bench/warmup_vs_leak.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oomguard.oom.trend import assess, at_oom
from oomguard.vocab.sizes import GiB, MiB
from oomguard.vocab.trace import MemSample


def warm_up(n: int, tau: float, peak_base: float, capacity: int | None = None) -> list[MemSample]:
    rise = [3 * GiB * (1 - math.exp(-s / tau)) for s in range(1, n + 1)]
    return [MemSample(s, kept=round(10 * GiB + r), peak=round(peak_base + r), capacity=capacity)
            for s, r in enumerate(rise, 1)]


def main() -> None:
    print("assess(), 80 GiB, A = 3 GiB: trace lengths called a leak")
    for tau in (2, 2.5, 3, 4, 6, 10):
        hits = [n for n in range(6, 40) if assess(warm_up(n, tau, 30 * GiB), capacity=80 * GiB).leak]
        print(f"  tau={tau:<4} {hits if hits else 'never'}")
    print("at_oom(), 24 GiB, A = 3 GiB: the OOM step and its verdicts")
    for tau in (2.5, 3, 4, 5):
        for base in (21.2, 21.3, 21.4):
            trace = warm_up(40, tau, base * GiB, 24 * GiB)
            oom = next(s.step for s in trace if (s.peak or 0) > 24 * GiB)
            verdicts = [v.kind for v in at_oom(trace[:oom - 1], step=oom, capacity=24 * GiB).verdicts]
            print(f"  tau={tau:<4} peak base {base} GiB: OOM at step {oom:>2} -> {verdicts}")
    leak = [MemSample(s, kept=46 * MiB + 6 * MiB * s, peak=64 * MiB + 6 * MiB * s, capacity=112 * MiB)
            for s in range(1, 8)]
    v = at_oom(leak, step=8).leak
    said = "no leak" if v is None else "a young leak" if getattr(v, "young", False) else "a leak"
    print(f"the issue-42 client at its OOM (step 8, 112 MiB): {said}")


if __name__ == "__main__":
    main()
