"""Shared helpers for tests that run `oomguard` as users do: a subprocess, a report file, its JSON."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
TINY = str(SCRIPTS / "grpo_tiny.py")

# The interpreter running the tests, never whatever `python`, `torchrun` or `accelerate` comes first on PATH (a
# system Python without TRL, another venv's launcher).
PYTHON = sys.executable
TORCHRUN = (PYTHON, "-m", "torch.distributed.run")
ACCELERATE_LAUNCH = (PYTHON, "-m", "accelerate.commands.launch")


def load_bench(name: str) -> Any:
    """``bench/NAME.py`` as a module (bench scripts are not a package), registered as ``bench_NAME`` so that its
    dataclasses and doctests resolve."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = mod
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    """A TCP port free right now: concurrent test runs on one machine must not meet on torch's default 29500."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_without_launchers() -> dict[str, str]:
    """``PATH`` without any directory that holds a ``python``, ``torchrun`` or ``accelerate``: a test run with it
    shows its commands reach this interpreter and its launchers by themselves, not through PATH."""
    bare = ("python", "torchrun", "accelerate")
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any(os.access(os.path.join(d, name), os.X_OK) for name in bare)]
    return {"PATH": os.pathsep.join(keep)}


def grpo_tiny(model: str, output_dir: Path | str, *args: str) -> list[str]:
    """The command that runs tests/scripts/grpo_tiny.py on ``model`` with this interpreter."""
    return [PYTHON, TINY, "--model", model, "--output-dir", str(output_dir), *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    """``torchrun --nproc_per_node N ARGS`` through this interpreter, on a free port."""
    return [*TORCHRUN, "--nproc_per_node", str(nproc), "--master_port", str(free_port()), *args]


def accelerate_launch(nproc: int, *args: str) -> list[str]:
    """``accelerate launch --multi_gpu --num_processes N ARGS`` through this interpreter, on a free port (without
    GPUs, ``--multi_gpu`` starts CPU ranks over gloo)."""
    return [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", str(nproc), "--main_process_port", str(free_port()),
            *args]


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


def once_per_session(tmp_path_factory: Any, name: str, run: Callable[[Path], Any]) -> Any:
    """``run(directory)``'s JSON-able result, computed once per test session however many pytest-xdist workers ask
    (one end-to-end run whose several outcomes separate tests assert: a test marked xfail for one of them costs no
    second launch). The other workers wait for it and read it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, not one worker's
    path = shared / f"once-{name}.json"
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return json.loads(path.read_text())
        result = run(tmp_path_factory.mktemp(name))
        path.write_text(json.dumps(result))
        return result


def reads_as_under_python(stderr: str, workdir: Path, launcher: str | None, attempt: int = 1) -> None:
    """A real OOM reads the same whatever launched it: the training process's trimmed traceback and oomguard's line
    naming its crash record on the terminal, and what a launcher printed after it (``launcher``: its error's name, a
    ChildFailedError or CalledProcessError traceback, with torchrun's error summary and the other ranks' errors at
    the collective) in a file of the attempt, named on the terminal, never on it."""
    adir = f"runs/*/attempt-{attempt}"
    records = {str(p) for p in workdir.glob(f"{adir}/crash-*.json")}
    said = re.findall(r"^oomguard: out of memory; the last \d+ of \d+ frames are above; (\S+) keeps the full "
                      r"traceback$", stderr, re.M)
    assert said and set(said) <= records, stderr[-3000:]
    assert stderr.count("Traceback (most recent call last)") == 1, stderr[-3000:]  # the training process's, trimmed
    assert "ChildFailedError" not in stderr and "CalledProcessError" not in stderr and "[rank0]" not in stderr
    aside = list(workdir.glob(f"{adir}/after-stop.log"))
    if launcher:
        assert aside and launcher in aside[0].read_text(), stderr[-3000:]
        assert "what the command printed after the out-of-memory error" in stderr and str(aside[0]) in stderr
    else:
        assert not aside


def events_of(tmp: Path, attempt: int) -> list[dict]:
    """The events attempt ``attempt`` of a run whose workdir is ``tmp / "wd"`` (``run_oomguard``'s) wrote."""
    path = next((tmp / "wd").glob(f"runs/*/attempt-{attempt}/events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def story(report: dict | None) -> str:
    """Each attempt of a report in one line (outcome, kind, OOM kind, note, override error): an assertion's message,
    so a failure on CI says why an attempt ended as it did."""
    if report is None:
        return "no report"
    lines = []
    for a in report.get("attempts", []):
        oom = a.get("oom") or {}
        lines.append(f"#{a.get('index')} {a.get('outcome')} ({a.get('kind')}) oom={oom.get('kind')} "
                     f"note={a.get('note')!r} override_error={a.get('override_error')!r} "
                     f"remedies={a.get('remedies')} climbed={a.get('climbed')!r}")
    return "\n".join(lines)


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


def wait_until(ready: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """``ready()``'s first true value, polled every ``every`` seconds; an AssertionError naming ``what`` once
    ``timeout`` seconds have passed without one. How a test waits for another process: for what it waits for, never
    for a guessed length of time (a sleep that is enough on an idle machine is not on a loaded one)."""
    deadline = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(every)


def still_alive(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Those of ``pids`` still alive once ``timeout`` seconds have passed (polled: a killed process may take a moment
    to die; at once when all are gone)."""
    try:
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout, "gone")
    except AssertionError:
        pass
    return [p for p in pids if pid_alive(p)]


def model_from_env(chosen: str | None, fallback: Callable[[], str]) -> str:
    """OOMGUARD_TEST_MODEL's directory (``chosen``) if it holds, or may take, the tests' model; else ``fallback()``.

    The end-to-end budgets are byte-exact for the builder's model: a build there is reused only if its stamp matches
    the builder, an outdated build of ours is rebuilt, and anything else is left alone with a warning.
    """
    if chosen:
        from build_tiny_model import ForeignModelDir, build

        try:
            return str(build(Path(chosen)))
        except ForeignModelDir as e:
            warnings.warn(f"OOMGUARD_TEST_MODEL ignored: {e}", stacklevel=2)
    return fallback()


def trl_head() -> str:
    """The LM head of the TRL this interpreter has (``oomguard.child.trlcompat``): ``fused`` (TRL 1.15 on) or
    ``logits`` (0.29-1.14). The end-to-end budgets are byte-exact, and the two heads take different memory on the
    simulated device, so a test that runs under both ends of the range (marker ``core``, tests/compat.sh) picks its
    figures by it."""
    from oomguard.child import trlcompat

    return trlcompat.features().head


def by_head(*, fused, logits):
    """``fused`` or ``logits``, whichever the installed TRL's LM head is (see :func:`trl_head`)."""
    return fused if trl_head() == "fused" else logits
