"""The group's store, held for a supervisor that never imports torch: a ``torch.distributed`` Store behind a pipe.

oomguard/run/rendezvous.py starts this helper with the training environment's Python (standard library and torch only)
and calls the Store's methods through its standard streams, one JSON line each way: ``{"id": 7, "op": "add", "args":
["session", 1]}`` is answered ``{"id": 7, "ok": 1}`` (``"timeout": true`` when a ``wait`` runs out, else ``"error"``).
Its first line is ``{"event": "ready", "role": R}``: ``file`` (a FileStore), ``host`` (it hosts the TCPStore: the
rendezvous host is this machine and the port was free, torchrun's own rule) or ``client`` (once the host answers:
torch's client keeps trying until the join timeout); else ``{"event": "error", "why": ...}``. When the supervisor
closes its stdin, the helper says goodbye (``bye/<node>``); a host stays until every node has (60 s at most), so that
none misses the end.

    python storesync.py '{"file": PATH}' | '{"host": H, "port": P, "node": I, "nodes": N}'
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from datetime import timedelta
from typing import Any

LINGER = 60.0
OP_TIMEOUT = timedelta(seconds=60)  # a get of a key that never comes, a host that stopped answering


def say(**data: Any) -> None:
    print(json.dumps(data), flush=True)


def connect(spec: dict[str, Any]) -> tuple[Any, str]:
    """The store ``spec`` names and this helper's role in it."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname  # torchrun's own test

    if "file" in spec:
        return dist.FileStore(spec["file"], -1), "file"
    host, port = spec["host"], int(spec["port"])
    if _matches_machine_hostname(host):
        try:
            return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=OP_TIMEOUT), "host"
        except (RuntimeError, OSError):
            pass  # the port is taken: another node on this machine hosts the store
    wait = timedelta(seconds=float(spec.get("join_timeout", 900)))
    return dist.TCPStore(host, port, is_master=False, timeout=wait), "client"


def main(spec: dict[str, Any]) -> int:
    requests, ready = queue.Queue[Any](), threading.Event()

    def read() -> None:
        for line in sys.stdin:
            requests.put(json.loads(line))
        requests.put(None)
        if not ready.is_set():  # the supervisor left while a client waited for the host
            os._exit(0)

    threading.Thread(target=read, name="stdin", daemon=True).start()
    try:
        import torch.distributed  # noqa: F401
    except Exception as e:
        say(event="error", torch=False, why=f"torch.distributed cannot be imported ({type(e).__name__}: {e})")
        return 2
    try:
        store, role = connect(spec)
        store.set_timeout(OP_TIMEOUT)
    except (RuntimeError, OSError, ValueError) as e:
        say(event="error", why=(str(e).splitlines() or [type(e).__name__])[0][:300])
        return 3
    ready.set()
    say(event="ready", role=role)
    for req in iter(requests.get, None):
        op, args = req["op"], req["args"]
        try:
            out = getattr(store, op)(*args[:-1], timedelta(seconds=args[-1])) if op == "wait" else \
                getattr(store, op)(*args)
            say(id=req["id"], ok=out.decode("utf-8", "replace") if isinstance(out, bytes) else out)
        except Exception as e:
            say(id=req["id"], **{"timeout": True} if op == "wait" and "timeout" in str(e).lower() else
                {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"})
    try:
        if role != "file":
            store.set(f"bye/{spec['node']}", "1")
        if role == "host":  # the store lives here: stay until every node has its last word
            store.wait([f"bye/{j}" for j in range(int(spec["nodes"]))], timedelta(seconds=LINGER))
    except Exception:
        pass  # the host went away, or a node never said goodbye: nothing more to serve
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
