"""The per-step memory trace in the training process (oomguard/child/trace.py, memwatch.py, census.py): what a sample
holds, that it costs no synchronisation and keeps the process's peak true, and that a leaking reward function is found
with its rate and named by its line and its list."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from oomguard.child import simulate
from oomguard.child.runtime import Runtime
from oomguard.child.trace import StepTracer, batch_lengths
from oomguard.vocab.protocol import Plan
from oomguard.vocab.sizes import MiB
from oomguard.vocab.trace import MemSample

from helpers import PYTHON, ROOT, SCRIPTS


@pytest.fixture
def device():
    dev = simulate.start(256 * MiB)
    try:
        yield dev
    finally:
        simulate.stop()


def test_a_sample_is_what_the_step_kept_and_its_own_peak(device) -> None:
    import torch

    rt = Runtime(Plan())
    tracer = StepTracer(rt)
    kept = [torch.zeros(MiB // 4)]  # 1 MiB kept
    tracer.step_begin()
    big = torch.zeros(16 * MiB // 4)  # 16 MiB used during step 1 only
    del big
    s1 = MemSample.from_event(tracer.sample(1))
    kept.append(torch.zeros(MiB // 4))
    tracer.step_begin()
    s2 = MemSample.from_event(tracer.sample(2))
    assert s1 is not None and s2 is not None
    assert s1.peak - s1.kept >= 16 * MiB  # type: ignore[operator]
    assert s2.kept - s1.kept == MiB  # type: ignore[operator]
    assert s2.peak < s1.peak  # type: ignore[operator]  # step 2's peak is its own
    assert s1.capacity == 256 * MiB and s1.reserved >= s1.kept  # type: ignore[operator]
    # the process's peak, which the progress events and the crash record report, is still the whole process's
    assert rt.peak_bytes() >= s1.peak  # type: ignore[operator]
    assert rt.peak_reserved_bytes() >= s1.reserved  # type: ignore[operator]


def test_without_reset_the_sample_has_no_peak_and_the_counters_stay(device) -> None:
    import torch

    tracer = StepTracer(reset_peak=False)
    big = torch.zeros(8 * MiB // 4)
    del big
    before = device.peak
    fields = tracer.sample(1)
    assert "peak" not in fields and device.peak == before


class FakeCuda:
    """torch.cuda as the tracer may use it: counters only. A synchronising call fails the test."""

    def __init__(self) -> None:
        self.resets = 0
        self.stats_calls = 0
        self.memory = types.SimpleNamespace(memory_stats_as_nested_dict=self.nested,
                                            reset_peak_memory_stats=self.reset_peak_memory_stats,
                                            _get_device_index=lambda d, optional=False: 0 if d is None else int(d))

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def nested(self, device: object = None) -> dict:
        self.stats_calls += 1
        return {"allocated_bytes": {"all": {"current": 10 * MiB, "peak": 30 * MiB}},
                "reserved_bytes": {"all": {"current": 40 * MiB, "peak": 48 * MiB}}}

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.resets += 1

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, i: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=80 << 30)

    def synchronize(self, *a: object) -> None:
        raise AssertionError("the trace must not synchronise the device")

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the trace called torch.cuda.{name}")


@pytest.fixture
def fresh_peaks(monkeypatch):
    """oomguard's wrap of torch.cuda.memory (child/peaks.py) made anew for one test, and taken away after it."""
    import torch

    from oomguard.child import peaks

    monkeypatch.setattr(peaks, "_REAL", {})
    monkeypatch.setattr(peaks, "_KEPT", {})
    for module in (torch.cuda.memory, torch.cuda):
        for name in ("memory_stats_as_nested_dict", "reset_peak_memory_stats"):
            monkeypatch.setattr(module, name, getattr(module, name))
    return peaks


def test_on_cuda_one_counter_read_and_a_reset_no_synchronisation(monkeypatch, fresh_peaks) -> None:
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    rt = Runtime(Plan())
    tracer = StepTracer(rt)
    fields = tracer.sample(7)
    assert {k: fields[k] for k in ("step", "kept", "peak", "reserved", "capacity")} == {
        "step": 7, "kept": 10 * MiB, "peak": 30 * MiB, "reserved": 40 * MiB, "capacity": 80 << 30}
    assert cuda.stats_calls == 1 and cuda.resets == 1
    assert (rt.peak_floor, rt.reserved_floor) == (30 * MiB, 48 * MiB)


class FakeAllocator:
    """CUDA's caching allocator as torch._C shows it to torch.cuda.memory: its counters, and a reset of their peaks."""

    def __init__(self) -> None:
        self.current = {"allocated_bytes": 0, "reserved_bytes": 0}
        self.peak = dict(self.current)

    def use(self, n: int) -> None:
        for k in self.current:
            self.current[k] += n
            self.peak[k] = max(self.peak[k], self.current[k])

    def stats(self, device: object = None) -> dict:
        return {k: {"all": {"current": self.current[k], "peak": self.peak[k]}} for k in self.current}

    def reset(self, device: object = None) -> None:
        self.peak = dict(self.current)


def test_the_peak_counters_the_user_reads_are_the_whole_run_s_with_the_trace_on(monkeypatch, fresh_peaks) -> None:
    """A script that logs torch.cuda.max_memory_allocated() reads the run's peak, not the last step's, while the
    trace measures each step's own; a reset of the user's own starts the user's peak again (torch.cuda.memory's
    real functions over a faked allocator: this torch is a CPU build)."""
    import torch

    alloc = FakeAllocator()
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", alloc.stats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", alloc.reset, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_get_device_index", lambda d, optional=False: 0 if d is None else int(d))
    for name, value in (("is_available", lambda: True), ("is_initialized", lambda: True), ("current_device", lambda: 0),
                        ("get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 << 30))):
        monkeypatch.setattr(torch.cuda, name, value)
    fresh_peaks.install(torch.cuda.memory)  # what the bootstrap does when torch.cuda.memory is imported
    from torch.cuda import max_memory_allocated, reset_peak_memory_stats  # as a script imports them

    tracer = StepTracer(Runtime(Plan()))
    alloc.use(100 * MiB)  # the model
    step_peaks = []
    for transient in (50, 300, 20, 40):  # step 2 peaks highest
        tracer.step_begin()
        alloc.use(transient * MiB)
        alloc.use(-transient * MiB)
        step_peaks.append(tracer.sample(len(step_peaks) + 1)["peak"] // MiB)
    assert step_peaks == [150, 400, 120, 140]  # the trace's own per-step peaks
    assert max_memory_allocated() == torch.cuda.max_memory_allocated() == 400 * MiB  # the whole run's
    assert torch.cuda.memory_stats()["reserved_bytes.all.peak"] == 400 * MiB
    reset_peak_memory_stats()  # the user's own reset: the user's peak starts again, the trace goes on
    tracer.step_begin()
    alloc.use(60 * MiB)
    alloc.use(-60 * MiB)
    assert tracer.sample(5)["peak"] == 160 * MiB and max_memory_allocated() == 160 * MiB


def test_the_simulated_device_s_own_peak_is_the_whole_run_s_with_the_trace_on(device) -> None:
    import torch

    tracer = StepTracer(Runtime(Plan()))
    peaks = []
    for mib in (8, 32, 4):
        tracer.step_begin()
        x = torch.zeros(mib * MiB // 4)
        del x
        peaks.append(tracer.sample(len(peaks) + 1)["peak"])
    assert peaks[1] - peaks[2] == 28 * MiB  # each step's own
    assert device.peak == max(peaks) and device.stats()["allocated_bytes.all.peak"] == max(peaks)


def test_lengths_are_the_widths_of_the_batch_trl_trains_on() -> None:
    import torch

    trainer = types.SimpleNamespace(_buffered_inputs=[
        {"prompt_ids": torch.zeros(4, 37, dtype=torch.long), "completion_ids": torch.zeros(4, 128, dtype=torch.long)},
        {"prompt_ids": torch.zeros(4, 52, dtype=torch.long), "completion_ids": torch.zeros(4, 96, dtype=torch.long)},
    ], _metrics={"train": {"completions/max_length": [77.0]}})
    assert batch_lengths(trainer) == (52, 128)
    assert batch_lengths(types.SimpleNamespace(_buffered_inputs=None, _metrics={"train": {}})) == (None, None)


def _events(*args: str) -> list[dict]:
    out = subprocess.run([PYTHON, str(SCRIPTS / "leaky_loop.py"), *args], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_a_reward_function_that_keeps_tensors_is_a_leak_named_by_its_line_and_its_list() -> None:
    events = _events("--steps", "12")
    trend = next(e for e in events if e["event"] == "mem_trend")["trend"]
    (leak,) = trend["verdicts"]  # the simulated device's tensors are not counted again as a host leak
    assert leak["kind"] == "leak" and abs(leak["rate"] - 6 * MiB) <= 0.2 * 6 * MiB
    assert leak["runs_out_at"] is not None
    holders = next(e for e in events if e["event"] == "mem_holders")
    names = [h["name"] for h in holders["holders"]]
    line = next(i for i, text in enumerate((SCRIPTS / "leaky_rewards.py").read_text().splitlines(), 1)
                if "CACHE.append" in text)
    assert any(n.endswith(f"leaky_rewards.py:{line} in leaky_reward") for n in names), names
    assert "list `CACHE` of module `leaky_rewards`" in names
    assert f"leaky_rewards.py:{line} in leaky_reward allocated 12.00 MiB more" in holders["evidence"]
    samples = [MemSample.from_event(e) for e in events if e["event"] == "mem"]
    assert [s.step for s in samples if s] == list(range(1, 13))


def test_a_reward_function_that_grows_a_host_cache_is_a_host_leak() -> None:
    events = _events("--steps", "10", "--host")
    trend = next(e for e in events if e["event"] == "mem_trend")["trend"]
    kinds = [v["kind"] for v in trend["verdicts"]]
    assert kinds == ["host-leak"]
    assert abs(trend["verdicts"][0]["rate"] - 16 * MiB) <= 0.2 * 16 * MiB
    assert not any(e["event"] == "mem_holders" for e in events)  # a census looks at the device's memory only


def test_census_sites_from_cuda_snapshots_are_read_without_torch() -> None:
    """On CUDA the sites come from two memory snapshots: the pure reader names the line that grew."""
    from oomguard.oom.snapshot import grown, site_totals

    def snap(n: int) -> dict:
        leak = {"size": 6 * MiB, "state": "active_allocated",
                "frames": [{"filename": "/venv/site-packages/torch/_tensor.py", "line": 1, "name": "ones"},
                           {"filename": "/home/me/rewards.py", "line": 12, "name": "leaky_reward"}]}
        batch = {"size": 2 * MiB, "state": "active_allocated",
                 "frames": [{"filename": "/venv/site-packages/trl/trainer/grpo_trainer.py", "line": 2443,
                             "name": "_generate_and_score_completions"}]}
        return {"segments": [{"blocks": [leak] * n + [batch, {"size": 1 << 30, "state": "active_allocated"}]}]}

    (h,) = grown("site", site_totals(snap(1)), site_totals(snap(4)), least=MiB, since=9, until=12)
    assert (h.name, h.grown, h.count) == ("/home/me/rewards.py:12 in leaky_reward", 18 * MiB, 3)



class FakeHistory:
    """torch as the census uses it on CUDA: the memory-history switch (``_record_memory_history``, with the settings
    it was last given), whether it is on (``torch._C._cuda_isHistoryEnabled``), and snapshots."""

    def __init__(self, user: dict | None) -> None:
        self.settings = user  # None: not recording
        self.calls: list[dict] = []
        self.cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                          memory=types.SimpleNamespace(_record_memory_history=self.record,
                                                                       _snapshot=lambda: {"segments": []}))
        self._C = types.SimpleNamespace(_cuda_isHistoryEnabled=lambda: self.settings is not None)
        self.Tensor = type("Tensor", (), {})

    def record(self, enabled: str | None = "all", **kw: object) -> None:
        self.calls.append({"enabled": enabled, **kw})
        self.settings = None if enabled is None else {"enabled": enabled, **kw}


@pytest.mark.parametrize("user", [{"enabled": "all", "max_entries": 100000}, None])
def test_the_census_leaves_a_memory_history_recording_the_user_started_as_it_was(monkeypatch, user) -> None:
    """PyTorch's advice for OOMs is to record memory history and dump a snapshot when one comes: a census (after any
    leak verdict) keeps that recording on, with the user's settings; one it started itself it stops again."""
    from oomguard.child.census import Census

    fake = FakeHistory(user)
    monkeypatch.setitem(sys.modules, "torch", fake)
    census = Census()
    census.start()
    census.take(3)
    census.take(5)
    census.stop()
    assert fake.settings == user
    if user is not None:
        assert fake.calls == []  # the user's recording, never touched
    else:
        assert [c["enabled"] for c in fake.calls] == ["state", None]


@pytest.mark.slow
@pytest.mark.e2e
def test_real_grpo_with_a_leaky_reward_function(tiny_model: str, tmp_path) -> None:
    """The same as test_a_reward_function_that_keeps_tensors_is_a_leak_named_by_its_line_and_its_list, through TRL's
    GRPOTrainer (its batch's widths, its optimizer state appearing at step 1) on the simulated device."""
    trace = tmp_path / "trace.jsonl"
    out = subprocess.run([PYTHON, str(SCRIPTS / "grpo_tiny.py"), "--model", tiny_model, "--output-dir",
                          str(tmp_path / "out"), "--max-steps", "11", "--leak-mib", "6", "--mem-trace", str(trace)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    samples = [MemSample.from_event(e) for e in events if e["event"] == "mem"]
    assert all(s is not None and s.prompt_tokens and s.completion_tokens == 32 for s in samples)
    (leak,) = next(e for e in events if e["event"] == "mem_trend")["trend"]["verdicts"]
    assert leak["kind"] == "leak" and abs(leak["rate"] - 6 * MiB) <= 0.2 * 6 * MiB
    names = [h["name"] for h in next(e for e in events if e["event"] == "mem_holders")["holders"]]
    assert "list `CACHE` of module `leaky_rewards`" in names
    assert any(n.endswith("in leaky_reward") for n in names)
