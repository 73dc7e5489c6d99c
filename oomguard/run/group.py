"""One job on several nodes: the supervisors of its nodes form a group that decides once, through a shared directory.

Each node of a multi-node job runs its own ``oomguard run`` (``srun oomguard run -- torchrun --nnodes 2 --node_rank
$SLURM_NODEID ...``). Alone, each would answer only its own ranks' OOMs while the other nodes' ranks wait at a
collective. In a group, node 0 leads: it decides every attempt (the climb is its own), and the other nodes follow.

Everything passes through a directory every node sees (a Slurm job's shared filesystem): no server to start. The
group's files, under ``DIR/<job>/<session>/``:

- ``node-I.json``: node I's heartbeat (rewritten every few seconds; a node silent for ``timeout`` seconds is dead);
- ``attempt-K/plan.json``: what the leader launches as attempt K (every node launches the same);
- ``attempt-K/events-nodeI.jsonl`` and ``crash-rankR.json``: what the training processes of node I recorded, read by
  every node (so that a rank's OOM on one node stops the ranks waiting for it on the others);
- ``attempt-K/ended-nodeI.json``: how node I's command ended (its exit status, evidence of the host's OOM killer);
- ``final.json``: the leader's report (the followers copy it) or ``failed.json``: why the group ended early.

The leader names its session in ``DIR/<job>/leader.json``; a follower joins the session whose leader is alive and not
finished, so a new job in the same directory never reads an old job's files. This module is the protocol only: the
supervisor runs the attempts, and which node this is comes from the command (``launch.membership_of``, re-exported
here). Every wait is tenacity's ``Retrying`` (a stop after the wait's time, a fixed poll, what is still missing as the
result to retry on). No torch here.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> lead = Group(Membership(node=0, nodes=2, root=d, job="j"), beat=False)
>>> follow = Group(Membership(node=1, nodes=2, root=d, job="j"), beat=False)
>>> lead.open(); follow.open(wait=1); lead.assemble(wait=1)
>>> lead.publish(1, {"kind": "run", "plan": {"overrides": {}}})
>>> follow.next_step(1, wait=1)["kind"]
'run'
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay, stop_never, wait_fixed

from ..vocab.events import EventTail
from ..vocab.files import write_json_atomic
from .launch import GROUP_ENV, GroupError, Membership, membership_of

TIMEOUT_ENV = "OOMGUARD_GROUP_TIMEOUT"  # seconds of silence after which a node counts as dead
DEFAULT_TIMEOUT = 120.0
JOIN_TIMEOUT = 900.0  # how long the nodes wait for each other at the start (torchrun's own rendezvous waits 900 s)
NOTICE_AFTER = 30.0  # a node still waiting for the others after this says so, once, with the way out
JOIN_POLL = 0.5  # how often a node waiting for the others at the start looks again
STEP_POLL = 0.2  # how often a node waiting for the others during the job looks again
BEAT_EVERY = 2.0


class Group:
    """The protocol, from one node's side. ``open()`` forms the group; then, per attempt, the leader ``publish``es
    the plan and each node ``ended`` its part; the leader ``gather``s, and at the end ``finish``es or ``fail``s."""

    def __init__(self, m: Membership, *, timeout: float | None = None, join_timeout: float = JOIN_TIMEOUT,
                 beat: bool = True) -> None:
        self.m = m
        self.timeout = timeout or float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
        self.join_timeout = join_timeout
        self.base = Path(m.root) / m.job
        self.session: Path | None = None
        self._beat = beat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = time.time()
        self.failure: str | None = None  # why the group ended early, once this node knows
        self.via: str | None = None  # the store the directory is mirrored through (host:port), when it is
        self.notice: Callable[[str], None] = lambda text: None  # a line for the user (a node that waits too long)
        self.tick: Callable[[], None] = lambda: None  # called while waiting (the store's helper speaks)

    # -- forming -------------------------------------------------------------------------------------------------
    def open(self, wait: float | None = None) -> None:
        """Leader: start a new session (then ``assemble``). Follower: join the live leader's session."""
        try:
            self.base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GroupError(f"cannot use {self.base} for the group ({e.strerror}): pass --group DIR, a directory "
                             "every node of the job can write") from None
        within = self.join_timeout if wait is None else wait
        if self.m.leader:
            name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            self.session = self.base / name
            self.session.mkdir(parents=True, exist_ok=True)
            self._heartbeat()
            write_json_atomic(self.base / "leader.json", {"session": name, "started": self.started})
        else:
            def no_leader(state: RetryCallState) -> NoReturn:
                raise GroupError(f"no leader (node 0) appeared {self._where()} within {within:.0f} s: start `oomguard "
                                 f"run` on node 0 too, and {self._fix()}")

            self.session = Retrying(stop=stop_after_delay(within), wait=wait_fixed(JOIN_POLL),
                                    retry=retry_if_result(_is_none), before_sleep=_Waiting(self, lambda state: [0]),
                                    retry_error_callback=no_leader)(self._live_session)
            self._heartbeat()
        if self._beat:
            self._thread = threading.Thread(target=self._beating, name="oomguard-group-heartbeat", daemon=True)
            self._thread.start()

    def assemble(self, wait: float | None = None) -> None:
        """Leader: wait until every node has joined its session."""
        within = self.join_timeout if wait is None else wait

        def missing() -> list[int]:
            return [i for i in range(1, self.m.nodes) if not self._node_file(i).exists()]

        def not_joined(state: RetryCallState) -> NoReturn:
            raise GroupError(f"node(s) {', '.join(map(str, _result(state)))} did not join the group "
                             f"{self._where(self.session)} within {within:.0f} s: start `oomguard run` on every node, "
                             f"and {self._fix()}")

        Retrying(stop=stop_after_delay(within), wait=wait_fixed(JOIN_POLL), retry=retry_if_result(bool),
                 before_sleep=_Waiting(self, _result), retry_error_callback=not_joined)(missing)

    def _where(self, d: Path | None = None) -> str:
        d = d or self.base
        return f"through the group's store at {self.via} (mirroring {d})" if self.via else f"in {d}"

    def _fix(self) -> str:
        if self.via:
            return (f"let every node reach {self.via} (torchrun's rendezvous host; OOMGUARD_GROUP_PORT names another "
                    "port), or pass --group DIR on a directory every node sees")
        return ("if the nodes do not share this directory (node-local working directories), pass --group DIR on a "
                "directory every node sees" + ("" if self.m.store is None else
                                               "; under torchrun the nodes meet through its rendezvous host instead "
                                               "when torch can be imported there"))

    def _live_session(self) -> Path | None:
        try:
            lead = json.loads((self.base / "leader.json").read_text())
        except (OSError, ValueError):
            return None
        s = self.base / str(lead.get("session", ""))
        fresh = self._age(s / "node-0.json") < self.timeout
        over = (s / "final.json").exists() or (s / "failed.json").exists()
        return s if fresh and not over else None

    def _node_file(self, i: int) -> Path:
        assert self.session is not None
        return self.session / f"node-{i}.json"

    @staticmethod
    def _age(path: Path) -> float:
        try:
            return time.time() - path.stat().st_mtime
        except OSError:
            return float("inf")

    def _heartbeat(self) -> None:
        import socket

        write_json_atomic(self._node_file(self.m.node), {"node": self.m.node, "host": socket.gethostname(),
                                                         "pid": os.getpid(), "beat": time.time()})

    def _beating(self) -> None:
        while not self._stop.wait(BEAT_EVERY):
            try:
                self._heartbeat()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the heartbeat (the node is done; its last word is in the session's files)."""
        self._stop.set()

    # -- while attempts run -----------------------------------------------------------------------------------
    def attempt_dir(self, index: int) -> Path:
        assert self.session is not None
        d = self.session / f"attempt-{index}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def events_path(self, index: int) -> Path:
        return self.attempt_dir(index) / f"events-node{self.m.node}.jsonl"

    def publish(self, index: int, step: dict[str, Any]) -> None:
        """Leader: what attempt ``index`` runs (every node launches the same)."""
        write_json_atomic(self.attempt_dir(index) / "plan.json", step)

    def trouble(self) -> str | None:
        """Why this node must stop what it runs now: the group failed or a node fell silent (then ``failure`` says
        why), or the leader ended the job."""
        assert self.session is not None
        failed = self._read(self.session / "failed.json")
        if failed is not None:
            self.failure = str(failed.get("why", "the group failed"))
            return self.failure
        if not self.m.leader and (self.session / "final.json").exists():
            return "the leader (node 0) has ended the job"
        for i in range(self.m.nodes):
            if i != self.m.node and not (self.session / f"done-node{i}").exists() and \
                    self._age(self._node_file(i)) > self.timeout:
                self.failure = self._dead(i)  # the caller fails the group with it (``fail``)
                return self.failure
        return None

    def _dead(self, i: int) -> str:
        info = self._read(self._node_file(i)) or {}
        host = f" ({info['host']})" if info.get("host") else ""
        return (f"node {i}{host} stopped answering: its oomguard wrote nothing to {self.session} for "
                f"{self.timeout:.0f} s (the node or its oomguard died; not an OOM). The job ends on every node")

    def ended(self, index: int, result: dict[str, Any]) -> None:
        """This node's command ended: how (exit status, host-OOM evidence, interrupt)."""
        write_json_atomic(self.attempt_dir(index) / f"ended-node{self.m.node}.json", result)

    def gather(self, index: int, tick: Callable[[], None] = lambda: None) -> dict[int, dict[str, Any]]:
        """Leader: how every other node's command ended, waiting for each (a silent node raises GroupError); ``tick``
        is called between looks."""
        got: dict[int, dict[str, Any]] = {}

        def all_ended() -> dict[int, dict[str, Any]] | None:
            for i in range(1, self.m.nodes):
                if i not in got and (r := self._read(self.attempt_dir(index) / f"ended-node{i}.json")) is not None:
                    got[i] = r
            if len(got) == self.m.nodes - 1:
                return got
            why = self.trouble()
            if why is not None:
                raise GroupError(why)
            return None

        return Retrying(stop=stop_never, wait=wait_fixed(STEP_POLL), retry=retry_if_result(_is_none),
                        before_sleep=lambda state: tick())(all_ended)

    def next_step(self, index: int, wait: float | None = None) -> dict[str, Any]:
        """Follower: the leader's plan for attempt ``index``, or ``{"kind": "final", ...}`` once it has ended the
        job; raises GroupError when the group failed or the leader is silent."""
        assert self.session is not None
        session = self.session

        def step() -> dict[str, Any] | None:
            plan = self._read(session / f"attempt-{index}" / "plan.json")
            if plan is not None:
                return plan
            final = self._read(session / "final.json")
            if final is not None:
                return {"kind": "final", **final}
            failed = self._read(session / "failed.json")
            if failed is not None:
                raise GroupError(str(failed.get("why")))
            if self._age(self._node_file(0)) > self.timeout:
                raise GroupError(self._dead(0))
            return None

        def late(state: RetryCallState) -> NoReturn:
            raise GroupError(f"the leader published no attempt {index} in time")

        found: dict[str, Any] = Retrying(stop=stop_never if wait is None else stop_after_delay(wait),
                                         wait=wait_fixed(STEP_POLL), retry=retry_if_result(_is_none),
                                         retry_error_callback=late)(step)
        return found

    def finish(self, data: dict[str, Any]) -> None:
        """Leader: the job's end (its report and lock), for every follower to copy."""
        assert self.session is not None
        write_json_atomic(self.session / "final.json", data)
        self.done()

    def fail(self, why: str) -> None:
        """Any node: the group cannot go on (a node died); every node ends with ``why``."""
        assert self.session is not None
        self.failure = why
        if not (self.session / "failed.json").exists():
            write_json_atomic(self.session / "failed.json", {"node": self.m.node, "why": why})

    def done(self) -> None:
        """This node has finished: its silence from now on is not a death."""
        if self.session is not None:
            (self.session / f"done-node{self.m.node}").touch()
        self.close()

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


def _is_none(value: object) -> bool:
    return value is None


def _result(state: RetryCallState) -> Any:
    """What the last look found (the nodes still missing)."""
    assert state.outcome is not None
    return state.outcome.result()


class _Waiting:
    """The ``before_sleep`` of a node waiting for others at the start: it lets the group's ``tick`` speak at every
    look, and after NOTICE_AFTER seconds it says, once, where it waits, who is missing (``missing`` reads them from
    the last look) and the way out (node-local working directories never meet in their own directories)."""

    def __init__(self, g: Group, missing: Callable[[RetryCallState], list[int]]) -> None:
        self.g = g
        self.missing = missing
        self.said = False

    def __call__(self, state: RetryCallState) -> None:
        self.g.tick()
        waited = state.seconds_since_start or 0.0
        if self.said or waited < NOTICE_AFTER:
            return
        self.said = True
        missing = self.missing(state)
        who = "node 0 (the leader)" if missing == [0] else f"node(s) {', '.join(map(str, missing))}"
        self.g.notice(f"node {self.g.m.node} has waited {waited:.0f} s for {who} {self.g._where()}: {self.g._fix()}")


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
