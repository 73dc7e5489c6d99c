"""The simulated device's allocator model (pure bookkeeping) and the device on real tensors."""

import os
import subprocess
import sys

import pytest

from oomguard import allocconf
from oomguard.child.simulate import (
    LARGE_BUFFER,
    PAGE,
    SMALL_BUFFER,
    AllocatorModel,
    expandable_from_env,
    max_split_from_env,
    segment_size,
)

MiB = 2**20


def test_segment_sizes_follow_the_cuda_allocator():
    assert segment_size(1000) == SMALL_BUFFER
    assert segment_size(3 * MiB) == LARGE_BUFFER
    assert segment_size(11 * MiB) == 12 * MiB


def test_blocks_split_merge_and_cache():
    m = AllocatorModel(100 * MiB)
    a = m.malloc(3 * MiB)
    b = m.malloc(3 * MiB)
    assert m.reserved == 20 * MiB and m.allocated == 6 * MiB  # one 20 MiB segment, split
    m.free(a)
    m.free(b)
    assert m.allocated == 0 and m.reserved == 20 * MiB  # cached, not returned
    m.release_cached()
    assert m.reserved == 0


def test_fragmentation_raises_with_reserved_but_unallocated_memory():
    m = AllocatorModel(60 * MiB)
    blocks = [m.malloc(3 * MiB) for _ in range(18)]  # three 20 MiB segments
    for b in blocks[::2]:
        m.free(b)
    with pytest.raises(MemoryError) as e:
        m.malloc(12 * MiB)  # no free run is that long and no segment is entirely free
    assert e.value.args[0] == 12 * MiB
    assert m.reserved - m.allocated >= 12 * MiB


def test_expandable_segments_reuse_freed_granules():
    m = AllocatorModel(64 * MiB, expandable=True)
    blocks = [m.malloc(3 * MiB) for _ in range(18)]  # 54 MiB over three 20 MiB granules
    for b in blocks[:7]:
        m.free(b)  # the first granule (and a bit) is free again
    m.malloc(12 * MiB)  # its granule is unmapped and mapped again where the new block goes
    assert m.reserved == 60 * MiB
    small = m.malloc(1000)
    assert small is not None and m.reserved % PAGE == 0


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
