"""Fallbacks that change what oomguard knows say so, once: a tokenizer that fails to load, an events file that
cannot be written, NVML failing on a machine that has a GPU (and only there)."""

from __future__ import annotations

import types

from oomguard.child import datasets
from oomguard.child.runtime import Runtime
from oomguard.memory import device
from oomguard.vocab.events import CodeSeen, StepDone
from oomguard.vocab.protocol import Plan


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_tokenizer_that_fails_to_load_is_one_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "TOKENIZER_WARNED_ONCE", False)
    missing = str(tmp_path / "no-such-model")
    assert datasets.tokenizer_for(None, missing) is None
    assert datasets.tokenizer_for(None, missing) is None
    (line,) = _lines(capsys)
    assert line.startswith("oomguard: warning: could not load the tokenizer of") and missing in line
    assert "counted in words" in line
    assert datasets.prompt_lengths(["four words right here"], None) == [4]  # the fallback it warned about


def test_events_that_cannot_be_written_are_one_warning(tmp_path, capsys):
    rt = Runtime(Plan(events=str(tmp_path / "gone" / "events.jsonl")))
    rt.emit(CodeSeen(point="config", observed={"max_completion_length": 512}))
    rt.emit(StepDone(step=1))
    (line,) = _lines(capsys)
    assert line.startswith("oomguard: warning: cannot write events to") and "your config" in line
    assert rt.observed == {} and "config" in rt.reached  # training goes on


class _FakeNVML(types.SimpleNamespace):
    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return (9, 0)

    def nvmlDeviceGetMigMode(self, handle):
        return (0, 0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        raise RuntimeError("NVMLError_NoPermission: Insufficient Permissions")

    def nvmlShutdown(self):
        pass


def test_nvml_failing_on_a_gpu_machine_is_one_warning(monkeypatch, capsys):
    monkeypatch.setattr(device, "_warned", False)
    monkeypatch.setattr(device, "_nvml", lambda: _FakeNVML())
    assert device.gpu_total_memory() is None and device.gpu_total_memory() is None
    (line,) = _lines(capsys)
    assert "NVML could not read the GPU's memory" in line and "Insufficient Permissions" in line
    assert "--gpu-memory" in line


def test_a_gpu_machine_whose_nvml_library_is_missing_is_warned(monkeypatch, capsys):
    monkeypatch.setattr(device, "_warned", False)
    monkeypatch.setattr(device, "_nvml", lambda: None)
    monkeypatch.setattr(device, "_gpu_present", lambda: True)
    monkeypatch.setattr(device, "_nvml_error", lambda: "NVMLError_LibraryNotFound: NVML Shared Library Not Found")
    assert device.gpu_total_memory() is None
    (line,) = _lines(capsys)
    assert "has an NVIDIA GPU but NVML cannot be used (NVMLError_LibraryNotFound" in line


def test_a_cpu_machine_without_nvml_is_quiet(monkeypatch, capsys):
    monkeypatch.setattr(device, "_warned", False)
    monkeypatch.setattr(device, "_nvml", lambda: None)
    monkeypatch.setattr(device, "_gpu_present", lambda: False)
    assert device.gpu_total_memory() is None
    assert _lines(capsys) == []
