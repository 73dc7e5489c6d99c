"""The group of a torchrun job's nodes, met through torchrun's rendezvous host instead of a shared directory.

Each node's group directory stays on its own disk; a helper process (oomguard/child/storesync.py, run with the training
environment's Python, since the supervisor never imports torch) mirrors it between the nodes through a TCPStore on
the rendezvous host, at the rendezvous port plus one (``launch.store_port``; ``OOMGUARD_GROUP_PORT`` names another).
torchrun's own c10d store cannot serve: it lives only while an attempt runs, and the group lives from before the
first attempt to after the last. The group protocol (oomguard/run/group.py) does not know the difference.

Used when the command is torchrun with a rendezvous on several nodes and no ``--group`` (nor ``$OOMGUARD_GROUP``)
names a shared directory; where the helper cannot run (no torch in the training environment), the nodes meet in
the directory as before, and say so.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_none

from .launch import PORT_ENV, GroupError, Membership

HELPER = Path(__file__).resolve().parent.parent / "child" / "storesync.py"
READY_WAIT = 20.0  # how long the supervisor waits for the helper's first word before it goes on without it
CLOSE_WAIT = 75.0  # the host's helper stays until every node has read the end (60 s at most)


def training_python(argv: Sequence[str]) -> str:
    """The Python that runs the command: its interpreter, a console script's shebang interpreter (``torchrun``),
    else this one.

    >>> training_python([sys.executable, "-m", "torch.distributed.run"]) == sys.executable
    True
    """
    first = argv[0] if argv else sys.executable
    if Path(first).name.startswith("python"):
        return shutil.which(first) or first
    path = shutil.which(first) or first
    try:
        with open(path, "rb") as f:
            line = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return sys.executable
    if line.startswith("#!"):
        parts = line[2:].split()
        if parts and Path(parts[0]).name == "env" and len(parts) > 1:
            return shutil.which(parts[1]) or sys.executable
        if parts and Path(parts[0]).name.startswith("python"):
            return parts[0]
    return sys.executable


class StoreSync:
    """The helper process of one node: start it, learn its role, relay what it says, close it at the end."""

    def __init__(self, m: Membership, python: str) -> None:
        assert m.store is not None
        self.m = m
        self.python = python
        self.host, self.port = m.store
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.role: str | None = None
        self.error: str | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, wait: float = READY_WAIT) -> None:
        """Start the helper and wait for it to host the store or reach it, up to ``wait`` seconds (a client keeps
        trying after that, saying so every 30 s); raises GroupError when it cannot run at all."""
        directory = Path(self.m.root) / self.m.job
        env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_PLAN")}
        cmd = [self.python, str(HELPER), "--dir", str(directory), "--host", self.host, "--port", str(self.port),
               "--node", str(self.m.node), "--nodes", str(self.m.nodes), "--job", self.m.job]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True, env=env, start_new_session=True)
        except OSError as e:
            raise GroupError(f"cannot start {self.python} for the group's store ({e.strerror})") from None
        threading.Thread(target=self._read, name="oomguard-group-store", daemon=True).start()
        # each look waits up to 0.2 s for the helper's next line; past ``wait`` the supervisor goes on without its role
        Retrying(stop=stop_after_delay(wait), wait=wait_none(), retry=retry_if_result(lambda heard: not heard),
                 retry_error_callback=lambda state: False)(self._heard, 0.2)
        if self.error is not None:
            self.close(wait=5)
            raise GroupError(self.error)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                continue
        self.lines.put({"event": "exited", "code": self.proc.wait()})

    def _heard(self, timeout: float) -> bool:
        """Whether the helper has said its role or why it cannot run, after waiting up to ``timeout`` for a line."""
        self.poll(timeout=timeout)
        return self.role is not None or self.error is not None

    def poll(self, timeout: float = 0.0) -> None:
        """Take what the helper said: its role, or why it cannot run."""
        try:
            msg = self.lines.get(timeout=timeout) if timeout else self.lines.get_nowait()
        except queue.Empty:
            return
        event = msg.get("event")
        if event == "ready":
            self.role = str(msg.get("role"))
        elif event == "error" or (event == "exited" and self.role is None and self.error is None):
            self.error = str(msg.get("why") or f"the group's store helper exited ({msg.get('code')})")
        # "waiting" (the host cannot be reached yet): the group's own wait says so, once (its before_sleep hook)

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """This node is done: the helper publishes its last files and says goodbye (the host waits for the others)."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


__all__ = ["PORT_ENV", "StoreSync", "training_python"]
