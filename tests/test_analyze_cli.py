"""`oomguard analyze`: the JSON contract, directories, crash records, and one-line messages for bad input."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.oom.analyze import analyze_paths
from oomguard.oom.parse import parse_oom
from oomguard.vocab.records import CrashRecord

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
                                "frees_bytes": round(2.41 * 2**30), "rank": 1,
                                "paste": ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"], "top": True}
    assert all(set(r) == {"name", "reason", "frees_bytes", "rank", "paste", "top"} for r in f["remedies"])
    assert [r["rank"] for r in f["remedies"]] == list(range(1, len(f["remedies"]) + 1))


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


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: the next test covers it whoever runs it")
def test_unreadable_file(tmp_path):
    p = tmp_path / "secret.log"
    p.write_text("MemoryError\n")
    p.chmod(0)
    out = cli(str(p))
    assert out.returncode == 2 and "permission denied" in out.stderr


def test_unreadable_file_is_a_note_whoever_runs_it(tmp_path, monkeypatch):
    """As root (how CI runs) nothing is unreadable, so the open itself is made to fail as it does for a user."""
    import builtins

    from oomguard.oom.analyze import analyze_paths

    p = tmp_path / "secret.log"
    p.write_text("MemoryError\n")
    real_open = builtins.open

    def denied(file, *a, **kw):
        if str(file) == str(p):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", denied)
    result = analyze_paths([str(p)])
    assert result.files_read == 0 and result.notes == [f"{p}: cannot read it (permission denied)"]


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


# --------------------------------------------------------------------------------------------------------------
# Issue 12 §4: headings that do not contradict the evidence, and a short list of remedies with lines to paste.

H100 = ROOT / "tests" / "fixtures" / "h100"
OOM_FIXTURES = ROOT / "tests" / "fixtures" / "oom"


def test_a_process_is_never_both_other_and_this():
    out = cli(str(LOGS / "torchrun_4gpu.log"))
    assert out.returncode == 0
    assert "others pid 51882" not in out.stdout
    assert "this process 77.02 GiB" in out.stdout and "it is this process" in out.stdout
    (f,) = json.loads(cli("--json", str(LOGS / "torchrun_4gpu.log")).stdout)["findings"]
    assert f["other_processes"] == [] and f["process_bytes"] == round(77.02 * 2**30)
    assert "Process 51882 has 77.02 GiB" in f["message"]  # the raw text keeps what NVML said


def _numbered(text: str) -> list[str]:
    return [ln.split(".", 1)[1].split(":", 1)[0].strip() for ln in text.splitlines()
            if ln.startswith("   ") and ln.strip()[:1].isdigit() and ". " in ln]


def test_terminal_shows_the_top_remedies_with_lines_to_paste_and_all_with_all():
    short = cli(str(LOGS / "grpo_rtx3080.log")).stdout
    names = _numbered(short)
    assert 3 <= len(names) <= 5 and names[0] == "expandable_segments"
    assert "      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in short
    assert "GRPOConfig(max_completion_length=256)" in short
    assert "more (--all lists them)" in short
    every = cli("--all", str(LOGS / "grpo_rtx3080.log")).stdout
    (f,) = json.loads(cli("--json", str(LOGS / "grpo_rtx3080.log")).stdout)["findings"]
    assert _numbered(every) == [r["name"] for r in f["remedies"]] and len(f["remedies"]) > len(names)
    assert "--all lists them" not in every
    assert [r["name"] for r in f["remedies"] if r["top"]] == names


def test_real_crash_record_under_an_allowance():
    (f,) = analyze_paths([str(H100 / "crashrecord-qwen3b-24GiB.json")]).findings
    assert (f["kind"], f["phase"], f["input"]) == ("shortfall", "backward", "crash-record")
    assert f["requested_bytes"] == 88 * 2**20 and f["allowed_bytes"] == 24 * 2**30
    assert f["capacity_bytes"] == round(79.18 * 2**30) and f["free_bytes"] == round(44.24 * 2**30)
    assert f["allocated_bytes"] == round(23.33 * 2**30) and f["reserved_unallocated_bytes"] == round(636.31 * 2**20)
    assert f["process_bytes"] == round(24.74 * 2**30)
    assert f["other_processes"] == [{"pid": 568, "bytes": round(10.18 * 2**30)}]
    # The request is a sliver of 23.33 GiB of live state: shrink the state first. LoRA alone fitted in the real run.
    top = [r for r in f["remedies"] if r["top"]]
    assert top[0]["name"] == "lora" and top[0]["paste"][0].startswith("GRPOTrainer(..., peft_config=LoraConfig(r=16")
    # gradient checkpointing was already on in that run: last, saying why
    assert f["remedies"][-1]["name"] == "checkpointing" and "already in force" in f["remedies"][-1]["reason"]


def test_run_report_attempts_are_diagnosed_again_from_their_message(tmp_path):
    message = (OOM_FIXTURES / "cuda_h100_allowance_minimize_attempt3.txt").read_text().splitlines()[-1]
    message = message.split("torch.OutOfMemoryError: ", 1)[1]
    stored = {"is_oom": True, "kind": "neighbour", "phase": "backward", "message": message, "evidence": ["old"]}
    report = {"schema": "oomguard.report/1", "attempts": [
        {"index": 3, "kind": "minimize", "knobs": {"max_completion_length": 256}, "oom": stored}]}
    p = tmp_path / "report.json"
    p.write_text(json.dumps(report))
    (f,) = analyze_paths([str(p)]).findings
    assert f["kind"] == "shortfall" and f["attempt"] == 3 and f["input"] == "run-report"
    assert f["phase"] == "backward" and f["free_bytes"] == round(52.77 * 2**30)
    shorter = next(r for r in f["remedies"] if r["name"] == "shorter_sequences")
    assert shorter["paste"] == ["GRPOConfig(max_completion_length=128)"]  # from the attempt's own knobs


def test_real_h100_messages_through_analyze():
    result = analyze_paths([str(p) for p in sorted(OOM_FIXTURES.glob("cuda_h100_*.txt"))])
    assert [f["kind"] for f in result.findings] == ["shortfall"] * 5
    # the quickstart runs under a 24 GiB cap, the snapshot's under 4 GiB (the files are sorted by name)
    assert [f["allowed_bytes"] for f in result.findings] == [24 * 2**30] * 4 + [4 * 2**30]
