"""Records: versioned schemas, atomic writes, tolerant readers."""

import json
import os

import pytest

from oomguard.oom.parse import parse_oom
from oomguard.vocab.events import CodeSeen, StepDone, read_events
from oomguard.vocab.files import write_json_atomic
from oomguard.vocab.oomreport import Frame
from oomguard.vocab.records import CRASH_SCHEMA, CrashRecord, RecordError


def test_crash_record_round_trip(tmp_path):
    rec = CrashRecord(message="MemoryError", exception_type="builtins.MemoryError", report=parse_oom("MemoryError"),
                      frames=[Frame("train.py", 3, "main")], phase="forward", step=7, knobs={"optim": "adamw_torch"})
    p = rec.write(tmp_path / "crash.json")
    data = json.loads(p.read_text())
    assert data["schema"] == CRASH_SCHEMA and data["step"] == 7
    back = CrashRecord.read(p)
    assert back.report.backend == "host" and back.frames[0].name == "main"


def test_newer_minor_fields_are_ignored_and_other_majors_refused(tmp_path):
    rec = CrashRecord(message="m", exception_type="t", report=parse_oom("MemoryError")).to_dict()
    rec["something_new"] = 1
    assert CrashRecord.from_dict(rec).message == "m"
    rec["schema"] = "oomguard.crash/2"
    with pytest.raises(RecordError, match="version 2 is not supported"):
        CrashRecord.from_dict(rec, "x.json")
    with pytest.raises(RecordError, match=r"not an oomguard\.crash record"):
        CrashRecord.from_dict({"schema": "oomguard.report/1"}, "x.json")


def test_atomic_write_never_leaves_a_partial_file(tmp_path):
    p = tmp_path / "r.json"
    write_json_atomic(p, {"a": 1})

    class Boom:
        def to_dict(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_json_atomic(p, {"a": Boom()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []


def test_events_reader_skips_a_torn_line(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_text('{"event": "config"}\n{"event": "step", "step": 2, "peak": 5}\n{"event": "st')
    assert read_events(p) == [CodeSeen("config"), StepDone(step=2, peak=5)]
    assert read_events(tmp_path / "missing.jsonl") == []
