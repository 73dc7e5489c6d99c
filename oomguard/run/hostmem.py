"""Evidence that the kernel's OOM killer ended an attempt, so that a SIGKILL is called a host-RAM OOM only with proof.

A SIGKILL (exit 137) has many senders: the kernel's OOM killer, but also a user's ``kill -9``, ``timeout -s KILL``,
a scheduler's preemption or a container runtime. Retrying all of them as host-RAM OOMs would climb the ladder for
nothing, so :class:`HostOOMWatch` gathers evidence around one attempt, torch-free and without root where possible:

1. the memory cgroup's OOM-kill counter, read before the launch and after the end (cgroup v2 ``memory.events``
   ``oom_kill``, v1 ``memory.oom_control`` ``oom_kill``); it counts every process of the cgroup that any OOM killer
   ended, the global one included;
2. the kernel's own line for one of the attempt's processes (``Out of memory: Killed process PID``, ``oom-kill:...
   pid=PID``), read from ``/dev/kmsg`` where this user may (root, or ``kernel.dmesg_restrict=0``);
3. the attempt's resident memory, sampled while it runs, against the cgroup's limit or the machine's RAM: 90% or more
   counts, as weak evidence (a rank's own error outweighs it). Each sample sums the processes' proportional set sizes
   (``Pss`` of ``/proc/PID/smaps_rollup``: a page that N processes share counts 1/N in each) read at the same moment,
   and the largest such sum is what counts: never each process's own high-water mark (``VmHWM``), which counts every
   shared page (a forked data-loader worker's copy-on-write memory, each rank's CUDA libraries) once per process, at
   moments that need not coincide, so that a ``kill -9`` of a job of many processes looked like the host running out.
   Where ``smaps_rollup`` cannot be read, a process's anonymous resident memory (``RssAnon``) stands in. Reading it
   walks the process's page tables, so samples are spaced to keep that under a twentieth of the time.

``OOMGUARD_CGROUP`` names the cgroup directory to read when it is mounted somewhere this module does not look.

>>> import tempfile, pathlib
>>> cg = pathlib.Path(tempfile.mkdtemp())
>>> _ = (cg / "memory.events").write_text("low 0\\nhigh 0\\nmax 3\\noom 1\\noom_kill 1\\n")
>>> watch = HostOOMWatch(cgroup=cg, kmsg=None)
>>> watch.start()
>>> _ = (cg / "memory.events").write_text("low 0\\nhigh 0\\nmax 9\\noom 2\\noom_kill 2\\n")
>>> watch.evidence()[0].startswith("the cgroup's OOM-kill counter rose from 1 to 2")
True
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..vocab.sizes import format_size

CGROUP_ENV = "OOMGUARD_CGROUP"
RSS_EVIDENCE_FRACTION = 0.9  # a group that used this share of the limit was near it
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712)
SAMPLE_EVERY = 1.0  # seconds between resident-memory samples, at least
SAMPLE_COST = 20  # ... and at least this many times as long as the last sample took to read


@dataclass(frozen=True)
class CgroupFiles:
    """Where one cgroup's memory files are: the directory and its version (1 or 2)."""

    path: Path
    version: int

    @property
    def events(self) -> Path:
        return self.path / ("memory.events" if self.version == 2 else "memory.oom_control")

    def oom_kills(self) -> int | None:
        """The OOM-kill counter, or None where the file cannot be read or has no such line.

        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); _ = (d / "memory.oom_control").write_text("oom_kill_disable 0\\noom_kill 7\\n")
        >>> CgroupFiles(d, 1).oom_kills()
        7
        """
        try:
            text = self.events.read_text()
        except OSError:
            return None
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(m.group(1)) if m else None

    def limit(self) -> int | None:
        """The cgroup's memory limit in bytes, None when it has none."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        try:
            raw = (self.path / name).read_text().strip()
        except OSError:
            return None
        if not raw.isdigit() or int(raw) >= UNLIMITED:
            return None
        return int(raw)


def find_cgroup(proc: Path = Path("/proc"), env: dict[str, str] | None = None) -> CgroupFiles | None:
    """This process's memory cgroup (a child launched from it starts in the same one).

    cgroup v2 first (the ``0::PATH`` line), then the v1 memory controller; the path is joined to the mount point
    of the hierarchy, or is the mount point itself inside a cgroup namespace or a container that mounts its own
    cgroup as the root.
    """
    env = dict(os.environ) if env is None else env
    if env.get(CGROUP_ENV):
        d = Path(env[CGROUP_ENV])
        return CgroupFiles(d, 2 if (d / "memory.events").exists() else 1)
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            if parts[0] == "0" and parts[1] == "":
                paths["v2"] = parts[2]
            elif "memory" in parts[1].split(","):
                paths["v1"] = parts[2]
    roots: dict[str, tuple[str, str]] = {}
    for m in mounts:
        left, _, right = m.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            roots.setdefault("v2", (fields[3], fields[4]))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            roots.setdefault("v1", (fields[3], fields[4]))
    for key, version, probe in (("v2", 2, "memory.events"), ("v1", 1, "memory.oom_control")):
        if key not in paths or key not in roots:
            continue
        root, mountpoint = roots[key]
        rel = os.path.relpath(paths[key], root) if paths[key].startswith(root) else paths[key].lstrip("/")
        for cand in (Path(mountpoint) / rel, Path(mountpoint)):
            if (cand / probe).exists():
                return CgroupFiles(cand.resolve(), version)
    return None


def _meminfo_total(proc: Path) -> int | None:
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", (proc / "meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def host_limit(proc: Path = Path("/proc")) -> int | None:
    """The host memory a training process launched from here may use: its cgroup's limit, else the machine's RAM
    (None where neither can be read)."""
    cgroup = find_cgroup(proc)
    lim = cgroup.limit() if cgroup else None
    return lim if lim is not None else _meminfo_total(proc)


def resident_share(pid: int, proc: Path = Path("/proc")) -> int | None:
    """A process's share of the host memory in use now, in bytes: its proportional set size (``Pss`` of
    ``smaps_rollup``: shared pages divided among the processes that share them), else its anonymous resident memory
    (``RssAnon``); None where neither can be read (the process is gone).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); (d / "7").mkdir()
    >>> _ = (d / "7" / "smaps_rollup").write_text("Rss:  262144 kB\\nPss:  65536 kB\\nShared_Clean: 0 kB\\n")
    >>> resident_share(7, d) // (1 << 20)   # a quarter of 256 MiB: shared with three other processes
    64
    """
    for name, field in (("smaps_rollup", "Pss"), ("status", "RssAnon")):
        try:
            m = re.search(rf"^{field}:\s+(\d+) kB", (proc / str(pid) / name).read_text(), re.M)
        except OSError:
            continue
        if m:
            return int(m.group(1)) * 1024
    return None


_KILLED = re.compile(r"(?:Killed process |oom-kill:.*?[ ,]pid=)(\d+)")


def kernel_oom_lines(records: list[str], pids: set[int]) -> list[str]:
    """The kernel log's OOM-killer lines about one of ``pids``.

    >>> kernel_oom_lines(["6,812,99,-;Out of memory: Killed process 4242 (python) total-vm:9kB, anon-rss:8kB",
    ...                   "6,813,99,-;Out of memory: Killed process 77 (other)"], {4242})
    ['Out of memory: Killed process 4242 (python) total-vm:9kB, anon-rss:8kB']
    """
    out = []
    for rec in records:
        msg = rec.split(";", 1)[1] if ";" in rec.split(" ", 1)[0] else rec
        m = _KILLED.search(msg)
        if m and int(m.group(1)) in pids:
            out.append(msg.strip())
    return out


class HostOOMWatch:
    """The evidence for one attempt: :meth:`start` before the launch, :meth:`sample` while it runs, then
    :meth:`evidence` after it ended (empty: no sign of the OOM killer)."""

    def __init__(self, cgroup: str | os.PathLike[str] | CgroupFiles | None = None,
                 kmsg: str | None = "/dev/kmsg", proc: str | os.PathLike[str] = "/proc") -> None:
        self.proc = Path(proc)
        if cgroup is None:
            self.cgroup = find_cgroup(self.proc)
        elif isinstance(cgroup, CgroupFiles):
            self.cgroup = cgroup
        else:
            d = Path(cgroup)
            self.cgroup = CgroupFiles(d, 2 if (d / "memory.events").exists() else 1)
        self.kmsg_path = kmsg
        self.kills_before: int | None = None
        self.pids: set[int] = set()
        self.used = 0  # the most memory the attempt's processes held together, summed at one moment
        self._kmsg_fd: int | None = None
        self.kmsg_readable = False
        self.strong = False  # set by evidence(): the kernel's own word, not resident memory alone
        self._next_sample = 0.0

    def start(self) -> None:
        """Read the OOM-kill counter and open the kernel log at its end (new lines only)."""
        self.kills_before = self.cgroup.oom_kills() if self.cgroup else None
        if self.kmsg_path:
            try:
                fd = os.open(self.kmsg_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                os.lseek(fd, 0, os.SEEK_END)
                self._kmsg_fd, self.kmsg_readable = fd, True
            except OSError:  # not readable for this user (dmesg_restrict), or no such device
                self._kmsg_fd = None

    def sample(self, pids: Iterable[int], force: bool = False) -> None:
        """Note the attempt's processes (``oomguard.run.proc.Tracker``) and the memory they hold together now (their
        resident shares, :func:`resident_share`, summed), keeping the largest sum; at most once a second, and spaced
        so that reading costs at most a twentieth of the time."""
        now = time.monotonic()
        if not force and now < self._next_sample:
            return
        total = 0
        for p in pids:
            self.pids.add(p)
            total += resident_share(p, self.proc) or 0
        self.used = max(self.used, total)
        done = time.monotonic()
        self._next_sample = done + max(SAMPLE_EVERY, SAMPLE_COST * (done - now))

    def close(self, read: bool = True) -> list[str]:
        """Stop watching; returns the kernel-log records written since :meth:`start` (none when unreadable, or
        when ``read`` is False: an interrupted attempt needs no evidence)."""
        records: list[str] = []
        fd, self._kmsg_fd = self._kmsg_fd, None
        if fd is None:
            return records
        if not read:
            os.close(fd)
            return records
        try:
            while True:
                try:
                    chunk = os.read(fd, 8192)
                except OSError as e:
                    if e.errno == errno.EPIPE:  # records overwritten while we read: go on from the next one
                        continue
                    break  # EAGAIN: nothing more
                if not chunk:
                    break
                records.append(chunk.decode("utf-8", errors="replace"))
        finally:
            os.close(fd)
        return records

    def limit(self) -> tuple[int | None, str]:
        """The memory the attempt could use: the cgroup's limit, else the machine's RAM."""
        lim = self.cgroup.limit() if self.cgroup else None
        if lim is not None:
            return lim, "the cgroup's limit"
        return _meminfo_total(self.proc), "the machine's RAM"

    def evidence(self, pids: set[int] | None = None) -> list[str]:
        """Sentences that show the OOM killer ended a process of the attempt; empty when nothing does. ``strong``
        says afterwards whether the kernel itself said so (its counter or its log), not resident memory alone."""
        out: list[str] = []
        if self.cgroup is not None and self.kills_before is not None:
            after = self.cgroup.oom_kills()
            if after is not None and after > self.kills_before:
                out.append(f"the cgroup's OOM-kill counter rose from {self.kills_before} to {after} during the "
                           f"attempt ({self.cgroup.events})")
        lines = kernel_oom_lines(self.close(), (pids or set()) | self.pids)
        if lines:
            out.append(f"the kernel log says: {lines[-1]}")
        self.strong = bool(out)
        used = self.used
        limit, what = self.limit()
        if used and limit and used >= RSS_EVIDENCE_FRACTION * limit:
            out.append(f"the attempt's processes held {format_size(used)} of memory together, "
                       f"{used / limit:.0%} of {what} ({format_size(limit)})")
        return out

    def describe_absence(self) -> str:
        """What was looked at, for the message that passes a SIGKILL through as a failure."""
        checks = []
        if self.cgroup is None or self.kills_before is None:
            checks.append("no memory cgroup to read")
        else:
            checks.append("the cgroup's OOM-kill counter did not rise")
        checks.append("no OOM-killer line for it in the kernel log" if self.kmsg_readable
                      else "the kernel log is not readable here")
        used = self.used
        limit, what = self.limit()
        if used and limit:
            checks.append(f"its processes held at most {format_size(used)} of memory together, of {what} "
                          f"({format_size(limit)})")
        return "; ".join(checks)


__all__ = ["CGROUP_ENV", "CgroupFiles", "HostOOMWatch", "find_cgroup", "kernel_oom_lines",
           "resident_share"]
