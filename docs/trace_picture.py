"""Draw the picture of docs/how-to/late-ooms.md: a real run's memory trace (tests/fixtures/trace/grpo_leak_160mib.jsonl:
the tests' tiny model under TRL's GRPOTrainer on a 160 MiB simulated device, a reward function keeping 6 MiB a step),
as `oomguard analyze --html` draws it (oomguard/display/trace_chart.py), into docs/images/late-oom-trace.svg and, where
rsvg-convert is installed, the PNG beside it.

    python docs/trace_picture.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oomguard.display.trace_chart import trace_svg  # noqa: E402
from oomguard.oom.analyze import analyze_paths  # noqa: E402

TRACE = ROOT / "tests" / "fixtures" / "trace" / "grpo_leak_160mib.jsonl"
OUT = ROOT / "docs" / "images" / "late-oom-trace"
OOM_STEP = 12  # the run's log: "CUDA out of memory. Tried to allocate 22.00 MiB" during step 12


def main() -> None:
    (trend,) = analyze_paths([str(TRACE)]).trends
    svg = trace_svg(trend["samples"], capacity=trend["capacity_bytes"], verdicts=trend["verdicts"],
                    oom_step=OOM_STEP, title="A reward function keeping 6 MiB a step (tiny model, 160 MiB device)")
    OUT.with_suffix(".svg").write_text(svg + "\n", encoding="utf-8")
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "--zoom", "1.5", "-o", str(OUT.with_suffix(".png")), str(OUT.with_suffix(".svg"))],
                       check=True)
    print("\n".join(trend["evidence"]))


if __name__ == "__main__":
    main()
