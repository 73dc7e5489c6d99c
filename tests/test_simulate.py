"""The simulated device on real tensors, and the allocator settings it reads (its allocator model is pure:
tests/test_allocmodel.py)."""

import os
import subprocess
import sys

import pytest

from oomguard.child.simulate import expandable_from_env, max_split_from_env
from oomguard.memory.allocmodel import AllocatorModel
from oomguard.vocab import allocconf

MiB = 2**20


def test_alloc_conf_from_environment_reads_the_variable_torch_reads():
    """torch 2.12+ reads PYTORCH_CUDA_ALLOC_CONF, then PYTORCH_HIP_ALLOC_CONF, then PYTORCH_ALLOC_CONF: the first set."""
    assert expandable_from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
                                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert not expandable_from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                    "PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:64"})
    assert max_split_from_env({"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,>:4],max_split_size_mb:64"}) \
        == 64 << 20
    assert not expandable_from_env({})


def test_alloc_conf_precedence_matches_the_installed_torch():
    """The order oomguard assumes is the one this torch really uses (it parses the variable at start-up)."""
    pytest.importorskip("torch")
    probe = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
    for env, read in [({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
                       "PYTORCH_CUDA_ALLOC_CONF"),
                      ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:32"},
                       "PYTORCH_HIP_ALLOC_CONF"),
                      ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}, "PYTORCH_ALLOC_CONF")]:
        clean = {k: v for k, v in os.environ.items() if k not in allocconf.VARS}
        out = subprocess.run([sys.executable, "-c", probe], env={**clean, **env}, capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"this torch cannot report its allocator settings: {out.stderr[-200:]}")
        assert out.stdout.strip() == env[read] == env[allocconf.variable_read(env)]


def test_device_counts_real_tensors_and_raises_real_ooms():
    torch = pytest.importorskip("torch")
    from oomguard.child import simulate

    dev = simulate.start(64 * MiB)
    try:
        assert isinstance(dev.model, AllocatorModel)  # the pure model places the blocks
        x = torch.zeros(4 * MiB // 4)
        assert dev.model.allocated >= 4 * MiB
        with pytest.raises(torch.OutOfMemoryError) as e:
            torch.zeros(100 * MiB // 4)
        assert "Tried to allocate 100.00 MiB" in str(e.value) and "simulated device" in str(e.value)
        del x
        assert dev.model.allocated == 0
        assert dev.peak >= 4 * MiB
    finally:
        simulate.stop()
    assert simulate.device() is None


def test_a_fragmented_simulated_device_runs_out_as_fragmentation_and_expandable_segments_fit_it():
    """The simulated device's own OOM after fragmentation (eighteen 3 MiB tensors fill its 60 MiB, six in a row are
    freed, and 18 MiB is asked: 24 MiB is free, in no run that long, since the freed blocks straddle two segments)
    reads as fragmentation, the fastest ladder's first rung for it is
    expandable segments, and with them the same tensors fit (what tests/test_run_e2e.py once proved with two launches
    of real TRL at 103 MiB)."""
    torch = pytest.importorskip("torch")
    from oomguard.child import simulate
    from oomguard.decide.ladder import Step, load_ladder
    from oomguard.oom.diagnose import diagnose
    from oomguard.oom.parse import parse_oom
    from oomguard.strategies import Context
    from oomguard.vocab.knobs import TRL_DEFAULTS

    def fragment(expandable: bool) -> str | None:
        simulate.start(60 * MiB, expandable=expandable)
        try:
            kept = [torch.zeros(3 * MiB // 4) for _ in range(18)]
            del kept[1:7]
            torch.zeros(18 * MiB // 4)
            return None
        except torch.OutOfMemoryError as e:
            return str(e)
        finally:
            simulate.stop()

    message = fragment(expandable=False)
    assert message is not None
    report = parse_oom(message)
    assert report is not None and report.reserved_unallocated >= 18 * MiB
    diag = diagnose(report)
    assert diag.kind == "fragmentation", diag.evidence
    step = load_ladder("fastest").next(Context(knobs=TRL_DEFAULTS, diagnosis=diag))
    assert isinstance(step, Step) and step.remedy.name == "expandable_segments"
    assert fragment(expandable=True) is None
