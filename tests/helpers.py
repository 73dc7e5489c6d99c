"""Shared helpers for tests that run `oomguard` as users do: a subprocess, a report file, its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


def run_oomguard(tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600,
                 **kw) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`python -m oomguard run` with its report, lock and workdir in ``tmp``; returns the process and the report."""
    report = tmp / "report.json"
    cmd = [sys.executable, "-m", "oomguard", "run", "--report", str(report), "--lock", str(tmp / "lock.json"),
           "--workdir", str(tmp / "wd"), *args]
    full_env = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=full_env, timeout=timeout, **kw)
    data = json.loads(report.read_text()) if report.exists() else None
    return out, data


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
