"""A GRPO reward function that ends the training process the way a test asks, under any launcher.

The launch-form x ending tests (tests/test_launch_matrix.py) need the same ending from ``python train.py``, from
``trl grpo`` (whose script is TRL's own: only a reward function, ``--reward_funcs endings.reward``, is ours) and from
the ranks that torchrun or ``accelerate launch`` start. So the ending is chosen by the environment, which every
process of a run inherits, and acted on the first time a reward is computed (the scoring phase of step 0):

  OOMGUARD_TEST_ENDING=error   raise a ValueError (a bug in the reward function: a non-OOM failure)
  OOMGUARD_TEST_ENDING=oom     raise torch.OutOfMemoryError with the CUDA caching allocator's message
  OOMGUARD_TEST_ENDING=kill    count an OOM kill in the stand-in cgroup's memory.events
                               (OOMGUARD_CGROUP), then SIGKILL this process, as the kernel's OOM killer would
  OOMGUARD_TEST_ENDING=sleep   sleep (an interrupt test sends its signal meanwhile)
  OOMGUARD_TEST_ENDING_RANK=R  only on rank R (the others go on, and wait for it at the next collective)
  OOMGUARD_TEST_MARKER=PATH    act once: write this process's pid to PATH first, do nothing if PATH exists

With no ending set, it is a plain length reward.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

ENDING_ENV = "OOMGUARD_TEST_ENDING"
RANK_ENV = "OOMGUARD_TEST_ENDING_RANK"
MARKER_ENV = "OOMGUARD_TEST_MARKER"

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.73 GiB of which "
            "1.28 GiB is free. Including non-PyTorch memory, this process has 14.43 GiB memory in use. Of the "
            "allocated memory 11.82 GiB is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but "
            "unallocated.")


def _act() -> None:
    ending = os.environ.get(ENDING_ENV)
    if not ending:
        return
    want = os.environ.get(RANK_ENV)
    if want is not None and os.environ.get("RANK", "0") != want:
        return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        if os.path.exists(marker):
            return
        Path(marker).write_text(str(os.getpid()))
    if ending == "error":
        raise ValueError("the reward function failed on purpose")
    if ending == "oom":
        import torch

        raise torch.OutOfMemoryError(CUDA_OOM)
    if ending == "kill":
        events = Path(os.environ["OOMGUARD_CGROUP"]) / "memory.events"
        events.write_text(re.sub(r"^oom_kill (\d+)$", lambda m: f"oom_kill {int(m[1]) + 1}", events.read_text(),
                                 flags=re.M))
        os.kill(os.getpid(), signal.SIGKILL)
    if ending == "sleep":
        time.sleep(120)
        return
    raise SystemExit(f"unknown {ENDING_ENV}={ending!r}")


def reward(completions, **kw):
    """A length reward that first ends the process as the environment asks (once per process)."""
    global _acted
    if not _acted:
        _acted = True
        _act()
    return [len(c[0]["content"]) / 100.0 if isinstance(c, list) else len(c) / 100.0 for c in completions]


_acted = False
