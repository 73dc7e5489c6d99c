"""`oomguard analyze` on a large log: throughput and peak memory (targets: >= 200 MB/s, < 200 MB RSS for 1 GB).

It writes a realistic training log (progress bars, loss dicts, warnings, lines that mention memory) with a planted OOM
every few hundred MB, runs `oomguard analyze --json` on it as a separate process, and reports wall time, MB/s, the
child's peak RSS and whether every planted OOM was found.

    python bench/analyze_throughput.py [--size 1GiB] [--keep PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oomguard.vocab.sizes import parse_size  # noqa: E402

LINES = [
    " 12%|█▏        | 118/1000 [1:02:13<7:45:02, 31.63s/it]\n",
    "{'loss': 0.0132, 'grad_norm': 0.41, 'learning_rate': 9.8e-07, 'reward': 0.61, 'completions/mean_length': 412.5,"
    " 'epoch': 0.12}\n",
    "[rank0]:[W1104 10:12:09.412] ProcessGroupNCCL.cpp:4115] using GPU 0 to perform barrier as devices used by this "
    "process are currently unknown\n",
    "INFO 05-14 09:01:31 [gpu_model_runner.py:1340] Model loading took 2.88 GiB memory and 3.12 seconds\n",
    "2024-05-01 12:00:00,123 - INFO - step 1234 gpu_mem_allocated=12.3GiB peak_memory=14.1GiB\n",
    "wandb: Tracking run with wandb version 0.19.4\n",
]
OOM = (ROOT / "examples" / "logs" / "grpo_rtx3080.log").read_bytes()


def write_log(path: Path, size: int, plant_every: int) -> int:
    chunk = "".join(LINES * 2000).encode()
    planted, written, next_plant = 0, 0, plant_every
    with open(path, "wb") as f:
        while written < size:
            f.write(chunk)
            written += len(chunk)
            if written >= next_plant:
                f.write(OOM)
                written += len(OOM)
                planted += 1
                next_plant += plant_every
    return planted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--plant-every", default="200MiB")
    p.add_argument("--keep", default=None, help="write the log here (and keep it)")
    a = p.parse_args()
    size = parse_size(a.size)
    with tempfile.TemporaryDirectory() as d:
        log = Path(a.keep) if a.keep else Path(d) / "train.log"
        planted = write_log(log, size, parse_size(a.plant_every))
        actual = log.stat().st_size
        os.system(f"cat {log} > /dev/null")  # warm the page cache: measure analyze, not the disk
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "oomguard", "analyze", "--json", str(log)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate()
        wall = time.perf_counter() - t
        import resource

        # the largest RSS among finished children: the analyze process (the cache-warming `cat` is tiny)
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        found = len(json.loads(out)["findings"])
    print(f"{'log size':>10} {'seconds':>8} {'MB/s':>8} {'peak RSS':>10} {'planted':>8} {'found':>6}")
    print(f"{actual / 1e6:>8.0f}MB {wall:>8.2f} {actual / 1e6 / wall:>8.0f} {rss / 1e6:>8.0f}MB {planted:>8} "
          f"{found:>6}")
    if found != planted:
        print(f"MISMATCH: planted {planted}, found {found}\n{err.decode()[-2000:]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
