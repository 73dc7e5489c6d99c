"""The pre-flight's stop rate and false-stop rate over the real H100 rows, at several margins.

    python bench/preflight_margin.py [--rows tests/fixtures/h100/calibration.jsonl ...]

Each calibration row (a GRPO config measured on an H100: its device use, reserved peak plus context) is put on cards
from 50% to 130% of its measured use, one per percent. On a card at least as large as its use the config fits, and a
stop there is a false stop (an OOM that would not have happened, traded for a climb); on a smaller card a stop saves
an OOM. The built-in coefficients predict each row; the margin is how far over the card a prediction must be before
the pre-flight stops it. ``default`` is the margin oomguard uses on a GPU without a machine calibration
(``oomguard.decide.plan.Judge.stop_margin``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_calibrate import load_rows, measured_device, predict, row_config  # noqa: E402

from oomguard.decide.judge import Judge  # noqa: E402
from oomguard.memory.estimate import Coefficients  # noqa: E402

DEFAULT_ROWS = [ROOT / "tests" / "fixtures" / "h100" / n for n in ("calibration.jsonl", "calibration-q3b.jsonl")]


def rates(pairs: list[tuple[int, int]], margin: float) -> tuple[int, int, int, int]:
    """(false stops, cards the config fits, stops, cards it does not fit) over the sweep of card sizes."""
    false_stops = fitting = stops = over = 0
    for predicted, measured in pairs:
        for pct in range(50, 131):
            cap = measured * pct // 100
            stopped = predicted > cap * (1 + margin)
            if measured <= cap:
                fitting += 1
                false_stops += stopped
            else:
                over += 1
                stops += stopped
    return false_stops, fitting, stops, over


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", type=Path, default=DEFAULT_ROWS)
    a = p.parse_args()
    co = Coefficients()
    pairs = []
    for path in a.rows:
        for r in load_rows(path).values():
            pairs.append((predict(row_config(r), co, 80 * 2**30).peak_bytes, measured_device(r, co)[0]))
    worst = max(pr / m - 1 for pr, m in pairs)
    default = Judge(16 * 2**30).stop_margin()[0]
    print(f"{len(pairs)} H100 rows; the built-in fit predicts at most {100 * worst:.1f}% over a row's device use")
    print(f"{'margin':>14} {'false stops':>14} {'stop rate (cards too small)':>30}")
    for m in sorted({0.0, 0.05, default, 0.10, 0.15, 0.20}):
        fs, fitting, stops, over = rates(pairs, m)
        label = f"{100 * m:.1f}%" + (" (default)" if m == default else "")
        print(f"{label:>14} {f'{fs}/{fitting}':>14} {f'{stops}/{over} = {100 * stops / over:.1f}%':>30}")


if __name__ == "__main__":
    main()
