"""`oomguard analyze`: the JSON contract, directories, crash records, and one-line messages for bad input."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.analyze import analyze_paths
from oomguard.oom import parse_oom
from oomguard.records import CrashRecord

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "examples" / "logs"
KEYS = {"source", "line", "is_oom", "backend", "requested_bytes", "capacity_bytes", "free_bytes", "allocated_bytes",
        "reserved_unallocated_bytes", "process_bytes", "other_processes", "kind", "phase", "evidence", "remedies"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomguard", "analyze", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_seed_oom_json_contract():
    out = cli("--json", str(LOGS / "grpo_rtx3080.log"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    (f,) = data["findings"]
    assert set(f) >= KEYS
    assert f["is_oom"] is True and f["backend"] == "cuda" and f["line"] == 25
    assert f["requested_bytes"] == round(1.90 * 2**30) and f["reserved_unallocated_bytes"] == round(2.41 * 2**30)
    assert f["kind"] == "fragmentation" and f["evidence"][0].startswith("2.41 GiB was reserved")
    assert f["remedies"][0] == {"name": "expandable_segments", "reason": f["remedies"][0]["reason"],
                                "frees_bytes": round(2.41 * 2**30)}
    assert all(set(r) == {"name", "reason", "frees_bytes"} for r in f["remedies"])


def test_terminal_report_is_readable():
    out = cli(str(LOGS / "grpo_rtx3080.log"))
    assert out.returncode == 0
    assert "fragmentation" in out.stdout and "expandable_segments" in out.stdout and "What to do" in out.stdout


def test_a_directory_in_file_order(tmp_path):
    data = json.loads(cli("--json", str(LOGS)).stdout)
    sources = [Path(f["source"]).name for f in data["findings"]]
    assert sources == sorted(sources)
    assert {f["backend"] for f in data["findings"]} == {"cuda", "vllm", "host"}


def test_crash_record_input(tmp_path):
    rec = CrashRecord(message="m", exception_type="torch.OutOfMemoryError",
                      report=parse_oom("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                       "of 8.00 GiB of which 1.00 GiB is free."), phase="optimizer", step=12)
    p = rec.write(tmp_path / "crash-0.json")
    (f,) = analyze_paths([str(p)]).findings
    assert f["phase"] == "optimizer" and f["step"] == 12 and f["remedies"][0]["name"] == "optimizer_8bit"
    assert f["line"] == 4  # the line of "message" in the record (after schema and created)


def test_gzip_log(tmp_path):
    p = tmp_path / "train.log.gz"
    p.write_bytes(gzip.compress((LOGS / "grpo_rtx3080.log").read_bytes()))
    assert analyze_paths([str(p)]).findings[0]["kind"] == "fragmentation"


def test_log_without_oom_yields_no_finding(tmp_path):
    p = tmp_path / "ok.log"
    p.write_text("step 1 loss 0.1\nout of memory slots in the cache\n")
    out = cli("--json", str(p))
    assert out.returncode == 0 and json.loads(out.stdout)["findings"] == []
    assert "No out-of-memory error found" in cli(str(p)).stdout


def put(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make, reason", [
    (lambda d: d / "missing.log", "no such file or directory"),
    (lambda d: (d / "empty.log").touch() or d / "empty.log", "empty file"),
    (lambda d: put(d / "blob.bin", b"\x00\x01\x02" * 100), "binary file"),
    (lambda d: (d / "sub").mkdir() or d / "sub", "directory holds no files"),
    (lambda d: put(d / "bad.json", b'{"schema": "oomguard.crash/1", "message": '), "not valid JSON"),
])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, make, reason):
    path = make(tmp_path)
    out = cli(str(path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0] and str(path) in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path):
    p = tmp_path / "secret.log"
    p.write_text("MemoryError\n")
    p.chmod(0)
    out = cli(str(p))
    assert out.returncode == 2 and "permission denied" in out.stderr


def test_exit_0_when_something_was_read(tmp_path):
    out = cli(str(tmp_path / "missing.log"), str(LOGS / "dmesg_oom_killer.txt"))
    assert out.returncode == 0
    assert "missing.log: no such file" in out.stderr


def test_huge_log_is_read_up_to_the_limit_with_a_note(tmp_path):
    p = tmp_path / "big.log"
    p.write_bytes(b"step 1 loss 0.5 reward 0.1\n" * 50_000 + (LOGS / "grpo_rtx3080.log").read_bytes())
    out = cli("--json", "--max-bytes", "100KiB", str(p))
    assert out.returncode == 0
    assert "only the first 100.00 KiB scanned" in out.stderr
    assert json.loads(out.stdout)["findings"] == []
    full = json.loads(cli("--json", str(p)).stdout)["findings"]
    assert full[0]["line"] == 50_000 + 25


def test_bad_max_bytes_is_a_usage_error():
    out = cli("--max-bytes", "lots", str(LOGS))
    assert out.returncode == 2 and "not a size" in out.stderr
