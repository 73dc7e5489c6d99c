"""Find the smallest simulated-device budget each configuration fits in, from one recorded run each.

Runs the command once under `oomguard run --simulate-gpu 64GiB` with OOMGUARD_SIMULATE_TRACE set, then replays the
allocation trace through the caching-allocator model at other budgets (bisection, milliseconds per try). Prints a
table: configuration, peak allocated, peak reserved with no limit, smallest budget without and with expandable
segments, and the OOM kind just below that budget.

    python bench/min_budget.py --model DIR -- --max-completion-length 64      # extra args go to grpo_tiny.py
    python bench/min_budget.py --script examples/grpo_gsm8k.py                # any script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _trace import min_capacity, read_trace, replay  # noqa: E402  (bench/_trace.py: the allocator-model replay)

from oomguard.vocab.sizes import MiB  # noqa: E402


def analyse(events: list, extra: dict) -> dict:
    plain = min_capacity(events, False)
    exp = min_capacity(events, True)
    below = replay(events, plain - MiB, False)[1]
    kind = "fragmentation" if below.get("reserved", 0) - below.get("allocated", 0) >= below.get("request", 1) else "other"
    return {**extra, "min_budget": plain, "min_budget_expandable": exp, "kind_below": kind, "events": len(events)}


def verdict(events: list, budget: int, expandable: bool) -> str:
    """'fits', or the diagnosis kind of the OOM at this budget."""
    from oomguard.oom.diagnose import diagnose
    from oomguard.vocab.oomreport import OOMReport

    ok, facts = replay(events, budget, expandable)
    if ok:
        return "fits"
    r = OOMReport("cuda", "allocator", "replay", requested=facts["request"], capacity=budget,
                  free=max(0, budget - facts["reserved"]), allocated=facts["allocated"],
                  reserved_unallocated=facts["reserved"] - facts["allocated"])
    return diagnose(r).kind


def measure(script: list[str], env: dict[str, str] | None = None, overrides: dict | None = None,
            save_trace: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.txt"
        report = Path(d) / "report.json"
        replay_args: list[str] = []
        if overrides:
            lock = Path(d) / "overrides.lock.json"
            lock.write_text(json.dumps({"schema": "oomguard.lock/1", "overrides": overrides}))
            replay_args = ["--config", str(lock)]
        cmd = [sys.executable, "-m", "oomguard", "run", "--quiet", "--no-probe", "--no-predict", "--simulate-gpu", "64GiB",
               "--report", str(report),
               "--lock", str(Path(d) / "lock.json"), "--workdir", str(Path(d) / "wd"), *replay_args, "--",
               sys.executable, *script]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=d,
                             env={**os.environ, **(env or {}), "OOMGUARD_SIMULATE_TRACE": str(trace)})
        if out.returncode != 0:
            raise SystemExit(f"the run failed ({out.returncode}):\n{out.stderr[-3000:]}")
        if save_trace:
            import shutil

            shutil.copy(trace, save_trace)
        events, _ = read_trace(str(trace))
        rep = json.loads(report.read_text())
    return analyse(events, {"peak_alloc": rep["attempts"][0]["peak_bytes"],
                            "peak_reserved": rep["attempts"][0]["peak_reserved_bytes"]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--script", default=str(ROOT / "tests" / "scripts" / "grpo_tiny.py"))
    p.add_argument("--model", help="model dir for grpo_tiny.py")
    p.add_argument("--override", action="append", default=[], metavar="KNOB=VALUE",
                   help="an oomguard knob to force (as a replayed lock would), e.g. load_in_4bit=true")
    p.add_argument("--env", action="append", default=[], metavar="VAR=VALUE")
    p.add_argument("--save-trace", metavar="PATH", help="keep the allocation trace")
    p.add_argument("--trace", metavar="PATH", help="analyse a saved trace instead of running anything")
    p.add_argument("--at", metavar="SIZES", help="comma-separated budgets: print fits/OOM kind at each")
    p.add_argument("rest", nargs="*", help="arguments for the script (after --)")
    a = p.parse_args()
    args = list(a.rest)
    if a.model:
        args = ["--model", a.model, "--output-dir", tempfile.mkdtemp(), *args]
    from oomguard.vocab.knobs import parse_knob
    from oomguard.vocab.sizes import parse_size

    if a.trace:
        events, _ = read_trace(a.trace)
        r = analyse(events, {"peak_alloc": 0, "peak_reserved": 0})
        print(f"{a.trace}: min budget {r['min_budget'] / MiB:.0f}MiB, with expandable segments "
              f"{r['min_budget_expandable'] / MiB:.0f}MiB")
        for b in (a.at or "").split(","):
            if b:
                n = parse_size(b)
                print(f"  at {b}: plain {verdict(events, n, False)}, expandable {verdict(events, n, True)}")
        return

    overrides = {}
    for item in a.override:
        k, _, v = item.partition("=")
        overrides[k] = parse_knob(k, v)
    env = dict(item.partition("=")[::2] for item in a.env)
    r = measure([a.script, *args], env, overrides, a.save_trace)
    print(f"{'config':<50} {'peak alloc':>11} {'peak resv':>10} {'min budget':>11} {'min (exp.)':>11} below")
    label = " ".join([*a.rest, *a.override, *a.env])
    print(f"{label[:50]:<50} {r['peak_alloc'] / MiB:>9.1f}Mi {r['peak_reserved'] / MiB:>8.1f}Mi "
          f"{r['min_budget'] / MiB:>9.0f}Mi {r['min_budget_expandable'] / MiB:>9.0f}Mi {r['kind_below']}")


if __name__ == "__main__":
    main()
