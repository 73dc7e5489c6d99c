"""Host-RAM evidence for a SIGKILL: cgroup OOM-kill counters, the kernel's OOM-killer line, resident memory."""

from __future__ import annotations

import doctest
import os
import signal
import sys
from pathlib import Path

from oomguard.run import hostmem
from oomguard.run.hostmem import CgroupFiles, HostOOMWatch, find_cgroup

from helpers import run_oomguard

GiB = 1 << 30


def test_doctests():
    assert doctest.testmod(hostmem).failed == 0


def _cgroup_v2(d: Path, kills: int, limit: str = "max") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 12\noom 3\noom_kill {kills}\noom_group_kill 0\n")
    (d / "memory.max").write_text(limit + "\n")
    return d


def _fake_proc(root: Path, cgroup_lines: str, mountinfo: str, meminfo_kb: int = 16 * 1024 * 1024) -> Path:
    (root / "self").mkdir(parents=True)
    (root / "self" / "cgroup").write_text(cgroup_lines)
    (root / "self" / "mountinfo").write_text(mountinfo)
    (root / "meminfo").write_text(f"MemTotal:       {meminfo_kb} kB\nMemFree:        1 kB\n")
    return root


def test_v2_counter_rising_is_evidence_and_a_flat_one_is_not(tmp_path):
    cg = _cgroup_v2(tmp_path / "cg", kills=2)
    watch = HostOOMWatch(cgroup=cg, kmsg=None)
    watch.start()
    assert watch.evidence() == []  # nothing changed: a kill -9, a preemption
    watch = HostOOMWatch(cgroup=cg, kmsg=None)
    watch.start()
    _cgroup_v2(cg, kills=3)
    (ev,) = watch.evidence()
    assert ev.startswith("the cgroup's OOM-kill counter rose from 2 to 3") and "memory.events" in ev


def test_v1_oom_control_counter(tmp_path):
    cg = tmp_path / "memory"
    cg.mkdir()
    (cg / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (cg / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    files = CgroupFiles(cg, 1)
    assert files.oom_kills() == 0 and files.limit() is None
    watch = HostOOMWatch(cgroup=files, kmsg=None)
    watch.start()
    (cg / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert "rose from 0 to 1" in watch.evidence()[0]


def test_find_cgroup_v2_and_v1_from_proc(tmp_path):
    sysfs = tmp_path / "sys"
    _cgroup_v2(sysfs / "user.slice" / "job-7", kills=0)
    proc = _fake_proc(tmp_path / "proc", "0::/user.slice/job-7\n",
                      "30 23 0:26 / /dummy rw - tmpfs tmpfs rw\n"
                      f"31 23 0:27 / {sysfs} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    assert find_cgroup(proc, env={}) == CgroupFiles((sysfs / "user.slice" / "job-7").resolve(), 2)
    # v1 inside a container: /proc/self/cgroup names the host's path, the mount's root is that same path
    mem = tmp_path / "v1" / "memory"
    mem.mkdir(parents=True)
    (mem / "memory.oom_control").write_text("oom_kill 4\n")
    proc1 = _fake_proc(tmp_path / "proc1", "4:memory:/docker/abc\n0::/\n",
                       f"35 31 0:32 /docker/abc {mem} rw,relatime - cgroup cgroup rw,memory\n")
    found = find_cgroup(proc1, env={})
    assert found == CgroupFiles(mem.resolve(), 1) and found.oom_kills() == 4
    assert find_cgroup(proc1, env={hostmem.CGROUP_ENV: str(mem)}) == CgroupFiles(mem, 1)


def test_kernel_line_for_one_of_the_attempts_processes(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    watch = HostOOMWatch(cgroup=_cgroup_v2(tmp_path / "cg", kills=0), kmsg=str(kmsg))
    watch.start()
    with kmsg.open("a") as f:  # a regular file stands in for /dev/kmsg (one read returns all records here)
        f.write("3,1203,77,-;oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=python,pid=4242,uid=0\n")
    ev = watch.evidence({4242})
    assert ev == ["the kernel log says: oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=python,pid=4242,uid=0"]


def _process(proc: Path, pid: int, *, pss_gib: float | None, hwm_gib: float, anon_gib: float = 0.0) -> None:
    (proc / str(pid) / "task" / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "task" / str(pid) / "children").write_text("")
    (proc / str(pid) / "status").write_text(f"Name:\tpython\nVmHWM:\t{int(hwm_gib * 1024 * 1024)} kB\n"
                                            f"RssAnon:\t{int(anon_gib * 1024 * 1024)} kB\n")
    if pss_gib is not None:
        (proc / str(pid) / "smaps_rollup").write_text(f"Rss:\t{int(hwm_gib * 1024 * 1024)} kB\n"
                                                      f"Pss:\t{int(pss_gib * 1024 * 1024)} kB\n")


def test_memory_held_together_near_the_limit_is_evidence(tmp_path):
    proc = _fake_proc(tmp_path / "proc", "0::/\n", "", meminfo_kb=64 * 1024 * 1024)
    _process(proc, 100, pss_gib=20, hwm_gib=20)
    _process(proc, 101, pss_gib=None, hwm_gib=9.5, anon_gib=9.5)  # no smaps_rollup: its anonymous memory
    cg = _cgroup_v2(tmp_path / "cg", kills=0, limit=str(32 * GiB))
    watch = HostOOMWatch(cgroup=cg, kmsg=None, proc=proc)
    watch.start()
    watch.sample({100, 101}, force=True)
    assert watch.pids == {100, 101}
    (ev,) = watch.evidence()
    assert "held 29.50 GiB of memory together, 92% of the cgroup's limit (32.00 GiB)" in ev
    small = HostOOMWatch(cgroup=_cgroup_v2(tmp_path / "cg2", kills=0, limit=str(64 * GiB)), kmsg=None, proc=proc)
    small.start()
    small.sample({100, 101}, force=True)
    assert small.evidence() == [] and "held at most 29.50 GiB of memory together" in small.describe_absence()


def test_shared_pages_and_peaks_of_different_moments_are_not_added_up(tmp_path):
    """Four processes sharing 8 GiB (a parent and forked workers): each one's high-water mark counts all of it, their
    proportional shares a quarter each; and two moments' sums are never added."""
    proc = _fake_proc(tmp_path / "proc", "0::/\n", "")
    for pid in (100, 101, 102, 103):
        _process(proc, pid, pss_gib=2.25, hwm_gib=8.5)
    watch = HostOOMWatch(cgroup=_cgroup_v2(tmp_path / "cg", kills=0, limit=str(16 * GiB)), kmsg=None, proc=proc)
    watch.start()
    watch.sample({100, 101, 102, 103}, force=True)  # 9 GiB together, where the marks add up to 34 GiB
    for pid in (100, 101):
        (proc / str(pid) / "smaps_rollup").write_text("Pss:\t1048576 kB\n")
    _process(proc, 104, pss_gib=5, hwm_gib=5)
    watch.sample({100, 101, 102, 103, 104}, force=True)  # 11.5 GiB at a later moment
    assert watch.used == int(11.5 * GiB) and watch.evidence() == []


SELF_KILL = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def test_a_sigkill_without_evidence_is_passed_through_not_retried(tmp_path):
    """A user's kill -9, `timeout -s KILL` or a preemption is no OOM: exit 137 as it came, one attempt."""
    cg = _cgroup_v2(tmp_path / "cg", kills=5)
    out, rep = run_oomguard(tmp_path, "--", sys.executable, "-c", SELF_KILL, env={hostmem.CGROUP_ENV: str(cg)})
    assert out.returncode == 128 + signal.SIGKILL
    assert rep["status"] == "failed" and len(rep["attempts"]) == 1
    first = rep["attempts"][0]
    assert first["outcome"] == "failed" and first["exit_code"] == 137 and first["oom"] is None
    assert "no sign of the kernel's OOM killer" in out.stderr and "OOM-kill counter did not rise" in out.stderr


def test_a_sigkill_the_cgroup_counted_as_an_oom_kill_is_host_ram(tmp_path):
    cg = _cgroup_v2(tmp_path / "cg", kills=5)
    bump = (f"import os, signal, pathlib; p = pathlib.Path({str(cg / 'memory.events')!r}); "
            "p.write_text(p.read_text().replace('oom_kill 5', 'oom_kill 6')); os.kill(os.getpid(), signal.SIGKILL)")
    out, rep = run_oomguard(tmp_path, "--", sys.executable, "-c", bump, env={hostmem.CGROUP_ENV: str(cg)})
    first = rep["attempts"][0]
    assert first["outcome"] == "oom" and first["exit_code"] == 137
    assert first["oom"]["kind"] == "host-ram" and first["oom"]["backend"] == "host"
    assert any("OOM-kill counter rose from 5 to 6" in e for e in first["oom"]["evidence"])
    assert out.returncode == 75  # a command that builds no GRPOConfig: no host rung reaches it


# A job of several processes, as a data loader's forked workers are: a parent with 128 MiB of its own memory and three
# forked children that share it copy-on-write; the first child sends the parent SIGKILL from outside (a health
# checker, `timeout -s KILL`, a user's kill -9) once the supervisor has sampled them a few times.
FORKED_JOB = """
import os, signal, time
buffer = bytearray(128 << 20)
for i in range(0, len(buffer), 4096):
    buffer[i] = 1
children = []
for n in range(3):
    pid = os.fork()
    if pid == 0:
        if n == 0:
            time.sleep(3.5)
            os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)
        os._exit(0)
    children.append(pid)
time.sleep(60)
"""


def test_a_kill_from_outside_of_a_job_sharing_memory_is_no_host_oom(tmp_path):
    """Each process's high-water mark counts the shared 128 MiB (4 x 138 MiB, over 90% of a 320 MiB limit): taken for
    the host running out, the job was retried with host rungs. What the processes hold together (their proportional
    shares, summed at one moment) is about 170 MiB: a kill, passed through."""
    cg = _cgroup_v2(tmp_path / "cg", kills=5, limit=str(320 << 20))
    out, rep = run_oomguard(tmp_path, "--", sys.executable, "-c", FORKED_JOB, env={hostmem.CGROUP_ENV: str(cg)})
    assert out.returncode == 128 + signal.SIGKILL, out.stderr[-2000:]
    assert rep["status"] == "failed" and len(rep["attempts"]) == 1
    first = rep["attempts"][0]
    assert first["outcome"] == "failed" and first["oom"] is None
    assert "no sign of the kernel's OOM killer" in out.stderr and "of memory together" in out.stderr


def test_the_real_cgroup_of_this_machine_is_found_or_absent_quietly():
    found = find_cgroup()
    if found is not None:
        assert found.events.exists() and found.oom_kills() is not None
    assert os.path.isdir("/proc")
