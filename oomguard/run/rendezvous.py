"""Where the nodes of a job meet: torch's Store, held by a helper process (oomguard/child/storesync.py) that the
supervisor, which never imports torch, starts with the training environment's Python and calls through a pipe.

A ``FileStore`` in the group's directory (``--group DIR``, which every node sees), or a ``TCPStore`` at torchrun's
rendezvous host, at the rendezvous port plus one (``launch.store_port``; ``OOMGUARD_GROUP_PORT`` names another), when
the command is torchrun on several nodes with a rendezvous and no directory was named (torchrun's own store lives only
while an attempt runs; the group, from before the first to after the last). ``HelperStore`` has the Store's methods,
so the group's protocol (oomguard/run/group.py) is written once, for both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from .launch import PORT_ENV, GroupError, Membership

HELPER = Path(__file__).resolve().parent.parent / "child" / "storesync.py"
OPS = ("set", "get", "add", "check", "wait", "compare_set")  # the Store's methods the group calls
CLOSE_WAIT = 75.0  # the host's helper stays until every node has read the end (60 s at most)


def training_python(argv: Sequence[str]) -> str:
    """The Python that runs the command: its interpreter, a console script's shebang interpreter (``torchrun``),
    else this one.

    >>> training_python([sys.executable, "-m", "torch.distributed.run"]) == sys.executable
    True
    """
    first = shutil.which(argv[0]) or argv[0] if argv else sys.executable
    if Path(first).name.startswith("python"):
        return first
    try:
        with open(first, "rb") as f:
            line = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return sys.executable
    parts = line[2:].split() if line.startswith("#!") else []
    if parts and Path(parts[0]).name == "env" and len(parts) > 1:
        return shutil.which(parts[1]) or sys.executable
    return parts[0] if parts and Path(parts[0]).name.startswith("python") else sys.executable


class HelperStore:
    """torch's Store in a helper process: its methods (``OPS``) answer text for bytes; a wait that runs out raises
    TimeoutError, a store that stopped answering GroupError."""

    def __init__(self, proc: subprocess.Popen[str], role: str, endpoint: str | None) -> None:
        self.proc, self.role, self.endpoint = proc, role, endpoint
        self.lock, self.calls = threading.Lock(), 0  # one call at a time: the heartbeat's thread shares the pipe

    @classmethod
    def start(cls, pythons: Sequence[str], spec: dict[str, Any], waiting: Callable[[], None] = lambda: None,
              after: float = 30.0) -> HelperStore:
        """The first of ``pythons`` that can import torch.distributed, holding the store ``spec`` names (``file``, or
        ``host`` and ``port``); ``waiting`` is called once a client has waited ``after`` seconds for the host."""
        tried = []
        for python in dict.fromkeys(pythons):
            try:
                proc = subprocess.Popen([python, str(HELPER), json.dumps(spec)], stdin=subprocess.PIPE, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                        env={k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_PLAN")})
            except OSError as e:
                tried.append(f"{python} ({e.strerror})")
                continue
            said: dict[str, Any] = {}
            timer = threading.Timer(after, waiting)
            timer.start()
            try:
                said = json.loads(proc.stdout.readline() or "{}") if proc.stdout else {}
            finally:  # whatever ends the wait (Ctrl-C too), a helper that is not ready goes
                timer.cancel()
                if said.get("event") != "ready":
                    cls(proc, "", None).close(wait=5)
            if said.get("event") == "ready":
                return cls(proc, str(said["role"]), None if "file" in spec else f"{spec['host']}:{spec['port']}")
            if said.get("torch") is not False:
                raise GroupError(f"the group's store cannot start: {said.get('why') or f'{python} exited'}")
            tried.append(f"{python} (no torch.distributed)")
        raise GroupError("the nodes meet through torch.distributed's store, which no Python here can import (tried "
                         f"{', '.join(tried)}): run oomguard from the training environment")

    def _call(self, op: str, *args: Any) -> Any:
        args = tuple(a.total_seconds() if isinstance(a, timedelta) else a for a in args)
        with self.lock:
            self.calls += 1
            try:
                assert self.proc.stdin is not None and self.proc.stdout is not None
                self.proc.stdin.write(json.dumps({"id": self.calls, "op": op, "args": args}) + "\n")
                self.proc.stdin.flush()
                said: dict[str, Any] = {"id": None}
                while said.get("id", self.calls) != self.calls:  # the answer to a call an interrupt cut short
                    said = json.loads(self.proc.stdout.readline() or '{"error": "the helper exited"}')
            except (OSError, ValueError) as e:
                said = {"error": f"the helper's pipe broke ({e})"}
        if said.get("timeout"):
            raise TimeoutError(f"no {args[0]} within {args[1]} s")
        if "error" in said:
            raise GroupError(f"the group's store {self.endpoint or ''} stopped answering ({said['error']})")
        return said["ok"]

    def __getattr__(self, op: str) -> Callable[..., Any]:  # set, get, add, check, wait, compare_set: as torch's
        if op not in OPS:
            raise AttributeError(op)
        return lambda *args: self._call(op, *args)

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """This node is done: the helper says goodbye (a host waits for the other nodes' goodbyes)."""
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


def open_store(m: Membership, argv: Sequence[str], waiting: Callable[[], None], after: float) -> HelperStore:
    """The group's store for ``m``: a TCPStore at torchrun's rendezvous host where ``m`` names one, else a FileStore
    in the group's directory; its helper runs with the command's Python, else this one, else ``python3``."""
    base = Path(m.root) / m.job
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GroupError(f"cannot use {base} for the group ({e.strerror}): pass --group DIR, a directory every node of "
                         "the job can write") from None
    spec = {"host": m.store[0], "port": m.store[1], "node": m.node, "nodes": m.nodes} if m.store else \
        {"file": str(base / "store")}
    return HelperStore.start([training_python(argv), sys.executable, shutil.which("python3") or sys.executable], spec,
                             waiting, after)


__all__ = ["PORT_ENV", "HelperStore", "open_store", "training_python"]
