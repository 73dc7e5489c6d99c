"""guard: allocator settings merged into the variable torch reads; memory really released after a failed attempt."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

import pytest
import torch

import oomguard
from oomguard import OOMGuardExhausted
from oomguard.vocab import allocconf

from helpers import SCRIPTS

FRAGMENTATION = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which "
                 "100.00 MiB is free. Of the allocated memory 6.00 GiB is allocated by PyTorch, and 1.50 GiB is "
                 "reserved by PyTorch but unallocated.")


@pytest.fixture
def alloc_env(monkeypatch):
    """A clean slate for the allocator variables (and no rehearsal device from the environment), restored after."""
    saved = {k: os.environ.get(k) for k in (*allocconf.VARS, "OOMGUARD_SIMULATE_GPU")}
    for k in saved:
        os.environ.pop(k, None)
    yield os.environ
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def _fragmented_until_expandable(seen):
    def train(knobs):
        seen.append({v: os.environ.get(v) for v in allocconf.VARS})
        if not knobs.expandable_segments:
            raise RuntimeError(FRAGMENTATION)
        return "trained"
    return train


def test_in_process_merges_into_the_variable_the_user_set(alloc_env):
    """PYTORCH_ALLOC_CONF is the user's; writing PYTORCH_CUDA_ALLOC_CONF beside it would replace their settings."""
    alloc_env["PYTORCH_ALLOC_CONF"] = "max_split_size_mb:256"
    seen: list[dict] = []
    g = oomguard.guard(_fragmented_until_expandable(seen))
    assert g() == "trained"
    assert seen[-1] == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_HIP_ALLOC_CONF": None,
                        "PYTORCH_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True"}
    assert "PYTORCH_ALLOC_CONF" in g.report.attempts[-1].note


def test_the_users_own_expandable_segments_false_is_kept(alloc_env):
    alloc_env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    seen: list[dict] = []
    g = oomguard.guard(_fragmented_until_expandable(seen), max_attempts=2)
    with pytest.raises(OOMGuardExhausted):
        g()
    assert {allocconf.parse(s["PYTORCH_CUDA_ALLOC_CONF"])["expandable_segments"] for s in seen} == {"False"}
    first = g.report.attempts[0]
    assert first.climbed != "expandable_segments"
    assert any(s["remedy"] == "expandable_segments" and "yourself" in s["reason"] for s in first.skipped)


def test_an_isolated_attempt_gets_the_users_options_plus_the_rung(alloc_env):
    alloc_env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:128"
    sys.path.insert(0, str(SCRIPTS))
    try:
        import alloc_fns

        seen = alloc_fns.isolated_env()
    finally:
        sys.path.remove(str(SCRIPTS))
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    assert alloc_env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"  # this process's settings are untouched


class StepFailed(RuntimeError):
    pass


def _step(model, rows):
    x = torch.randn(rows, 1024, 256)  # rows MiB
    h = model(x)  # rows MiB, live in this frame when the next line runs out of memory
    return h.repeat(8, 1, 1)


def test_memory_returns_to_the_baseline_even_when_the_code_keeps_the_oom(alloc_env):
    """The function logs the OOM (a buffering handler keeps the record, so the exception and its traceback) and
    re-raises it wrapped `from` another error, so the OOM is only the wrapper's __context__. The tensors of the failed
    step live in the OOM's frames: guard must clear those frames, not only the wrapper's."""
    log = logging.getLogger("oomguard-test.kept")
    kept = logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL + 1)
    log.addHandler(kept)
    log.propagate = False

    def train(knobs):
        model = torch.nn.Linear(256, 256)
        try:
            return float(_step(model, knobs.per_device_train_batch_size).sum().detach())
        except torch.OutOfMemoryError:
            log.exception("step failed")
            raise StepFailed("the training step failed") from ValueError("batch too large")

    try:
        g = oomguard.guard(train, ladder="quality-first", simulate_gpu="48MiB",
                           knobs={"per_device_train_batch_size": 8})
        assert isinstance(g(), float)
    finally:
        log.removeHandler(kept)
    failed = [a for a in g.report.attempts if a.outcome == "oom"]
    assert failed and kept.buffer  # the OOM really happened and its record is still held
    for a in failed:
        assert a.memory["live_after_release"] == a.memory["live_before"], a.memory


def test_release_clears_the_frames_of_an_oom_a_notebook_kept(monkeypatch):
    """A notebook keeps the last unhandled exception (sys.last_exc, for %debug): an earlier OOM's frames hold the
    failed run's tensors until something clears them."""
    import weakref

    from oomguard.inprocess.release import release

    class Weights:  # stands in for the model and its gradients
        pass

    refs = []

    def failed_cell():
        weights = Weights()  # held by this frame
        refs.append(weakref.ref(weights))
        raise RuntimeError(FRAGMENTATION)

    try:
        failed_cell()
    except RuntimeError as e:
        exc = e
    tb = exc.__traceback__
    held = refs[0]
    monkeypatch.setattr(sys, "last_exc", exc, raising=False)
    monkeypatch.setattr(sys, "last_value", exc, raising=False)
    monkeypatch.setattr(sys, "last_traceback", tb, raising=False)
    del exc, tb
    assert held() is not None
    release()
    assert held() is None
    assert sys.last_exc.__traceback__ is not None  # the exception stays for %debug, without its tensors
