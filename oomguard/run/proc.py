"""Launch one attempt: a fresh process group, output streamed live with a tail kept, signals forwarded.

SIGINT and SIGTERM go to the whole process group of the child, grandchildren included (a launcher such as torchrun
forwards them to its ranks). Every process the attempt starts is tracked while it runs (psutil), ranks that a
launcher starts in sessions of their own included, and after the child exits the group and every tracked process
are killed and waited for (bounded) until none is left, so nothing the attempt started outlives it or still holds
memory when the next attempt starts. While it runs, :class:`~oomguard.run.hostmem.HostOOMWatch`
gathers the evidence that tells a kernel OOM kill from any other SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import psutil
from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay, wait_fixed

from .aside import Aside
from .hostmem import HostOOMWatch

TAIL_BYTES = 256 * 1024
GROUP_GONE_TIMEOUT = 15.0  # how long to wait for a SIGKILLed group to be gone (a large process takes time to die)


class Tail:
    """The last ``limit`` bytes written to it."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._lock = threading.Lock()

    def write(self, b: bytes) -> None:
        with self._lock:
            self._chunks.append(b)
            self._size += len(b)
            while self._size - len(self._chunks[0]) >= self.limit:
                self._size -= len(self._chunks.popleft())

    def text(self) -> str:
        with self._lock:
            data = b"".join(self._chunks)[-self.limit:]
        return data.decode("utf-8", errors="replace")


@dataclass
class ProcessResult:
    returncode: int  # negative: killed by that signal (subprocess convention)
    stdout_tail: str
    stderr_tail: str
    interrupted: int | None  # the signal the supervisor received and forwarded, if any
    seconds: float
    host_oom: list[str] = field(default_factory=list)  # evidence that the kernel's OOM killer ended a process of it
    host_strong: bool = False  # the kernel's own word (its OOM-kill counter, its log), not resident memory alone
    host_checked: str = ""  # what was looked at when there was no such evidence
    pid: int | None = None  # the command's own process (its exit status is that process's)
    survivors: list[int] = field(default_factory=list)  # processes of the group still alive after the bounded wait

    @property
    def exit_code(self) -> int:
        """The code a shell would report: 128 + signal for a child killed by a signal."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode


class Interrupts:
    """SIGINT/SIGTERM handling for the supervisor's lifetime: remember the signal, forward it to the child group."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.pgid: int | None = None
        self.tracker: Tracker | None = None  # the processes of the attempt running now
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1
        if self.pgid is not None:
            # A second Ctrl-C means now: the ranks in sessions of their own too.
            _killpg(self.pgid, signal.SIGKILL if self.count > 1 else signum)
            if self.count > 1 and self.tracker is not None:
                self.tracker.signal(signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` is alive; a zombie (dead, waiting for its parent to reap it) is not.

    >>> process_alive(os.getpid()), process_alive(2**22 + 1)
    (True, False)
    """
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def group_alive(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are still alive; zombies (dead, waiting to be reaped) do not count.

    >>> os.getpid() in group_alive(os.getpgrp()), group_alive(2**22 + 1)
    (True, [])
    """
    alive = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                alive.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return alive


def wait_group_gone(pgid: int, timeout: float = GROUP_GONE_TIMEOUT, poll: float = 0.05) -> list[int]:
    """Wait until group ``pgid`` has no living process; returns those still alive when ``timeout`` ran out.

    >>> wait_group_gone(2**22 + 1, timeout=0), os.getpid() in wait_group_gone(os.getpgrp(), timeout=0.1)
    ([], True)
    """
    def still_alive(state: RetryCallState) -> list[int]:
        assert state.outcome is not None  # called once the last try has ended
        alive: list[int] = state.outcome.result()
        return alive

    alive: list[int] = Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(poll), retry=retry_if_result(bool),
                                retry_error_callback=still_alive)(group_alive, pgid)
    return alive


def become_subreaper() -> bool:
    """Make this process the one that orphans of its descendants are re-parented to (Linux' PR_SET_CHILD_SUBREAPER),
    so that a rank whose launcher died (torchrun starts each rank in a session of its own, out of reach of a signal
    to the launcher's process group) stays a descendant that ``Tracker`` finds. False where the kernel has no such
    thing: there the tracker still knows every process it saw while the attempt ran.

    >>> isinstance(become_subreaper(), bool)
    True
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


class Tracker:
    """Every process an attempt started, whatever session or process group it moved to: the descendants of the
    attempt's command, seen at every tick while it runs, the orphans re-parented to this process (after
    ``become_subreaper``), and the training processes the attempt's events name (``add``). ``sweep`` ends those still
    alive and waits until they are gone, so none outlives the attempt or holds memory the next one needs.

    A process is known by its PID and start time (psutil), so a PID the kernel gave to another process since is
    never signalled.

    >>> import subprocess, sys
    >>> child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    >>> t = Tracker(os.getpid())
    >>> t.look(); child.pid in t.pids()
    True
    >>> t.sweep(), process_alive(child.pid)
    ([], False)
    >>> _ = child.wait()  # already reaped by the sweep: Popen learns it is gone
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self.started = time.time()
        self.me = psutil.Process()
        try:  # this process's own helpers (a group's store helper), never the attempt's
            self.before = {c.pid for c in self.me.children()} - {root}
        except psutil.Error:
            self.before = set()
        self.procs: dict[int, psutil.Process] = {}

    def pids(self) -> set[int]:
        return set(self.procs)

    def look(self) -> None:
        """Note the attempt's processes as they are now."""
        found: list[psutil.Process] = []
        try:
            found += psutil.Process(self.root).children(recursive=True)
        except psutil.Error:
            pass
        try:
            for c in self.me.children():
                if c.pid in self.before or c.pid == self.root:
                    continue
                found.append(c)  # an orphan of the attempt, re-parented here
                found += c.children(recursive=True)
        except psutil.Error:
            pass
        for p in found:
            self.procs.setdefault(p.pid, p)

    def add(self, pid: int) -> None:
        """A process the attempt's events name (a training process): ours only if it started with the attempt."""
        if pid in self.procs or pid == self.root:
            return
        try:
            p = psutil.Process(pid)
            if p.create_time() >= self.started - 1:
                self.procs[pid] = p
        except psutil.Error:
            pass

    def alive(self) -> list[psutil.Process]:
        out = []
        for p in self.procs.values():
            try:
                if p.is_running() and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def signal(self, sig: int) -> None:
        for p in self.alive():
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def sweep(self, timeout: float = GROUP_GONE_TIMEOUT) -> list[int]:
        """Kill every process of the attempt still alive, reap those that are this process's children, and wait
        until all are gone; returns the PIDs still alive when ``timeout`` ran out."""
        self.look()
        alive = self.alive()
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(alive, timeout=timeout)
        for c in self._zombies():  # orphans re-parented here that ended on their own
            try:
                c.wait(timeout=0)
            except (psutil.Error, psutil.TimeoutExpired):
                pass
        return [p.pid for p in left]

    def _zombies(self) -> list[psutil.Process]:
        try:
            return [c for c in self.me.children() if c.pid not in self.before and c.pid != self.root
                    and c.status() == psutil.STATUS_ZOMBIE]
        except psutil.Error:
            return []


def _pump(src: IO[bytes], dst: Any, tail: Tail, on_data: Callable[[bytes], None] | None,
          aside: Aside | None = None) -> None:
    fd = src.fileno()
    while True:
        try:
            b = os.read(fd, 65536)
        except OSError:
            break
        if not b:
            break
        tail.write(b)
        if on_data is not None:
            on_data(b)
        if aside is not None:
            b = aside.split(fd, b)
        if dst is not None and b:
            try:
                # rich's live-view proxy forwards unknown attributes (.buffer) to the real stream: write str to it
                out = None if hasattr(dst, "rich_proxied_file") else getattr(dst, "buffer", None)
                if out is not None:
                    out.write(b)
                else:  # a text stream, e.g. the live view's redirect: it needs str
                    dst.write(b.decode("utf-8", errors="replace"))
                dst.flush()
            except (OSError, ValueError):
                pass
    src.close()


class StartError(Exception):
    """The command could not be started: Popen's own error (``error``: FileNotFoundError, PermissionError, another
    OSError such as ENOEXEC), the user's to fix, unlike any error raised once the attempt runs."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


TICK = 0.2  # seconds between looks at an attempt while it runs (signals, the supervisor's watch, host memory)


def run_attempt(argv: Sequence[str], env: dict[str, str], interrupts: Interrupts, *, grace: float = 20.0,
                echo: bool = True, on_stdout: Callable[[bytes], None] | None = None,
                on_stderr: Callable[[bytes], None] | None = None, cwd: str | None = None,
                on_tick: Callable[[], int | None] | None = None,
                named: Callable[[], Iterable[int]] | None = None, aside: Aside | None = None) -> ProcessResult:
    """Run ``argv`` in a new process group and wait for it. A command that cannot start raises :class:`StartError`
    (Popen's own error); any other error while the attempt runs (an ``on_tick`` that fails: a bug of oomguard's)
    ends every process the attempt started before it propagates, as the attempt's normal end does.

    ``on_tick`` is called about five times a second while the attempt runs; a signal number it returns is sent to
    the whole group (the supervisor ends a group whose rank died of OOM but whose other ranks hang), and to the
    attempt's processes in sessions of their own. ``named``: the PIDs of training processes the attempt's events
    name on this machine, tracked with the rest (``Tracker.add``). ``aside``: where the output goes once a training
    process ended the attempt on purpose or by an OOM (:class:`~oomguard.run.aside.Aside`). When it ends, every process the attempt started is killed and
    waited for (``Tracker.sweep``).
    """
    start = time.monotonic()
    watch = HostOOMWatch()
    watch.start()
    try:
        proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, cwd=cwd)
    except OSError as e:
        watch.close(read=False)
        raise StartError(e) from e
    tracker = Tracker(proc.pid)
    interrupts.pgid, interrupts.tracker = proc.pid, tracker
    out_tail, err_tail = Tail(), Tail()
    # sys.stdout/sys.stderr as they are now: under the live view they are rich's redirecting proxies.
    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, sys.stdout if echo else None, out_tail, on_stdout, aside),
                         daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, sys.stderr if echo else None, err_tail, on_stderr, aside),
                         daemon=True),
    ]
    for t in threads:
        t.start()
    if interrupts.signum is not None:  # a signal arrived while starting
        _killpg(proc.pid, interrupts.signum)
    killed_at: float | None = None
    # A thread blocks in waitpid, so the end is seen the moment it comes: Popen.wait(timeout) polls with sleeps of
    # up to 50 ms, a delay every attempt would pay.
    ended = threading.Event()
    def reap() -> None:
        proc.wait()
        ended.set()

    threading.Thread(target=reap, daemon=True).start()
    try:
        while not ended.wait(TICK):
            tracker.look()
            for pid in named() if named is not None else ():
                tracker.add(pid)
            if interrupts.signum is not None:
                killed_at = killed_at or time.monotonic()
                if time.monotonic() - killed_at > grace:
                    _killpg(proc.pid, signal.SIGKILL)
                    tracker.signal(signal.SIGKILL)
            if on_tick is not None:
                sig = on_tick()
                if sig is not None:
                    _killpg(proc.pid, sig)
                    tracker.signal(sig)
            watch.sample({proc.pid, *tracker.pids()})
        rc = proc.returncode
        if on_tick is not None:
            on_tick()  # the last events
    except BaseException:
        watch.close(read=False)
        raise
    finally:
        # Nothing the attempt started may outlive it (grandchildren, dataloader workers, a stuck rank, ranks a dead
        # launcher left in sessions of their own), however the attempt ends, the supervisor's own error included:
        # kill them and wait until they are gone, since a killed process still holds its memory until it has
        # finished dying.
        _killpg(proc.pid, signal.SIGKILL)
        survivors = sorted(set(tracker.sweep()) | set(wait_group_gone(proc.pid)))
        interrupts.pgid, interrupts.tracker = None, None
    for t in threads:
        t.join(timeout=5)
    if aside is not None:
        aside.flush()
    res = ProcessResult(rc, out_tail.text(), err_tail.text(), interrupts.signum, time.monotonic() - start,
                        survivors=survivors, pid=proc.pid)
    if not interrupts.signum:  # behind a launcher, a rank the OOM killer ended leaves any exit code: look every time
        res.host_oom = watch.evidence({proc.pid})
        res.host_strong = watch.strong
        res.host_checked = "" if res.host_oom else watch.describe_absence()
    else:
        watch.close(read=False)
    return res
