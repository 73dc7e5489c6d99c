"""@oomguard.guard: both styles, memory released between attempts, passthrough, exhaustion, isolation."""

import sys
import traceback

import pytest
import torch

import oomguard
from oomguard import OOMGuardExhausted

from helpers import SCRIPTS

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which "
            "1.00 GiB is free. Of the allocated memory 6.00 GiB is allocated by PyTorch, and 100.00 MiB is reserved "
            "by PyTorch but unallocated.")


def plain_loop(knobs, steps=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters())
    bs, ga = knobs.per_device_train_batch_size, knobs.gradient_accumulation_steps
    for _ in range(steps):
        for _ in range(ga):
            x = torch.randn(bs, 64, 256)
            loss = model(x).pow(2).mean() / ga
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return round(float(loss.detach()), 6)


def test_plain_loop_recovers_and_really_releases_memory():
    train = oomguard.guard(plain_loop, ladder="quality-first", simulate_gpu="40MiB",
                           knobs={"per_device_train_batch_size": 64})
    assert isinstance(train(), float)
    r = train.report
    assert r.status == "stable" and r.attempts[0].outcome == "oom" and r.attempts[-1].outcome == "ok"
    assert r.attempts[0].climbed == "micro_batch"
    for a in r.attempts[:-1]:
        assert a.memory["live_after_release"] == a.memory["live_before"], a.memory  # back to the pre-call level
    assert {row["knob"] for row in r.diff} <= {"per_device_train_batch_size", "gradient_accumulation_steps",
                                                "num_generations", "optim", "gradient_checkpointing"}
    first = r.attempts[0].oom
    assert first["backend"] == "cuda" and first["phase"] == "forward"
    from oomguard.child import simulate

    assert simulate.device() is None  # the rehearsal device stops with the call


def test_non_oom_exceptions_pass_through_untouched():
    def broken(knobs):
        raise KeyError("the real bug")

    g = oomguard.guard(broken)
    with pytest.raises(KeyError) as e:
        g()
    assert e.value.args == ("the real bug",)
    assert traceback.extract_tb(e.value.__traceback__)[-1].name == "broken"


def test_a_function_that_always_ooms_ends_exhausted(tmp_path):
    def hopeless(knobs):
        knobs.per_device_train_batch_size  # noqa: B018 (a read)
        raise torch.OutOfMemoryError(CUDA_OOM)

    g = oomguard.guard(hopeless, max_attempts=8, report=tmp_path / "r.json")
    with pytest.raises(OOMGuardExhausted) as e:
        g()
    assert "still ran out of memory" in str(e.value) and "no rung left" in str(e.value)
    assert e.value.report.status == "exhausted" and g.report.status == "exhausted"
    assert e.value.__cause__ is None and e.value.__context__ is None  # the last OOM and its frames are not kept
    assert (tmp_path / "r.json").exists()
    assert all(a.outcome == "oom" for a in g.report.attempts)


def test_budget_of_attempts():
    def hopeless(knobs):
        knobs.per_device_train_batch_size  # noqa: B018
        raise torch.OutOfMemoryError(CUDA_OOM)

    g = oomguard.guard(hopeless, max_attempts=2)
    with pytest.raises(OOMGuardExhausted, match="stopped after 2 attempts"):
        g()
    assert len(g.report.attempts) == 2


def test_decorator_forms_and_unread_fields():
    calls = []

    @oomguard.guard
    def bare(knobs):
        calls.append(knobs.optim)
        if knobs.optim != "adamw_bnb_8bit":
            raise torch.OutOfMemoryError(CUDA_OOM)
        return "ok"

    assert bare() == "ok"
    assert calls == ["adamw_torch_fused", "adamw_bnb_8bit"]  # only optim was read: straight to optimizer_8bit
    skipped = {s["remedy"]: s["reason"] for s in bare.report.attempts[0].skipped}
    assert "never reads per_device_train_batch_size" in skipped["micro_batch"]

    @oomguard.guard(max_attempts=3)
    def with_options(knobs):
        return knobs.max_completion_length

    assert with_options() == 512
    assert oomguard.guard(lambda knobs: 7)() == 7


def test_a_cuda_runtime_oom_stops_unless_isolated():
    def sticky(knobs):
        knobs.per_device_train_batch_size  # noqa: B018
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(OOMGuardExhausted, match="isolate=True"):
        oomguard.guard(sticky)()


def test_refuses_several_ranks(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(RuntimeError, match="oomguard run -- torchrun"):
        oomguard.guard(lambda knobs: 1)()


def test_isolate_needs_an_importable_function():
    def local(knobs):
        return 1

    with pytest.raises(TypeError, match="importable module"):
        oomguard.guard(local, isolate=True)()


def test_isolated_attempts_run_in_fresh_processes():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import guarded_fns

        assert guarded_fns.isolated_train() == 8  # 16 rows need 64 MiB of 48; 8 rows fit
        r = guarded_fns.isolated_train.report
        assert [a.outcome for a in r.attempts] == ["oom", "ok"]
        assert r.attempts[0].oom["kind"] == "impossible"
    finally:
        sys.path.remove(str(SCRIPTS))


def test_style_a_the_run_patches_reach_trls_real_grpo_config_in_each_call_and_are_removed_after(tmp_path):
    """A function that builds its own GRPOConfig: the first call's config is recorded as the user's, the rung
    climbed after its OOM is in the second call's config, and TRL's GRPOConfig is TRL's own again after the guard."""
    trl = pytest.importorskip("trl")
    from oomguard.child import patching

    configs = []

    def build():
        configs.append(trl.GRPOConfig(output_dir=str(tmp_path / "never"), use_cpu=True, bf16=False, report_to=[],
                                      max_completion_length=512, per_device_train_batch_size=8, num_generations=8))
        if len(configs) == 1:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return "trained"

    g = oomguard.guard(build, max_attempts=3, ladder="fastest")
    assert g() == "trained"
    r = g.report
    assert r.status == "stable" and [a.outcome for a in r.attempts] == ["oom", "ok"]
    assert r.original["max_completion_length"] == 512 and r.diff  # read from the function's own GRPOConfig
    in_config = [row for row in r.diff if hasattr(configs[1], row["knob"])]
    assert in_config and all(getattr(configs[1], row["knob"]) == row["to"] for row in in_config), r.diff
    assert patching.UNDO == []
    assert trl.GRPOConfig.__post_init__.__module__.startswith("trl")
    after = trl.GRPOConfig(output_dir=str(tmp_path / "never"), use_cpu=True, bf16=False, report_to=[],
                           max_completion_length=512)
    assert after.max_completion_length == 512  # no override outlives the call


@pytest.mark.core
@pytest.mark.e2e
@pytest.mark.slow
def test_style_a_grpo_builder_retried_in_process(tiny_model, tmp_path):
    """A function that builds its own GRPOTrainer: the run patches apply inside each call and are removed after.
    Slow: the test above takes the same patches through TRL's real GRPOConfig in a second, and
    test_plain_loop_recovers_and_really_releases_memory the release between attempts on the simulated device."""
    from oomguard.child import patching

    import grpo_tiny

    def build_and_train():
        argv = sys.argv
        sys.argv = ["grpo_tiny.py", "--model", tiny_model, "--output-dir", str(tmp_path / "out"),
                    "--max-completion-length", "64", "--max-steps", "2"]
        try:
            grpo_tiny.main()
        finally:
            sys.argv = argv
        return "trained"

    g = oomguard.guard(build_and_train, simulate_gpu="80MiB", max_attempts=4)
    assert g() == "trained"
    r = g.report
    assert r.status == "stable" and r.attempts[0].outcome == "oom" and r.attempts[-1].outcome == "ok"
    assert r.attempts[0].climbed and r.diff  # the GRPOConfig patch took the rung into the function's own config
    assert r.original["max_completion_length"] == 64  # recorded from the function's GRPOConfig
    live = [a.memory["live_after_release"] for a in r.attempts[:-1]]
    assert all(x - live[0] < 64 * 1024 for x in live)  # no growth between attempts (library caches aside)
    assert patching.UNDO == []  # every patch removed after the call
    import trl

    assert trl.GRPOConfig.__post_init__.__module__.startswith("trl")


def test_the_guard_stops_at_its_time_budget(monkeypatch):
    """max_time: no new attempt once the budget has passed, however many attempts are left. The clock is the test's:
    the first attempt takes no time, the second two minutes, so exactly two run whatever the machine's load."""
    import time

    import oomguard

    calls = []
    real, late = time.time, [0.0]
    monkeypatch.setattr(time, "time", lambda: real() + late[0])

    def slow_oom(knobs):
        calls.append(knobs.per_device_train_batch_size)
        if len(calls) == 2:
            late[0] += 120.0
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8.00 GiB "
                           "of which 1.00 GiB is free.")

    with pytest.raises(oomguard.OOMGuardExhausted, match=r"after 2 attempt\(s\) and 60 s \(max_time\)") as e:
        oomguard.guard(slow_oom, max_attempts=50, max_time=60, verbose=False, predict=False)()
    # the budget, not the ladder, ended it
    assert len(calls) == 2 and e.value.report.status == "exhausted"
    assert len(e.value.report.attempts) == 2
    with pytest.raises(ValueError, match="max_time"):
        oomguard.guard(slow_oom, max_time=0)
