"""Launch one attempt: a fresh process group, output streamed live with a tail kept, signals forwarded.

SIGINT and SIGTERM go to the whole process group of the child, grandchildren included. After the child exits, the
group is killed and waited for (bounded) until none of its processes is left, so nothing the attempt started outlives
it or still holds memory when the next attempt starts. While it runs, :class:`~oomguard.run.hostmem.HostOOMWatch`
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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
            # A second Ctrl-C means now.
            _killpg(self.pgid, signal.SIGKILL if self.count > 1 else signum)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def process_alive(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether process ``pid`` is alive; a zombie (dead, waiting for its parent to reap it) is not.

    >>> process_alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(proc, pid)
    return fields is None or fields[0] not in ("Z", "X")  # without /proc, os.kill's answer stands


def _stat_fields(proc: Path, pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)``: state, ppid, pgrp, ...; None when unreadable."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return fields or None


def group_alive(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes of group ``pgid`` that are still alive; zombies (dead, waiting to be reaped) do not count.

    >>> group_alive(os.getpgrp()) != []
    True
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    alive = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        fields = _stat_fields(proc, name)
        if fields is not None and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            alive.append(int(name))
    return alive


def wait_group_gone(pgid: int, timeout: float = GROUP_GONE_TIMEOUT, poll: float = 0.05) -> list[int]:
    """Wait until group ``pgid`` has no living process; returns those still alive when ``timeout`` ran out."""
    deadline = time.monotonic() + timeout
    while True:
        alive = group_alive(pgid)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(poll)


def _pump(src: IO[bytes], dst: Any, tail: Tail, on_data: Callable[[bytes], None] | None) -> None:
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
        if dst is not None:
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


TICK = 0.2  # seconds between looks at an attempt while it runs (signals, the supervisor's watch, host memory)


def run_attempt(argv: Sequence[str], env: dict[str, str], interrupts: Interrupts, *, grace: float = 20.0,
                echo: bool = True, on_stdout: Callable[[bytes], None] | None = None,
                on_stderr: Callable[[bytes], None] | None = None, cwd: str | None = None,
                on_tick: Callable[[], int | None] | None = None) -> ProcessResult:
    """Run ``argv`` in a new process group and wait for it. Raises FileNotFoundError/PermissionError as Popen does.

    ``on_tick`` is called about five times a second while the attempt runs; a signal number it returns is sent to
    the whole group (the supervisor ends a group whose rank died of OOM but whose other ranks hang).
    """
    start = time.monotonic()
    watch = HostOOMWatch()
    watch.start()
    proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=cwd)
    interrupts.pgid = proc.pid
    out_tail, err_tail = Tail(), Tail()
    # sys.stdout/sys.stderr as they are now: under the live view they are rich's redirecting proxies.
    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, sys.stdout if echo else None, out_tail, on_stdout),
                         daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, sys.stderr if echo else None, err_tail, on_stderr),
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
    threading.Thread(target=lambda: (proc.wait(), ended.set()), daemon=True).start()
    while not ended.wait(TICK):
        if interrupts.signum is not None:
            killed_at = killed_at or time.monotonic()
            if time.monotonic() - killed_at > grace:
                _killpg(proc.pid, signal.SIGKILL)
        if on_tick is not None:
            sig = on_tick()
            if sig is not None:
                _killpg(proc.pid, sig)
        watch.sample(proc.pid)
    rc = proc.returncode
    if on_tick is not None:
        on_tick()  # the last events
    # Nothing the attempt started may outlive it (grandchildren, dataloader workers, a stuck rank): kill the group
    # and wait until it is gone, since a killed process still holds its memory until it has finished dying.
    _killpg(proc.pid, signal.SIGKILL)
    survivors = wait_group_gone(proc.pid)
    interrupts.pgid = None
    for t in threads:
        t.join(timeout=5)
    res = ProcessResult(rc, out_tail.text(), err_tail.text(), interrupts.signum, time.monotonic() - start,
                        survivors=survivors, pid=proc.pid)
    if not interrupts.signum:  # behind a launcher, a rank the OOM killer ended leaves any exit code: look every time
        res.host_oom = watch.evidence({proc.pid})
        res.host_strong = watch.strong
        res.host_checked = "" if res.host_oom else watch.describe_absence()
    else:
        watch.close(read=False)
    return res
