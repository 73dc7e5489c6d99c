"""One job on several nodes: the supervisors of its nodes form a group that decides once, through torch's Store.

Each node runs its own ``oomguard run``; node 0 leads (it decides every attempt), the others follow. The protocol is
written once, against torch's Store (oomguard/run/rendezvous.py holds a FileStore in the shared directory or a
TCPStore at torchrun's rendezvous host). Its keys, under session N (a counter): ``N/name`` (the session's directory,
``DIR/<job>/<name>/``), ``N/host/I`` (node I joined), ``N/beat/I`` (its heartbeat: its clock, every few seconds),
``N/step/K`` (what every node launches as attempt K, or the job's end; ``N/end`` names that step), ``N/ended/K/I`` (how
node I's command ended), ``N/failed`` (why the group ended early; the first word stays) and, where the nodes do not
share the directory, ``N/files/K/I/C`` (node I's training files of attempt K: events, crash records).

A follower joins the newest session whose leader's beat is recent and which has not ended, so a new job never reads an
old one's keys; then a node whose beat has not moved for ``timeout`` seconds (of the watcher's clock) is dead. Every
wait is ``Store.wait`` on its key, in slices of about a second between which a failure or a silent node is seen.

>>> import sys, tempfile
>>> from oomguard.run.rendezvous import HelperStore
>>> d = tempfile.mkdtemp()
>>> store = HelperStore.start([sys.executable], {"file": d + "/store"})
>>> lead = Group(Membership(node=0, nodes=2, root=d, job="j"), beat=False)
>>> follow = Group(Membership(node=1, nodes=2, root=d, job="j"), beat=False)
>>> lead.open(store); follow.open(store, wait=1); lead.assemble(wait=1)
>>> lead.publish(1, {"kind": "run", "plan": {"overrides": {}}})
>>> follow.next_step(1, wait=1)["kind"], follow.session == lead.session
('run', True)
>>> store.close()
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..vocab.events import EventTail
from ..vocab.files import write_json_atomic
from .launch import GROUP_ENV, GroupError, Membership, membership_of

TIMEOUT_ENV = "OOMGUARD_GROUP_TIMEOUT"  # seconds of silence after which a node counts as dead
DEFAULT_TIMEOUT = 120.0
JOIN_TIMEOUT = 900.0  # how long the nodes wait for each other at the start (torchrun's own rendezvous waits 900 s)
NOTICE_AFTER = 30.0  # a node still waiting for the others after this says so, once, with the way out
SLICE = 0.9  # the longest single Store.wait (a FileStore's waits end on whole seconds: 0.9 s is one)
LOOK_EVERY = 0.8  # how often a node whose command runs looks at the group (its ticks come five a second)
BEAT_EVERY = 5.0  # at most: a quarter of the timeout where that is shorter
STORE_GONE = (GroupError, RuntimeError)  # the helper's store, or torch's own, stopped answering


class Group:
    """The protocol, from one node's side. ``open(store)`` forms the group; then, per attempt, the leader
    ``publish``es the plan and each node ``ended`` its part; the leader ``gather``s, and ``finish``es or ``fail``s."""

    def __init__(self, m: Membership, *, timeout: float | None = None, join_timeout: float = JOIN_TIMEOUT,
                 beat: bool = True) -> None:
        self.m, self.base, self.join_timeout, self._beats = m, Path(m.root) / m.job, join_timeout, beat
        self.timeout = timeout or float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
        self.store: Any = None  # torch's Store, or rendezvous.HelperStore
        self.n, self.index = 0, 0  # the session; the attempt this node runs now
        self.session: Path | None = None
        self.failure: str | None = None  # why the group ended early, once this node knows
        self.via: str | None = None  # the TCPStore's host:port, where the nodes do not share the directory
        self.notice: Callable[[str], None] = lambda text: None  # a line for the user (a node that waits too long)
        self._stop, self._said, self._looked = threading.Event(), False, -LOOK_EVERY
        self._seen: dict[int, tuple[str, float]] = {}  # node -> (its last beat, when it moved)
        self._sent: dict[Path, int] = {}  # this node's training files: bytes relayed so far
        self._got: dict[tuple[int, int], int] = {}  # (attempt, node) -> chunks relayed

    def _k(self, *parts: object) -> str:
        return "/".join(map(str, (self.n, *parts)))

    def _get(self, key: str) -> str:
        return _text(self.store.get(key))

    def _read(self, key: str) -> Any:
        return json.loads(self._get(key)) if self.store.check([key]) else None

    # -- forming -------------------------------------------------------------------------------------------------
    def open(self, store: Any, wait: float | None = None) -> None:
        """Leader: start a new session (then ``assemble``). Follower: join the live leader's session."""
        self.store, within = store, self.join_timeout if wait is None else wait
        if self.m.leader:
            self.n = int(store.add("session", 1))
            self._beat()
            store.set(self._k("name"), f"{self.n}-{uuid.uuid4().hex[:8]}")
        else:
            def live() -> int | None:
                self.n = int(store.add("session", 0))
                if self.n and store.check([self._k("name"), self._k("beat", 0)]) and not \
                        store.check([self._k("failed")]) and not store.check([self._k("end")]) and \
                        time.time() - float(self._get(self._k("beat", 0))) < self.timeout:
                    return self.n
                return None

            if self._until(live, lambda: [f"{self.n + 1}/name"], within, lambda: [0]) is None:
                raise GroupError(f"no leader (node 0) appeared {self._where()} within {within:.0f} s: start `oomguard "
                                 f"run` on node 0 too, and {self._fix()}")
            self._beat()
        store.set(self._k("host", self.m.node), socket.gethostname())
        self.session = self.base / self._get(self._k("name"))
        self.session.mkdir(parents=True, exist_ok=True)
        if self._beats:
            threading.Thread(target=self._beating, name="oomguard-group-heartbeat", daemon=True).start()

    def assemble(self, wait: float | None = None) -> None:
        """Leader: wait until every node has joined its session."""
        within, keys = self.join_timeout if wait is None else wait, [self._k("host", i) for i in range(1, self.m.nodes)]

        def missing() -> list[int]:
            return [i for i, key in enumerate(keys, 1) if not self.store.check([key])]

        if self._until(lambda: self.store.check(keys) or None, lambda: keys, within, missing) is None:
            raise GroupError(f"node(s) {', '.join(map(str, missing()))} did not join the group "
                             f"{self._where(self.session)} within {within:.0f} s: start `oomguard run` on every node, "
                             f"and {self._fix()}")

    def _until(self, look: Callable[[], Any], keys: Callable[[], list[str]], within: float | None,
               missing: Callable[[], list[int]] | None = None) -> Any:
        """What ``look`` finds, waiting on ``keys`` between looks; None after ``within`` seconds. A wait for
        ``missing`` nodes says so once after NOTICE_AFTER seconds."""
        began = time.monotonic()
        while (found := look()) is None:
            waited = time.monotonic() - began
            if missing is not None and waited >= NOTICE_AFTER:
                self.waiting(missing())
            if within is not None and waited >= within:
                return None
            try:
                self.store.wait(keys(), timedelta(seconds=min(SLICE, SLICE if within is None else within - waited)))
            except (TimeoutError, RuntimeError):  # RuntimeError: torch's own stores' DistStoreError
                pass
        return found

    def waiting(self, missing: list[int]) -> None:
        """Say, once, where this node waits, for whom, and the way out."""
        if not self._said:
            self._said = True
            who = "node 0 (the leader)" if missing == [0] else f"node(s) {', '.join(map(str, missing))}"
            self.notice(f"node {self.m.node} has waited {NOTICE_AFTER:.0f} s for {who} {self._where()}: {self._fix()}")

    def _where(self, d: Path | None = None) -> str:
        return f"through the group's store at {self.via}" if self.via else f"in {d or self.base}"

    def _fix(self) -> str:
        if self.via:
            return (f"let every node reach {self.via} (torchrun's rendezvous host; OOMGUARD_GROUP_PORT names another "
                    "port), or pass --group DIR on a directory every node sees")
        return ("if the nodes do not share this directory (node-local working directories), pass --group DIR on a "
                "directory every node sees")

    def _beat(self) -> None:
        self.store.set(self._k("beat", self.m.node), f"{time.time():.3f}")

    def _beating(self) -> None:
        while not self._stop.wait(min(BEAT_EVERY, self.timeout / 4)):
            try:
                self._beat()
            except STORE_GONE:
                pass  # the others see this node fall silent

    # -- while attempts run -----------------------------------------------------------------------------------
    def attempt_dir(self, index: int) -> Path:
        assert self.session is not None
        self.index = max(self.index, index)
        (d := self.session / f"attempt-{index}").mkdir(parents=True, exist_ok=True)
        return d

    def events_path(self, index: int) -> Path:
        return self.attempt_dir(index) / f"events-node{self.m.node}.jsonl"

    def publish(self, index: int, step: dict[str, Any]) -> None:
        """Leader: what attempt ``index`` runs (every node launches the same)."""
        self.index = index
        self.store.set(self._k("step", index), json.dumps(step))

    def trouble(self) -> str | None:
        """Why this node must stop what it runs now (it looks every 0.8 s): the group failed or a node fell silent
        (then ``failure`` says why; the leader watches every node, a follower the leader), or the leader ended the
        job. Where the nodes do not share the directory, it relays the attempt's files first."""
        if time.monotonic() - self._looked < LOOK_EVERY:
            return None
        self._looked = time.monotonic()
        try:
            self._relay(self.index)
            failed = self._read(self._k("failed"))
            if failed is None and not self.m.leader and self.store.check([self._k("end")]):
                return "the leader (node 0) has ended the job"
            why = str(failed.get("why", "the group failed")) if failed is not None else \
                next(filter(None, map(self._silent, range(1, self.m.nodes) if self.m.leader else [0])), None)
        except GroupError as e:  # the store stopped answering (its host is gone)
            why = str(e)
        self.failure = why or self.failure  # the caller fails the group with it (``fail``)
        return why

    def _silent(self, i: int) -> str | None:
        """Why node ``i`` counts as dead: its beat has not moved for ``timeout`` seconds (and it is not done)."""
        beat = self._get(self._k("beat", i)) if self.store.check([self._k("beat", i)]) else ""
        last, now = self._seen.get(i), time.monotonic()
        if last is None or last[0] != beat:
            self._seen[i] = (beat, now)
        if last is None or last[0] != beat or now - last[1] <= self.timeout or self.store.check([self._k("done", i)]):
            return None
        host = f" ({self._get(self._k('host', i))})" if self.store.check([self._k("host", i)]) else ""
        return (f"node {i}{host} stopped answering: its oomguard's heartbeat in the group's store has not moved for "
                f"{self.timeout:.0f} s (the node or its oomguard died; not an OOM). The job ends on every node")

    def ended(self, index: int, result: dict[str, Any]) -> None:
        """This node's command ended: how (exit status, host-OOM evidence, interrupt), after its files."""
        try:
            self._relay(index)
            self.store.set(self._k("ended", index, self.m.node), json.dumps(result))
        except GroupError as e:  # the store is gone: the next step says so
            self.failure = str(e)

    def gather(self, index: int, tick: Callable[[], object] = lambda: None) -> dict[int, dict[str, Any]]:
        """Leader: how every other node's command ended, waiting for each (a silent node raises GroupError); ``tick``
        is called at every look (what it returns is not read)."""
        keys = [self._k("ended", index, i) for i in range(1, self.m.nodes)]

        def all_ended() -> dict[int, dict[str, Any]] | None:
            tick()
            if self.store.check(keys):
                return {i: json.loads(self._get(key)) for i, key in enumerate(keys, 1)}
            if (why := self.trouble()) is not None:
                raise GroupError(why)
            return None

        got: dict[int, dict[str, Any]] = self._until(all_ended, lambda: keys, None)
        self._relay(index)  # the others' last events and crash records, before the leader reads them
        return got

    def next_step(self, index: int, wait: float | None = None) -> dict[str, Any]:
        """Follower: the leader's plan for attempt ``index``, or ``{"kind": "final", ...}`` once it has ended the
        job; raises GroupError when the group failed or the leader is silent."""
        keys = [self._k("step", index)]

        def step() -> dict[str, Any] | None:
            end = self._read(self._k("end"))  # the job's end: the step after its last attempt
            if self.store.check(keys) or end is not None:
                return dict(self._read(keys[0] if end is None else self._k("step", end)))
            if (failed := self._read(self._k("failed"))) is not None:
                raise GroupError(str(failed.get("why")))
            if (why := self._silent(0)) is not None:
                raise GroupError(why)
            return None

        found: dict[str, Any] | None = self._until(step, lambda: keys, wait)
        if found is None:
            raise GroupError(f"the leader published no attempt {index} in time")
        return found

    def finish(self, data: dict[str, Any]) -> None:
        """Leader: the job's end (its report and lock), for every follower to adopt."""
        try:
            self.store.set(self._k("step", self.index + 1), json.dumps({"kind": "final", **data}))
            self.store.set(self._k("end"), str(self.index + 1))
        except STORE_GONE:
            pass  # the followers see the leader fall silent
        self.done()

    def fail(self, why: str) -> None:
        """Any node: the group cannot go on (a node died); every node ends with ``why`` (the first word stays, and
        its node keeps it in ``failed.json``)."""
        assert self.session is not None
        self.failure, word = why, json.dumps({"node": self.m.node, "why": why})
        try:
            if _text(self.store.compare_set(self._k("failed"), "", word)) == word:
                write_json_atomic(self.session / "failed.json", json.loads(word))
        except STORE_GONE:
            pass  # the store is gone: every node sees it

    def done(self) -> None:
        """This node has finished: its heartbeat stops, and its silence from now on is not a death."""
        self._stop.set()
        try:
            if self.store is not None:
                self.store.set(self._k("done", self.m.node), "1")
        except STORE_GONE:
            pass

    def _relay(self, index: int) -> None:
        """Where the nodes do not share the directory: this node's training files of attempt ``index`` (its events in
        whole lines, its ranks' crash records) into the store, and the others' out of it into this node's."""
        if self.via is None or not index:
            return
        adir, me = self.attempt_dir(index), self.m.node
        for p in [adir / f"events-node{me}.jsonl", *adir.glob("crash-*.json")]:
            sent = self._sent.get(p, 0)
            if p.exists() and sent >= 0 and not (sent and p.suffix == ".json"):
                with open(p, "rb") as f:
                    f.seek(sent)
                    data = f.read()
                data = data[:data.rfind(b"\n") + 1] if p.suffix == ".jsonl" else data
                if data:
                    c = self._got[(index, me)] = self._got.get((index, me), 0) + 1
                    text = data.decode(errors="replace")
                    self.store.set(self._k("files", index, me, c), json.dumps({"name": p.name, "text": text}))
                    self.store.add(self._k("files", index, me), 1)
                    self._sent[p] = sent + len(data)
        for j in (j for j in range(self.m.nodes) if j != me):
            have, n = self._got.get((index, j), 0), int(self.store.add(self._k("files", index, j), 0))
            for c in range(have + 1, n + 1):
                got = self._read(self._k("files", index, j, c))
                p = adir / Path(got["name"]).name
                self._sent[p] = -1  # another node's: never sent back
                with open(p, "a" if p.suffix == ".jsonl" else "w") as f:
                    f.write(got["text"])
            self._got[(index, j)] = n


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # torch's own stores answer bytes, the helper text


class GroupTail:
    """Every node's events of one attempt, as they arrive (one EventTail per node's file)."""

    def __init__(self, adir: Path) -> None:
        self.adir = adir
        self.tails: dict[Path, EventTail] = {}

    def poll(self) -> list[Any]:
        out: list[Any] = []
        for p in sorted(self.adir.glob("events-node*.jsonl")):
            out.extend(self.tails.setdefault(p, EventTail(p)).poll())
        return out


__all__ = ["GROUP_ENV", "TIMEOUT_ENV", "Group", "GroupError", "GroupTail", "Membership", "membership_of"]
