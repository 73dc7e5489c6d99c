"""Allocator settings: one module knows which variable torch reads, and every writer merges into it."""

from __future__ import annotations

import doctest
import json
import sys

from oomguard.vocab import allocconf

from helpers import run_oomguard

FRAGMENTATION = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
                 "8.00 GiB of which 100.00 MiB is free. Of the allocated memory 6.00 GiB is allocated by PyTorch, and "
                 "1.50 GiB is reserved by PyTorch but unallocated.")


def test_doctests():
    assert doctest.testmod(allocconf).failed == 0


def test_merge_keeps_the_users_options_in_every_variable_they_set():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256", "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    assert allocconf.merge(env, {"expandable_segments": "True"}) == ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]
    assert env == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True",
                   "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True"}
    assert allocconf.in_force(env) == {"garbage_collection_threshold": "0.6", "expandable_segments": "True"}


def test_user_settings_come_from_the_variable_torch_reads():
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    user = allocconf.user_settings(env)
    assert user.variable == "PYTORCH_CUDA_ALLOC_CONF" and user.max_split_size_mb == 128
    assert user.expandable_segments is None and user.locked_text() is None  # PYTORCH_ALLOC_CONF is not read
    assert allocconf.user_settings({"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:False"}).locked_text() == \
        "PYTORCH_HIP_ALLOC_CONF=expandable_segments:False"


def test_run_merges_expandable_segments_into_the_variables_the_user_set(tmp_path):
    """The user set both variables; the rung lands in each, next to their own options, and nowhere else."""
    marker = tmp_path / "oomed"
    script = (f"import json, os, sys, pathlib\n"
              f"m = pathlib.Path({str(marker)!r})\n"
              f"if not m.exists():\n"
              f"    m.touch(); sys.stderr.write({FRAGMENTATION!r} + '\\n'); sys.exit(1)\n"
              f"print('ENV ' + json.dumps({{k: v for k, v in os.environ.items() if k.endswith('ALLOC_CONF')}}))\n")
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256", "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    out, rep = run_oomguard(tmp_path, "--no-predict", "--", sys.executable, "-c", script, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert rep["attempts"][0]["climbed"] == "expandable_segments"
    seen = json.loads(next(line[4:] for line in out.stdout.splitlines() if line.startswith("ENV ")))
    assert seen == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True",
                    "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True"}
