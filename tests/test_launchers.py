"""The launchers in one table (oomguard/vocab/launchers.py), read by the bootstrap (which processes only start workers)
and by the supervisor (whether a command is distributed, this node's place in a job of several nodes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oomguard.child.bootstrap import is_launcher
from oomguard.run.launch import distributed_reason, membership_of
from oomguard.vocab.launchers import LAUNCHERS, by_module, by_script

PY = "/venv/bin/python"


# Every program the bootstrap left clean before the table, and the launcher the supervisor read it as.
@pytest.mark.parametrize("orig_argv, key", [
    ([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"], "torchrun"),
    ([PY, "-m", "torch.distributed.launch", "t.py"], "torchrun"),
    ([PY, "/venv/bin/torchrun", "t.py"], "torchrun"),
    ([PY, "/venv/lib/python3.12/site-packages/torch/distributed/run.py", "t.py"], "torchrun"),
    ([PY, "/venv/lib/python3.12/site-packages/torch/distributed/launch.py", "t.py"], "torchrun"),
    ([PY, "-m", "accelerate.commands.launch", "t.py"], "accelerate"),
    ([PY, "-m", "accelerate.commands.accelerate_cli", "launch", "t.py"], "accelerate"),
    ([PY, "/venv/bin/accelerate", "launch", "t.py"], "accelerate"),
    ([PY, "/venv/bin/accelerate-launch", "t.py"], "accelerate"),
    ([PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "t.py"], "deepspeed"),
    ([PY, "-m", "deepspeed.launcher.runner", "t.py"], "deepspeed"),
    ([PY, "/venv/bin/deepspeed", "t.py"], "deepspeed"),
    ([PY, "-m", "trl.cli.main", "grpo"], "trl"),
    ([PY, "-m", "trl.cli", "grpo"], "trl"),
    ([PY, "/venv/bin/trl", "grpo", "--config", "grpo.yaml"], "trl"),
    ([PY, "/venv/bin/swift", "rlhf", "--rlhf_type", "grpo"], "swift"),
])
def test_a_launcher_process_stays_clean_and_is_named_by_one_table(orig_argv, key):
    assert is_launcher(orig_argv)
    kind, what = ("module", orig_argv[orig_argv.index("-m") + 1]) if "-m" in orig_argv else ("script", orig_argv[1])
    found = by_module(what) if kind == "module" else by_script(what)
    assert found is not None and found.key == key


@pytest.mark.parametrize("orig_argv", [
    ["python", "train.py", "--output_dir", "trl"],  # an argument is never the program
    ["python", "-m", "train"],
    ["python", "-c", "import torch"],
    ["python", "/work/swift/cli/rlhf.py"],  # what swift's CLI runs: the training process
    ["python", "/venv/bin/trl-helper"],
])
def test_a_training_process_is_not_a_launcher(orig_argv):
    assert not is_launcher(orig_argv)


def test_every_launcher_is_named_once_and_its_node_flags_come_in_pairs():
    modules = [m for launcher in LAUNCHERS for m in launcher.modules]
    scripts = [s for launcher in LAUNCHERS for s in launcher.scripts]
    assert len(modules) == len(set(modules)) and len(scripts) == len(set(scripts))
    assert len({launcher.key for launcher in LAUNCHERS}) == len(LAUNCHERS)
    for launcher in LAUNCHERS:
        assert bool(launcher.nodes) == bool(launcher.node_rank), launcher.key
        assert all(f.startswith("--") for f in (*launcher.nodes, *launcher.node_rank, *launcher.processes))


@pytest.mark.parametrize("argv", [
    ["torchrun", "--nnodes", "2", "--node_rank", "1", "t.py"],
    ["torchrun", "--nnodes=2", "--node-rank=1", "t.py"],
    ["accelerate", "launch", "--num_machines", "2", "--machine_rank", "1", "t.py"],
    ["accelerate", "launch", "--num-machines=2", "--machine-rank=1", "t.py"],
])
def test_every_spelling_of_a_launchers_node_flags_is_read(argv):
    m = membership_of(argv, {})
    assert m is not None and (m.node, m.nodes) == (1, 2)


@pytest.mark.parametrize("argv, words", [
    (["torchrun", "--nproc-per-node=3", "t.py"], "torchrun --nproc_per_node 3 starts 3 ranks"),
    (["torchrun", "--nnodes", "1:4", "t.py"], "torchrun --nnodes 4 spans 4 nodes"),  # elastic: the most it reaches
    (["accelerate", "launch", "--num-processes", "2", "t.py"], "accelerate launch --num_processes 2 starts 2 ranks"),
    ([PY, "/venv/lib/python3.12/site-packages/torch/distributed/run.py", "--nproc_per_node", "2", "t.py"],
     "2 ranks"),
])
def test_the_process_count_is_read_in_every_spelling(argv, words):
    assert words in (distributed_reason(argv, {}) or "")


def test_the_table_is_cheap_to_import():
    """The bootstrap reads it in every Python process of a run: it imports no third-party module."""
    code = ("import sys; import oomguard.vocab.launchers; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'click', 'tenacity', 'psutil')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_membership_is_read_where_the_launchers_arguments_are_and_the_group_names_it_too():
    """``run/launch.py`` reads the membership; ``run/group.py`` re-exports it for its importers (the CLI)."""
    from oomguard.run import group, launch

    assert (group.membership_of, group.Membership, group.GroupError, group.GROUP_ENV) == \
        (launch.membership_of, launch.Membership, launch.GroupError, launch.GROUP_ENV)
