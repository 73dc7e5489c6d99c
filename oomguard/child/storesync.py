"""Mirror a job's group directory between nodes through a TCPStore at torchrun's rendezvous host.

The nodes of a job meet through files (oomguard/run/group.py). Where their working directories are node-local
(Kubernetes pods, a job that runs from a local scratch disk), no node sees another's files; but every node of a
torchrun job reaches the rendezvous host. This helper runs beside each node's supervisor, with the training
environment's Python (the supervisor never imports torch), and keeps the group directory the same on every node:
each file a node writes is published in a ``torch.distributed.TCPStore`` and written on the other nodes.

One store serves the job, on the rendezvous host at ``--port`` (a port of its own, next to torchrun's: torchrun's
rendezvous store lives only while an attempt runs, the group lives from the first attempt to the last). The node on
the rendezvous host hosts it (torchrun's own rule for its c10d store; the first to bind wins where several nodes share
a machine); the others connect. Keys: ``oomguard/<job>/idx/<node>`` (a node's files and their versions),
``f/<path>`` (a file's content), ``v/<path>`` (its version counter), ``bye/<node>``.

Every file has one writer (node I writes ``node-I.json``, ``events-nodeI.jsonl``; the leader the plans and the end), so
the newest version of a path is its content. A file that was there before the helper started is never published (an
earlier job's files on a node-local disk). A heartbeat file rewritten on one node is rewritten on the others, so its
age stays the age of the last word.

It talks to the supervisor through its standard streams: JSON lines on stdout (``ready`` with its role, ``waiting``
every 30 s while the host cannot be reached, ``error``), and the supervisor closes its stdin when it is done. The host
then waits (60 s at most) until every node has said goodbye, so that none misses the leader's last word.

    python storesync.py --dir DIR --host HOST --port PORT --node I --nodes N --job JOB
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import click
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    stop_when_event_set,
    wait_fixed,
)

POLL = 0.25
SAY_EVERY = 30.0
RECONNECT_EVERY = 1.0
LINGER = 60.0
UNREACHABLE = (RuntimeError, OSError, ValueError)  # what torch's TCPStore raises while nobody listens at the port


def say(event: str, **data: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **data}) + "\n")
    sys.stdout.flush()


def on_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine (torchrun's own test for hosting its c10d store, where available)."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        return bool(_matches_machine_hostname(host))
    except Exception:
        pass
    if host in ("localhost", "127.0.0.1", "::1") or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        return any(a[4][0] in mine for a in socket.getaddrinfo(host, None))
    except OSError:
        return False


def connect(host: str, port: int, within: float, closed: threading.Event) -> tuple[Any, str]:
    """The store and this node's role in it: the host where ``host`` is this machine and the port is free, else a
    client, which tries again every second (saying ``waiting`` every 30 s) for ``within`` seconds or until the
    supervisor closes (``closed``); raises TimeoutError then."""
    import torch.distributed as dist

    if on_this_machine(host):
        try:
            return dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=30),
                                 wait_for_workers=False), "host"
        except UNREACHABLE:
            pass  # the port is taken: another node on this machine hosts the store
    said = 0.0

    def waiting(state: RetryCallState) -> None:
        nonlocal said
        waited = state.seconds_since_start or 0.0
        if waited - said >= SAY_EVERY:
            said = waited
            say("waiting", seconds=round(waited), endpoint=f"{host}:{port}", why=str(_failure(state))[:200])

    def gave_up(state: RetryCallState) -> NoReturn:
        raise TimeoutError(f"no store at {host}:{port} after {state.seconds_since_start or 0.0:.0f} s "
                           f"({_failure(state)})")

    def client() -> tuple[Any, str]:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5)), "client"

    return Retrying(stop=stop_after_delay(within) | stop_when_event_set(closed), wait=wait_fixed(RECONNECT_EVERY),
                    retry=retry_if_exception_type(UNREACHABLE), before_sleep=waiting,
                    retry_error_callback=gave_up)(client)


def _failure(state: RetryCallState) -> BaseException | None:
    assert state.outcome is not None
    return state.outcome.exception()


class Mirror:
    """One node's side of the directory mirror."""

    def __init__(self, store: Any, root: Path, node: int, nodes: int, job: str) -> None:
        self.store, self.root, self.node, self.nodes = store, root, node, nodes
        self.pre = f"oomguard/{job}/"
        self.known: dict[str, tuple[tuple[int, int], str | None]] = {}  # path -> ((mtime_ns, size), sha1)
        self.mine: dict[str, int] = {}  # what this node published: path -> version
        self.seen: dict[str, int] = {}  # the newest version of each path this node has
        for rel, key in self._files():  # an earlier job's files: never published
            self.known[rel] = (key, None)

    def _files(self) -> list[tuple[str, tuple[int, int]]]:
        out = []
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if name.startswith("."):  # atomic writes in progress
                    continue
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except OSError:
                    continue
                out.append((p.relative_to(self.root).as_posix(), (st.st_mtime_ns, st.st_size)))
        return out

    def publish(self) -> None:
        """Every file this node wrote or changed since the last look."""
        changed = False
        for rel, key in self._files():
            old = self.known.get(rel)
            if old is not None and old[0] == key:
                continue
            try:
                data = (self.root / rel).read_bytes()
            except OSError:
                continue
            digest = hashlib.sha1(data).hexdigest()
            if old is not None and old[1] == digest:
                self.known[rel] = (key, digest)
                continue
            self.store.set(self.pre + "f/" + rel, data)
            version = int(self.store.add(self.pre + "v/" + rel, 1))
            self.known[rel] = (key, digest)
            self.mine[rel] = self.seen[rel] = version
            changed = True
        if changed:
            self.store.set(self.pre + f"idx/{self.node}", json.dumps(self.mine))

    def fetch(self) -> None:
        """Every file another node published since the last look, written here."""
        for j in range(self.nodes):
            key = self.pre + f"idx/{j}"
            if j == self.node or not self.store.check([key]):
                continue
            for rel, version in json.loads(self.store.get(key)).items():
                if self.seen.get(rel, 0) >= version or ".." in Path(rel).parts:
                    continue
                data = self.store.get(self.pre + "f/" + rel)
                target = self.root / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".sync", dir=target.parent)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, target)
                st = target.stat()
                self.known[rel] = ((st.st_mtime_ns, st.st_size), hashlib.sha1(data).hexdigest())
                self.seen[rel] = version

    def step(self) -> None:
        self.publish()
        self.fetch()


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--dir", "directory", required=True)
@click.option("--host", required=True)
@click.option("--port", type=int, required=True)
@click.option("--node", type=int, required=True)
@click.option("--nodes", type=int, required=True)
@click.option("--job", default="job")
@click.option("--join-timeout", type=float, default=900.0)
def cli(**options: Any) -> None:
    sys.exit(main(**options))


def main(directory: str, host: str, port: int, node: int, nodes: int, job: str = "job",
         join_timeout: float = 900.0) -> int:
    a = SimpleNamespace(dir=directory, host=host, port=port, node=node, nodes=nodes, job=job,
                        join_timeout=join_timeout)
    closed = threading.Event()

    def watch_stdin() -> None:  # the supervisor closes our stdin when it is done (or dies)
        try:
            while sys.stdin.read(4096):
                pass
        except (OSError, ValueError):
            pass
        closed.set()

    threading.Thread(target=watch_stdin, name="stdin", daemon=True).start()
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        import torch.distributed  # noqa: F401
    except Exception as e:
        say("error", why=f"torch.distributed cannot be imported here ({type(e).__name__}: {e})")
        return 2
    try:
        store, role = connect(a.host, a.port, a.join_timeout, closed)
    except TimeoutError as e:
        say("error", why=str(e))
        return 3
    mirror = Mirror(store, root, a.node, a.nodes, a.job)
    say("ready", role=role, endpoint=f"{a.host}:{a.port}")
    try:
        while not closed.wait(POLL):
            mirror.step()
        mirror.step()  # the supervisor's last word (its end, its report)
        store.set(mirror.pre + f"bye/{a.node}", b"1")
        if role == "host":  # the store lives here: stay until every node has its last word, LINGER seconds at most
            byes = [mirror.pre + f"bye/{j}" for j in range(a.nodes)]
            Retrying(stop=stop_after_delay(LINGER), wait=wait_fixed(POLL), retry=retry_if_result(lambda said: not said),
                     retry_error_callback=lambda state: False)(store.check, byes)
    except Exception as e:  # the host went away: nothing more to mirror
        say("error", why=f"the store at {a.host}:{a.port} stopped answering ({type(e).__name__}: {e})")
        return 4
    return 0


if __name__ == "__main__":
    cli()
