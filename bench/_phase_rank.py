"""Run a training script with each GRPO phase's peak recorded on this rank's simulated device (bench/zero_calibrate.py).

    python -m torch.distributed.run --nproc_per_node 2 bench/_phase_rank.py tests/scripts/grpo_tiny.py ARGS...

Runs the script as ``python SCRIPT ARGS`` would (under oomguard, whose bootstrap has started the simulated device),
with the phase boundaries of bench/_phases.py on every GRPOTrainer it trains: the peak of allocated bytes is reset at
each boundary and recorded at the next, so each phase's peak is its own and the largest of them is the process's
peak. Each rank writes ``rank<RANK>.json`` into the directory named by ``OOMGUARD_BENCH_PHASES``:
``{"phases": {phase: peak bytes, max over steps}, "steps": [{phase: peak bytes}, ...]}`` (``setup``: from the start
to the first generation; ``end``: after the last step).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _phases import instrument_phases

ENV = "OOMGUARD_BENCH_PHASES"


class Tracker:
    """Each phase's peak: reset the device's peak at every boundary, record it at the next."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.current = "setup"
        self.records: list[dict[str, int]] = [{}]

    def switch(self, phase: str) -> None:
        rec = self.records[-1]
        rec[self.current] = max(rec.get(self.current, 0), int(self.device.peak))
        self.device.reset_peak()
        self.current = phase

    def next_step(self) -> None:
        self.switch(self.current)
        self.records.append({})

    def write(self, path: Path) -> None:
        steps = [r for r in self.records if r]
        phases: dict[str, int] = {}
        for rec in steps:
            for k, v in rec.items():
                phases[k] = max(phases.get(k, 0), v)
        path.write_text(json.dumps({"phases": phases, "steps": steps}))


def instrument(out: Path) -> None:
    """Wrap ``trl.GRPOTrainer.train`` (after oomguard's own patch, which loads with the class)."""
    import trl

    from oomguard.child import simulate

    cls = trl.GRPOTrainer
    train = cls.train

    def phased_train(self: Any, *a: Any, **kw: Any) -> Any:
        device = simulate.device()
        if device is None:
            raise SystemExit("bench/_phase_rank.py: no simulated device (run it under oomguard run --simulate-gpu)")
        tracker = Tracker(device)
        instrument_phases(self, tracker.switch, tracker.next_step)
        try:
            return train(self, *a, **kw)
        finally:
            tracker.switch("end")
            tracker.write(out / f"rank{os.environ.get('RANK', '0')}.json")

    cls.train = phased_train


def main() -> None:
    out = Path(os.environ[ENV])
    out.mkdir(parents=True, exist_ok=True)
    script, *args = sys.argv[1:]
    instrument(out)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
