"""The launchers: the programs that only start the training processes, how each is run, and which of its own flags
say how many nodes the job spans, which node this is and how many processes it starts.

One table, read on both sides of the run: the bootstrap in every Python process (a launcher process stays clean and
records nothing: ``child/bootstrap.py``'s ``is_launcher``) and the supervisor (``run/launch.py``: whether a command is
distributed, where torchrun's rendezvous is, this node's place in a job of several nodes). Pure data and two
look-ups; it imports nothing heavy, since every process of a run loads it.

>>> by_script("/venv/bin/torchrun").name, by_module("accelerate.commands.launch").name
('torchrun', 'accelerate launch')
>>> by_module("torch.distributed.run").nodes, by_script("accelerate").node_rank
(('--nnodes',), ('--machine_rank', '--machine-rank'))
>>> by_module("train") is None, by_script("python") is None
(True, True)
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Launcher:
    """One launcher. Each flag is given in every spelling the launcher accepts, the first as its help writes it."""

    key: str  # how oomguard names it in code: "torchrun", "accelerate", ...
    name: str  # how people write it: "accelerate launch"
    modules: tuple[str, ...] = ()  # what `python -m MODULE` runs it
    scripts: tuple[str, ...] = ()  # its console scripts (their file name)
    files: tuple[str, ...] = ()  # its module's file, when a script path runs it (`python .../torch/distributed/run.py`)
    nodes: tuple[str, ...] = ()  # the node count
    node_rank: tuple[str, ...] = ()  # this node's rank among them
    processes: tuple[str, ...] = ()  # the processes (ranks) it starts on this node


TORCHRUN = Launcher("torchrun", "torchrun", modules=("torch.distributed.run", "torch.distributed.launch"),
                    scripts=("torchrun",), files=("torch/distributed/run.py", "torch/distributed/launch.py"),
                    nodes=("--nnodes",), node_rank=("--node_rank", "--node-rank"),
                    processes=("--nproc_per_node", "--nproc-per-node"))
ACCELERATE = Launcher("accelerate", "accelerate launch",
                      modules=("accelerate.commands.launch", "accelerate.commands.accelerate_cli"),
                      scripts=("accelerate", "accelerate-launch"), nodes=("--num_machines", "--num-machines"),
                      node_rank=("--machine_rank", "--machine-rank"), processes=("--num_processes", "--num-processes"))
# deepspeed starts every node from one machine (over ssh, with a hostfile): one oomguard for the job, no node flags
DEEPSPEED = Launcher("deepspeed", "deepspeed", modules=("deepspeed.launcher.runner", "deepspeed.launcher.launch"),
                     scripts=("deepspeed",))
# Console scripts that only start workers. TRL's CLI (`trl grpo ...`) parses the script's arguments into a GRPOConfig
# and hands them to `accelerate launch`: the training runs in the process it starts. ms-swift's `swift rlhf ...` runs
# `python swift/cli/rlhf.py ...` (under torchrun when NPROC_PER_NODE is set) the same way.
TRL = Launcher("trl", "trl", modules=("trl.cli.main", "trl.cli"), scripts=("trl",))
SWIFT = Launcher("swift", "swift", scripts=("swift",))

LAUNCHERS: tuple[Launcher, ...] = (TORCHRUN, ACCELERATE, DEEPSPEED, TRL, SWIFT)
_BY_MODULE = {m: launcher for launcher in LAUNCHERS for m in launcher.modules}
_BY_SCRIPT = {s: launcher for launcher in LAUNCHERS for s in launcher.scripts}
_FILES = tuple((f, launcher) for launcher in LAUNCHERS for f in launcher.files)


def by_module(name: str) -> Launcher | None:
    """The launcher that ``python -m name`` runs, or None."""
    return _BY_MODULE.get(name)


def by_script(path: str) -> Launcher | None:
    """The launcher a program or script path runs (a console script by its file name, or the launcher's own module
    file), or None.

    >>> by_script("/venv/lib/python3.12/site-packages/torch/distributed/run.py").key
    'torchrun'
    """
    found = _BY_SCRIPT.get(os.path.basename(path))
    if found is None:
        unix = path.replace("\\", "/")
        found = next((launcher for f, launcher in _FILES if unix.endswith(f)), None)
    return found


__all__ = ["ACCELERATE", "DEEPSPEED", "LAUNCHERS", "SWIFT", "TORCHRUN", "TRL", "Launcher", "by_module", "by_script"]
